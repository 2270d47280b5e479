//! The commands that run until stopped and print a line per event: `debug --follow`,
//! `follow-addresses` and `ztunnel-serve`. With `-o json` each line is one JSON object, so a
//! script can read them as they come.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use super::Output;
use crate::addrfollow::{self, FollowEvent};
use crate::verdictlog::VerdictReader;
use crate::zds::{Workload, ZdsServer};

/// Prints every verdict of every pod whose log is on, until interrupted.
pub(super) fn follow_verdicts(mut reader: VerdictReader, output: Output) -> anyhow::Result<()> {
    loop {
        for line in reader.next_lines(Duration::from_millis(500)) {
            output.event(
                format_args!("netns {}: {}", line.netns_cookie, line.describe()),
                json!({"netns_cookie": line.netns_cookie, "verdict": line.describe()}),
            )?;
        }
    }
}

/// Hands the workloads to whichever ztunnel connects (each new connection gets them all in its
/// snapshot), and says when one is connected.
pub(super) fn ztunnel_serve(
    socket: &Path,
    workloads: Vec<Workload>,
    output: Output,
) -> anyhow::Result<()> {
    let server = ZdsServer::listen(socket)?;
    for w in workloads {
        // Without a ztunnel yet the workload waits for its snapshot.
        let _ = server.add(w);
    }
    let count = server.workloads().len();
    output.event(
        format_args!("serving {count} workloads on {}", socket.display()),
        json!({"event": "serving", "workloads": count, "socket": socket}),
    )?;
    let mut was = false;
    loop {
        let now = server.connected();
        if now != was {
            let what = if now { "connected" } else { "disconnected" };
            output.event(
                format_args!("ztunnel {what}"),
                json!({"event": format!("ztunnel {what}")}),
            )?;
            was = now;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One line on stdout per change, for scripts and tests to wait on.
pub(super) fn follow_addresses(
    pin_root: &Path,
    netns: Vec<PathBuf>,
    budget: usize,
    output: Output,
) {
    // No record here names a pod's excluded interfaces: only the agent follows those.
    let wanted: BTreeMap<PathBuf, Vec<String>> =
        netns.into_iter().map(|n| (n, Vec::new())).collect();
    addrfollow::follow(
        pin_root,
        Duration::from_secs(1),
        budget,
        || wanted.clone(),
        || true,
        |event| {
            if let Err(e) = print_follow_event(&event, output) {
                tracing::warn!(error = %e, "cannot write to stdout");
            }
        },
    );
}

fn print_follow_event(event: &FollowEvent<'_>, output: Output) -> anyhow::Result<()> {
    match event {
        FollowEvent::Started(f) => output.event(
            format_args!(
                "following {} (netns cookie {})",
                f.path().display(),
                f.cookie()
            ),
            json!({"event": "started", "netns": f.path(), "netns_cookie": f.cookie()}),
        ),
        FollowEvent::Synced(f, s) => {
            if !s.added.is_empty() || !s.removed.is_empty() {
                output.event(
                    format_args!(
                        "{}: added {:?}, removed {:?}, {} left out ({} over the budget)",
                        f.path().display(),
                        s.added,
                        s.removed,
                        s.left_out,
                        s.over_budget
                    ),
                    json!({
                        "event": "addresses", "netns": f.path(), "added": s.added,
                        "removed": s.removed, "left_out": s.left_out,
                        "over_budget": s.over_budget,
                    }),
                )?;
            }
            let source = &s.source;
            if source.changed() {
                let written: Vec<String> = source
                    .routes_written
                    .iter()
                    .map(|r| format!("{}/{} from {}", r.destination, r.prefix_len, r.source))
                    .collect();
                output.event(
                    format_args!(
                        "{}: source gained {:?}, routes written {written:?}, {} removed, {} left out",
                        f.path().display(),
                        source.gained,
                        source.routes_removed,
                        source.routes_left_out
                    ),
                    json!({
                        "event": "source", "netns": f.path(), "gained": source.gained,
                        "routes_written": written, "routes_removed": source.routes_removed,
                        "routes_left_out": source.routes_left_out,
                    }),
                )?;
            }
            for (ip, owner) in &s.held_by_others {
                tracing::warn!(%ip, owner, "address held by another pod; left to it");
            }
            Ok(())
        }
        FollowEvent::Stopped { path, removed } => output.event(
            format_args!("stopped following {} ({removed} removed)", path.display()),
            json!({"event": "stopped", "netns": path, "removed": removed}),
        ),
        FollowEvent::Failed { path, error } => {
            tracing::warn!(netns = %path.display(), "{error}");
            Ok(())
        }
    }
}
