//! `cargo xtask bench --repeat N`: the whole suite N times in one invocation, and each headline
//! figure's value per repeat with its range. One run's interleaved rounds share that run's
//! machine state (boot, page cache, whatever else runs); the spread between whole runs is what
//! a headline quoted from one run would hide.

use std::fmt::Write as _;

use anyhow::{Result, bail};

use super::report::{HeadlineFigure, Report};
use super::sections::{self, REPEATS};

/// Whole runs of the suite (`--repeat N`); unset means 1.
pub const REPEAT_ENV: &str = "SIDESTEP_BENCH_REPEAT";

pub fn count_from_env() -> Result<usize> {
    match std::env::var(REPEAT_ENV) {
        Err(_) => Ok(1),
        Ok(v) if v.trim().is_empty() => Ok(1),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => bail!("{REPEAT_ENV}={v:?}: want a whole number of at least 1"),
        },
    }
}

/// Each headline figure, one value per repeat (None where a repeat could not compute it).
pub fn figures(reports: &[Report]) -> Vec<(HeadlineFigure, Vec<Option<f64>>)> {
    let Some(first) = reports.first() else {
        return Vec::new();
    };
    // By label: a repeat that lacks a metric has fewer figures, and must not shift the others.
    first
        .headline_figures()
        .into_iter()
        .map(|f| {
            let vals = reports
                .iter()
                .map(|r| {
                    r.headline_figures()
                        .into_iter()
                        .find(|g| g.label == f.label)
                        .and_then(|g| g.value)
                })
                .collect();
            (f, vals)
        })
        .collect()
}

/// (min, max) of the values present.
pub fn range(v: &[Option<f64>]) -> Option<(f64, f64)> {
    let xs: Vec<f64> = v.iter().flatten().copied().collect();
    let lo = super::stats::min(&xs)?;
    Some((lo, super::stats::max(&xs)?))
}

fn fmt_range(f: &HeadlineFigure, v: &[Option<f64>]) -> String {
    match range(v) {
        Some((lo, hi)) => format!("{}–{}", f.fmt_value(Some(lo)), f.fmt_value(Some(hi))),
        None => "—".into(),
    }
}

/// The Repeats section.
pub fn section(reports: &[Report]) -> String {
    let mut o = String::new();
    let n = reports.len();
    let _ = writeln!(o, "## Repeats\n");
    if n < 2 {
        let _ = writeln!(
            o,
            "One run of the suite. `cargo xtask bench --repeat N` runs it N times in one invocation and gives here each headline figure per run and its range, the spread between whole runs that one run's rounds cannot show."
        );
        return o;
    }
    let _ = writeln!(
        o,
        "{n} whole runs of the suite in one invocation (`--repeat {n}`), each with its own topology, warm-up and rounds; every other section of this page is from the last. Each headline figure per run, and its range over the runs. A ratio marked * was within noise in that run (the two lanes' 95% intervals overlapped).\n"
    );
    let heads: Vec<String> = (1..=n).map(|i| format!("run {i}")).collect();
    let _ = writeln!(
        o,
        "| figure | {} | range (min–max) |\n|---|{}---:|",
        heads.join(" | "),
        "---:|".repeat(n)
    );
    for (f, vals) in figures(reports) {
        let cells: Vec<String> = vals
            .iter()
            .zip(reports)
            .map(|(v, r)| {
                let noisy = r
                    .headline_figures()
                    .into_iter()
                    .find(|g| g.label == f.label)
                    .and_then(|g| g.within_noise)
                    == Some(true);
                format!("{}{}", f.fmt_value(*v), if noisy { "*" } else { "" })
            })
            .collect();
        let _ = writeln!(
            o,
            "| {} | {} | {} |",
            f.label,
            cells.join(" | "),
            fmt_range(&f, &vals)
        );
    }
    let _ = writeln!(o, "\nFor the README: {}", readme_sentence(reports));
    o
}

/// The first line of a Repeats section carried over from an earlier invocation.
const KEPT: &str = "**Kept from an earlier `--repeat` invocation.**";

/// The Repeats section for a page written by `reports`: theirs when they are several runs; after
/// a single run, the section of `old_page` (the page being replaced) when it holds several runs,
/// marked as older than the rest of the page, so that one run does not erase the spread the
/// README quotes.
pub fn section_for_page(reports: &[Report], old_page: &str) -> String {
    if reports.len() >= 2 {
        return section(reports);
    }
    let date = reports.last().map_or("", |r| r.sys.date.as_str());
    match sections::section(old_page, REPEATS) {
        Some(old) if old.contains("| figure |") => kept(&old, date),
        _ => section(reports),
    }
}

fn kept(old: &str, date: &str) -> String {
    // An earlier mark goes, with the blank line that set it apart.
    let mut lines: Vec<&str> = Vec::new();
    let mut after_mark = false;
    for line in old.lines() {
        if line.starts_with(KEPT) || (after_mark && line.is_empty()) {
            after_mark = line.starts_with(KEPT);
            continue;
        }
        after_mark = false;
        lines.push(line);
    }
    let mut body = lines.join("\n");
    // Its own "every other section is from the last run" is no longer true of this page.
    if let Some(heading_end) = body.find("## Repeats\n") {
        body.insert_str(
            heading_end + "## Repeats\n".len(),
            &format!(
                "\n{KEPT} Every other section of this page is from a later single run ({date}); this section and its README sentence are the last multi-run spread, with that invocation's date in the sentence below.\n"
            ),
        );
    }
    body
}

/// The README's headline sentence: ranges over the repeats.
pub fn readme_sentence(reports: &[Report]) -> String {
    let figs = figures(reports);
    let get = |label: &str| {
        figs.iter()
            .find(|(f, _)| f.label.starts_with(label))
            .map_or_else(|| "—".into(), |(f, v)| fmt_range(f, v))
    };
    let date = reports.last().map_or("", |r| r.sys.date.as_str());
    let kind = if reports.iter().any(|r| r.config.quick) {
        "quick"
    } else {
        "full"
    };
    format!(
        "Over {} {kind} runs of the benchmark in one invocation ({date}), sidestep's new-connection capture overhead was {} of iptables'; it made {} the new connections/s and {} the keep-alive requests/s of iptables, and {} and {} those of Istio's nftables mode.",
        reports.len(),
        get("new connection: sidestep's capture overhead"),
        get("new connection per request, connections/s: sidestep ÷ iptables"),
        get("HTTP keep-alive, requests/s: sidestep ÷ iptables"),
        get("new connection per request, connections/s: sidestep ÷ Istio nftables"),
        get("HTTP keep-alive, requests/s: sidestep ÷ Istio nftables"),
    )
}

/// `page` with the Repeats section right after the headline (before "## The run").
pub fn with_section(page: &str, body: &str) -> String {
    let page = if sections::section(page, REPEATS).is_none() {
        match page.find("\n## The run") {
            Some(i) => {
                let marked = sections::splice("", REPEATS, "");
                format!("{}\n{}\n{}", &page[..i], marked.trim(), &page[i..])
            }
            None => page.to_owned(),
        }
    } else {
        page.to_owned()
    };
    sections::splice(&page, REPEATS, body)
}
