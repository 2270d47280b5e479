//! The benchmark: direct, explicit proxy, Istio iptables and sidestep in one interleaved run.
//! Regenerates docs/BENCHMARKS.md and docs/benchmarks.svg.
//!
//! Run it with `cargo xtask bench` (full, under 20 min) or `cargo xtask bench --quick` (under
//! 3 min); `--repeat N` runs the whole suite N times and reports each headline figure's range. It is `#[ignore]`d so that `cargo test` never runs it by accident, and it needs root;
//! it skips otherwise.

use std::fs;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use sidestep_tests::bench::{self, Config, repeats, report::SVG_NAME, sections};
use sidestep_tests::env::TestEnv;
use sidestep_tests::sidestep::Loaded;
use sidestep_tests::skip_unless_root;

#[test]
#[ignore = "benchmark: run with `cargo xtask bench [--quick]`"]
fn bench() -> Result<()> {
    if skip_unless_root("bench") {
        return Ok(());
    }
    let cfg = Config::from_env();
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let md = docs.join("BENCHMARKS.md");
    match std::env::var(bench::MODE_ENV).as_deref() {
        Ok("cni") => return only_section(&cfg, &md, sections::CNI),
        Ok("scale") => return only_section(&cfg, &md, sections::SCALE),
        Ok("ambient") => return only_section(&cfg, &md, sections::AMBIENT),
        _ => {}
    }
    // Before the run rather than when it writes the page: a hand-written block it cannot keep.
    sections::check_notes(&fs::read_to_string(&md).unwrap_or_default())?;
    let repeat = repeats::count_from_env()?;
    eprintln!(
        "bench: {} run, {} rounds of {} s per run, {repeat} repeat(s)",
        if cfg.quick { "quick" } else { "full" },
        cfg.rounds,
        cfg.run_secs
    );
    let mut reports = Vec::new();
    for i in 1..=repeat {
        eprintln!("bench: repeat {i}/{repeat}");
        // A failed repeat leaves the others' figures standing; the command still fails.
        match bench::run(&cfg) {
            Ok(r) => reports.push(r),
            Err(e) if repeat > 1 => eprintln!("bench: repeat {i} failed: {e:#}"),
            Err(e) => return Err(e),
        }
    }
    let Some(report) = reports.last() else {
        bail!("every one of the {repeat} repeats failed");
    };
    // The ambient section (it needs a ztunnel this run may not have) and the hand-written block
    // are kept from the page this one replaces.
    let old = fs::read_to_string(&md).unwrap_or_default();
    let page = sections::carry_over(
        &repeats::with_section(
            &report.markdown(),
            &repeats::section_for_page(&reports, &old),
        ),
        &old,
    );
    fs::write(&md, page).with_context(|| format!("write {}", md.display()))?;
    let svg = docs.join(SVG_NAME);
    fs::write(&svg, report.svg()).with_context(|| format!("write {}", svg.display()))?;
    eprintln!(
        "bench: wrote {} and {} ({:.0} s for the last repeat)",
        md.display(),
        svg.display(),
        report.timings.total.as_secs_f64()
    );
    if reports.len() > 1 {
        let sentence = repeats::readme_sentence(&reports);
        eprintln!("bench: README sentence: {sentence}");
        // Only a full run with every repeat in it speaks for the README: a quick one would put
        // coarse ratios there, and a range without a failed repeat would look tighter than it is.
        if cfg.quick || reports.len() < repeat {
            eprintln!("bench: README left alone (a quick run, or a repeat failed)");
        } else {
            let readme = docs.join("../README.md");
            let text = fs::read_to_string(&readme).unwrap_or_default();
            if sections::section(&text, sections::REPEATS).is_some() {
                fs::write(
                    &readme,
                    sections::splice(&text, sections::REPEATS, &sentence),
                )
                .with_context(|| format!("write {}", readme.display()))?;
                eprintln!("bench: updated the headline range in {}", readme.display());
            }
        }
    }
    if reports.len() < repeat {
        bail!(
            "{} of {repeat} repeats failed (the page has the others)",
            repeat - reports.len()
        );
    }
    for m in &report.missing {
        eprintln!("bench: no successful run for {m} (the report says so)");
    }
    let failed: Vec<_> = reports
        .iter()
        .flat_map(|r| r.missing_in_default_modes())
        .collect();
    if !failed.is_empty() {
        bail!(
            "no successful run for: {} (the report says so too)",
            failed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// One mode alone (`cargo xtask bench cni|scale`): its section of BENCHMARKS.md is replaced and
/// the rest of the page, from the last full run, is kept, the hand-written block with it.
fn only_section(cfg: &Config, md: &Path, id: &str) -> Result<()> {
    let t = std::time::Instant::now();
    let date = bench::sysinfo::SysInfo::collect(cfg.quick).date;
    let body = if id == sections::CNI {
        let env = TestEnv::new("bench-cni")?;
        let loaded = Loaded::load(&env)?;
        let c = bench::cni::run(&env, loaded.pin_root(), cfg.cni_runs)?;
        drop(loaded);
        sections::cni_section(&c, &date)
    } else if id == sections::AMBIENT {
        let Some(ztunnel) = std::env::var_os("SIDESTEP_ZTUNNEL") else {
            bail!(
                "bench ambient needs an unmodified ztunnel: set SIDESTEP_ZTUNNEL to a ztunnel \
                 binary built with --features testing (FAKE_CA)"
            );
        };
        let env = TestEnv::new("bench-ambient")?;
        let loaded = Loaded::load(&env)?;
        let (rounds, secs) = if cfg.quick { (2, 3) } else { (5, 10) };
        let a = bench::ambient::run(&env, &loaded, Path::new(&ztunnel), rounds, secs, 8)?;
        drop(loaded);
        let info = bench::sysinfo::SysInfo::collect(cfg.quick);
        let machine = format!("{} ({} CPUs), Linux {}", info.cpu, info.nproc, info.kernel);
        sections::ambient_section(&a, &date, &machine)
    } else {
        let s = bench::scale::run(&cfg.scale_levels, cfg.scale_samples, cfg.scale_conns)?;
        sections::scale_section(&s, &date, cfg.quick)
    };
    eprintln!("{body}");
    let page = fs::read_to_string(md).unwrap_or_else(|_| "# Benchmarks\n".into());
    fs::write(md, sections::splice(&page, id, &body))
        .with_context(|| format!("write {}", md.display()))?;
    eprintln!(
        "bench: {id}: wrote its section of {} ({:.0} s)",
        md.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The benchmark's floor window (tests/src/bench/floor.rs): its no-op programs attach beside
/// whatever the cgroup and the netns run, at every hook it names, and nothing of them stays
/// once the set drops. A benchmark that left them behind would slow every later run's lanes.
/// Runs in the host suite, unlike the benchmark itself.
#[test]
fn the_floors_no_ops_attach_at_every_hook_and_leave_nothing_behind() -> Result<()> {
    if skip_unless_root("the_floors_no_ops_attach_at_every_hook_and_leave_nothing_behind") {
        return Ok(());
    }
    use sidestep_tests::bench::floor::{HOOKS, NoopSet};
    use sidestep_tests::{Node, NodeOptions, faults::bpftool};
    let env = TestEnv::new("floor")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("p")?;
    let cgroup = env.cgroup_path().display().to_string();
    let attached = |json: &serde_json::Value| -> Vec<String> {
        json.as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["name"].as_str().map(str::to_owned))
            .collect()
    };
    let floor_programs = || -> Result<Vec<String>> {
        Ok(attached(&bpftool(&["prog", "show"])?)
            .into_iter()
            .filter(|n| n.starts_with("floor_"))
            .collect())
    };
    anyhow::ensure!(
        floor_programs()?.is_empty(),
        "floor programs loaded before the test: {:?}",
        floor_programs()?
    );
    {
        let set = NoopSet::attach(env.cgroup_path(), &[pod.netns_path()])?;
        let on_cgroup = attached(&bpftool(&["cgroup", "show", &cgroup])?);
        for hook in HOOKS.iter().filter(|h| h.name != "floor_sk_lookup") {
            anyhow::ensure!(
                on_cgroup.iter().any(|n| n == hook.name),
                "{} is not attached to the cgroup: {on_cgroup:?}",
                hook.name
            );
        }
        anyhow::ensure!(
            floor_programs()?.len() == HOOKS.len(),
            "loaded: {:?}",
            floor_programs()?
        );
        let samples = set.sample()?;
        anyhow::ensure!(samples.len() == HOOKS.len(), "{samples:?}");
    }
    // The kernel frees a program after an RCU grace period once its last reference goes.
    let deadline = std::time::Instant::now() + sidestep_tests::scaled(Duration::from_secs(3));
    while !floor_programs()?.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    anyhow::ensure!(
        floor_programs()?.is_empty(),
        "left behind: {:?}",
        floor_programs()?
    );
    anyhow::ensure!(
        attached(&bpftool(&["cgroup", "show", &cgroup])?)
            .iter()
            .all(|n| !n.starts_with("floor_")),
        "still attached to the cgroup"
    );
    Ok(())
}
