//! Which test binaries a `test --kernel` run boots into each VM, and the script that runs them
//! there one after another.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd;

/// The capture data path end to end, on both tc mechanisms: what differs between kernels.
/// Each entry: a test binary (its target name) and the arguments it always gets.
pub const CAPTURE: &[(&str, &[&str])] = &[
    ("outbound", &[]),
    ("inbound", &[]),
    ("parity", &[]),
    ("cni_chain", &[]),
    ("tc_netlink", &[]),
    ("validation", &[]),
    // aya-log's ring buffer and the larger debug-path programs, through each kernel's verifier.
    ("verdict_log", &[]),
    // Istio ambient mode: its parity table, and the agent handing pods to a ztunnel stand-in.
    ("parity_ambient", &[]),
    ("ambient", &[]),
    // Ambient: only ztunnel's marked sockets bind its in-pod ports (cgroup/bind4/6, sock_ops).
    ("ambient_ports", &[]),
    // sk_msg's sticky fallback under bulk writes (reads kernel struct fields at BTF offsets).
    ("skmsg_bulk", &[]),
    // Bypass attempts as the app (MPTCP's subflow hand-over, TFO, option memory) and re-routed
    // interfaces (tc DNAT, VLAN tag pops): kernel behaviour the capture relies on.
    ("bypass", &[]),
    // Source-routed sockets (routing headers, IPv4 LSRR) against Istio's rules, on the wire.
    ("source_route", &[]),
    ("reroute", &[]),
    // DNS capture: sendmsg's source address and connect's bind of a never-bound UDP socket.
    ("dns", &[]),
    // excludeInterfaces' routes as each kernel dumps them: multipath, nexthop objects.
    ("exclusion_routes", &[]),
    // Ambient DNS over UDP against istio-cni's rules: sendmsg/recvmsg under each kernel.
    ("parity_ambient_dns", &[]),
];

/// Left out of `full`: the benchmark measures the host, and under TCG it would measure qemu.
pub const NOT_IN_FULL: &[&str] = &["bench"];

/// The packages whose test binaries are built; `full` runs all of them.
pub const PACKAGES: &[&str] = &[
    "sidestep-tests",
    "sidestep",
    "sidestep-daemon",
    "sidestep-cni",
];

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    Capture,
    Full,
}

impl std::str::FromStr for Suite {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "capture" => Ok(Suite::Capture),
            "full" => Ok(Suite::Full),
            _ => Err(format!("unknown suite {s:?}: capture or full")),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TestBinary {
    /// An integration test's target name (`outbound`); for unit tests the target and its kind,
    /// `sidestep[lib]`, `sidestep-cni[bin]`.
    pub name: String,
    pub executable: PathBuf,
    /// The package's directory: cargo runs a test binary from there.
    pub dir: PathBuf,
}

/// The test executables of a `cargo test --no-run --message-format=json` build.
pub fn collect(json: &str) -> Result<Vec<TestBinary>> {
    let mut binaries: Vec<TestBinary> = Vec::new();
    for line in json.lines().filter(|l| l.starts_with('{')) {
        let msg: Value = serde_json::from_str(line).context("parsing cargo's JSON output")?;
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(executable) = msg["executable"].as_str() else {
            continue;
        };
        let target = &msg["target"];
        let name = target["name"]
            .as_str()
            .context("artifact without target.name")?;
        let kind = target["kind"][0].as_str().unwrap_or("?");
        let name = if kind == "test" {
            name.to_owned()
        } else {
            format!("{name}[{kind}]")
        };
        let manifest = msg["manifest_path"]
            .as_str()
            .context("artifact without manifest_path")?;
        let dir = Path::new(manifest)
            .parent()
            .context("manifest_path has no directory")?
            .to_owned();
        let binary = TestBinary {
            name,
            executable: executable.into(),
            dir,
        };
        match binaries.iter().find(|b| b.name == binary.name) {
            Some(have) if *have == binary => {}
            Some(have) => bail!(
                "two test binaries are both called {}: {} and {}",
                binary.name,
                have.executable.display(),
                binary.executable.display()
            ),
            None => binaries.push(binary),
        }
    }
    if binaries.is_empty() {
        bail!("cargo built no test executables");
    }
    // cargo reports them in the order they finished building; integration tests by name, then
    // the unit tests, make `full` run the same way every time.
    binaries.sort_by_key(|b| (b.name.contains('['), b.name.clone()));
    Ok(binaries)
}

/// The binaries to run, each with its own arguments (before `extra`, which all get). `only`,
/// when given, replaces the suite. A named binary that was not built is an error, not a skip.
pub fn select<'a>(
    all: &'a [TestBinary],
    suite: Suite,
    only: &[String],
) -> Result<Vec<(&'a TestBinary, Vec<String>)>> {
    let wanted: Vec<(String, Vec<String>)> = if !only.is_empty() {
        only.iter().map(|n| (n.clone(), Vec::new())).collect()
    } else if suite == Suite::Capture {
        CAPTURE
            .iter()
            .map(|(n, args)| {
                (
                    (*n).to_owned(),
                    args.iter().map(|a| (*a).to_owned()).collect(),
                )
            })
            .collect()
    } else {
        all.iter()
            .filter(|b| !NOT_IN_FULL.contains(&b.name.as_str()))
            .map(|b| (b.name.clone(), Vec::new()))
            .collect()
    };
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|(n, _)| !all.iter().any(|b| b.name == *n))
        .map(|(n, _)| n.as_str())
        .collect();
    if !missing.is_empty() {
        let names: Vec<&str> = all.iter().map(|b| b.name.as_str()).collect();
        bail!(
            "no test binary called {}; cargo built: {}",
            missing.join(", "),
            names.join(" ")
        );
    }
    Ok(wanted
        .into_iter()
        .map(|(n, args)| (all.iter().find(|b| b.name == n).expect("checked"), args))
        .collect())
}

