//! Istio ambient mode: the agent serving ZDS to a ztunnel stand-in that runs as its own
//! DaemonSet pod.

use std::time::Duration;

use anyhow::{Context, Result, ensure};

use super::manifests::{ambient_pod_manifest, ztunnel_manifest};
use super::*;

/// Istio's ambient namespace label, on the namespace.
const AMBIENT_NS: &str = "ambient";
/// With deploy/components/ambient, the agent serves ZDS on its hostPath socket. The ztunnel
/// stand-in (`probe ztunnel`, a DaemonSet in istio-system mounting the same directory) gets
/// the pod of an ambient-labelled namespace with its netns, listens in it with ztunnel's mark,
/// and sees the pod's outbound call arrive with its original destination.
pub(super) fn ambient_pod(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let socket_dir = node.layout.at("ztunnel");
    k.apply(
        &manifests(node),
        "ztunnel",
        &ztunnel_manifest(&socket_dir.display().to_string()),
    )?;
    k.run(&[
        "rollout",
        "status",
        "-n",
        "istio-system",
        "daemonset/ztunnel",
        "--timeout=90s",
    ])?;
    let ztunnel = k
        .run(&[
            "get",
            "pods",
            "-n",
            "istio-system",
            "-l",
            "app=ztunnel",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])?
        .trim()
        .to_owned();
    k.apply(
        &manifests(node),
        "ambient",
        &ambient_pod_manifest(AMBIENT_NS, "amb"),
    )?;
    k.wait_pod_ready(AMBIENT_NS, "amb", POD_TIMEOUT)?;
    let zds_add = format!("\"name\":\"amb\",\"namespace\":\"{AMBIENT_NS}\"");
    wait_container_log(
        k,
        "istio-system",
        &ztunnel,
        "istio-proxy",
        &["\"zds\":\"add\"", &zds_add],
    )?;
    k.poll(
        "ambient.istio.io/redirection: enabled on ambient/amb",
        Duration::from_secs(30),
        |k| {
            Ok(k.field(
                "pod/amb",
                AMBIENT_NS,
                "{.metadata.annotations.ambient\\.istio\\.io/redirection}",
            )? == "enabled")
        },
    )?;
    let server_ip = pod_ip(node, "server")?;
    let amb_ip = pod_ip_in(node, AMBIENT_NS, "amb")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    // The stand-in accepts and reports; it does not proxy, so there is no reply to read.
    let answer = probe_json_in(node, AMBIENT_NS, "amb", &["connect-sock", &target])?;
    ensure!(
        answer["peer"] == target.as_str(),
        "amb's getpeername: {answer}"
    );
    let peer = format!("\"peer\":\"{amb_ip}:");
    let orig = format!("\"addr\":\"{target}\"");
    let line = wait_container_log(
        k,
        "istio-system",
        &ztunnel,
        "istio-proxy",
        &["\"listener\":\"15001\"", &peer, &orig],
    )
    .context("the ztunnel stand-in did not see the call on its outbound listener")?;
    Ok(format!(
        "ZDS add for {AMBIENT_NS}/amb, annotated redirection enabled; the stand-in on 15001: {}",
        line.trim()
    ))
}
