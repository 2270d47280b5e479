//! The benchmark harness behind `cargo xtask bench`: direct, explicit proxy, Istio iptables and
//! sidestep, measured in one run, interleaved, over several rounds, on the real test topology.
//!
//! Entry point: [`run`]; `tests/tests/bench.rs` calls it and writes `docs/BENCHMARKS.md` and
//! `docs/benchmarks.svg` from the returned [`Report`].
//!
//! Everything happens inside netns pods on the test bridge: every load generator targets a pod
//! address or the pod's own loopback, never anything else. Every child process has a bounded
//! run time. Cleanup is by the usual guards: processes, then `sidestep unload`, then the node
//! (CNI DEL, netns with their iptables rules, bridge), then the test envs (cgroups, pin roots);
//! the `kernel.bpf_stats_enabled` sysctl is put back by its own guard.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

pub mod ambient;
pub mod bpfstats;
pub mod cni;
pub mod cpus;
pub mod enrol;
pub mod floor;
pub mod haproxy_cfg;
pub mod machine;
pub mod measure;
pub mod netstat;
pub mod repeats;
pub mod report;
pub mod rounds;
pub mod scale;
pub mod schedstat;
pub mod sections;
pub mod stats;
pub mod sysinfo;
pub mod topology;

use crate::env::TestEnv;
use measure::Workload;
pub use report::Report;

/// Set to `1` for the short run (`cargo xtask bench --quick`).
pub const QUICK_ENV: &str = "SIDESTEP_BENCH_QUICK";
/// `cni` or `scale` to run only that mode (`cargo xtask bench cni`); anything else: all.
pub const MODE_ENV: &str = "SIDESTEP_BENCH_MODE";

/// The modes, in the order of the tables. sk_msg acceleration (issue 6, mode 5) does not exist
/// yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// No sidecars, no capture: the network path alone.
    Direct,
    /// Both sidecars; the app connects to its sidecar explicitly, which uses a static backend.
    Explicit,
    /// Istio's default REDIRECT ruleset (iptables-legacy) in both pods, both sidecars.
    Iptables,
    /// The same ruleset through Istio's native nftables mode (`nft -f`, one inet table; 1.27+).
    Nftables,
    /// Both pods enrolled in sidestep with its default inbound hook (sk_lookup), both sidecars.
    Sidestep,
    /// As sidestep, with the tc inbound hook (what a pod whose proxy listened before its
    /// enrolment gets).
    SidestepTc,
    /// As sidestep, with sk_msg: app <-> sidecar bytes go socket to socket.
    SkMsg,
}

impl Mode {
    pub const COUNT: usize = 7;
    pub const ALL: [Mode; Mode::COUNT] = [
        Mode::Direct,
        Mode::Explicit,
        Mode::Iptables,
        Mode::Nftables,
        Mode::Sidestep,
        Mode::SidestepTc,
        Mode::SkMsg,
    ];

    pub fn index(self) -> usize {
        match self {
            Mode::Direct => 0,
            Mode::Explicit => 1,
            Mode::Iptables => 2,
            Mode::Nftables => 3,
            Mode::Sidestep => 4,
            Mode::SidestepTc => 5,
            Mode::SkMsg => 6,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Explicit => "explicit proxy",
            Mode::Iptables => "iptables",
            Mode::Nftables => "Istio nftables",
            Mode::Sidestep => "sidestep",
            Mode::SidestepTc => "sidestep, tc hook",
            Mode::SkMsg => "sidestep + sk_msg",
        }
    }

    /// Istio's two rulesets, whose REDIRECT puts the app's and its sidecar's connections to a
    /// server into one 4-tuple space.
    pub fn is_netfilter(self) -> bool {
        matches!(self, Mode::Iptables | Mode::Nftables)
    }

    /// Short lowercase name for pod names and logs.
    pub fn slug(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Explicit => "explicit",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::Sidestep => "sidestep",
            Mode::SidestepTc => "sidesteptc",
            Mode::SkMsg => "skmsg",
        }
    }
}

