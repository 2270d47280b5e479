//! Istio ambient mode in the agent: the node agent's half of istio-cni's ambient work.
//!
//! The plugin's ADD decides and enrols: a pod the ambient selectors pick gets istio-cni's in-pod
//! rules (`Policy::istio_ambient`), before any of its containers run, so its traffic never leaves
//! uncaptured. What the agent adds is ztunnel's side: it serves ZDS ([`crate::zds`]) and hands
//! ztunnel each ambient pod's netns, from the plugin's records, so that ztunnel opens its
//! listeners inside it; it takes them back when the record goes (DEL). Until ztunnel has a pod,
//! the pod's connections go to ports nobody listens on: refused, never around the mesh (Istio
//! instead fails the ADD until ztunnel answers, and the kubelet retries the sandbox).
//!
//! After ztunnel's Ack the pod is annotated `ambient.istio.io/redirection: enabled`, through
//! the pods/status subresource as istio-cni does (`pending` while ztunnel has not taken it).
//!
//! A running pod whose labels, or its namespace's, stop selecting it leaves the mesh as
//! istio-cni's node agent takes it out: its capture and records go, ztunnel releases it, and
//! the annotation is removed; the API must confirm what the watches say first.
//!
//! ZDS is served only once the pod watch has listed the node's pods and one pass has put every
//! recorded ambient pod in the server: ztunnel drains whatever its first snapshot lacks, so after
//! an agent restart an empty snapshot would cut every ambient pod off.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

mod leave;

use super::{Agent, podapi, pods, repair};
use sidestep::netns::Netns;

use crate::zds::{Workload, ZdsError, ZdsServer};

/// The annotation istio-cni writes on an ambient pod, and its two values.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
const ENABLED: &str = "enabled";
const PENDING: &str = "pending";

/// How often the records are compared with what ztunnel holds (a record appears at ADD).
const SYNC_INTERVAL: Duration = Duration::from_millis(250);
/// How soon a pod ztunnel has not taken is tried again.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What ztunnel was given, by pod UID.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Handed {
    netns: PathBuf,
    /// `ENABLED` once ztunnel acknowledged this netns, else `PENDING`.
    state: &'static str,
    /// The pod's annotation as last written successfully.
    annotated: Option<&'static str>,
    /// A pending pod is tried again from then on.
    next_try: Instant,
}

pub struct Ambient {
    zds: ZdsServer,
    handed: Mutex<BTreeMap<String, Handed>>,
    /// Pods the watches say left the mesh, not taken out yet: when to ask the API again.
    rechecks: Mutex<BTreeMap<String, Instant>>,
    /// Pods taken out whose redirection annotation is still to remove.
    unannotated: Mutex<BTreeMap<String, podapi::NodePod>>,
}

impl std::fmt::Debug for Ambient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ambient")
            .field("socket", &self.zds.path())
            .finish_non_exhaustive()
    }
}

/// An ambient pod as the plugin recorded it.
struct Recorded {
    namespace: String,
    name: String,
    /// The netns as the agent sees it.
    netns: PathBuf,
    netns_cookie: u64,
    created_unix: u64,
    /// An ADD is under way (or died) for this attachment.
    pending: bool,
}

impl Ambient {
    /// Listens, but serves ztunnel only once the first pass knows the node's ambient pods (see
    /// [`ZdsServer::listen_closed`]): after an agent restart, ztunnel's first snapshot must
    /// carry every pod it serves, or it drains them.
    pub fn listen(socket: &Path) -> Result<Self, ZdsError> {
        Ok(Self {
            zds: ZdsServer::listen_closed(socket)?,
            handed: Mutex::new(BTreeMap::new()),
            rechecks: Mutex::new(BTreeMap::new()),
            unannotated: Mutex::new(BTreeMap::new()),
        })
    }

