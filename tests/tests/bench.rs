//! The benchmark: direct, explicit proxy, Istio iptables and sidestep in one interleaved run.
//! Regenerates docs/BENCHMARKS.md and docs/benchmarks.svg.
//!
//! Run it with `cargo xtask bench` (full, under 20 min) or `cargo xtask bench --quick` (under
//! 3 min). It is `#[ignore]`d so that `cargo test` never runs it by accident, and it needs root;
//! it skips otherwise.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};
use sidestep_tests::bench::{self, Config, report::SVG_NAME};
use sidestep_tests::skip_unless_root;

#[test]
#[ignore = "benchmark: run with `cargo xtask bench [--quick]`"]
fn bench() -> Result<()> {
    if skip_unless_root("bench") {
        return Ok(());
    }
    let cfg = Config::from_env();
    eprintln!(
        "bench: {} run, {} rounds of {} s per run",
        if cfg.quick { "quick" } else { "full" },
        cfg.rounds,
        cfg.run_secs
    );
    let report = bench::run(&cfg)?;
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let md = docs.join("BENCHMARKS.md");
    fs::write(&md, report.markdown()).with_context(|| format!("write {}", md.display()))?;
    let svg = docs.join(SVG_NAME);
    fs::write(&svg, report.svg()).with_context(|| format!("write {}", svg.display()))?;
    eprintln!(
        "bench: wrote {} and {} ({:.0} s)",
        md.display(),
        svg.display(),
        report.timings.total.as_secs_f64()
    );
    if !report.missing.is_empty() {
        bail!(
            "no successful run for: {} (the report says so too)",
            report.missing.join(", ")
        );
    }
    Ok(())
}
