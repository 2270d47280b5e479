//! The metric names and selector labels a PromQL expression uses, and the series an exposition
//! has: enough of both to tell whether a rule or a dashboard query names what the agent exports.
//! A scan, not a parser: the expressions it reads are our own rules' and dashboard's.

use std::collections::{BTreeMap, BTreeSet};

/// Labels a series gets from its scrape target, not from the agent: the ServiceMonitor's
/// relabeling adds `node`; Prometheus adds `job` and `instance`; the target's `namespace` and
/// `pod` are the agent's own.
pub const TARGET_LABELS: [&str; 5] = ["node", "job", "instance", "namespace", "pod"];

/// Series Prometheus makes itself, which the rules may name.
pub const PROMETHEUS_SERIES: [&str; 1] = ["up"];

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The metric names an expression selects, each with the label names its `{...}` matches on.
/// Names are the `sidestep_*` identifiers and Prometheus' own series; label names inside a
/// selector are not metric names, and neither are the `by (...)` lists, which hold no
/// `sidestep_` identifier.
pub fn selectors(expr: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !is_name_char(chars[i]) || (i > 0 && is_name_char(chars[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && is_name_char(chars[i]) {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let named = word.starts_with("sidestep_") || PROMETHEUS_SERIES.contains(&word.as_str());
        // A word followed by `(` is a function, and one after `$`, a variable.
        let next = chars[i..].iter().find(|c| !c.is_whitespace());
        if !named || next == Some(&'(') || (start > 0 && chars[start - 1] == '$') {
            continue;
        }
        let mut labels = Vec::new();
        if chars.get(i) == Some(&'{') {
            let end = chars[i..]
                .iter()
                .position(|c| *c == '}')
                .map_or(chars.len(), |p| i + p);
            let inside: String = chars[i + 1..end].iter().collect();
            // Matchers: name, an operator, a quoted value without commas in our queries.
            for m in inside.split(',') {
                let name: String = m.trim().chars().take_while(|c| is_name_char(*c)).collect();
                if !name.is_empty() {
                    labels.push(name);
                }
            }
            i = end;
        }
        out.push((word, labels));
    }
    out
}

/// Every series name of an exposition with the label names any of its samples carries.
pub fn exported(body: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for l in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let end = l.find(['{', ' ']).unwrap_or(l.len());
        let labels = out.entry(l[..end].to_owned()).or_default();
        if l[end..].starts_with('{') {
            let inside = &l[end + 1..l.rfind('}').unwrap_or(l.len())];
            // Label values here are pod names, numbers and commands: no `,` or `="` inside.
            for pair in inside.split("\",") {
                if let Some((k, _)) = pair.split_once("=\"") {
                    labels.insert(k.trim_start_matches(',').to_owned());
                }
            }
        }
    }
    out
}

/// Every name and selector label of `queries` against an exposition: the problems found.
pub fn unexported(
    queries: &[(String, String)],
    have: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut bad = Vec::new();
    for (place, expr) in queries {
        let found = selectors(expr);
        if found.is_empty() {
            bad.push(format!("{place} names no sidestep metric: {expr}"));
        }
        for (name, labels) in found {
            if PROMETHEUS_SERIES.contains(&name.as_str()) {
                continue;
            }
            let Some(has) = have.get(&name) else {
                bad.push(format!("{place}: {name} is not exported"));
                continue;
            };
            for l in labels {
                if !has.contains(&l) && !TARGET_LABELS.contains(&l.as_str()) {
                    bad.push(format!("{place}: {name} has no label {l} (it has {has:?})"));
                }
            }
        }
    }
    bad
}

#[test]
fn the_selector_scan_finds_names_and_labels() {
    let s = selectors(
        r#"sum by (node, code) (rate(sidestep_cni_operations_total{result="error", node=~"$node"}[5m])) / on (node) sidestep_pod_capacity > 0 and up{job="x"} == 0"#,
    );
    assert_eq!(
        s,
        [
            (
                "sidestep_cni_operations_total".to_owned(),
                vec!["result".to_owned(), "node".to_owned()]
            ),
            ("sidestep_pod_capacity".to_owned(), vec![]),
            ("up".to_owned(), vec!["job".to_owned()]),
        ]
    );
    let have = exported(
        "# TYPE sidestep_reconciles counter\nsidestep_reconciles_total 3\n\
         sidestep_cni_operations_total{command=\"ADD\",result=\"error\",code=\"8\"} 1\n",
    );
    assert_eq!(
        have["sidestep_cni_operations_total"],
        ["code", "command", "result"].map(str::to_owned).into()
    );
    // A counter's family name is not a series, nor is a label that is not there.
    let q = |e: &str| vec![("q".to_owned(), e.to_owned())];
    assert!(unexported(&q("rate(sidestep_reconciles_total[5m])"), &have).is_empty());
    assert_eq!(
        unexported(&q("rate(sidestep_reconciles[5m])"), &have).len(),
        1
    );
    assert_eq!(
        unexported(&q(r#"sidestep_cni_operations_total{reason="x"}"#), &have).len(),
        1
    );
}