    fn handed(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Handed>> {
        self.handed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The /readyz line: whether ztunnel is connected, and how many pods it holds.
    pub fn summary(&self) -> String {
        let enabled = self
            .handed()
            .values()
            .filter(|h| h.state == ENABLED)
            .count();
        let link = if !self.zds.is_open() {
            "held back (the pod watch has not listed this node's pods yet)"
        } else if self.zds.connected() {
            "connected"
        } else {
            "NOT connected"
        };
        format!(
            "ambient: ztunnel {link} on {}, {enabled} of {} ambient pods handed to it\n",
            self.zds.path().display(),
            self.zds.workloads().len(),
        )
    }

    /// One pass: every recorded ambient pod to ztunnel, every pod whose record went away from it.
    fn sync(&self, agent: &Agent) {
        // Read first: a pass that started before the watch listed the pods cannot open ZDS.
        let synced = agent.pod_watch.synced();
        let records = ambient_records(&agent.settings.state_dir, &agent.settings.proc_dir);
        let api = repair::api_access(&agent.settings);
        let mut wanted: BTreeMap<String, (Workload, u64)> = BTreeMap::new();
        // Pods with an ADD under way: ztunnel may hold them, and they are coming back.
        let mut held = BTreeSet::new();
        // Pods whose labels (or their namespace's) no longer select them, taken out this pass.
        let mut taken_out: BTreeSet<String> = BTreeSet::new();
        // At most one API read per pass for them: an API outage must not hold up ztunnel's Adds.
        let mut confirms = 1;
        let mut seen = BTreeSet::new();
        for r in records {
            // ztunnel names workloads by the pod's UID, which only the API knows.
            let Some(pod) = agent.pod_watch.pod(&r.namespace, &r.name) else {
                continue;
            };
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            seen.insert(uid.clone());
            if r.pending {
                held.insert(uid);
                continue;
            }
            let check = leave::Check {
                recorded: &r,
                pod: &pod,
                uid: &uid,
                api: api.as_ref(),
            };
            if self.take_out_if_unselected(agent, &check, &mut confirms) {
                taken_out.insert(uid);
                continue;
            }
            let service_account = pod
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".into());
            let w = Workload {
                uid: uid.clone(),
                name: r.name,
                namespace: r.namespace,
                service_account,
                netns: Some(r.netns),
            };
            wanted.insert(uid, (w, r.netns_cookie));
        }
        let known: BTreeMap<String, Handed> = self.handed().clone();
        // Dels first: they must not wait behind Adds that wait for ztunnel.
        for uid in known.keys() {
            if wanted.contains_key(uid) || held.contains(uid) {
                continue;
            }
            match self.zds.del(uid) {
                Ok(_) => tracing::info!(uid = %uid, "ambient: ztunnel released the pod"),
                Err(e) => tracing::warn!(uid = %uid, error = %e, "ambient: Del"),
            }
            self.handed().remove(uid);
        }
        for uid in &taken_out {
            self.handed().remove(uid);
        }
        self.forget_rechecks_except(&seen);
        if let Some(api) = &api {
            self.remove_annotations(api);
        }
        let now = Instant::now();
        for (uid, (w, cookie)) in wanted {
            let before = known.get(&uid).cloned();
            let netns = w.netns.clone().unwrap_or_default();
            if before
                .as_ref()
                .is_some_and(|h| (h.state == ENABLED && h.netns == netns) || h.next_try > now)
            {
                continue;
            }
            let who = format!("{}/{}", w.namespace, w.name);
            // The path must still name the recorded netns (a path is reused after a DEL).
            if let Err(why) = same_netns(&netns, cookie) {
                tracing::warn!(pod = %who, netns = %netns.display(), reason = %why, "ambient: not handing the pod to ztunnel");
                continue;
            }
            let outcome = self.zds.add(w.clone());
            let state = match &outcome {
                Ok(()) => {
                    tracing::info!(pod = %who, netns = %netns.display(), "ambient: ztunnel took the pod");
                    ENABLED
                }
                Err(e) => {
                    if before.is_none() {
                        tracing::warn!(pod = %who, error = %e, "ambient: ztunnel has not taken the pod; retrying every second");
                    }
                    PENDING
                }
            };
            let mut annotated = before.as_ref().and_then(|h| h.annotated);
            if annotated != Some(state)
                && let Some(api) = &api
            {
                let pod = podapi::NodePod {
                    namespace: w.namespace.clone(),
                    name: w.name.clone(),
                    uid: uid.clone(),
                };
                match super::podapi::annotate_status(api, &pod, REDIRECTION_ANNOTATION, state) {
                    Ok(()) => annotated = Some(state),
                    Err(e) => tracing::warn!(pod = %who, error = %e, "ambient: annotating the pod"),
                }
            }
            self.handed().insert(
                uid,
                Handed {
                    netns,
                    state,
                    annotated,
                    next_try: now + RETRY_INTERVAL,
                },
            );
        }
        if synced && !self.zds.is_open() {
            tracing::info!(
                pods = self.zds.workloads().len(),
                "ambient: serving ZDS now that this node's ambient pods are known"
            );
            self.zds.open();
        }
    }
}

/// Whether `path` is the netns with `cookie` now.
fn same_netns(path: &Path, cookie: u64) -> Result<(), String> {
    let netns = Netns::open(path).map_err(|e| e.to_string())?;
    match netns.cookie() {
        Ok(c) if c == cookie => Ok(()),
        Ok(c) => Err(format!(
            "it is netns cookie {c} now, not the recorded {cookie}"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The plugin's records of ambient pods with a Kubernetes identity: per pod, its newest finished
/// record (a pod replaced under the same name can still have its old sandbox's record until that
/// DEL), and any pending ones.
fn ambient_records(state_dir: &Path, proc_dir: &Path) -> Vec<Recorded> {
    let mut out: Vec<Recorded> = Vec::new();
    for record in pods::records(state_dir).into_values() {
        if !record.policy.ambient {
            continue;
        }
        let (Some(namespace), Some(name)) = (record.pod_namespace, record.pod_name) else {
            continue;
        };
        let r = Recorded {
            namespace,
            name,
            netns: pods::agent_view(&record.netns, proc_dir),
            netns_cookie: record.netns_cookie,
            created_unix: record.created_unix,
            pending: record.pending,
        };
        // One pod, several attachments (or an old sandbox): one workload, the newest.
        let same = |o: &Recorded| o.namespace == r.namespace && o.name == r.name && !o.pending;
        match out.iter().position(same) {
            Some(i) if !r.pending => {
                if r.created_unix > out[i].created_unix {
                    out[i] = r;
                }
            }
            _ => out.push(r),
        }
    }
    out
}

/// Keeps ztunnel in step with the records for as long as the agent runs (a thread: ZDS calls
/// block until ztunnel answers).
pub fn spawn(agent: Arc<Agent>) -> std::io::Result<()> {
    if agent.ambient.is_none() {
        return Ok(());
    }
    std::thread::Builder::new()
        .name("ambient".into())
        .spawn(move || {
            let Some(ambient) = &agent.ambient else {
                return;
            };
            loop {
                ambient.sync(&agent);
                std::thread::sleep(SYNC_INTERVAL);
            }
        })
        .map(drop)
}
