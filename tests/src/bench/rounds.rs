//! Per-round TCP and conntrack counters of the new-connection workload, so that a slow round
//! (the iptables lane has had rounds at half its usual rate with a p99 ten times its usual) can
//! be matched to what the kernel counted during it, and a paragraph that says which counter,
//! if any, is higher in a lane's slow rounds than in its fast ones.

use std::fmt::Write as _;

use super::Mode;
use super::machine::{self, MachineCounters};
use super::netstat::{self, SetupCounters};
use super::report::fmt_num;
use super::schedstat::Sidecars;
use super::stats::median;
use super::topology::Lane;

/// One new-connection run of one lane.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundTcp {
    /// 1-based.
    pub round: usize,
    pub mode: Mode,
    /// Connections/s.
    pub rate: f64,
    pub p99_us: f64,
    /// Client and server pod together: deltas over the run, and the TIME_WAIT level after it.
    pub c: SetupCounters,
    /// The whole machine over the run; None when /proc could not be read.
    pub machine: Option<MachineCounters>,
    /// The lane's sidecars over the run; None in the direct lane.
    pub sidecars: Option<Sidecars>,
    /// The client pod's TIME_WAIT sockets to the server pod's address right after the run: under
    /// REDIRECT the app's connections and its sidecar's share that 4-tuple space.
    pub client_tw_to_server: Option<u64>,
    /// The ports `connect()` searches first in the client pod (half its ephemeral range).
    pub first_searched_ports: Option<u64>,
}

fn logged<T>(what: &str, r: anyhow::Result<T>) -> Option<T> {
    r.map_err(|e| eprintln!("bench: reading {what}: {e:#}"))
        .ok()
}

/// Client and server pod's counters summed; None (logged) when a read fails.
pub fn setup_counters(lane: &Lane<'_>) -> Option<SetupCounters> {
    match (
        netstat::setup_counters(&lane.client),
        netstat::setup_counters(&lane.server),
    ) {
        (Ok(a), Ok(b)) => Some(a.plus(b)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("bench: reading per-round TCP counters: {e:#}");
            None
        }
    }
}

/// Every reading a new-connection run's row is measured against, taken right before it.
pub struct Before {
    setup: SetupCounters,
    machine: Option<MachineCounters>,
    sidecars: Option<Sidecars>,
}

impl Before {
    /// None (logged) when the pods' counters cannot be read; the machine's and the sidecars'
    /// columns are left empty on their own when theirs cannot.
    pub fn read(lane: &Lane<'_>) -> Option<Self> {
        Some(Self {
            setup: setup_counters(lane)?,
            machine: machine::read(),
            sidecars: Sidecars::read(lane.sidecar_pids()),
        })
    }

    /// The run's row: every reading again, less this one.
    pub fn row(self, lane: &Lane<'_>, round: usize, rate: f64, p99_us: f64) -> Option<RoundTcp> {
        let setup = setup_counters(lane)?;
        Some(RoundTcp {
            round,
            mode: lane.mode,
            rate,
            p99_us,
            c: setup.since(self.setup),
            machine: machine::read().zip(self.machine).map(|(a, b)| a.since(b)),
            sidecars: Sidecars::read(lane.sidecar_pids())
                .zip(self.sidecars)
                .map(|(a, b)| a.since(b)),
            client_tw_to_server: logged(
                "the client pod's TIME_WAIT sockets",
                netstat::time_wait_to(&lane.client, lane.server.ipv4),
            ),
            first_searched_ports: logged(
                "the client pod's port range",
                netstat::first_searched_ports(&lane.client),
            ),
        })
    }
}

/// A column of the table, and a candidate cause of slow rounds.
pub struct Counter {
    pub label: &'static str,
    pub get: fn(&RoundTcp) -> Option<u64>,
}

