//! The chart docs/benchmarks.svg shows, drawn from the same medians as the tables.

use std::fmt::Write as _;

use super::*;

impl Report {
    /// The chart: one panel per figure (four bars, one per mode), plus the enrol latencies and
    /// the BPF cost per call. Plain SVG 1.1 text.
    pub fn svg(&self) -> String {
        const W: f64 = 1000.0;
        const PANEL_W: f64 = 480.0;
        const PANEL_H: f64 = 172.0;
        const TOP: f64 = 84.0;
        const LABEL_W: f64 = 150.0;
        const BAR_W: f64 = 195.0;
        let colors: [&str; Mode::COUNT] = [
            "#8c8c8c", "#4c78a8", "#e45756", "#f58518", "#54a24b", "#88d27a", "#b279a2",
        ];

        struct Panel {
            title: String,
            hint: String,
            bars: Vec<(String, Option<f64>, &'static str, String)>,
        }
        let mut panels = Vec::new();
        for m in &self.metrics {
            let ipt = m.median(Mode::Iptables);
            panels.push(Panel {
                title: format!("{} ({})", m.label, m.unit),
                hint: if m.higher_is_better {
                    "higher is better".into()
                } else {
                    "lower is better".into()
                },
                bars: Mode::ALL
                    .iter()
                    .map(|&mode| {
                        let v = m.median(mode);
                        let r = ratio(v, ipt);
                        let txt = match (v, r) {
                            (Some(v), Some(r)) if mode != Mode::Iptables => {
                                format!("{} ({r:.2}× ipt)", fmt_num(v))
                            }
                            (Some(v), _) => fmt_num(v),
                            _ => "no data".into(),
                        };
                        (mode.label().to_owned(), v, colors[mode.index()], txt)
                    })
                    .chain((m.key == "nc_cps").then(|| {
                        let v = median(&self.tw_control.rates);
                        let txt = match (v, ratio(v, ipt)) {
                            (Some(v), Some(r)) => format!("{} ({r:.2}× ipt)", fmt_num(v)),
                            (Some(v), None) => fmt_num(v),
                            _ => "no data".into(),
                        };
                        ("no-TIME_WAIT control".to_owned(), v, "#a6d99a", txt)
                    }))
                    .collect(),
            });
        }
        let e = &self.enrol;
        let ms = |v: Option<f64>| v.map_or_else(|| "no data".into(), |v| format!("{v:.2} ms"));
        panels.push(Panel {
            title: "Enrol latency, CLI (ms)".into(),
            hint: "lower is better; not CNI".into(),
            bars: vec![
                (
                    "enroll p50".into(),
                    percentile(&e.sidestep_ms, 50.0),
                    colors[3],
                    ms(percentile(&e.sidestep_ms, 50.0)),
                ),
                (
                    "enroll p99".into(),
                    percentile(&e.sidestep_ms, 99.0),
                    colors[3],
                    ms(percentile(&e.sidestep_ms, 99.0)),
                ),
                (
                    "ipt-restore p50".into(),
                    percentile(&e.iptables_ms, 50.0),
                    colors[2],
                    ms(percentile(&e.iptables_ms, 50.0)),
                ),
                (
                    "ipt-restore p99".into(),
                    percentile(&e.iptables_ms, 99.0),
                    colors[2],
                    ms(percentile(&e.iptables_ms, 99.0)),
                ),
            ],
        });
        if let Some(b) = &self.bpf {
            let mut bars = Vec::new();
            // The three of issue 6, then the other programs that ran, costliest first, five
            // bars at most.
            let mut names: Vec<&str> = vec!["sidestep_connect4", "sidestep_sockops", TC_PROGRAM];
            let mut others: Vec<_> = b
                .combined
                .iter()
                .filter(|p| p.calls > 0 && !names.contains(&p.name.as_str()))
                .collect();
            others.sort_by_key(|p| std::cmp::Reverse(p.total_ns));
            names.extend(others.iter().take(2).map(|p| p.name.as_str()));
            for name in names {
                let v = b
                    .combined
                    .iter()
                    .find(|p| p.name == name)
                    .and_then(|p| p.ns_per_call());
                bars.push((
                    name.trim_start_matches("sidestep_").to_owned(),
                    v,
                    colors[3],
                    v.map_or_else(|| "not called".into(), |v| format!("{v:.0} ns")),
                ));
            }
            panels.push(Panel {
                title: "sidestep BPF cost per call (ns)".into(),
                hint: "bpf_stats run_time_ns / run_cnt".into(),
                bars,
            });
        }

        let rows = panels.len().div_ceil(2);
        let h = TOP + rows as f64 * PANEL_H + 30.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="Helvetica, Arial, sans-serif">"#
        );
        let _ = writeln!(s, r#"<rect width="{W}" height="{h}" fill="white"/>"#);
        let kind = if self.config.quick { "quick" } else { "full" };
        let _ = writeln!(
            s,
            r#"<text x="20" y="30" font-size="18" font-weight="bold">{}</text>"#,
            xml_escape(&format!(
                "sidestep benchmarks: medians of {} interleaved rounds ({kind} run)",
                self.config.rounds
            ))
        );
        let _ = writeln!(
            s,
            r##"<text x="20" y="50" font-size="12" fill="#555">{}</text>"##,
            xml_escape(&format!(
                "{} · kernel {} · {} × {} · HAProxy sidecars, wrk / sockperf / iperf3",
                self.sys.date, self.sys.kernel, self.sys.cpu, self.sys.nproc
            ))
        );
        let mut lx = 20.0;
        for mode in Mode::ALL {
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="62" width="12" height="12" fill="{}"/><text x="{}" y="72" font-size="12">{}</text>"#,
                colors[mode.index()],
                lx + 16.0,
                xml_escape(mode.label())
            );
            lx += 130.0;
        }
        for (i, p) in panels.iter().enumerate() {
            let x0 = 20.0 + (i % 2) as f64 * (PANEL_W + 20.0);
            let y0 = TOP + (i / 2) as f64 * PANEL_H;
            let _ = writeln!(
                s,
                r##"<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{}" fill="#fafafa" stroke="#ddd"/>"##,
                PANEL_H - 10.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" font-size="13" font-weight="bold">{}</text>"#,
                x0 + 8.0,
                y0 + 18.0,
                xml_escape(&p.title)
            );
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" font-size="11" fill="#777">{}</text>"##,
                x0 + 8.0,
                y0 + 32.0,
                xml_escape(&p.hint)
            );
            let max = p.bars.iter().filter_map(|b| b.1).fold(0.0_f64, f64::max);
            for (j, (label, v, color, txt)) in p.bars.iter().enumerate() {
                let y = y0 + 42.0 + j as f64 * 24.0;
                let _ = writeln!(
                    s,
                    r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{}</text>"#,
                    x0 + LABEL_W - 6.0,
                    y + 14.0,
                    xml_escape(label)
                );
                let len = match v {
                    Some(v) if max > 0.0 && *v > 0.0 => (v / max * BAR_W).max(1.0),
                    _ => 0.0,
                };
                let _ = writeln!(
                    s,
                    r#"<rect x="{}" y="{}" width="{len:.1}" height="18" fill="{color}"/>"#,
                    x0 + LABEL_W,
                    y + 1.0
                );
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{}" font-size="11">{}</text>"#,
                    x0 + LABEL_W + len + 5.0,
                    y + 14.0,
                    xml_escape(txt)
                );
            }
        }
        let _ = writeln!(
            s,
            r##"<text x="20" y="{}" font-size="11" fill="#777">Generated by cargo xtask bench; see BENCHMARKS.md for the method, overheads and raw rounds.</text>"##,
            h - 10.0
        );
        s.push_str("</svg>\n");
        s
    }
}
