//! The end of docs/BENCHMARKS.md: how the figures were taken, the run's notes, and every raw
//! figure, so a reader can check the tables above against the samples.

use std::fmt::Write as _;

use super::*;

impl Report {
    pub(super) fn method(&self, o: &mut String) {
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
            "- Order: one unrecorded warm-up run per mode of the two wrk workloads (sockperf has its own warm-up), then a check that the iptables lane's REDIRECT chains and the sidestep lane's redirect counters both moved, then {} rounds. Within a round each workload runs on every mode back to back, and the mode order rotates by one every round (A B C …, B C … A, …), so slow phases of the shared machine hit every mode alike. Every figure is the median over the rounds, with a 95% bootstrap interval; the raw rounds are at the end.",
            c.rounds
        );
        let _ = writeln!(
            o,
            "- Cleanup: processes are killed by their guards, then `sidestep unload`, CNI DEL and netns deletion (the iptables rules live in the pod netns and go with them), then the test cgroups and pin roots; the bpf_stats sysctl has its own guard.\n"
        );
    }

    pub(super) fn notes_section(&self, o: &mut String) {
        let _ = writeln!(o, "## Notes\n");
        let _ = writeln!(
            o,
            "- The machine is a shared {}-CPU VM on which other engineers build and test at the same time: load average went from `{}` to `{}` during this run. Interleaving and rotation spread that noise over all modes, and medians drop the worst rounds, but differences smaller than the spread in the raw rounds below are not meaningful.",
            self.sys.nproc, self.sys.loadavg, self.sys_end.loadavg
        );
        let _ = writeln!(
            o,
            "- Client, two sidecars, server and load generator share {} CPUs, so every figure includes CPU contention between them; these are relative figures for this machine, not absolute capacity numbers. CPU layout: {}. Pinning fixes where each process runs, the same in every lane and round, so the scheduler's placement is not part of the spread; softirq work still runs on whichever CPU sends or receives.",
            self.sys.nproc, self.cpus
        );
        let _ = writeln!(
            o,
            "- Kernel: every figure is from the host's kernel ({}). The test suite also runs on Linux 6.1 and 6.12 in VMs, but under TCG (emulated CPUs; this machine's KVM does not work), where time is not comparable to a real CPU's, so no benchmark runs there: those runs are for correctness only (docs/RELIABILITY.md, \"Kernels\").",
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|r| r.trim().to_string())
                .unwrap_or_else(|_| "unknown".into())
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

    pub(super) fn raw(&self, o: &mut String) {
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
