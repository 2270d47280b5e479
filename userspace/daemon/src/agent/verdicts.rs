//! Forwards the verdict log of pods with `sidestep.io/debug` to the agent's own log, naming each
//! pod from the plugin's state records ([`crate::verdictlog`]).

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{Agent, pods};
use crate::verdictlog::{VerdictLine, VerdictReader};

/// How long a poll waits for lines, and how often a missing reader is tried again.
const POLL: Duration = Duration::from_millis(500);
const REOPEN: Duration = Duration::from_secs(2);
/// How often, at most, the records are read again for a cookie they did not name.
const NAMES_REFRESH: Duration = Duration::from_secs(1);

/// Runs on a thread of its own for the agent's life.
pub fn spawn(agent: Arc<Agent>) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("verdicts".into())
        .spawn(move || run(&agent))
}

fn run(agent: &Agent) {
    let mut names = PodNames::default();
    let mut reader: Option<VerdictReader> = None;
    let mut reported = false;
    loop {
        let current = reader.as_ref().is_some_and(VerdictReader::is_current);
        if !current {
            match VerdictReader::open(&agent.settings.pin_root) {
                Ok(r) => {
                    tracing::debug!("reading the verdict log of pods with sidestep.io/debug");
                    reader = Some(r);
                    reported = false;
                }
                Err(e) => {
                    // Before the first load, or programs of a version without the log.
                    if !reported {
                        tracing::debug!(error = %e, "no verdict log to read yet");
                        reported = true;
                    }
                    reader = None;
                    std::thread::sleep(REOPEN);
                    continue;
                }
            }
        }
        let Some(r) = reader.as_mut() else { continue };
        for line in r.next_lines(POLL) {
            forward(&line, names.of(agent, line.netns_cookie));
        }
    }
}

fn forward(line: &VerdictLine, pod: Option<&str>) {
    tracing::info!(
        target: "sidestep::verdict",
        pod = %pod.unwrap_or("-"),
        netns_cookie = line.netns_cookie,
        rule = line.rule,
        "{}",
        line.describe()
    );
}

/// Netns cookie -> `namespace/name`, from the records; read again when a cookie is unknown.
#[derive(Default)]
struct PodNames {
    by_cookie: BTreeMap<u64, String>,
    read_at: Option<Instant>,
}

impl PodNames {
    fn of(&mut self, agent: &Agent, cookie: u64) -> Option<&str> {
        let stale = self.read_at.is_none_or(|t| t.elapsed() >= NAMES_REFRESH);
        if !self.by_cookie.contains_key(&cookie) && stale {
            self.by_cookie = pods::records(&agent.settings.state_dir)
                .into_values()
                .filter_map(|r| {
                    let name = r.pod_name?;
                    let namespace = r.pod_namespace.unwrap_or_default();
                    Some((r.netns_cookie, format!("{namespace}/{name}")))
                })
                .collect();
            self.read_at = Some(Instant::now());
        }
        self.by_cookie.get(&cookie).map(String::as_str)
    }
}
