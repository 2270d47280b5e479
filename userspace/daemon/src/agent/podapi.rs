//! What the agent writes to the API about a pod: Kubernetes Events an operator sees in
//! `kubectl describe pod` and `kubectl get events`, and repair's two other actions, deleting the
//! pod (so its controller recreates it through the CNI chain) and labelling it. Each call is
//! short and blocking, made from a reconcile.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

use super::apiclient::ApiAccess;

/// A pod on this node, as the API lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

const TIMEOUT: Duration = Duration::from_secs(10);
/// The label repair's `label` mode puts on a pod that should be captured and is not.
pub const UNINITIALIZED_LABEL: &str = "sidestep.io/uninitialized";

fn block_on<T>(
    api: &ApiAccess,
    f: impl AsyncFnOnce(Client) -> Result<T, String>,
) -> Result<T, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start an async runtime: {e}"))?;
    rt.block_on(async {
        let client = super::apiclient::client(api, Some(TIMEOUT)).await?;
        tokio::time::timeout(TIMEOUT, f(client))
            .await
            .map_err(|_| format!("no answer from the API server within {TIMEOUT:?}"))?
    })
}

/// Why the agent tells an operator about a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Captured by the plugin's ADD.
    Enrolled,
    /// Started without capture: the ADD could not enrol it and FAIL_OPEN let it through.
    Uncaptured,
    /// Enrolled in place by repair.
    Repaired,
    /// Deleted by repair (`repair-mode: delete`) so that it is recreated through the CNI chain.
    DeletedUncaptured,
    /// Labelled by repair (`repair-mode: label`).
    LabelledUncaptured,
    /// Repair could not enrol it.
    RepairFailed,
    /// The plugin left it uncaptured: it has Istio's `istio-init` init container, so Istio's
    /// iptables captures it, not sidestep.
    IstioInitPresent,
    /// On the Node: the CNI configuration sidestep chains into also has an `istio-cni` entry,
    /// so both would capture its pods.
    CompetingCniEntry,
}

impl Reason {
    fn as_str(self) -> &'static str {
        match self {
            Self::Enrolled => "SidestepEnrolled",
            Self::Uncaptured => "SidestepUncaptured",
            Self::Repaired => "SidestepRepaired",
            Self::DeletedUncaptured => "SidestepDeletedUncaptured",
            Self::LabelledUncaptured => "SidestepLabelledUncaptured",
            Self::RepairFailed => "SidestepRepairFailed",
            Self::IstioInitPresent => "IstioInitPresent",
            Self::CompetingCniEntry => "CompetingCniEntry",
        }
    }

    fn warning(self) -> bool {
        !matches!(self, Self::Repaired | Self::Enrolled)
    }
}

/// Records an Event on `pod` (core/v1, as kubelet's own), from the agent on `node`.
pub fn event(
    api: &ApiAccess,
    node: &str,
    pod: &NodePod,
    reason: Reason,
    message: &str,
) -> Result<(), String> {
    let object = json!({"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                        "name": pod.name, "uid": pod.uid});
    post(
        api,
        node,
        &pod.namespace,
        &pod.name,
        object,
        reason,
        message,
    )
}

/// Records an Event on the Node `node` itself, as kubelet does: in `default`, with the node's
/// name as its UID (`kubectl describe node` looks its Events up so).
pub fn node_event(
    api: &ApiAccess,
    node: &str,
    reason: Reason,
    message: &str,
) -> Result<(), String> {
    let object = json!({"apiVersion": "v1", "kind": "Node", "name": node, "uid": node});
    post(api, node, "default", node, object, reason, message)
}

fn post(
    api: &ApiAccess,
    node: &str,
    namespace: &str,
    name: &str,
    object: serde_json::Value,
    reason: Reason,
    message: &str,
) -> Result<(), String> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let event: Event = serde_json::from_value(json!({
        "metadata": {"generateName": format!("{name}."), "namespace": namespace},
        "involvedObject": object,
        "reason": reason.as_str(),
        "message": message,
        "type": if reason.warning() { "Warning" } else { "Normal" },
        "source": {"component": "sidestep-agent", "host": node},
        "reportingComponent": "sidestep.io/agent",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }))
    .map_err(|e| format!("building the event: {e}"))?;
    let ns = namespace.to_owned();
    block_on(api, async move |client: Client| {
        Api::<Event>::namespaced(client, &ns)
            .create(&PostParams::default(), &event)
            .await
            .map(drop)
            .map_err(|e| format!("recording event {}: {e}", reason.as_str()))
    })
}

/// Deletes the pod, only if it is still the pod that was found (its UID).
pub fn delete(api: &ApiAccess, pod: &NodePod) -> Result<(), String> {
    let (ns, name, uid) = (pod.namespace.clone(), pod.name.clone(), pod.uid.clone());
    block_on(api, async move |client: Client| {
        let params = DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        Api::<Pod>::namespaced(client, &ns)
            .delete(&name, &params)
            .await
            .map(drop)
            .map_err(|e| format!("deleting pod {ns}/{name}: {e}"))
    })
}

/// The pod's UID, read from the API (for an Event about a pod the watch has not seen yet).
pub fn uid(api: &ApiAccess, namespace: &str, name: &str) -> Result<String, String> {
    let (ns, name) = (namespace.to_owned(), name.to_owned());
    block_on(api, async move |client: Client| {
        let pod = Api::<Pod>::namespaced(client, &ns)
            .get(&name)
            .await
            .map_err(|e| format!("reading pod {ns}/{name}: {e}"))?;
        Ok(pod.metadata.uid.unwrap_or_default())
    })
}

/// Labels the pod `sidestep.io/uninitialized=true`.
pub fn label(api: &ApiAccess, pod: &NodePod) -> Result<(), String> {
    let (ns, name) = (pod.namespace.clone(), pod.name.clone());
    block_on(api, async move |client: Client| {
        let patch = json!({"metadata": {"labels": {UNINITIALIZED_LABEL: "true"}}});
        Api::<Pod>::namespaced(client, &ns)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| format!("labelling pod {ns}/{name}: {e}"))
    })
}

