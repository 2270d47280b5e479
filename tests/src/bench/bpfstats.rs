//! The BPF programs' cost per call, from the kernel's own accounting
//! (`kernel.bpf_stats_enabled=1`: run_time_ns and run_cnt per program).
//!
//! Statistics are on only for these windows, after the interleaved rounds, so the timing
//! overhead they add never touches the sidestep figures above. The sysctl goes back to its
//! previous value when the guard drops, also on a panic.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::measure::{self, Outcome, Workload};
use super::topology::Topology;
use super::{Config, Mode};

const SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";
pub const TC_PROGRAM: &str = "sidestep_tc_ingress";

/// `kernel.bpf_stats_enabled=1` until dropped; then the previous value.
pub struct StatsEnabled {
    previous: String,
}

impl StatsEnabled {
    pub fn enable() -> Result<Self> {
        let previous = fs::read_to_string(SYSCTL)
            .with_context(|| format!("read {SYSCTL}"))?
            .trim()
            .to_owned();
        fs::write(SYSCTL, "1").with_context(|| format!("write 1 to {SYSCTL}"))?;
        Ok(Self { previous })
    }

    pub fn previous(&self) -> &str {
        &self.previous
    }
}

impl Drop for StatsEnabled {
    fn drop(&mut self) {
        if let Err(e) = fs::write(SYSCTL, &self.previous) {
            eprintln!(
                "bench: restoring kernel.bpf_stats_enabled={}: {e}",
                self.previous
            );
        }
    }
}

/// Cumulative counters of one program.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgSample {
    pub name: String,
    pub run_count: u64,
    pub run_time_ns: u64,
}

/// Cost of one program over the measured windows.
#[derive(Clone, Debug)]
pub struct ProgCost {
    pub name: String,
    pub calls: u64,
    pub total_ns: u64,
}

impl ProgCost {
    pub fn ns_per_call(&self) -> Option<f64> {
        (self.calls > 0).then(|| self.total_ns as f64 / self.calls as f64)
    }
}

/// One window: a workload on the sidestep lane with statistics on.
#[derive(Clone, Debug)]
pub struct Window {
    pub workload: Workload,
    /// Requests (= connections for the new-connection workload) wrk completed.
    pub requests: u64,
    pub progs: Vec<ProgCost>,
}

impl Window {
    /// All programs' time divided by the requests made: BPF ns per request (per connection for
    /// the new-connection workload), summed over both pods.
    pub fn ns_per_request(&self) -> Option<f64> {
        let total: u64 = self.progs.iter().map(|p| p.total_ns).sum();
        (self.requests > 0).then(|| total as f64 / self.requests as f64)
    }
}

#[derive(Clone, Debug)]
pub struct BpfCost {
    pub sysctl_before: String,
    /// Programs read through bpftool because `sidestep status` did not list them.
    pub via_bpftool: Vec<String>,
    pub windows: Vec<Window>,
    /// Over all windows.
    pub combined: Vec<ProgCost>,
    /// The new-connection workload once more, with a no-op beside each program (`floor.rs`);
    /// Why the window failed, when it did; the page's notes repeat it.
    pub floor: Result<Floor, String>,
}

/// A window with a no-op program at every hook, beside sidestep's.
#[derive(Clone, Debug)]
pub struct Floor {
    pub requests: u64,
    /// sidestep's programs in this window.
    pub sidestep: Vec<ProgCost>,
    /// The no-ops, named by hook (`floor::HOOKS`).
    pub noop: Vec<ProgCost>,
}

/// One sidestep program's cost per connection against its no-op's.
#[derive(Clone, Debug, PartialEq)]
pub struct FloorRow {
    pub program: String,
    pub hook: &'static str,
    pub calls_per_request: f64,
    pub ns_per_call: f64,
    pub noop_ns_per_call: f64,
}

impl Floor {
    /// Every sidestep program that ran and has a no-op at its hook, with both costs per call.
    pub fn rows(&self) -> Vec<FloorRow> {
        if self.requests == 0 {
            return Vec::new();
        }
        self.sidestep
            .iter()
            .filter_map(|p| {
                let hook = super::floor::hook_of(&p.name)?;
                let noop = self.noop.iter().find(|n| n.name == hook.name)?;
                Some(FloorRow {
                    program: p.name.clone(),
                    hook: hook.name,
                    calls_per_request: p.calls as f64 / self.requests as f64,
                    ns_per_call: p.ns_per_call()?,
                    noop_ns_per_call: noop.ns_per_call()?,
                })
            })
            .collect()
    }

