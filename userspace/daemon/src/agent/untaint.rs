//! The startup gate: a node can come up with a NoSchedule taint (`readiness-taint`, by default
//! `sidestep.io/agent-not-ready`, added by the node provisioner) so that no pod is scheduled
//! before the redirect is in place; the agent removes that taint once /readyz is true, as
//! Istio's untaint controller does for `cni.istio.io/not-ready`. Only that taint goes: the node's
//! other taints are kept, and the patch carries the node's resourceVersion, so a concurrent
//! change makes it fail (409) and try again rather than overwrite.

use std::{sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;

use super::Agent;

/// What one attempt did.
#[derive(Debug, PartialEq, Eq)]
enum Untainted {
    Removed,
    /// The node does not carry the taint (removed before, or never added).
    Absent,
}

async fn remove(client: Client, node: &str, key: &str) -> Result<Untainted, String> {
    let nodes: Api<Node> = Api::all(client);
    let current = nodes
        .get(node)
        .await
        .map_err(|e| format!("reading node {node}: {e}"))?;
    let taints = current
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let kept: Vec<_> = taints.iter().filter(|t| t.key != key).cloned().collect();
    if kept.len() == taints.len() {
        return Ok(Untainted::Absent);
    }
    let patch = json!({
        "metadata": {"resourceVersion": current.metadata.resource_version},
        "spec": {"taints": kept},
    });
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| format!("removing taint {key} from node {node}: {e}"))?;
    Ok(Untainted::Removed)
}

/// Waits until the agent is ready, then removes the readiness taint from its node, retrying
/// every 2 s until the API has confirmed it. Does nothing without a taint key or a node name.
pub async fn run(agent: Arc<Agent>) {
    let (Some(key), node) = (
        agent.settings.readiness_taint.clone(),
        agent.settings.node_name.clone(),
    ) else {
        return;
    };
    if node.is_empty() {
        tracing::warn!(taint = %key, "readiness-taint is set but node-name is not: the taint stays");
        return;
    }
    let mut last_error = String::new();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let a = agent.clone();
        let ready = tokio::task::spawn_blocking(move || a.readiness().0)
            .await
            .unwrap_or(false);
        if !ready {
            continue;
        }
        let Some(api) = super::repair::api_access(&agent.settings) else {
            continue;
        };
        let result = match super::apiclient::client(&api, Some(Duration::from_secs(10))).await {
            Ok(c) => remove(c, &node, &key).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(done) => {
                tracing::info!(
                    node = %node,
                    taint = %key,
                    removed = done == Untainted::Removed,
                    "ready: the node's readiness taint is gone"
                );
                agent
                    .counters
                    .untainted
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                return;
            }
            Err(e) => {
                if e != last_error {
                    tracing::warn!(error = %e, "readiness taint (retrying every 2 s)");
                }
                last_error = e;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
}
