//! Unit tests of the report: overhead arithmetic, which modes fail the run, and that the Markdown
//! and SVG render from a synthetic run.

use super::*;
use crate::bench::new_metrics;

fn sample() -> Report {
    let mut metrics = new_metrics();
    for m in &mut metrics {
        // direct, explicit, iptables, Istio nftables, sidestep.
        for (i, base) in [10.0, 20.0, 30.0, 30.0, 25.0].iter().enumerate() {
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
        "| figure | direct | explicit proxy | iptables | Istio nftables | sidestep | sidestep, tc hook | sidestep + sk_msg |"
    ));
}

#[test]
fn renders_markdown_and_svg() {
    let r = sample();
    let md = r.markdown();
    assert!(md.contains("| New connection: sidestep's capture overhead ≤ 25% of iptables' | 50%"));
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
