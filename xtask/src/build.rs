//! Building: the BPF object with nightly, then the workspace that embeds it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::cmd::Cmd;
use crate::{paths, setup};

/// Build the BPF crate and publish its object at `target/bpf/sidestep.bpf.o`.
pub fn ebpf(debug: bool) -> Result<PathBuf> {
    setup::toolchain()?;
    let krate = paths::ebpf_crate();
    let mut cargo = Cmd::new("cargo").args(["+nightly", "build"]);
    if !debug {
        cargo = cargo.arg("--release");
    }
    // The crate's own .cargo/config.toml supplies the target, build-std and
    // linker, so it must run from inside the crate and without the outer
    // toolchain's environment.
    cargo
        .current_dir(&krate)
        .clean_toolchain_env()
        .prepend_path(&paths::tools_bin())
        .hint("run `cargo xtask setup`; if it reports ok, the error above is in ebpf/sidestep-ebpf")
        .run()
        .context("building the BPF programs")?;

    let profile = if debug { "debug" } else { "release" };
    let built = krate
        .join("target/bpfel-unknown-none")
        .join(profile)
        .join("sidestep");
    let object = paths::bpf_object();
    publish(&built, &object)?;
    println!("bpf object: {}", object.display());
    Ok(object)
}

/// Copy only when the bytes differ. A fresh mtime on every run would make
/// cargo rebuild the userspace crate that `include_bytes!`s the object.
fn publish(built: &Path, object: &Path) -> Result<()> {
    let new = std::fs::read(built).with_context(|| {
        format!(
            "reading {}; the BPF crate's binary target must be named `sidestep`",
            built.display()
        )
    })?;
    if std::fs::read(object).is_ok_and(|old| old == new) {
        return Ok(());
    }
    let dir = object.parent().expect("object path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Rename into place so a concurrent build never embeds half a file.
    let tmp = object.with_extension("o.tmp");
    std::fs::write(&tmp, &new).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, object).with_context(|| format!("renaming to {}", object.display()))
}

/// A cargo invocation for the workspace. Every one of them gets
/// SIDESTEP_BPF_OBJECT, since the userspace crate refuses to build without.
pub fn workspace_cargo(object: &Path) -> Cmd {
    Cmd::cargo()
        .current_dir(&paths::workspace())
        .env("SIDESTEP_BPF_OBJECT", object)
}

/// The CNI plugin as it ships: a static, fixed-address executable. The agent copies it onto the
/// node, whose C library is not the build machine's: a dynamically linked plugin built on Debian
/// 12 needs glibc 2.34, so on an older node every pod's ADD (meshed or not, since the plugin is
/// chained for all) would fail to exec. Static, it also skips the dynamic loader at each start,
/// a large share of an ADD. `--target` keeps the flags off build scripts and proc macros, which
/// cannot link statically. Returns the binary's path. On a host that is not `*-linux-gnu` it is
/// the workspace build.
pub fn static_plugin(object: &Path, release: bool) -> Result<PathBuf> {
    let profile = if release { "release" } else { "debug" };
    let host = Cmd::new("rustc")
        .arg("-vV")
        .read()
        .context("asking rustc for the host target")?
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV printed no host")?;
    if !host.ends_with("-linux-gnu") {
        return Ok(paths::bin_dir(release).join("sidestep-cni"));
    }
    let mut flags = std::env::var("RUSTFLAGS").unwrap_or_default();
    flags.push_str(" -C target-feature=+crt-static -C relocation-model=static");
    let mut cargo = workspace_cargo(object)
        .env("RUSTFLAGS", flags.trim())
        .args(["build", "-p", "sidestep-cni", "--bin", "sidestep-cni"])
        .args(["--target", &host]);
    if release {
        cargo = cargo.arg("--release");
    }
    cargo
        .hint("fix the compile or link error above, then rerun")
        .run()
        .context("building the static CNI plugin")?;
    Ok(paths::target_dir()
        .join(&host)
        .join(profile)
        .join("sidestep-cni"))
}

/// build-ebpf, then the whole workspace. Returns the BPF object path for
/// the cargo invocations that follow.
pub fn workspace(release: bool) -> Result<PathBuf> {
    let object = ebpf(false)?;
    let mut cargo = workspace_cargo(&object).args(["build", "--workspace"]);
    if release {
        cargo = cargo.arg("--release");
    }
    cargo
        .hint("fix the compile error above, then rerun")
        .run()
        .context("building the workspace")?;
    Ok(object)
}