/// Run lengths. Quick: must finish in under 3 minutes; full: under 20.
#[derive(Clone, Debug)]
pub struct Config {
    pub quick: bool,
    /// Interleaved rounds; every figure is the median over them.
    pub rounds: usize,
    /// Seconds of each load run (wrk -d, sockperf -t, iperf3 -t).
    pub run_secs: u32,
    /// Unrecorded warm-up seconds per mode and workload before round 1.
    pub warmup_secs: u32,
    /// Runs of each enrol command (sidestep enroll, iptables-legacy-restore).
    pub enrol_runs: usize,
    /// Seconds of each bpf_stats window (one keep-alive, one new-connection).
    pub bpf_stats_secs: u32,
    /// wrk connections, keep-alive workload.
    pub keepalive_conns: u32,
    /// wrk connections, one-connection-per-request workload.
    pub close_conns: u32,
    /// Timed runs of each CNI operation (ADD, DEL, each iptables install).
    pub cni_runs: usize,
    /// Pods enrolled at each scale level.
    pub scale_levels: Vec<usize>,
    /// Timed ADDs per scale level.
    pub scale_samples: usize,
    /// Connections of the per-level connection loop.
    pub scale_conns: u64,
}

impl Config {
    pub fn quick() -> Self {
        Self {
            quick: true,
            rounds: 3,
            run_secs: 1,
            warmup_secs: 1,
            enrol_runs: 30,
            bpf_stats_secs: 1,
            keepalive_conns: 64,
            close_conns: 16,
            cni_runs: 40,
            scale_levels: vec![1, 20, 100],
            scale_samples: 20,
            scale_conns: 300,
        }
    }

    pub fn full() -> Self {
        Self {
            quick: false,
            rounds: 7,
            run_secs: 5,
            warmup_secs: 2,
            enrol_runs: 100,
            bpf_stats_secs: 5,
            keepalive_conns: 64,
            close_conns: 16,
            cni_runs: 200,
            scale_levels: vec![1, 100, 1000],
            scale_samples: 150,
            scale_conns: 2000,
        }
    }

    /// [`Config::quick`] when `SIDESTEP_BENCH_QUICK` is set to anything but `0` or empty.
    pub fn from_env() -> Self {
        match std::env::var(QUICK_ENV) {
            Ok(v) if !v.is_empty() && v != "0" => Self::quick(),
            _ => Self::full(),
        }
    }
}

/// Wall-clock time of each phase, for the report.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub setup: Duration,
    pub rounds: Duration,
    pub bpf_stats: Duration,
    pub enrol: Duration,
    pub cni: Duration,
    pub scale: Duration,
    pub total: Duration,
}

/// Connection-setup health of one lane over the recorded new-connection runs.
#[derive(Clone, Debug, Default)]
pub struct ConnHealth {
    /// Connections wrk completed.
    pub connections: u64,
    /// Client and server pod together, over those runs.
    pub tcp: netstat::TcpCounters,
    /// The most TIME_WAIT sockets seen in the server pod right after a run.
    pub server_time_wait: u64,
}

impl ConnHealth {
    /// `n` per 1000 connections.
    pub fn per_1000(&self, n: u64) -> Option<f64> {
        (self.connections > 0).then(|| 1000.0 * n as f64 / self.connections as f64)
    }

    /// Adds one run: its connections and the counter deltas around it.
    fn add(&mut self, connections: u64, before: netstat::TcpCounters, lane: &topology::Lane<'_>) {
        if let Some(after) = tcp_counters(lane) {
            self.connections += connections;
            self.tcp = self.tcp.plus(after.since(before));
        }
        if let Ok(tw) = netstat::time_wait(&lane.server) {
            self.server_time_wait = self.server_time_wait.max(tw);
        }
    }
}

/// The new-connection figures of the diagnostic lane without TIME_WAIT in its server pod.
#[derive(Clone, Debug, Default)]
pub struct TwControl {
    /// Connections/s, one per round.
    pub rates: Vec<f64>,
    pub health: ConnHealth,
}

