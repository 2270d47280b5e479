//! Bootstrap intervals of the medians, and which headline ratios the rounds cannot tell from
//! 1: a ratio of two medians whose 95% intervals overlap is "within noise".

use std::fmt::Write as _;

use super::*;

impl Metric {
    /// 95% percentile-bootstrap interval of the median over the rounds.
    pub fn ci(&self, mode: Mode) -> Option<(f64, f64)> {
        stats::median_ci(&self.values[mode.index()])
    }
}

/// `[lo–hi]`, or nothing without samples.
pub fn fmt_ci(ci: Option<(f64, f64)>) -> String {
    ci.map_or_else(String::new, |(lo, hi)| {
        format!("[{}–{}]", fmt_num(lo), fmt_num(hi))
    })
}

/// A figure the headline quotes, kept per repeat.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadlineFigure {
    pub label: String,
    pub value: Option<f64>,
    /// A percentage rather than a ratio.
    pub pct: bool,
    /// Whether the two lanes' intervals overlap; None for a figure that is no ratio of two
    /// lanes or when one has no sample.
    pub within_noise: Option<bool>,
}

impl HeadlineFigure {
    pub fn fmt_value(&self, v: Option<f64>) -> String {
        match v {
            Some(v) if self.pct => format!("{v:.0}%"),
            v => fmt_ratio(v),
        }
    }
}

/// The metrics and baselines of the headline's ratios (sidestep's median over the baseline's).
pub const HEADLINE_RATIOS: [(&str, &str); 2] = [
    ("nc_cps", "new connection per request, connections/s"),
    ("ka_rps", "HTTP keep-alive, requests/s"),
];
pub const HEADLINE_BASELINES: [Mode; 3] = [Mode::Iptables, Mode::Nftables, Mode::Explicit];

impl Report {
    /// Whether sidestep's and `against`'s intervals of metric `key` overlap.
    pub(super) fn within_noise(&self, key: &str, against: Mode) -> Option<bool> {
        let m = self.metric(key)?;
        Some(stats::overlap(m.ci(Mode::Sidestep)?, m.ci(against)?))
    }

    /// " (within noise)" when [`Report::within_noise`].
    pub(super) fn noise_tag(&self, key: &str, against: Mode) -> &'static str {
        if self.within_noise(key, against) == Some(true) {
            " (within noise)"
        } else {
            ""
        }
    }

    /// The headline's figures, in a fixed order so that repeats line up.
    pub fn headline_figures(&self) -> Vec<HeadlineFigure> {
        let mut v = vec![HeadlineFigure {
            label: "new connection: sidestep's capture overhead as % of iptables'".into(),
            value: self.metric("nc_cps").and_then(overhead_pct),
            pct: true,
            within_noise: None,
        }];
        for (key, what) in HEADLINE_RATIOS {
            let Some(m) = self.metric(key) else { continue };
            for against in HEADLINE_BASELINES {
                v.push(HeadlineFigure {
                    label: format!("{what}: sidestep ÷ {}", against.label()),
                    value: ratio(m.median(Mode::Sidestep), m.median(against)),
                    pct: false,
                    within_noise: self.within_noise(key, against),
                });
            }
        }
        v
    }

    pub(super) fn noise_section(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "## Headline ratios and noise\n\nEach median of the Results table has its 95% confidence interval in brackets: a percentile bootstrap of the median over the rounds ({} resamples, fixed seed, so the same rounds always give the same interval). A ratio is **within noise** when the two lanes' intervals overlap: the rounds cannot tell it from 1. With {} rounds the intervals are coarse (they run between sample values).\n",
            stats::BOOTSTRAP_RESAMPLES,
            self.config.rounds
        );
        let _ = writeln!(
            o,
            "| ratio | value | sidestep median [95% CI] | baseline median [95% CI] | verdict |\n|---|---:|---:|---:|---|"
        );
        for (key, what) in HEADLINE_RATIOS {
            let Some(m) = self.metric(key) else { continue };
            for against in HEADLINE_BASELINES {
                let both = |mode| format!("{} {}", fmt_opt(m.median(mode)), fmt_ci(m.ci(mode)));
                let verdict = match self.within_noise(key, against) {
                    Some(true) => "within noise",
                    Some(false) => "intervals apart",
                    None => "—",
                };
                let _ = writeln!(
                    o,
                    "| {what}: sidestep ÷ {} | {} | {} | {} | {verdict} |",
                    against.label(),
                    fmt_ratio(ratio(m.median(Mode::Sidestep), m.median(against))),
                    both(Mode::Sidestep),
                    both(against),
                );
            }
        }
        let _ = writeln!(o);
    }
}
