//! The table of issue 6's targets, each verdict computed from the run's figures.

use std::fmt::Write as _;

use super::*;

impl Report {
    pub(super) fn targets(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "## Targets from issue 6\n\nComputed from the medians above; nothing here is typed in by hand.\n"
        );
        let _ = writeln!(o, "| target | this run | verdict |\n|---|---|---|");
        let verdict = |ok: Option<bool>| match ok {
            Some(true) => "met",
            Some(false) => "**not met**",
            None => "undetermined",
        };
        if let Some(m) = self.metric("nc_cps") {
            let p = overhead_pct(m);
            let control = match (
                median(&self.tw_control.rates),
                m.median(Mode::Explicit),
                overhead(m, Mode::Iptables),
            ) {
                (Some(c), Some(e), Some(i)) if i > 0.0 => {
                    let ov = cost(m, c) - cost(m, e);
                    format!(
                        " The control lane without TIME_WAIT sockets in the server pod: {} µs/connection, {:.0}% of iptables'.",
                        fmt_num(ov),
                        100.0 * ov / i
                    )
                }
                _ => String::new(),
            };
            let _ = writeln!(
                o,
                "| New connection: sidestep's capture overhead ≤ 25% of iptables' | {} (sidestep {} vs iptables {} µs/connection over the floor).{control} | {} |",
                p.map_or_else(|| "—".into(), |p| format!("{p:.0}%")),
                fmt_opt(overhead(m, Mode::Sidestep)),
                fmt_opt(overhead(m, Mode::Iptables)),
                verdict(p.map(|p| p <= 25.0))
            );
        }
        if let Some(m) = self.metric("ka_rps") {
            let r = ratio(m.median(Mode::Sidestep), m.median(Mode::Iptables));
            let _ = writeln!(
                o,
                "| Keep-alive: sidestep req/s ≥ iptables | {} of iptables.{} | {} |",
                fmt_ratio(r),
                self.noise_note(m, Mode::Sidestep, Mode::Iptables),
                verdict(r.map(|r| r >= 1.0))
            );
        }
        if let Some(m) = self.metric("ka_p99") {
            let r = ratio(m.median(Mode::Sidestep), m.median(Mode::Iptables));
            let _ = writeln!(
                o,
                "| Keep-alive: sidestep p99 ≤ iptables | {} of iptables.{} | {} |",
                fmt_ratio(r),
                self.noise_note(m, Mode::Sidestep, Mode::Iptables),
                verdict(r.map(|r| r <= 1.0))
            );
        }
        if let (Some(bulk), Some(p99)) = (self.metric("bulk"), self.metric("ka_p99")) {
            let t = ratio(bulk.median(Mode::SkMsg), bulk.median(Mode::Iptables));
            let l = ratio(p99.median(Mode::SkMsg), p99.median(Mode::Iptables));
            let _ = writeln!(
                o,
                "| sk_msg: app-to-sidecar throughput ≥ 1.5× iptables, keep-alive p99 ≤ 0.85× iptables | throughput {} of iptables (the iperf3 stream, which crosses both sidecars), keep-alive p99 {} of iptables.{} | {} |",
                fmt_ratio(t),
                fmt_ratio(l),
                self.noise_note(p99, Mode::SkMsg, Mode::Iptables),
                verdict(t.zip(l).map(|(t, l)| t >= 1.5 && l <= 0.85))
            );
        }
        match &self.cni {
            Some(c) => {
                let (add, best, r) = crate::bench::sections::cni_add_target(c, &c.add_ms);
                let (skl, _, rs) = crate::bench::sections::cni_add_target(c, &c.add_tc_ms);
                let _ = writeln!(
                    o,
                    "| CNI ADD p50 ≤ 0.5× the iptables install | sidestep-cni ADD (a whole process) p50 against the faster Istio install (iptables-restore + ip6tables-restore, {}): `inbound_hook: sk_lookup` (default) {} = {}, **{}**; `inbound_hook: tc` {} = {}, **{}**. See the CNI section for where ADD's time goes | {} |",
                    fmt_ms(best),
                    fmt_ms(add),
                    fmt_ratio(r),
                    crate::bench::sections::verdict_at_most(r, 0.5).trim_matches('*'),
                    fmt_ms(skl),
                    fmt_ratio(rs),
                    crate::bench::sections::verdict_at_most(rs, 0.5).trim_matches('*'),
                    crate::bench::sections::verdict_at_most(r, 0.5)
                );
            }
            None => {
                let _ = writeln!(
                    o,
                    "| CNI ADD p50 ≤ 0.5× the iptables install | not measured in this run | not measured |"
                );
            }
        }
        match self
            .scale
            .as_ref()
            .and_then(crate::bench::sections::scale_targets)
        {
            Some(crate::bench::sections::ScaleRatios {
                pods,
                add_p99: p99,
                conn,
                ..
            }) => {
                let both = match (p99, conn) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
                let _ = writeln!(
                    o,
                    "| Scale: ADD p99 at 1,000 pods within 1.2× of the first pod's, flat per-connection cost | at {pods} pods: ADD p99 {} of the first pod's, per-connection loop time {} | {} |",
                    fmt_ratio(p99),
                    fmt_ratio(conn),
                    crate::bench::sections::verdict_at_most(both, 1.2)
                );
            }
            None => {
                let _ = writeln!(
                    o,
                    "| Scale: ADD p99 at 1,000 pods within 1.2× of the first pod's, flat per-connection cost | not measured in this run | not measured |"
                );
            }
        }
        let _ = writeln!(
            o,
            "| Hot path: BPF cost per call for connect4, sockops, tc ingress | {} | reported |",
            if self.bpf.is_some() {
                "see the table below"
            } else {
                "not available in this run"
            }
        );
        let limit = if self.config.quick { 180.0 } else { 1200.0 };
        let total = self.timings.total.as_secs_f64();
        let _ = writeln!(
            o,
            "| Run time: {} in under {} min | harness {total:.0} s (without the build) | {} |\n",
            if self.config.quick {
                "`--quick`"
            } else {
                "full run"
            },
            limit / 60.0,
            verdict(Some(total < limit))
        );
    }
}
