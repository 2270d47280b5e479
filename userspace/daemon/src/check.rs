//! `sidestep check`: whether this node can run sidestep (`--pre`, before an install), and whether
//! it does (the default, node health). Each item is a pure function of what it reads, says ✔ or
//! ✖ (`!` for what only some pods need or what cannot be told) with a one-line hint, and links to
//! its section in the docs; the command's exit code is 0 only when no item failed. It runs on a
//! node with the agent's settings, or in the agent's pod (`kubectl exec ds/sidestep-agent --
//! sidestep check`).
//!
//! The items: [`items`] (kernel, BTF, cgroup2, bpffs, CNI directories, conflist, programs, the
//! build that loaded them, map fill), [`runtime`] (the CNI directories as the container runtime
//! is configured to use them), [`access`] (the API and the RBAC the settings need) and
//! [`agent_pods`] (pods the agent found uncaptured, by name).

pub mod access;
pub mod agent_pods;
pub mod items;
pub mod runtime;

use serde::Serialize;

use crate::agent::settings::Settings;

pub use items::{FULL_AT_PERCENT, bpffs, conflist, fill};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    /// Only some pods need it (sk_msg), or it cannot be told from here (no runtime in sight, the
    /// agent not answering): said, but not a failure.
    Warn,
}

#[derive(Debug, Clone, Serialize)]
pub struct Item {
    pub id: &'static str,
    pub verdict: Verdict,
    pub line: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Where the docs explain it: `docs/FILE.md#anchor`.
    pub doc: &'static str,
}

/// What an item found: a line that passes, or (line, hint) that fails.
pub type Found = Result<String, (String, String)>;

impl Item {
    fn new(id: &'static str, doc: &'static str, result: Found) -> Self {
        match result {
            Ok(line) => Self {
                id,
                verdict: Verdict::Pass,
                line,
                hint: None,
                doc,
            },
            Err((line, hint)) => Self {
                id,
                verdict: Verdict::Fail,
                line,
                hint: (!hint.is_empty()).then_some(hint),
                doc,
            },
        }
    }

    fn warn(id: &'static str, doc: &'static str, line: String, hint: impl Into<String>) -> Self {
        Self {
            id,
            verdict: Verdict::Warn,
            line,
            hint: Some(hint.into()),
            doc,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Before an install: what the node must offer.
    Pre,
    /// On a node that runs sidestep: also the installed parts.
    Node,
}

const DOC_KERNEL: &str = "docs/ARCHITECTURE.md#kernels-61-and-later-features-probed-at-load";
const DOC_CGROUP: &str = "docs/ARCHITECTURE.md#where-cgroup-programs-attach";
const DOC_BPFFS: &str = "docs/REFERENCE.md#checking-a-node-sidestep-check";
const DOC_CNI: &str = "docs/REFERENCE.md#the-plugins-configuration-sidestep-cni";
const DOC_PROGRAMS: &str = "docs/REFERENCE.md#healthz-and-readyz";
const DOC_MAPS: &str = "docs/ARCHITECTURE.md#maps";
/// A runtime reading other CNI directories never calls the plugin: its pods go uncaptured.
const DOC_RUNTIME: &str = "docs/TROUBLESHOOTING.md#2-traffic-not-captured";
/// The RBAC of each repair mode is explained with repair.
const DOC_ACCESS: &str = "docs/REFERENCE.md#reconcile-and-repair";
/// The build marker is part of the pin layout.
const DOC_BUILD: &str = "docs/ARCHITECTURE.md#pin-layout";
const DOC_PODS: &str = "docs/TROUBLESHOOTING.md#2-traffic-not-captured";
/// Every doc link an item can carry (tested to resolve).
pub const DOCS: [&str; 10] = [
    DOC_KERNEL,
    DOC_CGROUP,
    DOC_BPFFS,
    DOC_CNI,
    DOC_PROGRAMS,
    DOC_MAPS,
    DOC_RUNTIME,
    DOC_ACCESS,
    DOC_BUILD,
    DOC_PODS,
];

pub fn run(s: &Settings, mode: Mode) -> Vec<Item> {
    let mut items = vec![
        items::kernel(),
        items::btf(),
        items::cgroup2(s),
        bpffs(&s.pin_root),
        items::cni_dirs(s),
        runtime::item(s),
        items::conflist_item(s, mode),
    ];
    if mode == Mode::Node {
        items.push(items::programs(&s.pin_root));
        items.push(items::build(s));
        items.push(items::pod_map(&s.pin_root));
        items.push(access::item(s));
        items.push(agent_pods::item(s));
    }
    items
}

/// Whether every item passed (warnings pass).
pub fn passed(items: &[Item]) -> bool {
    items.iter().all(|i| i.verdict != Verdict::Fail)
}

pub fn render(items: &[Item]) -> String {
    let mut out = String::new();
    for i in items {
        let mark = match i.verdict {
            Verdict::Pass => "✔",
            Verdict::Fail => "✖",
            Verdict::Warn => "!",
        };
        out.push_str(&format!("{mark} {:<9} {}\n", i.id, i.line));
        if let Some(h) = &i.hint {
            out.push_str(&format!("  {:<9} {h} ({})\n", "", i.doc));
        }
    }
    let failed = items.iter().filter(|i| i.verdict == Verdict::Fail).count();
    out.push_str(&if failed == 0 {
        "all checks passed\n".to_owned()
    } else {
        format!("{failed} of {} checks failed\n", items.len())
    });
    out
}

#[cfg(test)]
mod tests;