pub const COUNTERS: [Counter; 19] = [
    Counter {
        label: "SYN retransmits",
        get: |r| Some(r.c.syn_retrans),
    },
    Counter {
        label: "ListenDrops",
        get: |r| Some(r.c.listen_drops),
    },
    Counter {
        label: "ListenOverflows",
        get: |r| Some(r.c.listen_overflows),
    },
    Counter {
        label: "TW",
        get: |r| Some(r.c.tw),
    },
    Counter {
        label: "TWRecycled",
        get: |r| Some(r.c.tw_recycled),
    },
    Counter {
        label: "TCPTimeWaitOverflow",
        get: |r| Some(r.c.tw_overflow),
    },
    Counter {
        label: "TIME_WAIT sockets after the run",
        get: |r| Some(r.c.sockstat_tw),
    },
    Counter {
        label: "client pod's TIME_WAIT sockets to the server after the run",
        get: |r| r.client_tw_to_server,
    },
    Counter {
        label: "conntrack insert_failed",
        get: |r| r.c.ct_insert_failed,
    },
    Counter {
        label: "conntrack drop",
        get: |r| r.c.ct_drop,
    },
    Counter {
        label: "CPU steal ‰",
        get: |r| r.machine.map(|m| m.steal_permille()),
    },
    Counter {
        label: "CPU iowait ‰",
        get: |r| r.machine.map(|m| m.iowait_permille()),
    },
    Counter {
        label: "CPU idle ‰",
        get: |r| r.machine.map(|m| m.idle_permille()),
    },
    Counter {
        label: "dirty + writeback after the run (MiB)",
        get: |r| r.machine.map(|m| m.dirty_kib / 1024),
    },
    Counter {
        label: "direct reclaim + compaction stalls",
        get: |r| r.machine.map(|m| m.memory_stalls),
    },
    Counter {
        label: "client sidecar CPU ms",
        get: |r| r.sidecars.map(|s| s.client.run_ms()),
    },
    Counter {
        label: "client sidecar µs per timeslice",
        get: |r| r.sidecars.and_then(|s| s.client.us_per_timeslice()),
    },
    Counter {
        label: "client sidecar run-queue wait ms",
        get: |r| r.sidecars.map(|s| s.client.wait_ms()),
    },
    Counter {
        label: "server sidecar CPU ms",
        get: |r| r.sidecars.map(|s| s.server.run_ms()),
    },
];

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// A lane's rounds below its median rate against those above it.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub mode: Mode,
    pub slow_rounds: Vec<usize>,
    pub fast_rounds: Vec<usize>,
    /// Mean connections/s and p99 (µs) of the slow and the fast rounds.
    pub slow_rate: f64,
    pub fast_rate: f64,
    pub slow_p99: f64,
    pub fast_p99: f64,
    /// Counters whose per-round mean is at least 1 in the slow rounds and at least twice the
    /// fast rounds': (label, slow mean, fast mean).
    pub higher_when_slow: Vec<(&'static str, f64, f64)>,
    /// The client pod's TIME_WAIT sockets to the server after the slow and the fast rounds;
    /// None where a round's could not be read.
    pub port_search: Option<PortSearch>,
}

/// What explains the netfilter lanes' tail (docs/BENCHMARKS.md, "The netfilter lanes'
/// new-connection tail"): how full the client pod's first-searched half of the ephemeral range
/// was with TIME_WAIT sockets to the server, in slow and fast rounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PortSearch {
    /// (min, max) over the slow rounds, and over the fast ones.
    pub slow: (u64, u64),
    pub fast: (u64, u64),
    pub first_searched: u64,
}

impl PortSearch {
    fn of(slow: &[&RoundTcp], fast: &[&RoundTcp]) -> Option<Self> {
        let span = |v: &[&RoundTcp]| -> Option<(u64, u64)> {
            let xs: Vec<u64> = v
                .iter()
                .map(|r| r.client_tw_to_server)
                .collect::<Option<_>>()?;
            Some((*xs.iter().min()?, *xs.iter().max()?))
        };
        Some(Self {
            slow: span(slow)?,
            fast: span(fast)?,
            first_searched: slow
                .iter()
                .chain(fast)
                .find_map(|r| r.first_searched_ports)?,
        })
    }

    /// Every slow round's count above every fast round's.
    pub fn separates(&self) -> bool {
        self.slow.0 > self.fast.1
    }

    fn sentence(&self) -> String {
        let pct = |x: u64| {
            format!(
                "{:.0}%",
                100.0 * x as f64 / self.first_searched.max(1) as f64
            )
        };
        let span = |(lo, hi): (u64, u64)| {
            format!(
                "{}–{} ({}–{})",
                fmt_num(lo as f64),
                fmt_num(hi as f64),
                pct(lo),
                pct(hi)
            )
        };
        format!(
            " The client pod's TIME_WAIT sockets to the server's address after the run, against the {} ports `connect()` searches first: {} after the slow rounds, {} after the fast ones; {}.",
            fmt_num(self.first_searched as f64),
            span(self.slow),
            span(self.fast),
            if self.separates() {
                "every slow round left more than any fast round"
            } else {
                "this count does not separate the slow rounds from the fast ones"
            }
        )
    }
}