fn tcp_counters(lane: &topology::Lane<'_>) -> Option<netstat::TcpCounters> {
    match (
        netstat::tcp_counters(&lane.client),
        netstat::tcp_counters(&lane.server),
    ) {
        (Ok(a), Ok(b)) => Some(a.plus(b)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("bench: reading TCP counters: {e:#}");
            None
        }
    }
}

/// Per-mode samples of one figure: `values[mode.index()]` holds one value per round that
/// succeeded.
#[derive(Clone, Debug)]
pub struct Metric {
    pub key: &'static str,
    pub workload: Workload,
    pub label: &'static str,
    pub unit: &'static str,
    pub higher_is_better: bool,
    pub values: [Vec<f64>; Mode::COUNT],
}

impl Metric {
    fn new(
        workload: Workload,
        key: &'static str,
        label: &'static str,
        unit: &'static str,
        higher: bool,
    ) -> Self {
        Self {
            key,
            workload,
            label,
            unit,
            higher_is_better: higher,
            values: Default::default(),
        }
    }

    pub fn median(&self, mode: Mode) -> Option<f64> {
        stats::median(&self.values[mode.index()])
    }
}

/// The figures collected from the interleaved rounds, in table order.
pub fn new_metrics() -> Vec<Metric> {
    use Workload::*;
    vec![
        Metric::new(
            KeepAlive,
            "ka_rps",
            "HTTP keep-alive: requests/s",
            "req/s",
            true,
        ),
        Metric::new(
            KeepAlive,
            "ka_p50",
            "HTTP keep-alive: p50 latency",
            "µs",
            false,
        ),
        Metric::new(
            KeepAlive,
            "ka_p99",
            "HTTP keep-alive: p99 latency",
            "µs",
            false,
        ),
        Metric::new(
            NewConn,
            "nc_cps",
            "New connection per request: connections/s",
            "conn/s",
            true,
        ),
        Metric::new(
            NewConn,
            "nc_p99",
            "New connection per request: p99 latency",
            "µs",
            false,
        ),
        Metric::new(
            PingPong,
            "pp_p50",
            "TCP ping-pong (sockperf): p50 RTT",
            "µs",
            false,
        ),
        Metric::new(
            PingPong,
            "pp_p99",
            "TCP ping-pong (sockperf): p99 RTT",
            "µs",
            false,
        ),
        Metric::new(
            Bulk,
            "bulk",
            "Bulk TCP (iperf3), app -> sidecar -> sidecar -> server",
            "Gbit/s",
            true,
        ),
    ]
}

fn metric<'m>(metrics: &'m mut [Metric], key: &str) -> &'m mut Metric {
    metrics
        .iter_mut()
        .find(|m| m.key == key)
        .expect("metric key from new_metrics")
}

/// Runs one load run and files its figures; a failed run is logged and noted, not fatal.
fn record(
    metrics: &mut [Metric],
    notes: &mut Vec<String>,
    mode: Mode,
    w: Workload,
    round: usize,
    outcome: Result<measure::Outcome>,
) {
    let i = mode.index();
    match outcome {
        Ok(measure::Outcome::Wrk(r)) => {
            let (rate, p50, p99) = match w {
                Workload::KeepAlive => ("ka_rps", Some("ka_p50"), "ka_p99"),
                _ => ("nc_cps", None, "nc_p99"),
            };
            if r.errors > 0 || r.non_2xx > 0 {
                notes.push(format!(
                    "round {round}, {}, {}: wrk reported {} socket errors and {} non-2xx responses out of {} requests",
                    mode.label(),
                    w.label(),
                    r.errors,
                    r.non_2xx,
                    r.requests
                ));
            }
            metric(metrics, rate).values[i].push(r.rate);
            if let Some(k) = p50 {
                metric(metrics, k).values[i].push(r.p50_us);
            }
            metric(metrics, p99).values[i].push(r.p99_us);
        }
        Ok(measure::Outcome::Sockperf(r)) => {
            metric(metrics, "pp_p50").values[i].push(r.p50_us);
            metric(metrics, "pp_p99").values[i].push(r.p99_us);
        }
        Ok(measure::Outcome::Iperf(gbps)) => metric(metrics, "bulk").values[i].push(gbps),
        Err(e) => {
            eprintln!(
                "bench: round {round} {} {} failed: {e:#}",
                mode.label(),
                w.label()
            );
            let msg = format!("{e:#}");
            let first = msg.lines().next().unwrap_or_default();
            notes.push(format!(
                "round {round}, {}, {}: run failed and is left out ({first})",
                mode.label(),
                w.label()
            ));
        }
    }
}

