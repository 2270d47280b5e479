//! The benchmark: direct, explicit proxy, Istio iptables and sidestep in one interleaved run.
//! Regenerates docs/BENCHMARKS.md and docs/benchmarks.svg.
//!
//! Run it with `cargo xtask bench` (full, under 20 min) or `cargo xtask bench --quick` (under
//! 3 min). It is `#[ignore]`d so that `cargo test` never runs it by accident, and it needs root;
//! it skips otherwise.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};
use sidestep_tests::bench::{self, Config, report::SVG_NAME, sections};
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
    eprintln!(
        "bench: {} run, {} rounds of {} s per run",
        if cfg.quick { "quick" } else { "full" },
        cfg.rounds,
        cfg.run_secs
    );
    let report = bench::run(&cfg)?;
    // The ambient section needs a ztunnel this run may not have: the last one is kept.
    let old = fs::read_to_string(&md).unwrap_or_default();
    let page = match sections::section(&old, sections::AMBIENT) {
        Some(body) => sections::splice(&report.markdown(), sections::AMBIENT, &body),
        None => report.markdown(),
    };
    fs::write(&md, page).with_context(|| format!("write {}", md.display()))?;
    let svg = docs.join(SVG_NAME);
    fs::write(&svg, report.svg()).with_context(|| format!("write {}", svg.display()))?;
    eprintln!(
        "bench: wrote {} and {} ({:.0} s)",
        md.display(),
        svg.display(),
        report.timings.total.as_secs_f64()
    );
    for m in &report.missing {
        eprintln!("bench: no successful run for {m} (the report says so)");
    }
    let failed = report.missing_in_default_modes();
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
/// the rest of the page, from the last full run, is kept.
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
