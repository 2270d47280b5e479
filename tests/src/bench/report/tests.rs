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
        round_tcp: Vec::new(),
        cpus: "every lane: load generator on CPU 0".into(),
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

#[test]
fn intervals_and_noise_verdicts() {
    let mut r = sample();
    let md = r.markdown();
    // Every median of the Results table carries its interval; the sample's lanes are 1% wide and
    // far apart, so no headline ratio is within noise.
    assert!(md.contains("| 40.0 [39.6–40.4]<br>"), "{md}");
    assert_eq!(r.within_noise("nc_cps", Mode::Iptables), Some(false));
    assert!(!r.headline().contains("within noise"));
    // sidestep's rounds spread over iptables' median: the intervals overlap.
    let nc = r.metrics.iter_mut().find(|m| m.key == "nc_cps").unwrap();
    nc.values[Mode::Sidestep.index()] = vec![30.0, 45.0, 33.0, 50.0, 34.0];
    assert_eq!(r.within_noise("nc_cps", Mode::Iptables), Some(true));
    assert!(
        r.headline()
            .contains("the connections/s of iptables (within noise)"),
        "{}",
        r.headline()
    );
    let f = r.headline_figures();
    assert_eq!(f.len(), 7);
    assert!(f[0].pct && f[0].within_noise.is_none());
    assert_eq!(f[1].within_noise, Some(true));
}

#[test]
fn repeats_give_ranges() {
    use crate::bench::repeats;
    let a = sample();
    let mut b = sample();
    for m in &mut b.metrics {
        for v in &mut m.values[Mode::Sidestep.index()] {
            *v *= 1.1;
        }
    }
    let reports = [a, b];
    let figs = repeats::figures(&reports);
    let (f, vals) = &figs[1];
    assert!(f.label.ends_with("sidestep ÷ iptables"), "{}", f.label);
    let (lo, hi) = repeats::range(vals).unwrap();
    assert!((hi / lo - 1.1).abs() < 1e-9, "{lo} {hi}");
    let s = repeats::section(&reports);
    assert!(s.contains("| run 1 | run 2 | range (min–max) |"), "{s}");
    assert!(s.contains("1.20×–1.32×"), "{s}");
    assert!(repeats::readme_sentence(&reports).starts_with("Over 2 quick runs"));
    assert!(repeats::section(&reports[..1]).contains("One run of the suite"));
    let page = "# B\n\n**Headline:** x\n\n## The run\n\nt\n";
    let once = repeats::with_section(page, "## Repeats\nv1");
    assert!(
        once.find("v1").unwrap() < once.find("## The run").unwrap(),
        "{once}"
    );
    let twice = repeats::with_section(&once, "## Repeats\nv2");
    assert!(twice.contains("v2") && !twice.contains("v1"));
    assert_eq!(twice.matches("bench:repeats:begin").count(), 1);
}

#[test]
fn a_single_run_keeps_the_last_multi_run_spread() {
    use crate::bench::repeats;
    let multi = [sample(), sample()];
    let page = repeats::with_section(
        "# B\n\n## The run\n",
        &repeats::section_for_page(&multi, ""),
    );
    assert!(page.contains("| run 1 | run 2 |"), "{page}");
    let single = [sample()];
    let date = single[0].sys.date.clone();
    let once = repeats::section_for_page(&single, &page);
    assert!(once.contains("| run 1 | run 2 |"), "{once}");
    assert!(
        once.contains(&format!("**Kept from an earlier `--repeat` invocation.** Every other section of this page is from a later single run ({date})")),
        "{once}"
    );
    assert!(once.starts_with("## Repeats\n"), "{once}");
    // A second single run re-dates the mark instead of stacking another one.
    let again = repeats::section_for_page(&single, &repeats::with_section(&page, &once));
    assert_eq!(again.matches("Kept from an earlier").count(), 1, "{again}");
    assert_eq!(again, once);
    // Nothing to keep: the one-run text.
    assert!(repeats::section_for_page(&single, "# B\n").contains("One run of the suite"));
    assert!(
        repeats::section_for_page(
            &single,
            &repeats::with_section("# B\n", &repeats::section(&single))
        )
        .contains("One run of the suite")
    );
    // Several runs always write their own.
    assert!(!repeats::section_for_page(&multi, &page).contains("Kept"));
}

#[test]
fn bpf_cost_beside_the_overhead_never_as_a_share_of_it() {
    let below = super::costs::bpf_against_overhead(6.73, 8.37);
    assert!(below.contains("8.37 µs per connection"), "{below}");
    assert!(below.contains("timed at 6.73 µs"), "{below}");
    assert!(
        !below.contains("of it") && !below.contains("the larger"),
        "{below}"
    );
    let above = super::costs::bpf_against_overhead(7.79, 3.81);
    assert!(above.contains("The timed cost is the larger"), "{above}");
}

