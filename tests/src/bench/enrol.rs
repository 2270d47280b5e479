//! CNI-free enrol latency: one `sidestep enroll` process against one `iptables-legacy-restore`
//! of Istio's default ruleset, each into a fresh network namespace, alternating. This measures
//! the command-line tools, not a CNI plugin (sidestep-cni is written elsewhere): both sides pay
//! one fork+exec from this process; neither pays a CNI runtime's overhead.
//!
//! Each fresh netns gets `lo` and a veth `eth0` (its peer stays in the same netns) with an
//! address, so that sidestep attaches its
//! tc program there as it would on a pod. Creating and deleting the netns, and the
//! `sidestep unenroll` after each run, are outside the timed part.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::topology::{Topology, iptables_restore, spare_address};
use crate::env::TestEnv;
use crate::istio_iptables::IstioCapture;
use crate::netns;
use crate::sidestep::{sidestep, sidestep_bin};
use crate::util::cmd;

#[derive(Clone, Debug, Default)]
pub struct EnrolResult {
    /// Milliseconds per `sidestep enroll`.
    pub sidestep_ms: Vec<f64>,
    /// Milliseconds per `sidestep unenroll` (informational; Istio's DEL leaves the rules to die
    /// with the netns).
    pub unenroll_ms: Vec<f64>,
    /// Milliseconds per `sidestep --version`: the process start-up floor of the CLI.
    pub startup_ms: Vec<f64>,
    /// Milliseconds per `iptables-legacy-restore --noflush` of the ruleset.
    pub iptables_ms: Vec<f64>,
    /// Lines of iptables-restore input (rules, chains, COMMIT).
    pub ruleset_lines: usize,
}

/// A throwaway netns, deleted on drop. Named `sidestep-<env id>-enrol-<n>`, so the crate's
/// sweep removes it if this process dies first.
struct FreshNetns {
    name: String,
    path: PathBuf,
}

impl FreshNetns {
    fn new(env: &TestEnv, n: usize, addr: &str) -> Result<Self> {
        let name = format!("sidestep-{}-enrol-{n}", env.id());
        let path = netns::create(&name)?;
        let ns = Self { name, path };
        let n = ns.name.as_str();
        cmd(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        // A veth pair with both ends inside the netns: no host interface is touched, and the
        // pair goes with the netns. Only eth0 is enrolled.
        cmd(&[
            "ip", "-n", n, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
        ])?;
        cmd(&["ip", "-n", n, "link", "set", "peer0", "up"])?;
        cmd(&["ip", "-n", n, "addr", "add", addr, "dev", "eth0"])?;
        cmd(&["ip", "-n", n, "link", "set", "eth0", "up"])?;
        Ok(ns)
    }
}

impl Drop for FreshNetns {
    fn drop(&mut self) {
        if let Err(e) = netns::delete(&self.name) {
            eprintln!("bench: deleting netns {}: {e:#}", self.name);
        }
    }
}

fn time_enroll(pin_root: &str, netns: &str, ip: &str) -> Result<f64> {
    let t = Instant::now();
    let out = Command::new(sidestep_bin())
        .args(["enroll", "--pin-root", pin_root, "--netns", netns])
        .args(["--interface", "eth0", "--pod-ip", ip])
        .stdin(Stdio::null())
        .output()
        .context("running sidestep enroll")?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !out.status.success() {
        bail!(
            "sidestep enroll --netns {netns} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(ms)
}

/// `runs` timed runs of each command (plus two untimed warm-up runs of each).
pub fn run(env: &TestEnv, topo: &Topology<'_>, runs: usize) -> Result<EnrolResult> {
    let rules_text = IstioCapture::default().iptables_restore_v4();
    let rules = env.tmp_dir().join("bench-enrol-istio-v4.rules");
    std::fs::write(&rules, &rules_text)?;
    let (ip, prefix) = spare_address(&topo.node);
    let addr = format!("{ip}/{prefix}");
    let ip_s = ip.to_string();
    let pin_root = topo.loaded.pin_root().display().to_string();
    let mut res = EnrolResult {
        ruleset_lines: rules_text.lines().filter(|l| !l.trim().is_empty()).count(),
        ..EnrolResult::default()
    };
    let warmup = 2;
    let mut n = 0;
    for i in 0..runs + warmup {
        let timed = i >= warmup;
        // Alternate which tool goes first.
        for k in 0..2 {
            let sidestep_turn = (i + k) % 2 == 0;
            n += 1;
            let ns = FreshNetns::new(env, n, &addr)?;
            let path = ns.path.display().to_string();
            if sidestep_turn {
                let ms = time_enroll(&pin_root, &path, &ip_s)?;
                let t = Instant::now();
                sidestep(&["unenroll", "--pin-root", &pin_root, "--netns", &path])?;
                let un = t.elapsed().as_secs_f64() * 1e3;
                if timed {
                    res.sidestep_ms.push(ms);
                    res.unenroll_ms.push(un);
                }
            } else {
                let d = iptables_restore(&ns.path, &rules)?;
                if timed {
                    res.iptables_ms.push(d.as_secs_f64() * 1e3);
                }
            }
            drop(ns);
        }
        let t = Instant::now();
        sidestep(&["--version"])?;
        if timed {
            res.startup_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    eprintln!(
        "bench: enrol microbenchmark: {} + {} runs",
        res.sidestep_ms.len(),
        res.iptables_ms.len()
    );
    Ok(res)
}
