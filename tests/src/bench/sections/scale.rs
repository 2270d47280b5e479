//! The scale section: ADD, DEL, per-connection BPF cost and map memory at 1, 100 and 1,000 pods.

use std::fmt::Write as _;

use super::super::report::fmt_num;
use super::super::scale::{Level, ScaleResult};
use super::super::stats::median;
use super::{ms, p, quotient, verdict_at_most};

/// Issue 6's scale targets: the last level's figures over the first's.
pub struct ScaleRatios {
    /// Pods enrolled at the last level.
    pub pods: usize,
    pub add_p99: Option<f64>,
    pub add_p50: Option<f64>,
    /// Per-connection loop time.
    pub conn: Option<f64>,
    pub del_p50: Option<f64>,
}

pub fn scale_targets(s: &ScaleResult) -> Option<ScaleRatios> {
    let (first, last) = (s.levels.first()?, s.levels.last()?);
    Some(ScaleRatios {
        pods: last.pods,
        add_p99: quotient(p(&last.add_ms, 99.0), p(&first.add_ms, 99.0)),
        add_p50: quotient(p(&last.add_ms, 50.0), p(&first.add_ms, 50.0)),
        conn: quotient(last.conn_us, first.conn_us),
        del_p50: quotient(p(&last.del_ms, 50.0), p(&first.del_ms, 50.0)),
    })
}

