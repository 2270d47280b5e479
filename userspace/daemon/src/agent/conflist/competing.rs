//! Another capturing plugin in the chain sidestep joins: an `istio-cni` entry left in the
//! conflist (an Istio install with istio-cni on, or one half taken away) means istio-cni's
//! iptables and sidestep would both capture each new pod. The agent says so once per change of
//! the count (a log line, an Event on the Node, the gauge
//! `sidestep_conflist_competing_entries`), not at every look: the conflist is looked at every
//! few seconds and on each write to its directory.

use std::sync::Mutex;

use serde_json::Value;

/// The plugin types that capture as sidestep does.
pub const COMPETING: [&str; 1] = ["istio-cni"];

/// What changed since the last look, worth a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Entries appeared (from none), or their count changed: a warning.
    Present { before: usize, now: usize },
    /// The last one went.
    Gone { before: usize },
}

/// The decision: what to say when the count goes from `last` (`None`: never looked) to `now`.
/// A first look that finds none says nothing; so does any look that finds what the last did.
pub fn change(last: Option<usize>, now: usize) -> Option<Change> {
    let before = last.unwrap_or(0);
    match (before, now) {
        (b, n) if b == n => None,
        (b, 0) => Some(Change::Gone { before: b }),
        (b, n) => Some(Change::Present { before: b, now: n }),
    }
}

/// The last count seen per competing type.
#[derive(Debug, Default)]
pub struct Seen {
    last: Mutex<[Option<usize>; COMPETING.len()]>,
}

impl Seen {
    /// Records the counts found in `list` (`None`: no conflist to chain into yet, so no entry
    /// either); returns each type's count now, and its change if it changed.
    pub fn observe(&self, list: Option<&Value>) -> Vec<(&'static str, usize, Option<Change>)> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (i, t) in COMPETING.iter().enumerate() {
            let now = list.map_or(0, |l| super::count_entries(l, t));
            out.push((*t, now, change(last[i], now)));
            last[i] = Some(now);
        }
        out
    }
}

/// Looks at the conflist at `path` (`None`: none yet) and says what changed: a warning in the
/// log and an Event on the Node when entries appear or their count changes, an info line when
/// the last goes; the gauge follows every look.
pub fn check(
    seen: &Seen,
    warnings: &crate::agent::report::Warnings,
    events: &crate::agent::podapi::Queue,
    path: Option<&std::path::Path>,
) {
    // A file another CNI is half-way through writing reads as none this time; the next look
    // (within seconds) sees it whole.
    let list = path
        .and_then(|p| super::read_as_list(p).ok())
        .map(|(l, _)| l);
    for (t, now, c) in seen.observe(list.as_ref()) {
        warnings.set_competing(t, now);
        let at = path.unwrap_or(std::path::Path::new("-"));
        match c {
            None => {}
            Some(Change::Present { before, now }) => {
                let text = message(t, at, now);
                tracing::warn!(path = %at.display(), plugin = t, entries = now, before, "{text}");
                events.post(
                    crate::agent::podapi::Subject::Node,
                    crate::agent::podapi::Reason::CompetingCniEntry,
                    text,
                );
            }
            Some(Change::Gone { before }) => {
                tracing::info!(path = %at.display(), plugin = t, before, "the CNI configuration no longer has a {t} entry: sidestep alone captures new pods");
            }
        }
    }
}

/// The warning's text: what it means and what to do.
pub fn message(plugin_type: &str, path: &std::path::Path, count: usize) -> String {
    format!(
        "the CNI configuration {} has {count} {plugin_type} entr{} besides sidestep's: both \
         capture new pods (iptables and eBPF); remove Istio's CNI node agent (istio-cni-node, \
         which takes its entry out as it stops) so that sidestep alone captures",
        path.display(),
        if count == 1 { "y" } else { "ies" }
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn says_something_only_when_the_count_changes() {
        let steps = [0, 0, 1, 1, 1, 2, 2, 0, 0, 1];
        let mut last = None;
        let mut said = Vec::new();
        for now in steps {
            said.push(change(last, now));
            last = Some(now);
        }
        use Change::*;
        assert_eq!(
            said,
            [
                None,
                None,
                Some(Present { before: 0, now: 1 }),
                None,
                None,
                Some(Present { before: 1, now: 2 }),
                None,
                Some(Gone { before: 2 }),
                None,
                Some(Present { before: 0, now: 1 }),
            ]
        );
        // A first look that finds one warns; a first look that finds none is silent.
        assert_eq!(change(None, 1), Some(Present { before: 0, now: 1 }));
        assert_eq!(change(None, 0), None);
    }

    #[test]
    fn counts_istio_cni_entries_of_the_list() {
        let with = json!({"plugins": [{"type": "bridge"}, {"type": "istio-cni"},
                                      {"type": "sidestep"}]});
        let without = json!({"plugins": [{"type": "bridge"}, {"type": "sidestep"}]});
        let seen = Seen::default();
        assert_eq!(seen.observe(Some(&without)), [("istio-cni", 0, None)]);
        assert_eq!(
            seen.observe(Some(&with)),
            [("istio-cni", 1, Some(Change::Present { before: 0, now: 1 }))]
        );
        assert_eq!(
            seen.observe(Some(&with)),
            [("istio-cni", 1, None)],
            "said once, not at every look"
        );
        assert_eq!(
            seen.observe(None),
            [("istio-cni", 0, Some(Change::Gone { before: 1 }))]
        );
        assert_eq!(seen.observe(Some(&without)), [("istio-cni", 0, None)]);
    }
}
