//! The Debian packages the tests, demo and benchmarks drive as real
//! components: pod runtime, sidecar proxy, load generators, kernel tools.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, bail};

use crate::cmd::{self, Cmd};

const PACKAGES: &[&str] = &[
    "iproute2",
    "bpftool",
    "iptables",
    // `nft`, for Istio's native nftables ruleset (the parity test's second oracle, the CNI
    // benchmark's install lane).
    "nftables",
    "containernetworking-plugins",
    "podman",
    // The pause process of `podman pod create`'s locally built infra image; only a Recommends.
    "catatonit",
    "runc",
    "haproxy",
    "nginx-light",
    "wrk",
    "busybox-static",
    "curl",
    "python3",
    "sockperf",
    "iperf3",
    "hyperfine",
    "conntrack",
    "util-linux",
    "procps",
    "kmod",
];

pub fn ensure() -> Result<()> {
    ensure_packages(PACKAGES)
}

/// Install whichever of `packages` are missing, with apt and without their Recommends; a
/// no-op (a few dpkg-query probes) when all are there. `ensure` uses it for the always-needed
/// list, the VM tasks for qemu and the tools that unpack a kernel, which only they need.
pub fn ensure_packages(packages: &[&str]) -> Result<()> {
    if !cmd::on_path("dpkg-query") {
        bail!(
            "dpkg-query not found: setup only knows Debian/Ubuntu\n  fix: install the equivalents of: {}",
            packages.join(" ")
        );
    }
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        println!("debian packages: ok ({} checked)", packages.len());
        return Ok(());
    }

    let install = format!(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    if !cmd::is_root() || !cmd::on_path("apt-get") {
        bail!(
            "missing Debian packages: {}\n  fix: run as root: apt-get update && {install}",
            missing.join(" ")
        );
    }

    println!("debian packages: installing {}", missing.join(" "));
    apt_update()?;
    Cmd::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .hint("see apt's output above; the package names may differ on this release")
        .run()?;

    // apt can exit 0 yet leave a package half-configured.
    let still: Vec<&str> = missing.into_iter().filter(|p| !installed(p)).collect();
    if !still.is_empty() {
        bail!(
            "still not installed after apt-get: {}\n  fix: inspect `dpkg --audit`",
            still.join(" ")
        );
    }
    Ok(())
}

/// `apt-get update`, at most once per run: installing packages and resolving a kernel package
/// may both want fresh lists, and each update costs seconds of network.
pub fn apt_update() -> Result<()> {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    Cmd::new("apt-get")
        .arg("update")
        .hint("check network access and /etc/apt/sources.list")
        .run()?;
    DONE.store(true, Ordering::Relaxed);
    Ok(())
}

/// "install ok installed" is the only state in which the files are there;
/// "deinstall ok config-files" and unknown packages do not count.
fn installed(pkg: &str) -> bool {
    Cmd::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .read()
        .is_ok_and(|s| s.trim() == "install ok installed")
}