    /// (sidestep's programs, the same calls made to no-ops) in ns per connection, over the
    /// programs of `rows`.
    pub fn per_request(&self) -> Option<(f64, f64)> {
        let rows = self.rows();
        (!rows.is_empty()).then(|| {
            rows.iter().fold((0.0, 0.0), |(s, f), r| {
                (
                    s + r.calls_per_request * r.ns_per_call,
                    f + r.calls_per_request * r.noop_ns_per_call,
                )
            })
        })
    }
}

/// The programs `sidestep status --json` lists, plus the tc program from bpftool through its
/// pin when status does not list it. The flag says whether bpftool was needed.
pub fn sample(topo: &Topology<'_>) -> Result<(Vec<ProgSample>, bool)> {
    let status = topo.loaded.status()?;
    let mut v: Vec<ProgSample> = status["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some(ProgSample {
                name: p["name"].as_str()?.to_owned(),
                run_count: p["run_count"].as_u64().unwrap_or(0),
                run_time_ns: p["run_time_ns"].as_u64().unwrap_or(0),
            })
        })
        .collect();
    let mut via_bpftool = false;
    if !v.iter().any(|p| p.name == TC_PROGRAM) {
        let pin = topo.loaded.pin_root().join("progs").join(TC_PROGRAM);
        v.push(bpftool_sample(&pin, TC_PROGRAM)?);
        via_bpftool = true;
    }
    Ok((v, via_bpftool))
}

fn bpftool_sample(pin: &Path, name: &str) -> Result<ProgSample> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "pinned"])
        .arg(pin)
        .arg("--json")
        .output()
        .context("running bpftool")?;
    if !out.status.success() {
        bail!(
            "bpftool prog show pinned {}: {}",
            pin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_bpftool(&String::from_utf8_lossy(&out.stdout), name)
}

/// `bpftool prog show --json` prints run_time_ns and run_cnt only once the program has run
/// with statistics on; absent means zero.
pub fn parse_bpftool(json: &str, name: &str) -> Result<ProgSample> {
    let v: Value = serde_json::from_str(json).context("bpftool JSON")?;
    let v = if let Some(a) = v.as_array() {
        a.first().cloned().unwrap_or(Value::Null)
    } else {
        v
    };
    if v.is_null() || v.get("id").is_none() {
        bail!("bpftool printed no program: {json}");
    }
    Ok(ProgSample {
        name: name.to_owned(),
        run_count: v["run_cnt"].as_u64().unwrap_or(0),
        run_time_ns: v["run_time_ns"].as_u64().unwrap_or(0),
    })
}

pub fn delta(before: &[ProgSample], after: &[ProgSample]) -> Vec<ProgCost> {
    after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.name == a.name);
            ProgCost {
                name: a.name.clone(),
                calls: a.run_count - b.map_or(0, |b| b.run_count.min(a.run_count)),
                total_ns: a.run_time_ns - b.map_or(0, |b| b.run_time_ns.min(a.run_time_ns)),
            }
        })
        .collect()
}