/// Sets one annotation through the pods/status subresource (a JSON merge patch), as istio-cni
/// writes `ambient.istio.io/redirection`: it needs `patch` on pods/status only.
pub fn annotate_status(
    api: &ApiAccess,
    pod: &NodePod,
    key: &str,
    value: &str,
) -> Result<(), String> {
    let (ns, name) = (pod.namespace.clone(), pod.name.clone());
    let patch = json!({"metadata": {"annotations": {key: value}}});
    block_on(api, async move |client: Client| {
        Api::<Pod>::namespaced(client, &ns)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| format!("annotating pod {ns}/{name}: {e}"))
    })
}

/// The pod `namespace/name` and its Namespace, read from the API now (not from a watch, which
/// may lag behind what the plugin read at the pod's ADD).
pub fn pod_and_namespace(
    api: &ApiAccess,
    namespace: &str,
    name: &str,
) -> Result<(Pod, Namespace), String> {
    let (ns, name) = (namespace.to_owned(), name.to_owned());
    block_on(api, async move |client: Client| {
        let pod = Api::<Pod>::namespaced(client.clone(), &ns)
            .get(&name)
            .await
            .map_err(|e| format!("reading pod {ns}/{name}: {e}"))?;
        let namespace = Api::<Namespace>::all(client)
            .get(&ns)
            .await
            .map_err(|e| format!("reading namespace {ns}: {e}"))?;
        Ok((pod, namespace))
    })
}

/// Removes one annotation through the pods/status subresource, from this pod only: the patch
/// carries its UID, which the API server takes as a precondition. A pod that is gone, or is
/// another pod under the same name now, counts as done.
pub fn remove_annotation_status(api: &ApiAccess, pod: &NodePod, key: &str) -> Result<(), String> {
    let (ns, name) = (pod.namespace.clone(), pod.name.clone());
    let patch = json!({"metadata": {"uid": pod.uid, "annotations": {key: null}}});
    block_on(
        api,
        async move |client: Client| match Api::<Pod>::namespaced(client, &ns)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
            Err(e) => Err(format!("removing an annotation of pod {ns}/{name}: {e}")),
        },
    )
}

/// What an Event of the [`Queue`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// A pod; an empty UID is read from the API before posting.
    Pod(NodePod),
    /// This node.
    Node,
}

type Queued = (Subject, Reason, String);

/// Events posted from a thread of their own, so that a slow or absent API server never holds up
/// the loop that noticed something (the CNI configuration's watch, the plugin's log). A full
/// queue drops the Event: the log line and the metric that go with each one still say it.
#[derive(Debug, Default)]
pub struct Queue {
    /// The agent's credentials and node; `None` outside a cluster (nothing is posted).
    to: Option<(ApiAccess, String)>,
    /// Started at the first Event, never before: capabilities are per thread, and a thread made
    /// before the agent drops its own would keep them all.
    tx: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<Queued>>>,
}

/// Events waiting at most; a burst beyond it (a rollout of many pods at once) loses the rest.
const QUEUE_LEN: usize = 256;

impl Queue {
    /// A queue posting with `api` as the agent on `node`; without either, one that drops
    /// everything (not in a cluster).
    pub fn new(api: Option<ApiAccess>, node: &str) -> Self {
        Self {
            to: api
                .filter(|_| !node.is_empty())
                .map(|a| (a, node.to_owned())),
            tx: std::sync::OnceLock::new(),
        }
    }

    fn start(&self) -> Option<std::sync::mpsc::SyncSender<Queued>> {
        let (api, node) = self.to.clone()?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Queued>(QUEUE_LEN);
        let spawned = std::thread::Builder::new()
            .name("events".into())
            .spawn(move || {
                for (subject, reason, message) in rx {
                    let done = match subject {
                        Subject::Node => node_event(&api, &node, reason, &message),
                        Subject::Pod(mut pod) => {
                            if pod.uid.is_empty() {
                                pod.uid = uid(&api, &pod.namespace, &pod.name).unwrap_or_default();
                            }
                            event(&api, &node, &pod, reason, &message)
                        }
                    };
                    if let Err(e) = done {
                        tracing::warn!(error = %e, "could not record an event");
                    }
                }
            });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::warn!(error = %e, "no thread for Events: none is recorded");
                None
            }
        }
    }

    /// Queues an Event; never waits.
    pub fn post(&self, subject: Subject, reason: Reason, message: String) {
        if let Some(tx) = self.tx.get_or_init(|| self.start())
            && tx.try_send((subject, reason, message)).is_err()
        {
            tracing::debug!(reason = reason.as_str(), "the Event queue is full: dropped");
        }
    }
}
