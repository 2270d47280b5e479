//! `cargo xtask bench scale`: ADD latency, per-connection cost and map memory with 1, 100 and
//! 1,000 pods enrolled.
//!
//! Each level is a node of its own: its own cgroup, pin root and loaded programs, with N-1
//! background pods (netns only: lo, and a veth `eth0` with its own address) enrolled through
//! sidestep-cni exactly as the `cni` mode does it. All levels exist at once, so their samples
//! can be interleaved (rotating order every round) and see the same machine noise; on this
//! shared 2-core machine, levels measured one after another differed by more than the effect
//! looked for. Per round and level:
//! - one further ADD on a fresh netns, timed as a whole process, then its DEL (timed too), so
//!   the level stays put; level N means N pods enrolled including the one being added.
//!
//! Then, interleaved the same way, `windows` new-connection loops per level (`probe
//! connect-many` as an app UID, against `probe origdst-echo` on the capture port as the proxy
//! UID) with `kernel.bpf_stats_enabled` on: every program's calls and run time per call, and the
//! loop's wall time per connection (medians over the windows); and the memory the kernel charges
//! for the maps (`bpftool map show`, bytes_memlock, summed over the pin root's maps).
//!
//! What the levels share is the kernel: netns, veths and TCX links of all levels count for all.
//! What differs is sidestep's own state: map entries and attachment records.
//!
//! Every netns is deleted on drop (one batched `ip` call), also on failure; the pin roots and
//! cgroups go with the [`TestEnv`]s.

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::bpfstats::StatsEnabled;
use super::cni::{FreshNetns, PluginCall, container_id};
use crate::env::TestEnv;
use crate::netns;
use crate::process::{self, Spawn};
use crate::sidestep::{Loaded, bin_dir};

/// The proxy's UID (its own connections are never captured) and the app's.
const PROXY_UID: u32 = 1337;
const APP_UID: u32 = 1000;

#[derive(Clone, Debug, Default)]
pub struct Level {
    /// Pods enrolled while the samples ran, the sampled one included.
    pub pods: usize,
    pub add_ms: Vec<f64>,
    pub del_ms: Vec<f64>,
    /// ns per call over the loop: (program name, ns/call, calls).
    pub prog_ns: Vec<(String, f64, u64)>,
    /// Wall time per connection of the loop (connect, redirect, accept, answer, close).
    pub conn_us: Option<f64>,
    /// Connections the loop completed with the right original destination.
    pub conn_ok: u64,
    /// Sum of bytes_memlock over the pin root's maps.
    pub memlock: Option<u64>,
    /// Seconds spent enrolling the background pods of this level.
    pub fill_secs: f64,
    /// Per connection-loop window: µs per connection, and (program, ns/call, calls).
    pub conn_windows: Vec<f64>,
    pub prog_windows: Vec<(String, f64, u64)>,
}

impl Level {
    /// The loop's (ns per call, calls) of the program `name`, if it ran.
    pub fn prog(&self, name: &str) -> Option<(f64, u64)> {
        self.prog_ns
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, ns, calls)| (*ns, *calls))
    }
}

#[derive(Clone, Debug, Default)]
pub struct ScaleResult {
    pub levels: Vec<Level>,
    pub samples: usize,
    pub conns: u64,
    /// Connection-loop windows per level (medians are reported).
    pub windows: usize,
    pub pod_capacity: Option<u64>,
}

/// The background pods: netns names, deleted together on drop.
struct Background {
    names: Vec<String>,
}