/// Turns statistics on, runs a keep-alive window and a new-connection window on the sidestep
/// lane, and reads the counters around each.
pub fn measure(topo: &Topology<'_>, cfg: &Config) -> Result<BpfCost> {
    let guard = StatsEnabled::enable()?;
    // Let in-flight work from before settle, so each window's delta is its own.
    std::thread::sleep(Duration::from_millis(200));
    let lane = topo.lane(Mode::Sidestep);
    let mut windows = Vec::new();
    let (first, via_bpftool) = sample(topo)?;
    let mut prev = first.clone();
    for w in [Workload::KeepAlive, Workload::NewConn] {
        let outcome = measure::run(lane, w, cfg, cfg.bpf_stats_secs)?;
        let (now, _) = sample(topo)?;
        let requests = match outcome {
            Outcome::Wrk(r) => r.requests,
            _ => 0,
        };
        windows.push(Window {
            workload: w,
            requests,
            progs: delta(&prev, &now),
        });
        prev = now;
    }
    let combined = delta(&first, &prev);
    let floor = measure_floor(topo, cfg).map_err(|e| {
        eprintln!("bench: bpf_stats: the no-op floor: {e:#}");
        format!("{e:#}")
    });
    let sysctl_before = guard.previous().to_owned();
    drop(guard);
    let now = fs::read_to_string(SYSCTL).unwrap_or_default();
    if now.trim() != sysctl_before {
        bail!(
            "kernel.bpf_stats_enabled is {} after restoring {sysctl_before}",
            now.trim()
        );
    }
    Ok(BpfCost {
        sysctl_before,
        via_bpftool: if via_bpftool {
            vec![TC_PROGRAM.to_owned()]
        } else {
            Vec::new()
        },
        windows,
        combined,
        floor,
    })
}

/// A new-connection window with a no-op at every hook of the sidestep lane (its cgroup, and
/// sk_lookup in both pods' netns), detached when it ends.
fn measure_floor(topo: &Topology<'_>, cfg: &Config) -> Result<Floor> {
    let lane = topo.lane(Mode::Sidestep);
    let noops = super::floor::NoopSet::attach(
        lane.env.cgroup_path(),
        &[&lane.client.netns_path, &lane.server.netns_path],
    )?;
    let (before, _) = sample(topo)?;
    let noop_before = noops.sample()?;
    let outcome = measure::run(lane, Workload::NewConn, cfg, cfg.bpf_stats_secs)?;
    let (after, _) = sample(topo)?;
    let noop_after = noops.sample()?;
    drop(noops);
    let requests = match outcome {
        Outcome::Wrk(r) => r.requests,
        _ => 0,
    };
    if requests == 0 {
        bail!("no connection completed in the window");
    }
    Ok(Floor {
        requests,
        sidestep: delta(&before, &after),
        noop: delta(&noop_before, &noop_after),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpftool_json_and_deltas() {
        let s = parse_bpftool(
            r#"{"id":42,"type":"sched_cls","name":"sidestep_tc_ing","run_time_ns":5000,"run_cnt":50}"#,
            TC_PROGRAM,
        )
        .unwrap();
        assert_eq!((s.run_count, s.run_time_ns), (50, 5000));
        let z = parse_bpftool(r#"{"id":42,"type":"sched_cls"}"#, TC_PROGRAM).unwrap();
        assert_eq!((z.run_count, z.run_time_ns), (0, 0));
        assert!(parse_bpftool("[]", TC_PROGRAM).is_err());
        let d = delta(&[z], &[s]);
        assert_eq!(d[0].ns_per_call(), Some(100.0));
    }

    #[test]
    fn the_floor_charges_each_call_at_its_hooks_no_op_price() {
        let cost = |name: &str, calls, total_ns| ProgCost {
            name: name.into(),
            calls,
            total_ns,
        };
        let floor = Floor {
            requests: 10,
            sidestep: vec![
                cost("sidestep_sockops", 300, 60_000),
                cost("sidestep_pod_id", 30, 3_000),
                cost("sidestep_sk_lookup", 30, 12_000),
                // No no-op stands in for tc; it is left out of both sums.
                cost(TC_PROGRAM, 50, 5_000),
            ],
            noop: vec![
                cost("floor_sockops", 300, 15_000),
                cost("floor_sk_lookup", 60, 2_400),
            ],
        };
        let rows = floor.rows();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].calls_per_request, 30.0);
        assert_eq!(
            (rows[0].ns_per_call, rows[0].noop_ns_per_call),
            (200.0, 50.0)
        );
        // Both sk_lookup programs are charged the one sk_lookup no-op's 40 ns per call.
        assert_eq!(rows[1].noop_ns_per_call, 40.0);
        let (ours, noop) = floor.per_request().unwrap();
        assert_eq!(ours, 6000.0 + 300.0 + 1200.0);
        assert_eq!(noop, 1500.0 + 120.0 + 120.0);
        let idle = Floor {
            requests: 0,
            ..floor
        };
        assert!(idle.rows().is_empty() && idle.per_request().is_none());
    }
}