#[test]
fn the_floor_section_states_whether_the_target_is_above_the_no_ops() {
    use crate::bench::bpfstats::{Floor, ProgCost};
    let cost = |name: &str, calls, total_ns| ProgCost {
        name: name.into(),
        calls,
        total_ns,
    };
    let floor = |noop_ns| Floor {
        requests: 100,
        sidestep: vec![cost("sidestep_sockops", 3000, 600_000)],
        noop: vec![cost("floor_sockops", 3000, noop_ns)],
    };
    let high = super::costs::floor_section(Some(&floor(180_000)), 5);
    assert!(
        high.contains("| `sidestep_sockops` | `floor_sockops` | 30.0 | 200 | 60.0 | 4200 |"),
        "{high}"
    );
    assert!(high.contains("not reachable with these calls"), "{high}");
    let low = super::costs::floor_section(Some(&floor(30_000)), 5);
    assert!(
        low.contains("0.30 µs of it is the price of the calls"),
        "{low}"
    );
    assert!(super::costs::floor_section(None, 5).contains("Not measured"));
}

/// A hand-written block of the kind docs/BENCHMARKS.md carries, with bytes a careless rewrite
/// would change: trailing spaces, a run of blank lines, a tab, a CR, non-ASCII.
const HAND_WRITTEN: &str = "<!-- notes:begin (hand-written; every bench run keeps it as it is) -->\n\
## What the runs say\n\nThe headline, in words.  \n\n\n| by | hand |\n|---|---:|\n| x |\t1.23× |\r\n\n\
## The netfilter lanes' new-connection tail\n\n- `__inet_hash_connect` took 10.0%.\n\
<!-- notes:end -->";

/// The hand-written block is no run's to write: a full run puts it back byte for byte where it
/// was, between Notes and Raw rounds, the next run does the same with that page, and `bench cni`
/// or `bench scale` leave it alone.
#[test]
fn a_full_run_keeps_the_hand_written_block_byte_for_byte() {
    use crate::bench::sections::{self, NOTES_BEGIN};
    let generated = sample().markdown();
    assert!(
        !generated.contains(NOTES_BEGIN),
        "the run writes no block of its own"
    );
    // The page the run replaces: the last run's, with the block between its Notes and Raw
    // rounds, and an ambient section at the end.
    let at = generated.find("## Raw rounds\n").unwrap();
    let old = format!("{}{HAND_WRITTEN}\n\n{}", &generated[..at], &generated[at..]);
    let old = sections::splice(&old, sections::AMBIENT, "## Ambient\nkept");
    let page = sections::carry_over(&generated, &old);
    assert_eq!(sections::notes_block(&page), Some(HAND_WRITTEN), "{page}");
    assert_eq!(page.matches(NOTES_BEGIN).count(), 1);
    let kept = page.find(HAND_WRITTEN).unwrap();
    assert!(page.find("## Notes\n").unwrap() < kept);
    assert!(kept + HAND_WRITTEN.len() < page.find("## Raw rounds\n").unwrap());
    // The same run over the same page gives that page back, blank lines and all.
    assert_eq!(page, old);
    // The next run keeps it again.
    assert_eq!(sections::carry_over(&generated, &page), page);
    // One mode alone replaces its own section and nothing else.
    for id in [sections::CNI, sections::SCALE, sections::AMBIENT] {
        let one = sections::splice(&page, id, "## One mode\nnew");
        assert_eq!(sections::notes_block(&one), Some(HAND_WRITTEN), "{id}");
    }
    assert!(sections::check_notes(&page).is_ok());
}

/// Without a block in the page it replaces, a full run writes none, and that is no error. Half a
/// block (a begin marker without its end) keeps nothing, so the full run refuses to start on it.
#[test]
fn a_page_without_the_hand_written_block_regenerates_without_it() {
    use crate::bench::sections::{self, NOTES_BEGIN, NOTES_END};
    let generated = sample().markdown();
    let no_block = format!(
        "{}\n",
        generated.replace("## Raw rounds", "## Old raw rounds")
    );
    for old in [
        "",
        "# sidestep benchmarks\n\nNo block.\n",
        &generated,
        &no_block,
    ] {
        assert_eq!(sections::carry_over(&generated, old), generated);
        assert!(sections::check_notes(old).is_ok());
    }
    let half = format!("{generated}\n{NOTES_BEGIN} -->\nunclosed\n");
    assert_eq!(sections::carry_over(&generated, &half), generated);
    assert!(sections::check_notes(&half).is_err());
    let backwards = format!("{NOTES_END}\n{generated}\n{NOTES_BEGIN} -->\n");
    assert!(sections::check_notes(&backwards).is_err());
    // A page without a Raw rounds section gets the block at its end.
    assert_eq!(
        sections::with_notes("# B\n\ntext\n", HAND_WRITTEN),
        format!("# B\n\ntext\n\n{HAND_WRITTEN}\n")
    );
}
