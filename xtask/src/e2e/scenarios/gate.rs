//! The startup gate: with deploy/components/readiness-taint, a node that carries
//! `sidestep.io/agent-not-ready` schedules no meshed pod until the agent is ready and removes it.

use std::time::Duration;

use anyhow::{Result, ensure};

use super::manifests::gated_pod;
use super::*;
use crate::e2e::config::NODE_NAME;

pub(super) const READINESS_TAINT: &str = "sidestep.io/agent-not-ready";

/// Before the install: the node carries the startup taint, as a node registered with it
/// (kubelet `registerWithTaints`) would. Pods already running stay (NoSchedule).
pub fn taint_node(node: &Running) -> Result<()> {
    let k = &node.kubectl;
    k.run(&[
        "taint",
        "node",
        NODE_NAME,
        &format!("{READINESS_TAINT}=true:NoSchedule"),
        "--overwrite",
    ])?;
    // The scheduler's message says only "untolerated taint(s)": it must be this one.
    let taints = node_taints(k)?;
    ensure!(
        taints == READINESS_TAINT,
        "the node has other taints than {READINESS_TAINT}: {taints}"
    );
    Ok(())
}

fn node_taints(k: &Kubectl) -> Result<String> {
    k.field(
        &format!("node/{NODE_NAME}"),
        "default",
        "{.spec.taints[*].key}",
    )
}

/// Right after `kubectl apply -k`, before the agent is Ready: a meshed pod that must wait.
pub fn create_gated_pod(node: &Running) -> Result<()> {
    node.kubectl
        .apply(&manifests(node), "gated", &gated_pod("gated"))
}

/// The scheduler turned the gated pod away for the taint (a FailedScheduling Event that names
/// it), the agent removed the taint, and the pod then ran and was enrolled by the plugin.
pub(super) fn gated_pod_waited(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    k.wait_pod_ready(MESH, "gated", POD_TIMEOUT)?;
    let turned_away = k.run(&[
        "get",
        "events",
        "-n",
        MESH,
        "--field-selector",
        "involvedObject.name=gated,reason=FailedScheduling",
        "-o",
        "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}",
    ])?;
    // The node's only taint was ours (checked when it was set).
    let held = turned_away
        .lines()
        .find(|m| m.contains("untolerated taint"))
        .map(str::to_owned);
    ensure!(
        held.is_some(),
        "no FailedScheduling Event for an untolerated taint: the pod was never held back \
         (events: {turned_away:?})"
    );
    let taints = node_taints(k)?;
    ensure!(
        !taints.contains(READINESS_TAINT),
        "the node still has {READINESS_TAINT}: {taints}"
    );
    k.poll("a record of mesh/gated", Duration::from_secs(10), |_| {
        Ok(!records_of(node, "gated")?.is_empty())
    })?;
    Ok(format!(
        "held back ({}), then scheduled once the agent removed the taint, and enrolled",
        held.unwrap_or_default().trim()
    ))
}
