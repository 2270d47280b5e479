//! docs/BENCHMARKS.md and docs/benchmarks.svg, from the collected figures. Nothing here is a
//! figure of its own: every number comes from the run.

use std::fmt::Write as _;

use super::bpfstats::{BpfCost, TC_PROGRAM};
use super::enrol::EnrolResult;
use super::measure::Workload;
use super::stats::{self, median, percentile};
use super::sysinfo::SysInfo;
use super::{Config, ConnHealth, Metric, Mode, Timings, TwControl};

mod svg;
mod targets;

/// Where the chart goes, relative to docs/BENCHMARKS.md.
pub const SVG_NAME: &str = "benchmarks.svg";

pub struct Report {
    pub config: Config,
    pub sys: SysInfo,
    pub sys_end: SysInfo,
    pub metrics: Vec<Metric>,
    /// Indexed by [`Mode::index`].
    pub health: [ConnHealth; Mode::COUNT],
    pub tw_control: TwControl,
    pub bpf: Option<BpfCost>,
    pub enrol: EnrolResult,
    pub cni: Option<super::cni::CniBench>,
    pub scale: Option<super::scale::ScaleResult>,
    pub timings: Timings,
    /// Failed runs, wrk errors and the like.
    pub notes: Vec<String>,
    /// Metric / mode pairs without a single successful run.
    pub missing: Vec<Missing>,
}

/// A figure of one mode that no run of the benchmark measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Missing {
    pub metric: String,
    pub mode: Mode,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} / {}", self.metric, self.mode.label())
    }
}

impl Report {
    /// Missing figures of the modes sidestep runs by default. sk_msg is opt-in and its bulk runs
    /// are known to fail (ENOMEM on the app's write when the proxy lags, docs/ARCHITECTURE.md):
    /// the page reports those, and they do not fail the command.
    pub fn missing_in_default_modes(&self) -> Vec<&Missing> {
        self.missing
            .iter()
            .filter(|m| m.mode != Mode::SkMsg)
            .collect()
    }
}

/// A figure with a precision that suits its size.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "—".into();
    }
    let a = v.abs();
    if a >= 10_000.0 {
        let mut s = format!("{:.0}", v.abs());
        let mut out = String::new();
        while s.len() > 3 {
            let tail = s.split_off(s.len() - 3);
            out = format!(",{tail}{out}");
        }
        format!("{}{s}{out}", if v < 0.0 { "-" } else { "" })
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), fmt_num)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "—".into(), |r| format!("{r:.2}×"))
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.2} ms"))
}

/// What a figure costs per operation, so that overheads add up: µs per request or connection
/// for rates, µs per MB for throughput, the latency itself for latencies.
fn cost(m: &Metric, v: f64) -> f64 {
    match m.unit {
        "Gbit/s" => 8_000.0 / v,
        _ if m.higher_is_better => 1e6 / v,
        _ => v,
    }
}

fn cost_unit(m: &Metric) -> &'static str {
    match m.unit {
        "Gbit/s" => "µs/MB",
        "req/s" => "µs/request",
        "conn/s" => "µs/connection",
        _ => "µs",
    }
}

/// Capture overhead of a mode in cost units: cost(mode) - cost(explicit proxy).
fn overhead(m: &Metric, mode: Mode) -> Option<f64> {
    let e = m.median(Mode::Explicit)?;
    let v = m.median(mode)?;
    Some(cost(m, v) - cost(m, e))
}