impl Drop for Background {
    fn drop(&mut self) {
        if self.names.is_empty() {
            return;
        }
        let batch: String = self
            .names
            .iter()
            .map(|n| format!("netns del {n}\n"))
            .collect();
        let ok = Command::new("ip")
            .args(["-force", "-b", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .and_then(|mut c| {
                if let Some(mut i) = c.stdin.take() {
                    i.write_all(batch.as_bytes())?;
                }
                c.wait()
            })
            .is_ok_and(|s| s.success());
        // One by one whatever the batch left (it stops at nothing with -force, but be sure).
        for n in &self.names {
            if Path::new(netns::NETNS_DIR).join(n).exists()
                && let Err(e) = netns::delete(n)
            {
                eprintln!("bench: scale: deleting netns {n}: {e:#}");
            }
        }
        if !ok {
            eprintln!("bench: scale: batched netns deletion failed; deleted one by one");
        }
    }
}

/// 100.64.0.0/10 addresses, one per pod (the pod-address map is node-wide). Only ever
/// configured inside the pods' own netns.
fn pod_cidr(i: usize) -> String {
    let i = i + 2;
    format!(
        "100.{}.{}.{}/10",
        64 + (i >> 16) % 64,
        (i >> 8) & 0xff,
        i & 0xff
    )
}

fn memlock(pin_root: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(pin_root.join("maps"))? {
        let path = e?.path();
        let out = Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(&path)
            .output()
            .context("bpftool map show")?;
        let v: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("bpftool JSON for {}", path.display()))?;
        total += v["bytes_memlock"].as_u64().unwrap_or(0);
    }
    Ok(total)
}

fn pod_capacity(pin_root: &Path) -> Option<u64> {
    let out = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(pin_root.join("maps/SIDESTEP_POD"))
        .output()
        .ok()?;
    serde_json::from_slice::<Value>(&out.stdout).ok()?["max_entries"].as_u64()
}

fn prog_samples(loaded: &Loaded) -> Result<Vec<(String, u64, u64)>> {
    let status = loaded.status()?;
    Ok(status["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some((
                p["name"].as_str()?.to_owned(),
                p["run_count"].as_u64().unwrap_or(0),
                p["run_time_ns"].as_u64().unwrap_or(0),
            ))
        })
        .collect())
}

/// The new-connection loop in `ns` (enrolled): per-connection wall time and program costs.
fn connection_loop(
    env: &TestEnv,
    loaded: &Loaded,
    ns: &Path,
    conns: u64,
    level: &mut Level,
) -> Result<()> {
    let probe = bin_dir().join("probe");
    let probe = probe.to_str().context("probe path")?;
    let mut server = process::spawn(
        env,
        Some(ns),
        &Spawn::new(&[probe, "origdst-echo", "127.0.0.1:15001"]).user(PROXY_UID, PROXY_UID),
        false,
    )?;
    std::thread::sleep(Duration::from_millis(200));
    server.ensure_running()?;
    let n = conns.to_string();
    let argv = [probe, "connect-many", "10.255.0.1:80", &n, "--threads", "1"];
    let before = prog_samples(loaded)?;
    let _stats = StatsEnabled::enable()?;
    let t = Instant::now();
    let out = process::run(
        env,
        Some(ns),
        &Spawn::new(&argv).user(APP_UID, APP_UID),
        Duration::from_secs(120),
    )?;
    let wall = t.elapsed();
    let after = prog_samples(loaded)?;
    drop(_stats);
    let _ = server.kill();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim())
        .with_context(|| format!("probe connect-many printed {text}"))?;
    level.conn_ok = v["ok"].as_u64().unwrap_or(0);
    if level.conn_ok == 0 {
        bail!("no connection of the loop was redirected: {v}");
    }
    let elapsed_ms = v["elapsed_ms"].as_f64().unwrap_or(wall.as_secs_f64() * 1e3);
    level.conn_us = Some(elapsed_ms * 1e3 / level.conn_ok as f64);
    for (name, cnt, ns_total) in after {
        let Some((_, c0, t0)) = before.iter().find(|(n, _, _)| *n == name) else {
            continue;
        };
        let calls = cnt.saturating_sub(*c0);
        if calls > 0 {
            let ns_per = ns_total.saturating_sub(*t0) as f64 / calls as f64;
            level.prog_ns.push((name, ns_per, calls));
        }
    }
    Ok(())
}

/// One level: its own cgroup, pin root and loaded programs, its background pods, its state
/// directory. Field order is drop order: netns, then programs, then the env.
struct Node {
    bg: Background,
    loaded: Loaded,
    state_dir: std::path::PathBuf,
    env: TestEnv,
    level: Level,
}

impl Node {
    fn new(k: usize, pods: usize, first_addr: usize) -> Result<Self> {
        let env = TestEnv::new(&format!("bench-scale{k}"))?;
        let loaded = Loaded::load(&env)?;
        let state_dir = env.tmp_dir().join("cni-state");
        std::fs::create_dir_all(&state_dir)?;
        let mut node = Self {
            bg: Background { names: Vec::new() },
            loaded,
            state_dir,
            env,
            level: Level {
                pods,
                ..Level::default()
            },
        };
        let t = Instant::now();
        // N pods: N-1 in the background plus the one being measured.
        for i in first_addr..first_addr + pods.saturating_sub(1) {
            let cidr = pod_cidr(i);
            let ns = FreshNetns::new(&node.env, "bg", i, &cidr)?;
            // The batch in `Background` deletes it.
            let (name, path) = (ns.name.clone(), ns.path.clone());
            std::mem::forget(ns);
            node.bg.names.push(name);
            let cid = container_id("bg", i);
            let pod = format!("bg-{i}");
            node.call(&path, &cid, &pod, &cidr)
                .run("ADD")
                .with_context(|| format!("enrolling background pod {i}"))?;
        }
        node.level.fill_secs = t.elapsed().as_secs_f64();
        Ok(node)
    }

