//! A running pod leaving the mesh, as istio-cni's node agent takes it out: when Istio's
//! selectors stop picking it (its label, or its namespace's, removed or set to `none`), its
//! capture and records go as its DEL would take them, ztunnel releases it (the caller's Del, once
//! the record is gone) and its `ambient.istio.io/redirection` annotation is removed.
//!
//! Only the API decides: the watches raise the question, and the pod and its namespace, read
//! then, must agree (a watch may lag behind what the plugin read at the pod's ADD). Anything
//! unknown (no namespace in the store, no answer, an ADD under way, a reconcile re-enrolling
//! from records) keeps the pod captured, and it is asked about again later.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Pod;

use super::{Ambient, REDIRECTION_ANNOTATION, Recorded, same_netns};
use crate::agent::{Agent, apiclient::ApiAccess, podapi::NodePod, pods, reconcile};

/// How soon a pod the watches say left the mesh is checked against the API again, after the API
/// disagreed (a watch lagging behind) or did not answer.
const RECHECK_INTERVAL: Duration = Duration::from_secs(5);

/// One recorded ambient pod, as the pod watch holds it.
pub(super) struct Check<'a> {
    pub recorded: &'a Recorded,
    pub pod: &'a Pod,
    pub uid: &'a str,
    pub api: Option<&'a ApiAccess>,
}

impl Ambient {
    fn rechecks(&self) -> MutexGuard<'_, BTreeMap<String, Instant>> {
        self.rechecks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn unannotated(&self) -> MutexGuard<'_, BTreeMap<String, NodePod>> {
        self.unannotated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the pod out when the selectors no longer pick it; `confirms` is how many API reads
    /// this pass may still make. Returns whether it was taken out.
    pub(super) fn take_out_if_unselected(
        &self,
        agent: &Agent,
        c: &Check<'_>,
        confirms: &mut usize,
    ) -> bool {
        let r = c.recorded;
        let Some(namespace_labels) = agent.pod_watch.namespace_labels(&r.namespace) else {
            return false;
        };
        if selected(c.pod, &namespace_labels) {
            self.rechecks().remove(c.uid);
            return false;
        }
        let now = Instant::now();
        if *confirms == 0 || self.rechecks().get(c.uid).is_some_and(|at| *at > now) {
            return false;
        }
        let Some(api) = c.api else {
            return false;
        };
        *confirms -= 1;
        self.rechecks()
            .insert(c.uid.to_owned(), now + RECHECK_INTERVAL);
        let who = format!("{}/{}", r.namespace, r.name);
        match crate::agent::podapi::pod_and_namespace(api, &r.namespace, &r.name) {
            Ok((fresh, ns)) => {
                let labels = ns.metadata.labels.unwrap_or_default();
                if fresh.metadata.uid.as_deref() != Some(c.uid) || selected(&fresh, &labels) {
                    return false;
                }
            }
            Err(e) => {
                tracing::warn!(pod = %who, error = %e, "ambient: the watches say the pod left the mesh; keeping it in until the API confirms");
                return false;
            }
        }
        match take_out(agent, r) {
            Ok(records) => {
                self.rechecks().remove(c.uid);
                self.unannotated().insert(
                    c.uid.to_owned(),
                    NodePod {
                        namespace: r.namespace.clone(),
                        name: r.name.clone(),
                        uid: c.uid.to_owned(),
                    },
                );
                tracing::info!(
                    pod = %who,
                    netns_cookie = r.netns_cookie,
                    records,
                    "ambient: the pod left the mesh (its labels, or its namespace's, no longer select it); its capture is removed and ztunnel releases it"
                );
                true
            }
            Err(why) => {
                tracing::warn!(pod = %who, reason = %why, "ambient: the pod left the mesh, but stays captured for now");
                false
            }
        }
    }

    /// Drops the recheck times of pods no longer recorded (deleted, or taken out).
    pub(super) fn forget_rechecks_except(&self, seen: &BTreeSet<String>) {
        self.rechecks().retain(|uid, _| seen.contains(uid));
    }

    /// Removes the redirection annotation of every pod taken out, until the API has it done (or
    /// the pod is gone, or is another pod now).
    pub(super) fn remove_annotations(&self, api: &ApiAccess) {
        let pending: Vec<(String, NodePod)> = self
            .unannotated()
            .iter()
            .map(|(u, p)| (u.clone(), p.clone()))
            .collect();
        for (uid, pod) in pending {
            match crate::agent::podapi::remove_annotation_status(api, &pod, REDIRECTION_ANNOTATION)
            {
                Ok(()) => {
                    self.unannotated().remove(&uid);
                }
                Err(e) => {
                    tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e, "ambient: removing the pod's redirection annotation; retrying");
                }
            }
        }
    }
}

/// Unenrols the recorded netns and removes its records, as a DEL of its last attachment would.
/// Returns how many records went, or why nothing was done.
fn take_out(agent: &Agent, r: &Recorded) -> Result<usize, String> {
    let s = &agent.settings;
    let records: Vec<_> = pods::records(&s.state_dir)
        .into_iter()
        .filter(|(_, record)| {
            record.netns_cookie == r.netns_cookie
                && record.pin_root.as_deref().is_none_or(|p| p == s.pin_root)
        })
        .collect();
    if records.is_empty() {
        return Err("no record of this pin root names the netns".into());
    }
    if records.iter().any(|(_, record)| record.pending) {
        return Err("an ADD of the netns is under way".into());
    }
    same_netns(&r.netns, r.netns_cookie)?;
    // A reconcile pass enrols pods again from their records; not while these go.
    let Some(_records) = reconcile::records_lock_if_free() else {
        return Err("a reconcile pass is running".into());
    };
    sidestep::enroll::unenroll(&s.pin_root, &r.netns).map_err(|e| e.to_string())?;
    for (path, record) in &records {
        reconcile::forget(s, path, record).map_err(|e| e.to_string())?;
    }
    Ok(records.len())
}

/// Whether Istio's ambient selectors pick `pod` with its namespace's `namespace_labels`.
fn selected(pod: &Pod, namespace_labels: &BTreeMap<String, String>) -> bool {
    let meta = &pod.metadata;
    sidestep::policy::ambient_selectors::selected(
        &meta.labels.clone().unwrap_or_default(),
        &meta.annotations.clone().unwrap_or_default(),
        namespace_labels,
    )
}