/// None when the lane has no round on one side of its median.
pub fn finding(rows: &[RoundTcp], mode: Mode) -> Option<Finding> {
    let lane: Vec<&RoundTcp> = rows.iter().filter(|r| r.mode == mode).collect();
    let rates: Vec<f64> = lane.iter().map(|r| r.rate).collect();
    let m = median(&rates)?;
    // The median round itself, with an odd count, is on neither side.
    let slow: Vec<&RoundTcp> = lane.iter().copied().filter(|r| r.rate < m).collect();
    let fast: Vec<&RoundTcp> = lane.iter().copied().filter(|r| r.rate > m).collect();
    if slow.is_empty() || fast.is_empty() {
        return None;
    }
    let avg = |v: &[&RoundTcp], f: &dyn Fn(&RoundTcp) -> f64| {
        mean(&v.iter().map(|r| f(r)).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    // Raw counts per round, not per connection: a slow round makes fewer connections, so a
    // counter that grows with connections is lower there and cannot be flagged by mistake.
    let higher_when_slow = COUNTERS
        .iter()
        .filter_map(|k| {
            let per_round = |v: &[&RoundTcp]| {
                mean(
                    &v.iter()
                        .filter_map(|r| (k.get)(r))
                        .map(|x| x as f64)
                        .collect::<Vec<_>>(),
                )
            };
            let (s, f) = (per_round(&slow)?, per_round(&fast)?);
            (s >= 1.0 && s >= 2.0 * f).then_some((k.label, s, f))
        })
        .collect();
    Some(Finding {
        mode,
        slow_rounds: slow.iter().map(|r| r.round).collect(),
        fast_rounds: fast.iter().map(|r| r.round).collect(),
        slow_rate: avg(&slow, &|r| r.rate),
        fast_rate: avg(&fast, &|r| r.rate),
        slow_p99: avg(&slow, &|r| r.p99_us),
        fast_p99: avg(&fast, &|r| r.p99_us),
        higher_when_slow,
        port_search: PortSearch::of(&slow, &fast),
    })
}

/// Whether a lane's slow rounds are a mode of their own rather than the usual spread.
fn bimodal(f: &Finding) -> bool {
    f.slow_rate < 0.8 * f.fast_rate
}

/// "round 3" or "rounds 1, 4".
fn rounds_list(v: &[usize]) -> String {
    let list = v
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    format!("round{} {list}", if v.len() == 1 { "" } else { "s" })
}

/// The paragraph for one lane.
pub fn explain(f: &Finding) -> String {
    let mut s = format!(
        "**{}**: {} (below the lane's median rate) made {} conn/s on average with a p99 of {} µs; {} (above it) {} conn/s, p99 {} µs. ",
        f.mode.label(),
        rounds_list(&f.slow_rounds),
        fmt_num(f.slow_rate),
        fmt_num(f.slow_p99),
        rounds_list(&f.fast_rounds),
        fmt_num(f.fast_rate),
        fmt_num(f.fast_p99),
    );
    if f.higher_when_slow.is_empty() {
        s += "No counter of the table is higher in the slow rounds (by the rule: a mean of at least 1 per round and at least twice the fast rounds'), so these counters do not explain them.";
    } else {
        let parts: Vec<String> = f
            .higher_when_slow
            .iter()
            .map(|(l, a, b)| format!("{l} ({} per round against {})", fmt_num(*a), fmt_num(*b)))
            .collect();
        s += &format!(
            "Higher in the slow rounds (a mean of at least 1 per round and at least twice the fast rounds'): {}.",
            parts.join("; ")
        );
    }
    if let Some(p) = f.port_search {
        s += &p.sentence();
    }
    s
}

fn cell(v: Option<u64>) -> String {
    v.map_or_else(|| "—".into(), |x| x.to_string())
}

/// The section: the table, then a paragraph for each netfilter lane and for every lane whose
/// slow rounds average under 0.8× its fast ones.
pub fn section(rows: &[RoundTcp]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "## New-connection rounds and TCP counters\n\nEvery new-connection run of every lane, with the deltas over the run of the client and server pods' counters together: TcpExt `TCPSynRetrans`, `ListenDrops`, `ListenOverflows`, `TW` (TIME_WAIT sockets ended by their timer), `TWRecycled`, `TCPTimeWaitOverflow`; sockstat's `tw` right after the run (a level); the client pod's own TIME_WAIT sockets to the server pod's address right after the run (its `/proc/net/tcp`: under REDIRECT the app's connections and its sidecar's leave from the same address for the same address and port, `tcp_tw_reuse=2` reuses none of those TIME_WAIT sockets, and once they fill the half of the ephemeral range that `connect()` searches first, every connect walks all of it; see [The netfilter lanes' new-connection tail](#the-netfilter-lanes-new-connection-tail) below); each pod netns's own nf_conntrack statistics `insert_failed` and `drop` (— where the module is not loaded); and the whole machine's share of CPU time (all CPUs, from `/proc/stat`) that was stolen by the hypervisor, spent waiting on I/O, or idle, in per mille of the run, with the page cache's Dirty + Writeback right after it (`/proc/meminfo`) and the times an allocation anywhere on the machine stopped to reclaim or compact memory itself over the run (`/proc/vmstat` `allocstall_*` + `compact_stall`); then the lane's two sidecars from `/proc/<pid>/schedstat`: CPU time over the run, and for the client sidecar its mean time on the CPU per timeslice (a sidecar that runs as much as usual in far longer stretches is doing work it cannot break off, not waiting) and its time runnable but waiting for the CPU (what a saturated client CPU costs it). A rate marked ↓ is below the lane's median.\n"
    );
    let _ = writeln!(
        o,
        "| lane | round | conn/s | p99 (µs) | {} |\n|---|---:|---:|---:|{}",
        COUNTERS.map(|c| c.label).join(" | "),
        "---:|".repeat(COUNTERS.len())
    );
    for mode in Mode::ALL {
        let lane: Vec<&RoundTcp> = rows.iter().filter(|r| r.mode == mode).collect();
        let m = median(&lane.iter().map(|r| r.rate).collect::<Vec<_>>());
        for r in lane {
            let slow = m.is_some_and(|m| r.rate < m);
            let _ = writeln!(
                o,
                "| {} | {} | {}{} | {} | {} |",
                mode.label(),
                r.round,
                fmt_num(r.rate),
                if slow { " ↓" } else { "" },
                fmt_num(r.p99_us),
                COUNTERS
                    .iter()
                    .map(|k| cell((k.get)(r)))
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
    }
    let _ = writeln!(o);
    for mode in Mode::ALL {
        match finding(rows, mode) {
            Some(f) if mode.is_netfilter() || bimodal(&f) => {
                let _ = writeln!(o, "{}\n", explain(&f));
            }
            None if mode.is_netfilter() => {
                let _ = writeln!(
                    o,
                    "**{}**: too few rounds on either side of the median to compare.\n",
                    mode.label()
                );
            }
            _ => {}
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(round: usize, rate: f64, syn: u64, tw: u64) -> RoundTcp {
        // Slow rounds fill the first-searched half (14,116 ports), fast ones do not.
        let tw_to_server = if rate < 4000.0 { 14_300 } else { 9_000 };
        RoundTcp {
            round,
            mode: Mode::Iptables,
            rate,
            p99_us: if rate < 4000.0 { 20_000.0 } else { 2500.0 },
            c: SetupCounters {
                syn_retrans: syn,
                tw,
                ct_insert_failed: Some(0),
                ..Default::default()
            },
            machine: None,
            sidecars: None,
            client_tw_to_server: Some(tw_to_server),
            first_searched_ports: Some(14_116),
        }
    }

    #[test]
    fn slow_rounds_are_matched_to_their_counters() {
        // Rounds 1 and 3 are slow and have SYN retransmits; TW grows with connections, so it is
        // higher in the fast rounds and must not be named.
        let rows = vec![
            row(1, 2500.0, 12, 100),
            row(2, 5900.0, 0, 300),
            row(3, 2600.0, 9, 110),
            row(4, 5800.0, 1, 290),
            row(5, 5850.0, 0, 295),
        ];
        let f = finding(&rows, Mode::Iptables).unwrap();
        assert_eq!(f.slow_rounds, vec![1, 3]);
        assert_eq!(f.fast_rounds, vec![2, 5], "round 4 is the median");
        assert_eq!(f.higher_when_slow.len(), 1, "{f:?}");
        assert_eq!(f.higher_when_slow[0].0, "SYN retransmits");
        assert!(bimodal(&f));
        let text = section(&rows);
        assert!(
            text.contains("SYN retransmits (10.5 per round against 0.00)"),
            "{text}"
        );
        assert!(text.contains("| iptables | 1 | 2500 ↓ |"), "{text}");
        assert!(finding(&rows, Mode::Sidestep).is_none());
        assert_eq!(
            f.port_search,
            Some(PortSearch {
                slow: (14_300, 14_300),
                fast: (9_000, 9_000),
                first_searched: 14_116
            })
        );
        assert!(
            text.contains("against the 14,116 ports `connect()` searches first: 14,300–14,300 (101%–101%) after the slow rounds, 9000–9000 (64%–64%) after the fast ones; every slow round left more than any fast round."),
            "{text}"
        );
    }

    #[test]
    fn a_port_range_that_does_not_explain_the_slow_rounds_is_said_so() {
        let with_tw = |round, rate, tw| RoundTcp {
            client_tw_to_server: Some(tw),
            ..row(round, rate, 0, 100)
        };
        let rows = vec![
            with_tw(1, 2500.0, 8_000),
            with_tw(2, 5900.0, 12_000),
            with_tw(3, 5000.0, 10_000),
        ];
        let f = finding(&rows, Mode::Iptables).unwrap();
        assert!(!f.port_search.unwrap().separates());
        assert!(
            explain(&f).contains("this count does not separate the slow rounds from the fast ones"),
            "{}",
            explain(&f)
        );
        // A round whose count could not be read leaves the comparison out, not half-made.
        let mut rows = rows;
        rows[1].client_tw_to_server = None;
        let f = finding(&rows, Mode::Iptables).unwrap();
        assert_eq!(f.port_search, None);
        assert!(!explain(&f).contains("connect()"));
    }

    #[test]
    fn slow_rounds_with_stolen_cpu_name_the_steal() {
        let with_steal = |round, rate, steal| RoundTcp {
            machine: Some(MachineCounters {
                steal,
                busy: 900,
                total: 1000,
                ..Default::default()
            }),
            ..row(round, rate, 0, 100)
        };
        let rows = vec![
            with_steal(1, 5900.0, 2),
            with_steal(2, 2500.0, 250),
            with_steal(3, 5000.0, 10),
        ];
        let f = finding(&rows, Mode::Iptables).unwrap();
        assert_eq!(f.higher_when_slow.len(), 1, "{f:?}");
        assert_eq!(f.higher_when_slow[0].0, "CPU steal ‰");
        assert!(explain(&f).contains("CPU steal ‰ (250 per round against 2.00)"));
        assert!(
            section(&rows).contains("| 250 | 0 | 100 | 0 |"),
            "{}",
            section(&rows)
        );
    }

    #[test]
    fn slow_rounds_whose_client_sidecar_ran_in_long_stretches_name_it() {
        use crate::bench::schedstat::SchedStat;
        let with_slices = |round, rate, us_per_slice: u64| RoundTcp {
            sidecars: Some(Sidecars {
                client: SchedStat {
                    run_ns: 3_000_000_000,
                    wait_ns: 0,
                    timeslices: 3_000_000 / us_per_slice,
                },
                server: SchedStat {
                    run_ns: 2_000_000_000,
                    ..Default::default()
                },
            }),
            ..row(round, rate, 0, 100)
        };
        let rows = vec![
            with_slices(1, 5900.0, 130),
            with_slices(2, 2500.0, 1500),
            with_slices(3, 5000.0, 140),
        ];
        let f = finding(&rows, Mode::Iptables).unwrap();
        let named: Vec<&str> = f.higher_when_slow.iter().map(|h| h.0).collect();
        assert_eq!(named, ["client sidecar µs per timeslice"], "{f:?}");
        assert!(
            section(&rows).contains("| 3000 | 1500 | 0 | 2000 |"),
            "{}",
            section(&rows)
        );
    }

    #[test]
    fn no_counter_no_claim() {
        let rows = vec![
            row(1, 2500.0, 0, 100),
            row(2, 5900.0, 0, 300),
            row(3, 5000.0, 0, 300),
        ];
        let f = finding(&rows, Mode::Iptables).unwrap();
        assert!(f.higher_when_slow.is_empty());
        assert!(explain(&f).contains("do not explain them"));
        assert!(explain(&f).contains("**iptables**: round 1 (below"));
    }
}
