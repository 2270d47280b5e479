//! docs/BENCHMARKS.md and docs/benchmarks.svg, from the collected figures. Nothing here is a
//! figure of its own: every number comes from the run.

use std::fmt::Write as _;

use super::bpfstats::{BpfCost, TC_PROGRAM};
use super::enrol::EnrolResult;
use super::measure::Workload;
use super::stats::{self, median, percentile};
use super::sysinfo::SysInfo;
use super::{Config, ConnHealth, Metric, Mode, Timings, TwControl};

mod appendix;
mod costs;
mod noise;
mod svg;
mod targets;
#[cfg(test)]
mod tests;

/// Where the chart goes, relative to docs/BENCHMARKS.md.
pub const SVG_NAME: &str = "benchmarks.svg";

pub use noise::{HeadlineFigure, fmt_ci};

pub struct Report {
    pub config: Config,
    pub sys: SysInfo,
    pub sys_end: SysInfo,
    pub metrics: Vec<Metric>,
    /// Indexed by [`Mode::index`].
    pub health: [ConnHealth; Mode::COUNT],
    pub tw_control: TwControl,
    /// Every new-connection run with its counters, in run order.
    pub round_tcp: Vec<super::rounds::RoundTcp>,
    /// The CPU layout, as the setup table prints it.
    pub cpus: String,
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
                    "on a new connection per request, sidestep's capture overhead is {p:.0}% of iptables' ({} vs {} µs per connection over the explicit-proxy floor; {} the connections/s of iptables{})",
                    fmt_opt(overhead(m, Mode::Sidestep)),
                    fmt_opt(overhead(m, Mode::Iptables)),
                    fmt_ratio(r),
                    self.noise_tag("nc_cps", Mode::Iptables)
                ),
                None => format!(
                    "on a new connection per request, iptables showed no overhead over the explicit-proxy floor in this run, so the overhead ratio is undefined (sidestep: {} the connections/s of iptables{})",
                    fmt_ratio(r),
                    self.noise_tag("nc_cps", Mode::Iptables)
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
                "on HTTP keep-alive sidestep serves {} the requests/s of iptables{}",
                fmt_ratio(ratio(m.median(Mode::Sidestep), m.median(Mode::Iptables))),
                self.noise_tag("ka_rps", Mode::Iptables)
            ));
        }
        if let (Some(nc), Some(ka)) = (self.metric("nc_cps"), self.metric("ka_rps")) {
            parts.push(format!(
                "against Istio's native nftables mode, {} the connections/s{} and {} the keep-alive requests/s{}",
                fmt_ratio(ratio(nc.median(Mode::Sidestep), nc.median(Mode::Nftables))),
                self.noise_tag("nc_cps", Mode::Nftables),
                fmt_ratio(ratio(ka.median(Mode::Sidestep), ka.median(Mode::Nftables))),
                self.noise_tag("ka_rps", Mode::Nftables)
            ));
            parts.push(format!(
                "against the explicit-proxy floor (no capture at all), {} the connections/s{} and {} the keep-alive requests/s{}",
                fmt_ratio(ratio(nc.median(Mode::Sidestep), nc.median(Mode::Explicit))),
                self.noise_tag("nc_cps", Mode::Explicit),
                fmt_ratio(ratio(ka.median(Mode::Sidestep), ka.median(Mode::Explicit))),
                self.noise_tag("ka_rps", Mode::Explicit)
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
            "<!-- Generated by `{cmdline}` (tests/tests/bench.rs, tests/src/bench/). Do not edit outside the hand-written notes block, which every run keeps as it is: the next run overwrites the rest. -->\n"
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
            "| CPU layout | {} (tests/src/bench/cpus.rs says why; `SIDESTEP_BENCH_CPUS` overrides it). The CNI, scale and ambient sections run unpinned. |",
            self.cpus
        );
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
            "Every mode has its own client pod and server pod on one Linux bridge, made by the real CNI plugins (bridge, host-local, loopback); all of them are set up once and measured in the same run. The server pod runs nginx (:80, no access log: a `write()` per request would put disk writeback into every lane's figures; tests/src/nginx.rs), `sockperf server` (:11111) and `iperf3 -s` (:5201). Sidecars are HAProxy in `mode tcp`, one thread, as UID 1337, with the same configuration in modes 2-7 and no per-connection log (tests/src/bench/haproxy_cfg.rs).\n"
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
            "4. **Istio nftables**: the same ruleset through Istio's native nftables mode (`global.nativeNftables`, sidecar mode since 1.27): one `inet` table loaded with `nft -f` (tests/src/istio_nftables.rs, checked against the iptables ruleset by the parity test) in both pods, both sidecars."
        );
        let _ = writeln!(
            o,
            "5. **sidestep**: both pods enrolled with Istio's defaults (`sidestep enroll`, before anything listens in them, so with the default inbound hook, as a pod the CNI plugin enrols), both sidecars. Outbound by cgroup connect4 to 15001; inbound to 15006 by the kernel's listener lookup, steered by the pod's `sk_lookup` program (docs/ARCHITECTURE.md). sidestep's programs are attached to the sidestep lanes' cgroup only; the other lanes run in a cgroup with no BPF program attached."
        );
        let _ = writeln!(
            o,
            "6. **sidestep, tc hook**: as sidestep, enrolled `--inbound-hook tc` (what a pod whose proxy listened before its enrolment gets): inbound by tc ingress `bpf_sk_assign` on every captured interface, a program run on every packet the pod receives.
7. **sidestep + sk_msg**: as sidestep, with both pods enrolled `--sk-msg`: app <-> sidecar bytes on loopback go socket to socket (sockhash + `bpf_msg_redirect_hash`), skipping the loopback TCP/IP path. Sidecar <-> sidecar traffic crosses the bridge as usual.\n"
        );

        // Results.
        let _ = writeln!(
            o,
            "## Results\n\nMedians over {} rounds, each with its 95% bootstrap confidence interval in brackets (see Headline ratios and noise). Under each figure: its ratio to iptables (`÷ipt`) and to the explicit-proxy floor (`÷expl`). For requests/s, connections/s and Gbit/s higher is better; for latencies lower is better.\n",
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
                        "{} {}<br><sub>{} ÷ipt · {} ÷expl</sub>",
                        fmt_opt(v),
                        fmt_ci(m.ci(mode)),
                        fmt_ratio(ratio(v, ipt)),
                        fmt_ratio(ratio(v, expl))
                    )
                })
                .collect();
            let _ = writeln!(o, "| {} ({}) | {} |", m.label, m.unit, cells.join(" | "));
        }
        let _ = writeln!(o);
        self.noise_section(&mut o);

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
        o.push_str(&super::rounds::section(&self.round_tcp));
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
}