/// `SIDESTEP_BENCH_NSTAT=1`: print every TCP counter that moved in each new-connection run.
fn nstat_dump() -> bool {
    std::env::var("SIDESTEP_BENCH_NSTAT").is_ok_and(|v| v == "1")
}

/// Client and server pod's counters summed, by name; empty when a read fails.
fn nstat(lane: &topology::Lane<'_>) -> std::collections::BTreeMap<String, u64> {
    let mut sum = std::collections::BTreeMap::new();
    for pod in [&lane.client, &lane.server] {
        for (k, v) in netstat::all_counters(pod).unwrap_or_default() {
            *sum.entry(k).or_insert(0) += v;
        }
    }
    sum
}

/// Builds the topology, runs the warm-up, the interleaved rounds, the bpf_stats windows and the
/// enrol microbenchmark, and returns the report. Everything it made is gone when it returns.
pub fn run(cfg: &Config) -> Result<Report> {
    let t0 = Instant::now();
    let sys_start = sysinfo::SysInfo::collect(cfg.quick);
    // Declared first so they drop last: the sidestep lane's processes and programs live in
    // `ss_env`, the other three lanes' processes in `env`, so no BPF program is attached where
    // the baseline modes run.
    let env = TestEnv::new("bench")?;
    let ss_env = TestEnv::new("bench-ss")?;
    let mut topo =
        topology::Topology::build(&env, &ss_env).context("building the bench topology")?;
    let cpus = topo.cpus.to_string();
    let mut timings = Timings {
        setup: t0.elapsed(),
        ..Timings::default()
    };
    eprintln!("bench: topology up in {:.1?}", timings.setup);

    let mut metrics = new_metrics();
    let mut notes = Vec::new();
    let mut health: [ConnHealth; Mode::COUNT] = Default::default();
    let mut tw_control = TwControl::default();
    let mut round_tcp = Vec::new();

    // Warm-up (unrecorded), then the capture sanity checks: each lane's traffic really went
    // the way its mode says.
    // sockperf has a warm-up of its own and iperf3 needs none.
    for w in [Workload::KeepAlive, Workload::NewConn] {
        for lane in topo.lanes.iter().chain([&topo.tw_control]) {
            if let Err(e) = measure::run(lane, w, cfg, cfg.warmup_secs) {
                eprintln!("bench: warm-up {} {}: {e:#}", lane.mode.label(), w.label());
            }
        }
    }
    topo.check_capture()
        .context("capture sanity check after warm-up")?;

    let t_rounds = Instant::now();
    for round in 0..cfg.rounds {
        for w in Workload::ALL {
            for k in 0..topo.lanes.len() {
                // Rotate the order every round so that no mode always runs first or after
                // the same neighbour.
                let lane = &topo.lanes[(k + round) % topo.lanes.len()];
                let new_conn = w == Workload::NewConn;
                let before = new_conn.then(|| tcp_counters(lane)).flatten();
                let round_before = new_conn.then(|| rounds::Before::read(lane)).flatten();
                let nstat_before = (new_conn && nstat_dump()).then(|| nstat(lane));
                let outcome = measure::run(lane, w, cfg, cfg.run_secs);
                if let (Some(b), Ok(measure::Outcome::Wrk(r))) = (before, &outcome) {
                    health[lane.mode.index()].add(r.requests, b, lane);
                }
                if let (Some(b), Ok(measure::Outcome::Wrk(r))) = (round_before, &outcome)
                    && let Some(row) = b.row(lane, round + 1, r.rate, r.p99_us)
                {
                    if let Some(before) = &nstat_before {
                        eprintln!(
                            "bench: nstat {} round {} ({} conn, p99 {} us): {}",
                            lane.mode.label(),
                            round + 1,
                            r.requests,
                            r.p99_us,
                            netstat::grown(before, &nstat(lane))
                        );
                    }
                    round_tcp.push(row);
                }
                if w == Workload::NewConn && lane.mode == Mode::Sidestep {
                    // The diagnostic control runs right after the sidestep lane.
                    let c = &topo.tw_control;
                    let before = tcp_counters(c);
                    match measure::run(c, w, cfg, cfg.run_secs) {
                        Ok(measure::Outcome::Wrk(r)) => {
                            tw_control.rates.push(r.rate);
                            if let Some(b) = before {
                                tw_control.health.add(r.requests, b, c);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => eprintln!("bench: TIME_WAIT control run: {e:#}"),
                    }
                }
                record(&mut metrics, &mut notes, lane.mode, w, round + 1, outcome);
            }
        }
        topo.ensure_running()
            .with_context(|| format!("a server or sidecar died during round {}", round + 1))?;
        eprintln!(
            "bench: round {}/{} done at {:.0?}",
            round + 1,
            cfg.rounds,
            t0.elapsed()
        );
    }
    timings.rounds = t_rounds.elapsed();

    let t_stats = Instant::now();
    let bpf = match bpfstats::measure(&topo, cfg) {
        Ok(b) => {
            if let Err(e) = &b.floor {
                notes.push(format!(
                    "The no-op floor of the BPF costs not measured: {e}"
                ));
            }
            Some(b)
        }
        Err(e) => {
            eprintln!("bench: bpf_stats: {e:#}");
            notes.push(format!("BPF per-call cost not measured: {e:#}"));
            None
        }
    };
    timings.bpf_stats = t_stats.elapsed();

    let t_enrol = Instant::now();
    let enrol = match enrol::run(&env, &topo, cfg.enrol_runs) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("bench: enrol microbenchmark: {e:#}");
            notes.push(format!("Enrol microbenchmark failed: {e:#}"));
            enrol::EnrolResult::default()
        }
    };
    timings.enrol = t_enrol.elapsed();

    // On the sidestep lane's programs: a node that already has pods.
    let t_cni = Instant::now();
    let cni = cni::run(&env, topo.loaded.pin_root(), cfg.cni_runs)
        .map_err(|e| {
            eprintln!("bench: cni: {e:#}");
            notes.push(format!("CNI benchmark failed: {e:#}"));
        })
        .ok();
    timings.cni = t_cni.elapsed();

    drop(topo);
    drop(ss_env);
    drop(env);

    let t_scale = Instant::now();
    let scale = scale::run(&cfg.scale_levels, cfg.scale_samples, cfg.scale_conns)
        .map_err(|e| {
            eprintln!("bench: scale: {e:#}");
            notes.push(format!("Scale benchmark failed: {e:#}"));
        })
        .ok();
    timings.scale = t_scale.elapsed();
    timings.total = t0.elapsed();
    let sys_end = sysinfo::SysInfo::collect(cfg.quick);

    let missing: Vec<report::Missing> = metrics
        .iter()
        .flat_map(|m| {
            Mode::ALL
                .iter()
                .filter(|mode| m.values[mode.index()].is_empty())
                .map(move |&mode| report::Missing {
                    metric: m.label.to_string(),
                    mode,
                })
        })
        .collect();
    Ok(Report {
        config: cfg.clone(),
        sys: sys_start,
        sys_end,
        metrics,
        health,
        tw_control,
        round_tcp,
        cpus,
        bpf,
        enrol,
        cni,
        scale,
        timings,
        notes,
        missing,
    })
}