pub fn scale_section(s: &ScaleResult, date: &str, quick: bool) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## Scale: 1, 100 and 1,000 pods\n");
    let _ = writeln!(
        o,
        "{date}{}. Each level is its own pin root and cgroup with its pods enrolled through \
         sidestep-cni (background pods are netns only); all levels exist at once and their \
         samples are interleaved, so they share the machine's noise (and the kernel: netns, \
         veths and TCX links of all levels count for all). {} rounds: per level one ADD on a \
         fresh netns (a whole process) and its DEL, so the level holds; the first round is \
         warm-up. Then {} windows per level, interleaved, of {} new connections one after \
         another (`probe connect-many` as an app UID, redirected to `probe origdst-echo` on \
         15001 as the proxy UID) with bpf_stats on; medians over the windows. Map memory is \
         bytes_memlock summed over the pin root's maps (pod map capacity {}).\n",
        if quick {
            " (quick run: smaller levels and counts)"
        } else {
            ""
        },
        s.samples,
        s.windows,
        s.conns,
        s.pod_capacity.map_or("?".into(), |c| c.to_string())
    );
    let all_progs = scale_programs(s);
    // The level table follows the two programs every redirected connect runs through; the
    // per-program table below has them all.
    let progs: Vec<String> = all_progs
        .iter()
        .filter(|n| n.contains("connect4") || n.contains("sockops"))
        .cloned()
        .collect();
    let _ = write!(
        o,
        "| pods enrolled | ADD p50 | ADD p99 | DEL p50 | µs per connection (loop) |"
    );
    for pn in &progs {
        let _ = write!(o, " {pn} ns/call |");
    }
    let _ = writeln!(o, " map memlock |");
    let _ = writeln!(
        o,
        "|---:|---:|---:|---:|---:|{}---:|",
        "---:|".repeat(progs.len())
    );
    for l in &s.levels {
        let _ = write!(
            o,
            "| {} | {} | {} | {} | {} |",
            l.pods,
            ms(p(&l.add_ms, 50.0)),
            ms(p(&l.add_ms, 99.0)),
            ms(p(&l.del_ms, 50.0)),
            l.conn_us.map_or("—".into(), fmt_num)
        );
        for pn in &progs {
            let v = l.prog(pn).map(|(ns, _)| ns);
            let _ = write!(o, " {} |", v.map_or("—".into(), fmt_num));
        }
        let _ = writeln!(
            o,
            " {} |",
            l.memlock
                .map_or("—".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0))
        );
    }
    if let Some(ScaleRatios {
        pods: last_pods,
        add_p99: p99,
        add_p50: p50,
        conn,
        del_p50: del,
    }) = scale_targets(s)
    {
        let _ = writeln!(
            o,
            "\nTarget: ADD p99 at {} pods within 1.2× of the first pod's: {} — {} (p50 ratio {}). \
             Per-connection cost flat: loop time ratio {} ({}).",
            last_pods,
            p99.map_or("—".into(), |x| format!("{x:.2}×")),
            verdict_at_most(p99, 1.2),
            p50.map_or("—".into(), |x| format!("{x:.2}×")),
            conn.map_or("—".into(), |x| format!("{x:.2}×")),
            verdict_at_most(conn, 1.2),
        );
        let _ = writeln!(
            o,
            "DEL p50 at {} pods is {} the first pod's{}.",
            last_pods,
            del.map_or("—".into(), |x| format!("{x:.2}×")),
            if del.is_some_and(|x| x > 1.2) {
                ": DEL still scans every pod's entries (the per-pod port, CIDR, address and \
                 interface maps) and reads every attachment record of the state directory to \
                 find other attachments of the netns, so it grows with the node"
            } else {
                ""
            }
        );
        let (first, last) = (&s.levels[0], &s.levels[s.levels.len() - 1]);
        for pn in &progs {
            let get = |l: &Level| l.prog(pn).map(|(ns, _)| ns);
            let _ = writeln!(
                o,
                "{pn}: {} at {} pods vs {} at {} ({}).",
                get(last).map_or("—".into(), |x| format!("{} ns", fmt_num(x))),
                last.pods,
                get(first).map_or("—".into(), |x| format!("{} ns", fmt_num(x))),
                first.pods,
                quotient(get(last), get(first)).map_or("—".into(), |x| format!("{x:.2}×")),
            );
        }
        o.push_str(&scale_programs_table(s, &all_progs));
        let _ = writeln!(
            o,
            "\nFill time (enrolling the background pods through the plugin): {}.",
            s.levels
                .iter()
                .map(|l| format!("{:.0} s to {}", l.fill_secs, l.pods))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let _ = writeln!(
            o,
            "Median of every sample ADD: {}.",
            s.levels
                .iter()
                .map(|l| format!("{} at {}", ms(median(&l.add_ms)), l.pods))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    o
}

/// Every program that ran in some level's connection loop, by name.
fn scale_programs(s: &ScaleResult) -> Vec<String> {
    let mut progs: Vec<String> = s
        .levels
        .iter()
        .flat_map(|l| l.prog_ns.iter().map(|(n, _, _)| n.clone()))
        .collect();
    progs.sort();
    progs.dedup();
    progs
}

/// Calls per connection and ns per call of every program in the loop, per level, and all of them
/// together per connection: what one redirected connection costs in BPF, step by step.
fn scale_programs_table(s: &ScaleResult, progs: &[String]) -> String {
    let mut o = String::new();
    let loops = s.conns * s.windows as u64;
    if progs.is_empty() || loops == 0 {
        return o;
    }
    let _ = writeln!(
        o,
        "\nBPF per redirected connection in the loop, by program: calls per connection from the \
         run counts over all {} windows of {} connections, ns per call the median over the \
         windows.\n",
        s.windows, s.conns
    );
    let _ = write!(o, "| program |");
    for l in &s.levels {
        let _ = write!(o, " calls/conn at {0} | ns/call at {0} |", l.pods);
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "|---|{}", "---:|---:|".repeat(s.levels.len()));
    let mut totals = vec![0.0; s.levels.len()];
    for pn in progs {
        let _ = write!(o, "| `{pn}` |");
        for (i, l) in s.levels.iter().enumerate() {
            match l.prog(pn) {
                Some((ns, calls)) => {
                    let per_conn = calls as f64 / loops as f64;
                    totals[i] += ns * per_conn;
                    let _ = write!(o, " {per_conn:.2} | {} |", fmt_num(ns));
                }
                None => {
                    let _ = write!(o, " — | — |");
                }
            }
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(
        o,
        "\nAll programs together, per connection: {}. With statistics on, every call also pays \
         for two clock reads, so these are upper bounds.",
        s.levels
            .iter()
            .zip(&totals)
            .map(|(l, t)| {
                let plural = if l.pods == 1 { "" } else { "s" };
                format!("{} ns at {} pod{plural}", fmt_num(*t), l.pods)
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(pods: usize, progs: &[(&str, f64, u64)]) -> Level {
        Level {
            pods,
            prog_ns: progs
                .iter()
                .map(|(n, ns, calls)| ((*n).to_owned(), *ns, *calls))
                .collect(),
            ..Level::default()
        }
    }

    #[test]
    fn programs_table_adds_up_per_connection() {
        let s = ScaleResult {
            levels: vec![
                level(
                    1,
                    &[
                        ("sidestep_connect4", 800.0, 3000),
                        ("sidestep_sockops", 120.0, 36000),
                    ],
                ),
                level(100, &[("sidestep_connect4", 900.0, 3000)]),
            ],
            conns: 1000,
            windows: 3,
            ..ScaleResult::default()
        };
        let progs = scale_programs(&s);
        assert_eq!(progs, ["sidestep_connect4", "sidestep_sockops"]);
        let t = scale_programs_table(&s, &progs);
        // 3000 calls over 3 windows of 1000 connections: one call per connection.
        assert!(
            t.contains("| `sidestep_connect4` | 1.00 | 800 | 1.00 | 900 |"),
            "{t}"
        );
        assert!(
            t.contains("| `sidestep_sockops` | 12.00 | 120 | — | — |"),
            "{t}"
        );
        // 800 + 12 × 120 at the first level; the second lacks sockops.
        assert!(t.contains("2240 ns at 1 pod, 900 ns at 100 pods"), "{t}");
    }

    #[test]
    fn programs_table_is_empty_without_loops() {
        let s = ScaleResult::default();
        assert!(scale_programs_table(&s, &["x".to_owned()]).is_empty());
    }
}
