//! The libcni-style chain with real plugins: bridge + host-local, portmap, then sidestep-cni,
//! executed as libcni does (env, stdin, prevResult threading, DEL in reverse). Pods made through
//! the chain carry traffic through HAProxy sidecars both ways; deleting them leaves nothing.
//! Needs root; skips otherwise.

use std::time::Duration;

use anyhow::{Result, ensure};
use serde_json::json;
use sidestep_tests::{
    Node, NodeOptions, PodOptions, TestEnv, haproxy, http_get, nginx, sidestep::Loaded,
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;
const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

#[test]
fn pods_through_the_real_chain() -> Result<()> {
    if skip_unless_root("pods_through_the_real_chain") {
        return Ok(());
    }
    let env = TestEnv::new("chain")?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack: true,
            chain: sidestep_tests::sidestep::cni_chain(loaded.pin_root(), &state_dir),
            plugin_dirs: vec![sidestep_tests::sidestep::cni_plugin_dir(&env)?],
        },
    )?;
    let meshed = PodOptions {
        namespace: "shop".into(),
        runtime_config: Some(json!({
            "io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}
        })),
        ..Default::default()
    };
    let client = node.add_pod_with("client", meshed.clone())?;
    let server = node.add_pod_with("server", meshed)?;
    // An unmeshed pod (no sidecar.istio.io/status) goes through the same chain and is skipped.
    let plain = node.add_pod_with(
        "plain",
        PodOptions {
            namespace: "shop".into(),
            runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": {}})),
            ..Default::default()
        },
    )?;

    let status = loaded.status()?;
    let enrolled: Vec<u64> = status["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["netns_cookie"].as_u64())
        .collect();
    ensure!(enrolled.len() == 2, "{status}");
    ensure!(
        enrolled.contains(&client.netns_cookie()?) && enrolled.contains(&server.netns_cookie()?)
    );
    ensure!(
        !enrolled.contains(&plain.netns_cookie()?),
        "unmeshed pod enrolled"
    );
    // The pod IPs came from prevResult, dual-stack: inbound capture is on eth0 (its one
    // ifindex), through the plugin's default hook, sk_lookup.
    for pod in status["pods"].as_array().into_iter().flatten() {
        ensure!(
            pod["inbound_hook"] == "sk_lookup"
                && pod["inbound_ifindexes"].as_array().map(Vec::len) == Some(1),
            "{pod}"
        );
    }

    let _web = nginx::Server::start(&env, &server, 80)?;
    let body = nginx::body_for("server");
    let target = url(server.ipv4.into(), 80, "/");
    // Captured both ways with no sidecars up: nothing gets through.
    ensure!(
        http_get(&env, &client, APP_UID, &target).is_err(),
        "not captured"
    );
    let _c = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let s = haproxy::Sidecar::start(&env, &server, Default::default())?;
    ensure!(http_get(&env, &client, APP_UID, &target)? == body);
    s.wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    ensure!(
        http_get(&env, &plain, APP_UID, &target)? == body,
        "unmeshed client to meshed server"
    );

    // CNI DEL through the chain, in reverse: enrolment, per-pod links and records are gone.
    node.remove_pod(&client)?;
    node.remove_pod(&server)?;
    let status = loaded.status()?;
    ensure!(
        status["pods"].as_array().map(Vec::len) == Some(0),
        "{status}"
    );
    for dir in ["links/tc", "links/sklookup"] {
        let left = std::fs::read_dir(loaded.pin_root().join(dir)).map_or(0, |d| d.count());
        ensure!(left == 0, "{left} pins left under {dir}");
    }
    // Records and markers; the plugin's invocation log (`timings`) is not one.
    let records = std::fs::read_dir(&state_dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_file() && e.file_name() != "timings")
                .count()
        })
        .unwrap_or(0);
    ensure!(
        records == 0,
        "{records} state records left in {}",
        state_dir.display()
    );
    Ok(())
}