    fn call<'a>(
        &'a self,
        netns: &'a Path,
        cid: &'a str,
        pod: &'a str,
        cidr: &'a str,
    ) -> PluginCall<'a> {
        PluginCall {
            pin_root: self.loaded.pin_root(),
            state_dir: &self.state_dir,
            netns,
            container_id: cid,
            pod,
            cidr,
            inbound_hook: None,
            kubeconfig: None,
        }
    }

    /// One fresh pod: ADD, then the connection loop when `conns` is given, then DEL.
    fn sample(&mut self, i: usize, record: bool, conns: Option<u64>) -> Result<()> {
        let cidr = pod_cidr(i);
        let ns = FreshNetns::new(&self.env, "sc", i, &cidr)?;
        let cid = container_id("sc", i);
        let pod = format!("sc-{i}");
        let add = self
            .call(&ns.path, &cid, &pod, &cidr)
            .run("ADD")
            .context("sample ADD")?;
        if let Some(n) = conns {
            if self.level.memlock.is_none() {
                self.level.memlock = memlock(self.loaded.pin_root()).ok();
            }
            let mut w = Level::default();
            match connection_loop(&self.env, &self.loaded, &ns.path, n, &mut w) {
                Ok(()) => {
                    self.level.conn_windows.push(w.conn_us.unwrap_or(f64::NAN));
                    self.level.conn_ok += w.conn_ok;
                    self.level.prog_windows.extend(w.prog_ns);
                }
                Err(e) => eprintln!(
                    "bench: scale: connection loop at {} pods: {e:#}",
                    self.level.pods
                ),
            }
        }
        let del = self
            .call(&ns.path, &cid, &pod, &cidr)
            .run("DEL")
            .context("sample DEL")?;
        if record && conns.is_none() {
            self.level.add_ms.push(add.as_secs_f64() * 1e3);
            self.level.del_ms.push(del.as_secs_f64() * 1e3);
        }
        Ok(())
    }
}

/// Builds one node per level (each its own pin root with its pods), then interleaves the
/// samples across the levels, rotating the order every round, so that every level sees the
/// same machine noise. The connection loops are interleaved the same way, `windows` per level.
pub fn run(levels: &[usize], samples: usize, conns: u64) -> Result<ScaleResult> {
    let windows = 3;
    let mut nodes = Vec::new();
    let mut next = 0usize;
    for (k, &pods) in levels.iter().enumerate() {
        nodes.push(Node::new(k, pods, next)?);
        next += pods;
        eprintln!(
            "bench: scale: node {k} with {pods} pods (filled in {:.1} s)",
            nodes[k].level.fill_secs
        );
    }
    let pod_capacity = nodes
        .first()
        .and_then(|n| pod_capacity(n.loaded.pin_root()));
    // One warm-up round, unrecorded.
    for round in 0..samples + 1 {
        for k in 0..nodes.len() {
            let j = (k + round) % nodes.len();
            nodes[j].sample(next, round > 0, None)?;
            next += 1;
        }
    }
    for w in 0..windows {
        for k in 0..nodes.len() {
            let j = (k + w) % nodes.len();
            nodes[j].sample(next, false, Some(conns))?;
            next += 1;
        }
    }
    let mut res = ScaleResult {
        samples,
        conns,
        windows,
        pod_capacity,
        ..ScaleResult::default()
    };
    for mut n in nodes {
        let l = &mut n.level;
        l.conn_us = super::stats::median(&l.conn_windows);
        let mut names: Vec<String> = l.prog_windows.iter().map(|p| p.0.clone()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let v: Vec<f64> = l
                .prog_windows
                .iter()
                .filter(|p| p.0 == name)
                .map(|p| p.1)
                .collect();
            let calls = l
                .prog_windows
                .iter()
                .filter(|p| p.0 == name)
                .map(|p| p.2)
                .sum();
            if let Some(m) = super::stats::median(&v) {
                l.prog_ns.push((name, m, calls));
            }
        }
        res.levels.push(std::mem::take(l));
        // `n` drops here: its netns, programs and env.
    }
    Ok(res)
}
