//! The sections on what sidestep costs besides throughput and latency: connection setup (SYN
//! retransmissions, failed attempts, TIME_WAIT), BPF run time per call, and enrolment latency.
//! Each reads its own collector's result, so they are apart from the main tables.

use std::fmt::Write as _;

use super::*;

impl Report {
    pub(super) fn health_section(&self, o: &mut String) {
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

    pub(super) fn bpf_section(&self, o: &mut String) {
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
            let unit = if w.workload == Workload::NewConn {
                "connection"
            } else {
                "request"
            };
            let label = w.workload.label();
            let _ = write!(head, " | ns/call, {label} | calls per {unit}, {label}");
            sep.push_str("|---:|---:");
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
                let q = w.progs.iter().find(|q| q.name == p.name);
                let per_request =
                    q.and_then(|q| (w.requests > 0).then(|| q.calls as f64 / w.requests as f64));
                let _ = write!(
                    row,
                    "| {} | {} ",
                    fmt_opt(q.and_then(crate::bench::bpfstats::ProgCost::ns_per_call)),
                    fmt_opt(per_request)
                );
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
            let _ = writeln!(o, "{}", bpf_against_overhead(ns / 1000.0, ov));
        }
        let _ = writeln!(o);
        o.push_str(&floor_section(
            b.floor.as_ref().ok(),
            self.config.bpf_stats_secs,
        ));
    }

    pub(super) fn enrol_section(&self, o: &mut String) {
        let e = &self.enrol;
        let _ = writeln!(
            o,
            "## Enrol latency (command-line tools)\n\nThe `sidestep enroll` CLI (what an operator runs by hand), against the same iptables install; the CNI plugin's own ADD is in the CNI section. Each run makes a fresh network namespace with `lo` and a veth `eth0` (untimed; the peer stays inside the netns), then times one process from spawn to exit: `sidestep enroll --netns … --interface eth0 --pod-ip …` (writes the pod's map entries and attaches the netns's identity and sk_lookup links: nothing listens in the fresh netns, so the default hook is sk_lookup), or `iptables-legacy-restore --noflush -w 5` of Istio's default ruleset ({} lines), started inside the netns (setns between fork and exec, no `ip netns exec`). The two alternate; each has two untimed warm-up runs. `sidestep unenroll` runs untimed after each enroll and is shown for information (Istio's DEL has no iptables counterpart: the rules die with the netns).\n",
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
}

/// The last line of the bpf_stats section: the programs' timed cost beside the measured capture
/// overhead, without subtracting one from the other. The overhead is a difference of two lanes'
/// medians and bpf_stats inflates every call, so the timed cost can exceed it.
pub(super) fn bpf_against_overhead(bpf_us: f64, overhead_us: f64) -> String {
    let mut s = format!(
        "- For scale: sidestep's measured capture overhead on that workload is {} µs per connection (a difference of two lanes' medians), and its BPF programs were timed at {} µs per connection (an upper bound: the timing adds two clock reads to every call).",
        fmt_num(overhead_us),
        fmt_num(bpf_us)
    );
    if bpf_us > overhead_us {
        s += " The timed cost is the larger: each figure has its own error, so neither is a share of the other.";
    }
    s
}

/// The no-op window (bench/floor.rs): what each of sidestep's programs costs per call beside
/// what a program that does nothing costs at the same hook, and the sums per connection.
pub(super) fn floor_section(floor: Option<&crate::bench::bpfstats::Floor>, secs: u32) -> String {
    let mut o = String::from("### The floor: what being called costs\n\n");
    let rows = floor
        .map(crate::bench::bpfstats::Floor::rows)
        .unwrap_or_default();
    let (Some(f), Some((ours, noop))) = (floor, floor.and_then(|f| f.per_request())) else {
        o.push_str("Not measured in this run (see the notes).\n\n");
        return o;
    };
    let _ = writeln!(
        o,
        "A third window of {secs} s, new connection per request, with a program that does nothing (`r0 = 1; exit`, loaded from raw instructions by bench/floor.rs) attached beside each of sidestep's: to the lane's cgroup at every cgroup hook sidestep uses, and as an sk_lookup program in both pods' netns. The kernel calls it as often as sidestep's program at the same hook and bpf_stats times it the same way, two clock reads included, so its ns/call is the price of being attached there, measured; sidestep's own code costs the difference. The kernel runs a cgroup's sock_ops program at every event of every TCP socket in it (RTO and receive-window initialisation, ECN, the established callbacks), whether or not the program wants it, so only fewer sockets or fewer hooks lower that part.\n"
    );
    let _ = writeln!(
        o,
        "| program | hook of the no-op | calls per connection | ns/call | no-op ns/call | above the no-op, ns per connection |\n|---|---|---:|---:|---:|---:|"
    );
    for r in &rows {
        let _ = writeln!(
            o,
            "| `{}` | `{}` | {} | {} | {} | {} |",
            r.program,
            r.hook,
            fmt_num(r.calls_per_request),
            fmt_num(r.ns_per_call),
            fmt_num(r.noop_ns_per_call),
            fmt_num(r.calls_per_request * (r.ns_per_call - r.noop_ns_per_call))
        );
    }
    let _ = writeln!(
        o,
        "\n- In this window ({} connections): sidestep's programs {} ns per connection; the same calls made to no-op programs {} ns per connection; sidestep's code above that floor {} ns per connection.",
        f.requests,
        fmt_num(ours),
        fmt_num(noop),
        fmt_num(ours - noop)
    );
    let _ = writeln!(
        o,
        "- Issue 17's target, all programs ≤ 1.5 µs per new connection as bpf_stats counts it: {}.\n",
        if noop >= 1500.0 {
            format!(
                "not reachable with these calls: programs that do nothing already cost {} µs per connection here",
                fmt_num(noop / 1000.0)
            )
        } else {
            format!(
                "{} µs of it is the price of the calls themselves, which leaves {} µs for sidestep's code against {} µs spent now",
                fmt_num(noop / 1000.0),
                fmt_num((1500.0 - noop) / 1000.0),
                fmt_num((ours - noop) / 1000.0)
            )
        }
    );
    o
}
