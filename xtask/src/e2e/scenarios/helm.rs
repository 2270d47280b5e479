//! Scenario 9: the Helm chart (deploy/helm/sidestep) on the node sidestep was just uninstalled
//! from: `helm install` with the node's values, the agent Ready, a meshed pod enrolled, then the
//! drain and `helm uninstall`, after which nothing of sidestep is left.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use super::lifecycle::{agent_pods, leftovers, pods_with_netns, request_uninstall};
use super::manifests::{ProxyUid, injected_pod, sleep_app};
use super::*;
use crate::e2e::install;

const RELEASE: &str = "sidestep";
const POD: &str = "helm-meshed";

pub(super) fn install_and_uninstall(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let start = Instant::now();
    // Helm stores its release in the namespace, so the namespace comes first; deploy/README.md
    // says the same to the operator.
    k.run(&["create", "namespace", install::NAMESPACE])?;
    k.run(&[
        "label",
        "namespace",
        install::NAMESPACE,
        "pod-security.kubernetes.io/enforce=privileged",
    ])?;
    let values = install::write_helm_values(node)?;
    let chart = crate::paths::workspace().join("deploy/helm/sidestep");
    install::helm(node)
        .args(["install", RELEASE])
        .arg(&chart)
        .args(["--namespace", install::NAMESPACE, "--values"])
        .arg(&values)
        .read()
        .context("helm install")?;
    install::wait_agent_ready(node, Duration::from_secs(120))?;
    let ready_in = start.elapsed().as_secs_f64();

    k.apply(
        &manifests(node),
        POD,
        &injected_pod(POD, ProxyUid::Default, &sleep_app()),
    )?;
    k.wait_pod_ready(MESH, POD, POD_TIMEOUT)?;
    ensure!(
        !records_of(node, POD)?.is_empty() && pod_map_entries()? > 0,
        "the meshed pod was not enrolled by the chart's agent"
    );
    ensure!(
        super::sidecar::chained_types(node)?
            .iter()
            .any(|(_, types)| types.iter().any(|t| t == "sidestep")),
        "the chart's agent did not chain its plugin into the node's conflist"
    );

    // The drain, as deploy/README.md has it for Helm too: request it, let every pod that
    // existed when it began go (the plugin binary stays for their DEL), then uninstall the
    // release. The ztunnel stand-in's DaemonSet makes its pod again, after the drain began.
    request_uninstall(node)?;
    let old = pods_with_netns(node)?;
    for (namespace, name) in &old {
        k.run(&[
            "delete",
            "pod",
            "-n",
            namespace,
            name,
            "--wait=true",
            "--timeout=60s",
        ])
        .with_context(|| format!("deleting {namespace}/{name} (stuck in Terminating?)"))?;
    }
    let pins = PathBuf::from(install::PIN_ROOT);
    let plugin = node.layout.cni_bin_dir().join("sidestep");
    k.poll("the drain finishes", Duration::from_secs(60), |_| {
        Ok(!pins.exists() && !plugin.exists())
    })
    .with_context(|| {
        format!(
            "left: pins {}, plugin {}; pods: {}; the agent's log:\n{}",
            pins.exists(),
            plugin.exists(),
            k.run(&["get", "pods", "-A", "-o", "wide"])
                .unwrap_or_default(),
            k.run(&[
                "logs",
                "-n",
                install::NAMESPACE,
                "daemonset/sidestep-agent",
                "--tail=30",
            ])
            .unwrap_or_default()
        )
    })?;
    install::helm(node)
        .args(["uninstall", RELEASE, "--namespace", install::NAMESPACE])
        .args(["--wait", "--timeout", "90s"])
        .read()
        .context("helm uninstall")?;
    let left = leftovers(node)?;
    ensure!(
        left.is_empty(),
        "left after helm uninstall: {}",
        left.join(", ")
    );
    // The DaemonSet is gone; its pod follows through the garbage collector, its preStop
    // finding nothing left to remove.
    k.poll(
        "the agent's pod gone after helm uninstall",
        Duration::from_secs(60),
        |k| {
            let agents = agent_pods(k, "{.metadata.name}")?;
            Ok(agents.trim().is_empty())
        },
    )?;
    Ok(format!(
        "agent Ready {ready_in:.0} s after helm install; {POD} enrolled; drained ({} pods \
         deleted) and uninstalled, nothing left, in {:.0} s in all",
        old.len(),
        start.elapsed().as_secs_f64()
    ))
}
