//! The agent's address follower: every pod the plugin enrolled (a state record with this pin
//! root) has its netns's later addresses kept in `SIDESTEP_ADDRS`, and the source of its captured
//! connections in `SIDESTEP_SRC`/`SIDESTEP_SRCR` ([`crate::addrfollow`]), from within a second of
//! its ADD until its DEL removes the record.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use super::{Agent, pods};
use crate::addrfollow::{self, FollowEvent};

/// How often the set of followed pods is read again from the records.
const REFRESH: Duration = Duration::from_secs(1);

/// Runs on a thread of its own for the agent's life.
pub fn spawn(agent: Arc<Agent>) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("addrwatch".into())
        .spawn(move || run(&agent))
}

fn run(agent: &Agent) {
    let s = &agent.settings;
    // Record file name -> the netns path as the agent sees it and the interfaces the recorded
    // policy excludes; records are read once each.
    let mut known: BTreeMap<String, Option<(PathBuf, Vec<String>)>> = BTreeMap::new();
    let wanted = || {
        let names: BTreeSet<String> = pods::record_names(&s.state_dir).into_iter().collect();
        known.retain(|n, _| names.contains(n));
        for name in names {
            known
                .entry(name)
                .or_insert_with_key(|name| netns_of(agent, &s.state_dir.join(name)));
        }
        // A pod with several attachments has a record each: their exclusions together.
        let mut wanted: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
        for (netns, excluded) in known.values().flatten() {
            let all = wanted.entry(netns.clone()).or_default();
            all.extend(excluded.iter().cloned());
            all.sort();
            all.dedup();
        }
        wanted
    };
    let counters = &agent.counters;
    addrfollow::follow(
        &s.pin_root,
        REFRESH,
        s.late_address_budget,
        wanted,
        || true,
        |event| match event {
            FollowEvent::Started(f) => {
                tracing::debug!(netns = %f.path().display(), netns_cookie = f.cookie(), "following the pod's addresses");
            }
            FollowEvent::Synced(f, synced) => {
                counters.address_syncs.fetch_add(1, Ordering::Relaxed);
                if !synced.added.is_empty() || !synced.removed.is_empty() {
                    tracing::info!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        added = ?synced.added,
                        removed = ?synced.removed,
                        "the pod's addresses changed after its enrolment"
                    );
                }
                let source = &synced.source;
                if source.changed() {
                    tracing::info!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        gained = ?source.gained,
                        routes_written = ?source.routes_written,
                        routes_removed = source.routes_removed,
                        "the source of the pod's captured connections follows its netns"
                    );
                }
                let exclusion = &synced.exclusion;
                if exclusion.changed() {
                    tracing::info!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        interfaces_added = ?exclusion.interfaces_added,
                        interfaces_removed = exclusion.interfaces_removed,
                        routes_written = exclusion.routes_written,
                        routes_removed = exclusion.routes_removed,
                        "the pod's excluded interfaces follow its netns"
                    );
                    counters.late_exclusions.fetch_add(
                        (exclusion.interfaces_added.len()
                            + exclusion.interfaces_removed
                            + exclusion.routes_written
                            + exclusion.routes_removed) as u64,
                        Ordering::Relaxed,
                    );
                }
                if synced.over_budget > 0 && synced.left_out_changed {
                    tracing::warn!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        left_out = synced.over_budget,
                        budget = s.late_address_budget,
                        "the node's budget for addresses pods gained after enrolment is spent (late-address-budget); connections to this pod's other addresses are captured as outbound"
                    );
                }
                if synced.left_out > synced.over_budget && synced.left_out_changed {
                    tracing::warn!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        left_out = synced.left_out - synced.over_budget,
                        max = sidestep::enroll::MAX_POD_ADDRESSES,
                        "the pod has more addresses than are registered for one pod; connections to the rest are captured as outbound"
                    );
                }
                if let Some(routes) = exclusion.routes_over_cap
                    && synced.left_out_changed
                {
                    tracing::warn!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        routes,
                        max = sidestep::enroll::MAX_EXCLUSION_ROUTES,
                        "the pod has more routes than are written for its excluded interfaces; none is written, so its connections are captured whatever interface their route takes (sockets bound to an excluded device excepted)"
                    );
                }
                if source.routes_left_out > 0 && synced.left_out_changed {
                    tracing::warn!(
                        netns = %f.path().display(),
                        netns_cookie = f.cookie(),
                        left_out = source.routes_left_out,
                        max = sidestep::enroll::source::MAX_FOLLOWED_ROUTES,
                        "the pod has more routes through its other interfaces than are followed; connections to the rest leave from its primary address"
                    );
                }
                counters.late_source_routes.fetch_add(
                    (source.routes_written.len() + source.routes_removed) as u64,
                    Ordering::Relaxed,
                );
                counters
                    .late_addresses_added
                    .fetch_add(synced.added.len() as u64, Ordering::Relaxed);
                counters
                    .late_addresses_removed
                    .fetch_add(synced.removed.len() as u64, Ordering::Relaxed);
                for (ip, owner) in &synced.held_by_others {
                    tracing::warn!(
                        netns = %f.path().display(),
                        %ip,
                        owner_netns_cookie = owner,
                        "an address of this pod is registered to another live pod; it stays with that pod"
                    );
                }
            }
            FollowEvent::Stopped { path, removed } => {
                counters
                    .late_addresses_removed
                    .fetch_add(removed as u64, Ordering::Relaxed);
                tracing::debug!(netns = %path.display(), removed, "stopped following the pod's addresses");
            }
            FollowEvent::Failed { path, error } => {
                tracing::warn!(netns = %path.display(), error = %error, "following the pod's addresses");
            }
        },
    );
}

/// The netns of a record of this agent's pin root, as the agent sees the path, and the
/// interfaces its policy excludes.
fn netns_of(agent: &Agent, record: &std::path::Path) -> Option<(PathBuf, Vec<String>)> {
    let s = &agent.settings;
    let r: pods::Record = serde_json::from_slice(&std::fs::read(record).ok()?).ok()?;
    if r.pin_root.as_deref().is_some_and(|p| p != s.pin_root) {
        return None;
    }
    Some((
        pods::agent_view(&r.netns, &s.proc_dir),
        r.policy.exclude_interfaces,
    ))
}