/// sidestep's overhead as a percentage of iptables', when iptables has a positive overhead.
fn overhead_pct(m: &Metric) -> Option<f64> {
    let i = overhead(m, Mode::Iptables)?;
    let s = overhead(m, Mode::Sidestep)?;
    (i > 0.0).then(|| 100.0 * s / i)
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Report {
    fn metric(&self, key: &str) -> Option<&Metric> {
        self.metrics.iter().find(|m| m.key == key)
    }

    fn spread_pct(&self, m: &Metric, mode: Mode) -> Option<f64> {
        stats::rel_spread(&m.values[mode.index()]).map(|s| s * 100.0)
    }

    /// "(within the rounds' spread)" when the two modes differ by less than the larger of
    /// their spreads.
    fn noise_note(&self, m: &Metric, a: Mode, b: Mode) -> String {
        let (Some(va), Some(vb)) = (m.median(a), m.median(b)) else {
            return String::new();
        };
        let diff = 100.0 * (va - vb).abs() / vb.abs().max(f64::MIN_POSITIVE);
        let spread = self
            .spread_pct(m, a)
            .unwrap_or(0.0)
            .max(self.spread_pct(m, b).unwrap_or(0.0));
        if diff < spread {
            format!(
                " The {diff:.1}% difference is smaller than the rounds' spread ({spread:.0}%), so it is within the noise at this run length."
            )
        } else {
            String::new()
        }
    }

    /// Whether the data point at the TIME_WAIT collision: sidestep's new-connection rate is
    /// under half of iptables', and the control lane, whose server pod keeps no TIME_WAIT
    /// sockets, makes at least half of iptables'.
    fn tw_collapse(&self) -> bool {
        let Some(m) = self.metric("nc_cps") else {
            return false;
        };
        match (
            m.median(Mode::Sidestep),
            m.median(Mode::Iptables),
            median(&self.tw_control.rates),
        ) {
            (Some(s), Some(i), Some(c)) => s < 0.5 * i && c >= 0.5 * i,
            _ => false,
        }
    }

    fn headline(&self) -> String {
        let mut parts = Vec::new();
        if let Some(m) = self.metric("nc_cps") {
            let r = ratio(m.median(Mode::Sidestep), m.median(Mode::Iptables));
            let mut p = match overhead_pct(m) {
                Some(p) => format!(
                    "on a new connection per request, sidestep's capture overhead is {p:.0}% of iptables' ({} vs {} µs per connection over the explicit-proxy floor; {} the connections/s of iptables)",
                    fmt_opt(overhead(m, Mode::Sidestep)),
                    fmt_opt(overhead(m, Mode::Iptables)),
                    fmt_ratio(r)
                ),
                None => format!(
                    "on a new connection per request, iptables showed no overhead over the explicit-proxy floor in this run, so the overhead ratio is undefined (sidestep: {} the connections/s of iptables)",
                    fmt_ratio(r)
                ),
            };
            if self.tw_collapse() {
                let c = ratio(median(&self.tw_control.rates), m.median(Mode::Iptables));
                p += &format!(
                    ", and TIME_WAIT sockets in the server pod are what stands in the way: a control lane whose server pod keeps none makes {} the connections/s of iptables (see Connection setup)",
                    fmt_ratio(c)
                );
            }
            parts.push(p);
        }
        if let Some(m) = self.metric("ka_rps") {
            parts.push(format!(
                "on HTTP keep-alive sidestep serves {} the requests/s of iptables",
                fmt_ratio(ratio(m.median(Mode::Sidestep), m.median(Mode::Iptables)))
            ));
        }
        if let Some(c) = &self.cni
            && let (_, _, Some(r)) = super::sections::cni_add_target(c, &c.add_ms)
        {
            let (_, _, rs) = super::sections::cni_add_target(c, &c.add_tc_ms);
            parts.push(format!(
                "a sidestep-cni ADD takes {} of the time of installing Istio's rules with iptables-restore and ip6tables-restore (p50, whole processes; {} with `inbound_hook: tc`)",
                fmt_ratio(Some(r)),
                fmt_ratio(rs)
            ));
        }
        let mut s = parts.join("; ");
        if let Some(c) = s.get(..1) {
            s = c.to_uppercase() + &s[1..];
        }
        s + "."
    }

    pub fn markdown(&self) -> String {
        let mut o = String::new();
        let cfg = &self.config;
        let kind = if cfg.quick { "quick" } else { "full" };
        let cmdline = if cfg.quick {
            "cargo xtask bench --quick"
        } else {
            "cargo xtask bench"
        };
        let _ = writeln!(o, "# sidestep benchmarks\n");
        let _ = writeln!(
            o,
            "<!-- Generated by `{cmdline}` (tests/tests/bench.rs, tests/src/bench/). Do not edit: the next run overwrites this file. -->\n"
        );
        let _ = writeln!(o, "**Headline ({kind} run):** {}\n", self.headline());
        if !self.missing.is_empty() {
            let _ = writeln!(
                o,
                "**This run is incomplete:** no successful run for {}.\n",
                self.missing
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }

        // Environment.
        let _ = writeln!(o, "## The run\n");
        let _ = writeln!(o, "| | |\n|---|---|");
        let _ = writeln!(o, "| date | {} |", self.sys.date);
        let _ = writeln!(o, "| kernel | {} |", self.sys.kernel);
        let _ = writeln!(o, "| CPU | {} × {} (nproc) |", self.sys.cpu, self.sys.nproc);
        let _ = writeln!(
            o,
            "| kind | **{kind}** (`{cmdline}`): {} interleaved rounds, {} s per run, {} s wrk warm-up per mode, {} enrol runs per tool |",
            cfg.rounds, cfg.run_secs, cfg.warmup_secs, cfg.enrol_runs
        );
        let _ = writeln!(
            o,
            "| load average (1, 5, 15 min) | at start `{}`, at end `{}` |",
            self.sys.loadavg, self.sys_end.loadavg
        );
        let t = &self.timings;
        let _ = writeln!(
            o,
            "| harness wall time | {:.0} s total: setup {:.0} s, rounds {:.0} s, bpf_stats {:.0} s, enrol {:.0} s (the release build before it is not counted) |",
            t.total.as_secs_f64(),
            t.setup.as_secs_f64(),
            t.rounds.as_secs_f64(),
            t.bpf_stats.as_secs_f64(),
            t.enrol.as_secs_f64()
        );
        let tools: Vec<String> = self
            .sys
            .tools
            .iter()
            .map(|(n, v)| format!("{n}: `{v}`"))
            .collect();
        let _ = writeln!(o, "| tools | {} |\n", tools.join("; "));

        // Modes.
        let _ = writeln!(o, "## Modes\n");
        let _ = writeln!(
            o,
            "Every mode has its own client pod and server pod on one Linux bridge, made by the real CNI plugins (bridge, host-local, loopback); all four are set up once and measured in the same run. The server pod runs nginx (:80), `sockperf server` (:11111) and `iperf3 -s` (:5201). Sidecars are HAProxy in `mode tcp`, one thread, as UID 1337, with the same configuration in modes 2-4 (tests/src/bench/haproxy_cfg.rs).\n"
        );
        let _ = writeln!(
            o,
            "1. **direct**: no sidecars, no capture. The client connects to the server pod. The floor of the network path."
        );
        let _ = writeln!(
            o,
            "2. **explicit proxy**: both sidecars; the client connects to its sidecar's explicit frontend on 127.0.0.1, which has a static backend at the server sidecar, which forwards to the app from 127.0.0.6. No capture of any kind: the floor of any sidecar architecture."
        );
        let _ = writeln!(
            o,
            "3. **iptables**: Istio's default istio-cni ruleset (REDIRECT, `iptables-legacy-restore --noflush`, from tests/src/istio_iptables.rs) in both pods, both sidecars. Outbound goes to 15001 and SO_ORIGINAL_DST; inbound to 15006."
        );
        let _ = writeln!(
            o,
            "4. **sidestep**: both pods enrolled with Istio's defaults (`sidestep enroll`), both sidecars. Outbound by cgroup connect4 to 15001; inbound to 15006 by tc ingress `bpf_sk_assign`, or by the kernel's listener lookup steered by `sk_lookup` for SYNs that meet a TIME_WAIT socket (docs/ARCHITECTURE.md). sidestep's programs are attached to this lane's cgroup only; the other lanes run in a cgroup with no BPF program attached."
        );
        let _ = writeln!(
            o,
            "5. **sidestep + sk_msg**: as sidestep, with both pods enrolled `--sk-msg`: app <-> sidecar bytes on loopback go socket to socket (sockhash + `bpf_msg_redirect_hash`), skipping the loopback TCP/IP path. Sidecar <-> sidecar traffic crosses the bridge as usual.\n"
        );

        // Results.
        let _ = writeln!(
            o,
            "## Results\n\nMedians over {} rounds. Under each figure: its ratio to iptables (`÷ipt`) and to the explicit-proxy floor (`÷expl`). For requests/s, connections/s and Gbit/s higher is better; for latencies lower is better.\n",
            cfg.rounds
        );
        // One column per mode, from the same list the rows iterate, so the two cannot drift.
        let _ = writeln!(
            o,
            "| figure | {} |\n|---|{}",
            Mode::ALL.map(Mode::label).join(" | "),
            "---:|".repeat(Mode::COUNT)
        );
        for m in &self.metrics {
            let ipt = m.median(Mode::Iptables);
            let expl = m.median(Mode::Explicit);
            let cells: Vec<String> = Mode::ALL
                .iter()
                .map(|&mode| {
                    let v = m.median(mode);
                    format!(
                        "{}<br><sub>{} ÷ipt · {} ÷expl</sub>",
                        fmt_opt(v),
                        fmt_ratio(ratio(v, ipt)),
                        fmt_ratio(ratio(v, expl))
                    )
                })
                .collect();
            let _ = writeln!(o, "| {} ({}) | {} |", m.label, m.unit, cells.join(" | "));
        }
        let _ = writeln!(o);

        // Overhead.
        let _ = writeln!(
            o,
            "## Capture overhead\n\nCapture overhead is a mode's figure minus the explicit-proxy figure, taken in cost per operation so that it adds up: µs per request or connection for rates (1/rate), µs per MB for bulk, the latency itself for latencies. The sidecars' own cost is explicit proxy minus direct, for scale. Negative means faster than the explicit-proxy floor (noise, or a shorter path).\n"
        );
        let _ = writeln!(
            o,
            "| figure | unit | sidecars' own cost | iptables overhead | sidestep overhead | sidestep's overhead as % of iptables' |\n|---|---|---:|---:|---:|---:|"
        );
        for m in &self.metrics {
            let own = match (m.median(Mode::Explicit), m.median(Mode::Direct)) {
                (Some(e), Some(d)) => Some(cost(m, e) - cost(m, d)),
                _ => None,
            };
            let pct = match overhead_pct(m) {
                Some(p) => format!("{p:.0}%"),
                None if overhead(m, Mode::Iptables).is_some() => "n/a (iptables ≤ floor)".into(),
                None => "—".into(),
            };
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} |",
                m.label,
                cost_unit(m),
                fmt_opt(own),
                fmt_opt(overhead(m, Mode::Iptables)),
                fmt_opt(overhead(m, Mode::Sidestep)),
                pct
            );
        }
        let _ = writeln!(o);

        let _ = writeln!(o, "## Chart\n\n![benchmark chart]({SVG_NAME})\n");

        self.targets(&mut o);
        self.health_section(&mut o);
        self.bpf_section(&mut o);
        self.enrol_section(&mut o);
        let mut o = o.trim_end().to_owned();
        if let Some(c) = &self.cni {
            o = super::sections::splice(
                &o,
                super::sections::CNI,
                &super::sections::cni_section(c, &self.sys.date),
            );
        }
        if let Some(s) = &self.scale {
            o = super::sections::splice(
                &o,
                super::sections::SCALE,
                &super::sections::scale_section(s, &self.sys.date, self.config.quick),
            );
        }
        o.push_str("\n\n");
        self.method(&mut o);
        self.notes_section(&mut o);
        self.raw(&mut o);
        o
    }

    fn health_section(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "## Connection setup\n\nTCP counters of each lane's two pods (client and server together) over the recorded new-connection runs, per 1000 connections: SYN and SYN-ACK retransmissions (`TcpExtTCPSynRetrans`; each costs at least the 1 s initial RTO), failed connection attempts (`Tcp AttemptFails`, e.g. a connect answered by a reset; HAProxy then retries after a turnaround of up to 1 s) and resets sent (`Tcp OutRsts`), and the most TIME_WAIT sockets seen in the server pod right after a run.\n"
        );
        let _ = writeln!(
            o,
            "| lane | connections/s (median) | connections | SYN retransmits /1000 | failed attempts /1000 | resets sent /1000 | TIME_WAIT in the server pod |\n|---|---:|---:|---:|---:|---:|---:|"
        );
        let nc = self.metric("nc_cps");
        let row = |o: &mut String, name: &str, rate: Option<f64>, h: &ConnHealth| {
            let _ = writeln!(
                o,
                "| {name} | {} | {} | {} | {} | {} | {} |",
                fmt_opt(rate),
                h.connections,
                fmt_opt(h.per_1000(h.tcp.syn_retrans)),
                fmt_opt(h.per_1000(h.tcp.attempt_fails)),
                fmt_opt(h.per_1000(h.tcp.out_rsts)),
                h.server_time_wait
            );
        };
        for mode in Mode::ALL {
            row(
                o,
                mode.label(),
                nc.and_then(|m| m.median(mode)),
                &self.health[mode.index()],
            );
        }
        let c = &self.tw_control;
        row(
            o,
            "*control: sidestep, server pod with `tcp_max_tw_buckets=0`*",
            median(&c.rates),
            &c.health,
        );
        let _ = writeln!(
            o,
            "\nThe control row is a diagnostic, not a mode: a second sidestep lane, identical except that its server pod keeps no TIME_WAIT sockets. It runs the new-connection workload right after the sidestep lane in every round ({} runs).",
            c.rates.len()
        );
        if self.tw_collapse() {
            let s = &self.health[Mode::Sidestep.index()];
            let _ = writeln!(
                o,
                "\nsidestep's connections/s collapse while the control lane's do not, so what stands in the way on this workload is TIME_WAIT sockets in the server pod (up to {} here), not the cost of sidestep's programs (see the BPF table). The server side closes first in this workload, so the server pod holds TIME_WAIT sockets for (pod:80, client sidecar:port) tuples, and the client sidecar soon reuses such a port. A SYN onto such a tuple must go through the kernel's TIME_WAIT recycling (TCP_TW_SYN) before a listener is chosen, as it does under iptables; if inbound capture assigns it to the proxy listener first, the new connection and the TIME_WAIT socket share a 4-tuple, and the handshake is dropped or answered by the TIME_WAIT socket (the counters above show which: retransmissions, failed attempts, resets) until a retransmission or the client sidecar's retry. See docs/ARCHITECTURE.md, inbound capture, on how sidestep leaves such SYNs to the kernel and steers its listener lookup with sk_lookup.",
                s.server_time_wait
            );
        }
        let _ = writeln!(o);
    }

    fn bpf_section(&self, o: &mut String) {
        let _ = writeln!(o, "## BPF programs' cost per call\n");
        let Some(b) = &self.bpf else {
            let _ = writeln!(o, "Not measured in this run (see the notes).\n");
            return;
        };
        let _ = writeln!(
            o,
            "From the kernel's own accounting: `kernel.bpf_stats_enabled=1` (it was `{}` before and was put back) for two windows of {} s on the sidestep lane after the rounds, a keep-alive one and a new-connection one; run_time_ns / run_cnt per program, read from `sidestep status --json`{}. Counts include both pods: the client's connects and the server's inbound packets. The rounds above ran with statistics off, so this timing never touched them; with it on, every call also pays for two clock reads.\n",
            b.sysctl_before,
            self.config.bpf_stats_secs,
            if b.via_bpftool.is_empty() {
                String::new()
            } else {
                format!(
                    " and, for {} (which status did not list), from `bpftool prog show pinned`",
                    b.via_bpftool
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        let mut head = String::from("| program | calls | ns/call (both windows)");
        let mut sep = String::from("|---|---:|---:");
        for w in &b.windows {
            let _ = write!(head, " | ns/call, {}", w.workload.label());
            sep.push_str("|---:");
        }
        let _ = writeln!(o, "{head} |\n{sep}|");
        let key = |n: &str| match n {
            "sidestep_connect4" => 0,
            "sidestep_sockops" => 1,
            TC_PROGRAM => 2,
            "sidestep_sk_lookup" => 3,
            _ => 4,
        };
        let mut progs: Vec<_> = b.combined.iter().filter(|p| p.calls > 0).collect();
        progs.sort_by_key(|p| (key(&p.name), p.name.clone()));
        for p in progs {
            let mut row = format!(
                "| `{}` | {} | {} ",
                p.name,
                p.calls,
                fmt_opt(p.ns_per_call())
            );
            for w in &b.windows {
                let v = w
                    .progs
                    .iter()
                    .find(|q| q.name == p.name)
                    .and_then(|q| q.ns_per_call());
                let _ = write!(row, "| {} ", fmt_opt(v));
            }
            let _ = writeln!(o, "{row}|");
        }
        let silent: Vec<&str> = b
            .combined
            .iter()
            .filter(|p| p.calls == 0)
            .map(|p| p.name.as_str())
            .collect();
        if !silent.is_empty() {
            let _ = writeln!(o, "\nNot called in these windows: {}.", silent.join(", "));
        }
        let _ = writeln!(o);
        for w in &b.windows {
            let unit = if w.workload == Workload::NewConn {
                "connection"
            } else {
                "request"
            };
            let _ = writeln!(
                o,
                "- {}: all programs together cost {} ns per {unit} ({} {unit}s in the window).",
                w.workload.label(),
                fmt_opt(w.ns_per_request()),
                w.requests
            );
        }
        if let (Some(w), Some(m)) = (
            b.windows.iter().find(|w| w.workload == Workload::NewConn),
            self.metric("nc_cps"),
        ) && let (Some(ns), Some(ov)) = (w.ns_per_request(), overhead(m, Mode::Sidestep))
        {
            let _ = writeln!(
                o,
                "- For scale: sidestep's measured capture overhead on that workload is {} µs per connection, and its BPF programs account for {} µs of it.",
                fmt_num(ov),
                fmt_num(ns / 1000.0)
            );
        }
        let _ = writeln!(o);
    }

    fn enrol_section(&self, o: &mut String) {
        let e = &self.enrol;
        let _ = writeln!(
            o,
            "## Enrol latency (command-line tools)\n\nThe `sidestep enroll` CLI (what an operator runs by hand), against the same iptables install; the CNI plugin's own ADD is in the CNI section. Each run makes a fresh network namespace with `lo` and a veth `eth0` (untimed; the peer stays inside the netns), then times one process from spawn to exit: `sidestep enroll --netns … --interface eth0 --pod-ip …` (writes the pod's map entries and attaches tc ingress inside the netns), or `iptables-legacy-restore --noflush -w 5` of Istio's default ruleset ({} lines), started inside the netns (setns between fork and exec, no `ip netns exec`). The two alternate; each has two untimed warm-up runs. `sidestep unenroll` runs untimed after each enroll and is shown for information (Istio's DEL has no iptables counterpart: the rules die with the netns).\n",
            e.ruleset_lines
        );
        let _ = writeln!(
            o,
            "| command | runs | p50 | p99 | min | max |\n|---|---:|---:|---:|---:|---:|"
        );
        for (name, v) in [
            ("`sidestep enroll`", &e.sidestep_ms),
            ("`iptables-legacy-restore` (Istio rules)", &e.iptables_ms),
            ("`sidestep unenroll`", &e.unenroll_ms),
            (
                "`sidestep --version` (process start-up floor)",
                &e.startup_ms,
            ),
        ] {
            let _ = writeln!(
                o,
                "| {name} | {} | {} | {} | {} | {} |",
                v.len(),
                fmt_ms(percentile(v, 50.0)),
                fmt_ms(percentile(v, 99.0)),
                fmt_ms(stats::min(v)),
                fmt_ms(stats::max(v))
            );
        }
        let _ = writeln!(
            o,
            "\nsidestep enroll ÷ iptables-restore: p50 {}, p99 {}.\n",
            fmt_ratio(ratio(
                percentile(&e.sidestep_ms, 50.0),
                percentile(&e.iptables_ms, 50.0)
            )),
            fmt_ratio(ratio(
                percentile(&e.sidestep_ms, 99.0),
                percentile(&e.iptables_ms, 99.0)
            ))
        );
    }

    fn method(&self, o: &mut String) {
        let c = &self.config;
        let d = c.run_secs;
        let _ = writeln!(o, "## Method\n");
        let _ = writeln!(
            o,
            "- Load generators run as UID 1000 in the client pod of the lane being measured, inside that lane's cgroup; all traffic stays on the test bridge and the pods' loopback."
        );
        let _ = writeln!(
            o,
            "- HTTP keep-alive: `wrk -t1 -c{} -d{d}s --timeout 5s --latency http://<server>:80/` (nginx returns a short text body). Requests/s, p50 and p99 from wrk.",
            c.keepalive_conns
        );
        let _ = writeln!(
            o,
            "- New connection per request: the same with `-c{} -H 'Connection: close'`, so every request opens a new TCP connection through every hop (app to client sidecar, sidecar to sidecar, server sidecar to nginx). Requests/s is connections/s. wrk starts its latency clock when it writes the request, so the client's own handshake is outside p99; the sidecars' upstream handshakes and the inbound capture are inside it.",
            c.close_conns
        );
        let _ = writeln!(
            o,
            "- TCP ping-pong: `sockperf ping-pong --tcp -t {d} --full-rtt` over one connection (12-byte messages), p50 and p99 of the full round trip, through client sidecar, server sidecar and `sockperf server`. sockperf drops its own warm-up from the statistics."
        );
        let _ = writeln!(
            o,
            "- Bulk: `iperf3 -c <server> -p 5201 -t {d}`, one stream, receiver's Gbit/s. In modes 2-4 the stream crosses app → client sidecar → server sidecar → iperf3 server, so it includes the app-to-sidecar leg that sk_msg would shorten, but it is bounded by two single-threaded HAProxies copying through user space."
        );
        let _ = writeln!(
            o,
            "- Explicit mode targets: 127.0.0.1:15080 (HTTP), :15111 (sockperf), :15201 (iperf3) in the client pod."
        );
        let _ = writeln!(
            o,
            "- Order: one unrecorded warm-up run per mode of the two wrk workloads (sockperf has its own warm-up), then a check that the iptables lane's REDIRECT chains and the sidestep lane's redirect counters both moved, then {} rounds. Within a round each workload runs on all four modes back to back (A B C D), and the mode order rotates by one every round (A B C D, B C D A, …), so slow phases of the shared machine hit every mode alike. Every figure is the median over the rounds; the raw rounds are at the end.",
            c.rounds
        );
        let _ = writeln!(
            o,
            "- Cleanup: processes are killed by their guards, then `sidestep unload`, CNI DEL and netns deletion (the iptables rules live in the pod netns and go with them), then the test cgroups and pin roots; the bpf_stats sysctl has its own guard.\n"
        );
    }

    fn notes_section(&self, o: &mut String) {
        let _ = writeln!(o, "## Notes\n");
        let _ = writeln!(
            o,
            "- The machine is a shared {}-CPU VM on which other engineers build and test at the same time: load average went from `{}` to `{}` during this run. Interleaving and rotation spread that noise over all modes, and medians drop the worst rounds, but differences smaller than the spread in the raw rounds below are not meaningful.",
            self.sys.nproc, self.sys.loadavg, self.sys_end.loadavg
        );
        let _ = writeln!(
            o,
            "- Client, two sidecars, server and load generator share {} CPUs, so every figure includes CPU contention between them; these are relative figures for this machine, not absolute capacity numbers.",
            self.sys.nproc
        );
        if self.config.quick {
            let _ = writeln!(
                o,
                "- This is a **quick** run ({} rounds of {} s): good for checking the harness and for coarse ratios only. Run `cargo xtask bench` for the full run.",
                self.config.rounds, self.config.run_secs
            );
        }
        let _ = writeln!(
            o,
            "- iptables uses the legacy backend in the pod netns (as istio-cni does when the host uses it); with REDIRECT, conntrack and NAT run in both pods for every packet of every captured connection. The nft backend, and Istio's TPROXY mode, are not measured."
        );
        let _ = writeln!(
            o,
            "- IPv4 only. Not measured yet: the CNI plugin's ADD/DEL, and scale with 100 and 1,000 enrolled pods (issue 6)."
        );
        for n in &self.notes {
            let _ = writeln!(o, "- Run note: {n}");
        }
        let _ = writeln!(o);
    }

    fn raw(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "## Raw rounds\n\nIn round order; spread is (max - min) / median.\n"
        );
        let _ = writeln!(o, "| figure | mode | values | spread |\n|---|---|---|---:|");
        for m in &self.metrics {
            for mode in Mode::ALL {
                let v = &m.values[mode.index()];
                let vals: Vec<String> = v.iter().map(|x| fmt_num(*x)).collect();
                let _ = writeln!(
                    o,
                    "| {} ({}) | {} | {} | {} |",
                    m.label,
                    m.unit,
                    mode.label(),
                    vals.join(", "),
                    self.spread_pct(m, mode)
                        .map_or_else(|| "—".into(), |s| format!("{s:.0}%"))
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::new_metrics;

    fn sample() -> Report {
        let mut metrics = new_metrics();
        for m in &mut metrics {
            for (i, base) in [10.0, 20.0, 30.0, 25.0].iter().enumerate() {
                let v = if m.higher_is_better {
                    1000.0 / base
                } else {
                    *base
                };
                m.values[i] = vec![v, v * 1.01, v * 0.99];
            }
        }
        Report {
            config: Config::quick(),
            sys: SysInfo::default(),
            sys_end: SysInfo::default(),
            metrics,
            health: Default::default(),
            tw_control: Default::default(),
            bpf: None,
            enrol: EnrolResult {
                sidestep_ms: vec![2.0, 3.0],
                unenroll_ms: vec![1.0],
                startup_ms: vec![0.5],
                iptables_ms: vec![10.0, 12.0],
                ruleset_lines: 30,
            },
            cni: None,
            scale: None,
            timings: Timings::default(),
            notes: vec!["a <note>".into()],
            missing: Vec::new(),
        }
    }

    #[test]
    fn overheads_use_cost_per_operation() {
        let r = sample();
        let m = r.metric("nc_cps").unwrap();
        // cost = 1e6 / (1000 / base) = 1000 * base µs: explicit 20000, iptables 30000,
        // sidestep 25000 -> 10000 and 5000 -> 50%.
        assert!((overhead(m, Mode::Iptables).unwrap() - 10_000.0).abs() < 1e-6);
        assert!((overhead_pct(m).unwrap() - 50.0).abs() < 1e-9);
        let l = r.metric("ka_p99").unwrap();
        assert!((overhead_pct(l).unwrap() - 50.0).abs() < 1e-9);
    }

    #[test]
    fn only_default_modes_fail_the_run() {
        let mut r = sample();
        let miss = |mode| Missing {
            metric: "Bulk TCP".into(),
            mode,
        };
        r.missing = vec![miss(Mode::SkMsg)];
        assert!(r.missing_in_default_modes().is_empty());
        assert!(
            r.markdown()
                .contains("no successful run for Bulk TCP / sidestep + sk_msg")
        );
        r.missing.push(miss(Mode::Sidestep));
        assert_eq!(r.missing_in_default_modes(), vec![&miss(Mode::Sidestep)]);
    }

    /// Every Markdown table row has as many cells as its header (the Results header once
    /// lacked the sk_msg column, which shifted every figure under the wrong mode).
    #[test]
    fn table_rows_match_their_headers() {
        let md = sample().markdown();
        let mut header_cells = None;
        for line in md.lines() {
            if !line.starts_with('|') {
                header_cells = None;
                continue;
            }
            // `<br>` and `<sub>` hold no pipes; split on the table's own separators.
            let cells = line.trim_end_matches('|').matches('|').count();
            match header_cells {
                None => header_cells = Some(cells),
                Some(n) => assert_eq!(cells, n, "row {line:?} under a header of {n} cells"),
            }
        }
        assert!(md.contains(
            "| figure | direct | explicit proxy | iptables | sidestep | sidestep + sk_msg |"
        ));
    }

    #[test]
    fn renders_markdown_and_svg() {
        let r = sample();
        let md = r.markdown();
        assert!(
            md.contains("| New connection: sidestep's capture overhead ≤ 25% of iptables' | 50%")
        );
        assert!(md.contains("not measured"));
        assert!(md.contains("benchmarks.svg"));
        let svg = r.svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(!svg.contains("<note>"));
        assert_eq!(fmt_num(12345.6), "12,346");
        assert_eq!(fmt_num(1234567.0), "1,234,567");
        assert_eq!(fmt_num(-12345.0), "-12,345");
        assert_eq!(fmt_num(5.432), "5.43");
    }
}
