//! `cargo xtask bench scale`: ADD latency, per-connection cost and map memory with 1, 100 and
//! 1,000 pods enrolled on the node.
//!
//! Background pods are netns only (lo, and a veth `eth0` with its own address), each enrolled
//! through sidestep-cni exactly as the `cni` mode does it. At each level:
//! - `samples` further ADDs, each on a fresh netns, timed as whole processes, each followed by
//!   its DEL (timed too), so the level stays put; level N means N pods enrolled including the
//!   one being added;
//! - one pod runs a new-connection loop (`probe connect-many` as an app UID, against `probe
//!   origdst-echo` on the capture port as the proxy UID), with `kernel.bpf_stats_enabled` on:
//!   connect4 and sockops run time per call, and the loop's wall time per connection;
//! - the memory the kernel charges for the maps (`bpftool map show`, bytes_memlock, summed over
//!   the pin root's maps).
//!
//! Every netns is deleted on drop (one batched `ip` call), also on failure; the pin root and
//! the cgroup go with the [`TestEnv`].

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
    /// Seconds spent enrolling the background pods up to this level.
    pub fill_secs: f64,
}

#[derive(Clone, Debug, Default)]
pub struct ScaleResult {
    pub levels: Vec<Level>,
    pub samples: usize,
    pub conns: u64,
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
        if calls > 0 && (name.contains("connect4") || name.contains("sockops")) {
            let ns_per = ns_total.saturating_sub(*t0) as f64 / calls as f64;
            level.prog_ns.push((name, ns_per, calls));
        }
    }
    Ok(())
}

/// Runs the levels in order (each fills the node up to it).
pub fn run(levels: &[usize], samples: usize, conns: u64) -> Result<ScaleResult> {
    let env = TestEnv::new("bench-scale")?;
    let loaded = Loaded::load(&env)?;
    let pin_root = loaded.pin_root().to_path_buf();
    let state_dir = env.tmp_dir().join("cni-state");
    std::fs::create_dir_all(&state_dir)?;
    let mut bg = Background { names: Vec::new() };
    let mut res = ScaleResult {
        samples,
        conns,
        pod_capacity: pod_capacity(&pin_root),
        ..ScaleResult::default()
    };
    let mut next = 0usize;
    for &target in levels {
        let t_fill = Instant::now();
        // Level N: N-1 background pods plus the one being measured.
        while bg.names.len() + 1 < target {
            let i = next;
            next += 1;
            let cidr = pod_cidr(i);
            let ns = FreshNetns::new(&env, "bg", i, &cidr)?;
            // Keep the netns past the guard: the batch in `Background` deletes it.
            let name = ns.name.clone();
            let path = ns.path.clone();
            std::mem::forget(ns);
            bg.names.push(name);
            let cid = container_id("bg", i);
            let pod = format!("bg-{i}");
            PluginCall {
                pin_root: &pin_root,
                state_dir: &state_dir,
                netns: &path,
                container_id: &cid,
                pod: &pod,
                cidr: &cidr,
            }
            .run("ADD")
            .with_context(|| format!("enrolling background pod {i}"))?;
        }
        let mut level = Level {
            pods: target,
            fill_secs: t_fill.elapsed().as_secs_f64(),
            ..Level::default()
        };
        for s in 0..samples + 1 {
            let i = next;
            next += 1;
            let cidr = pod_cidr(i);
            let ns = FreshNetns::new(&env, "sc", i, &cidr)?;
            let cid = container_id("sc", i);
            let pod = format!("sc-{i}");
            let call = PluginCall {
                pin_root: &pin_root,
                state_dir: &state_dir,
                netns: &ns.path,
                container_id: &cid,
                pod: &pod,
                cidr: &cidr,
            };
            let add = call.run("ADD").context("sample ADD")?;
            if s == samples {
                // The last sample pod (untimed) runs the connection loop.
                level.memlock = memlock(&pin_root).ok();
                if let Err(e) = connection_loop(&env, &loaded, &ns.path, conns, &mut level) {
                    eprintln!("bench: scale: connection loop at {target} pods: {e:#}");
                }
                call.run("DEL").context("loop pod DEL")?;
                continue;
            }
            let del = call.run("DEL").context("sample DEL")?;
            // The first ADD of a level warms the caches; it is left out.
            if s > 0 || samples == 1 {
                level.add_ms.push(add.as_secs_f64() * 1e3);
                level.del_ms.push(del.as_secs_f64() * 1e3);
            }
        }
        eprintln!(
            "bench: scale: {target} pods (filled in {:.1} s), {} samples",
            level.fill_secs,
            level.add_ms.len()
        );
        res.levels.push(level);
    }
    drop(bg);
    drop(loaded);
    drop(env);
    Ok(res)
}