/// The functions `run` and `summary` of the script below.
const RUNNER: &str = include_str!("runner.sh");

/// A POSIX sh script that runs each binary as `cargo test` would (see runner.sh), reports
/// `== NAME on KERNEL: ok|FAILED (N s)` per binary and a table at the end, and exits 1 if any
/// failed.
pub fn script(
    kernel: &str,
    workspace: &Path,
    selected: &[(&TestBinary, Vec<String>)],
    extra: &[String],
) -> String {
    let q = |s: &Path| cmd::quote(&s.to_string_lossy());
    let mut s = format!(
        "cd {} || exit 126\nk={}\n{RUNNER}",
        q(workspace),
        cmd::quote(kernel)
    );
    for (binary, args) in selected {
        s.push_str("run ");
        s.push_str(&cmd::quote(&binary.name));
        s.push_str(&format!(" {} {}", q(&binary.dir), q(&binary.executable)));
        for arg in args.iter().chain(extra) {
            s.push(' ');
            s.push_str(&cmd::quote(arg));
        }
        s.push('\n');
    }
    s.push_str("summary\n");
    s
}

/// The per-binary results in the script's `== NAME on KERNEL: ok|FAILED (N s)` lines.
pub fn results(markers: &[String]) -> Vec<(String, bool)> {
    markers
        .iter()
        .filter_map(|m| {
            let (head, tail) = m.strip_prefix("== ")?.rsplit_once(": ")?;
            let (name, _) = head.rsplit_once(" on ")?;
            let ok = if tail.starts_with("ok (") {
                true
            } else if tail.starts_with("FAILED (") {
                false
            } else {
                return None;
            };
            Some((name.to_owned(), ok))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"{"reason":"compiler-artifact","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"name":"outbound"},"profile":{"test":true},"executable":"/w/target/debug/deps/outbound-1"}
{"reason":"compiler-artifact","manifest_path":"/w/userspace/Cargo.toml","target":{"kind":["lib"],"name":"sidestep"},"profile":{"test":true},"executable":"/w/target/debug/deps/sidestep-2"}
{"reason":"compiler-artifact","manifest_path":"/w/userspace/Cargo.toml","target":{"kind":["lib"],"name":"sidestep"},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"name":"bench"},"profile":{"test":true},"executable":"/w/target/debug/deps/bench-3"}
{"reason":"build-finished","success":true}"#;

    #[test]
    fn collects_and_selects() {
        let all = collect(JSON).unwrap();
        let names: Vec<&str> = all.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["bench", "outbound", "sidestep[lib]"]);
        assert_eq!(all[1].dir, Path::new("/w/tests"));
        let full = select(&all, Suite::Full, &[]).unwrap();
        assert_eq!(full.len(), 2);
        let only = select(&all, Suite::Capture, &["outbound".into()]).unwrap();
        assert_eq!(only[0].0.name, "outbound");
        let err = select(&all, Suite::Capture, &[]).unwrap_err().to_string();
        assert!(
            err.contains("inbound, parity, cni_chain, tc_netlink"),
            "{err}"
        );
    }

    #[test]
    fn reads_results() {
        let markers = [
            "== outbound on 6.1: running /x".to_owned(),
            "== outbound on 6.1: ok (52 s)".to_owned(),
            "== cni_chain on 6.1: FAILED (3 s)".to_owned(),
        ];
        assert_eq!(
            results(&markers),
            [
                ("outbound".to_owned(), true),
                ("cni_chain".to_owned(), false)
            ]
        );
    }
}
