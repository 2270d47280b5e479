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

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use super::{Agent, pods, repair};
use crate::zds::{Workload, ZdsError, ZdsServer};

/// The annotation istio-cni writes on an ambient pod, and its two values.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
const ENABLED: &str = "enabled";
const PENDING: &str = "pending";

/// How often the records are compared with what ztunnel holds (a record appears at ADD).
const SYNC_INTERVAL: Duration = Duration::from_millis(250);

/// What ztunnel was given, by pod UID.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Handed {
    netns: PathBuf,
    /// The pod's annotation as last written.
    annotated: &'static str,
}

pub struct Ambient {
    zds: ZdsServer,
    handed: Mutex<BTreeMap<String, Handed>>,
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
    netns: PathBuf,
}

impl Ambient {
    pub fn listen(socket: &Path) -> Result<Self, ZdsError> {
        Ok(Self {
            zds: ZdsServer::listen(socket)?,
            handed: Mutex::new(BTreeMap::new()),
        })
    }

    /// The /readyz line: whether ztunnel is connected, and how many pods it holds.
    pub fn summary(&self) -> String {
        let handed = self.handed.lock().unwrap_or_else(PoisonError::into_inner);
        let enabled = handed.values().filter(|h| h.annotated == ENABLED).count();
        format!(
            "ambient: ztunnel {} on {}, {enabled} of {} ambient pods handed to it\n",
            if self.zds.connected() {
                "connected"
            } else {
                "NOT connected"
            },
            self.zds.path().display(),
            self.zds.workloads().len(),
        )
    }

    /// One pass: every recorded ambient pod to ztunnel, every pod whose record went away from it.
    fn sync(&self, agent: &Agent) {
        let records = ambient_records(&agent.settings.state_dir);
        let kubeconfig = repair::api_kubeconfig(&agent.settings);
        let mut wanted = BTreeMap::new();
        for r in records {
            // ztunnel names workloads by the pod's UID, which only the API knows.
            let Some(pod) = agent.pod_watch.pod(&r.namespace, &r.name) else {
                tracing::debug!(pod = %format!("{}/{}", r.namespace, r.name), "ambient: pod not in the watch yet");
                continue;
            };
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            let service_account = pod
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".into());
            wanted.insert(
                uid.clone(),
                Workload {
                    uid,
                    name: r.name,
                    namespace: r.namespace,
                    service_account,
                    netns: Some(r.netns),
                },
            );
        }
        let known: Vec<(String, Handed)> = self
            .handed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (uid, _) in known.iter().filter(|(uid, _)| !wanted.contains_key(uid)) {
            match self.zds.del(uid) {
                Ok(_) => tracing::info!(uid = %uid, "ambient: ztunnel released the pod"),
                Err(e) => tracing::warn!(uid = %uid, error = %e, "ambient: Del"),
            }
            self.handed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(uid);
        }
        for (uid, w) in wanted {
            let before = known
                .iter()
                .find(|(k, _)| *k == uid)
                .map(|(_, h)| h.clone());
            if before
                .as_ref()
                .is_some_and(|h| h.annotated == ENABLED && Some(&h.netns) == w.netns.as_ref())
            {
                continue;
            }
            let who = format!("{}/{}", w.namespace, w.name);
            let netns = w.netns.clone().unwrap_or_default();
            let outcome = self.zds.add(w.clone());
            let state = match &outcome {
                Ok(()) => {
                    tracing::info!(pod = %who, netns = %netns.display(), "ambient: ztunnel took the pod");
                    ENABLED
                }
                Err(e) => {
                    if before.is_none() {
                        tracing::warn!(pod = %who, error = %e, "ambient: ztunnel has not taken the pod; retrying");
                    }
                    PENDING
                }
            };
            if before.as_ref().map(|h| h.annotated) != Some(state)
                && let Some(kc) = &kubeconfig
            {
                let pod = repair::NodePod {
                    namespace: w.namespace.clone(),
                    name: w.name.clone(),
                    uid: uid.clone(),
                };
                if let Err(e) =
                    super::podapi::annotate_status(kc, &pod, REDIRECTION_ANNOTATION, state)
                {
                    tracing::warn!(pod = %who, error = %e, "ambient: annotating the pod");
                }
            }
            self.handed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    uid,
                    Handed {
                        netns,
                        annotated: state,
                    },
                );
        }
    }
}

/// The plugin's records of ambient pods (finished ADDs with a Kubernetes identity).
fn ambient_records(state_dir: &Path) -> Vec<Recorded> {
    let mut out: Vec<Recorded> = Vec::new();
    for (path, record) in pods::records(state_dir) {
        let ambient = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|v| {
                v["policy"]["ambient"].as_bool() == Some(true) && v["pending"] != true
            });
        let (Some(namespace), Some(name)) = (record.pod_namespace, record.pod_name) else {
            continue;
        };
        // One pod, several attachments: one workload.
        if ambient
            && !out
                .iter()
                .any(|r| r.namespace == namespace && r.name == name)
        {
            out.push(Recorded {
                namespace,
                name,
                netns: record.netns,
            });
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
