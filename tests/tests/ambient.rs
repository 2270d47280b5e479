//! Ambient mode end to end: the real agent (`--ambient`), the plugin chained into a node's CNI
//! configuration and run by the test's runtime for every pod, a local API server holding the pods
//! and their namespaces (real Pod and Namespace JSON, watched as kube-apiserver serves them), and
//! a ztunnel stand-in (`probe ztunnel`) that speaks ZDS to the agent and opens marked listeners
//! in each pod netns it is handed.
//!
//! What it shows: the plugin picks the pods Istio's ambient selectors pick (the namespace label,
//! the pod's `none` opt-out) and enrols them before they run; the agent hands exactly those to
//! ztunnel with their netns fd and UID, annotates them `ambient.istio.io/redirection: enabled`,
//! sends the whole set again as a snapshot when ztunnel reconnects, and a Del at the pod's DEL;
//! an app's outbound connection lands on ztunnel's 15001 in its own pod with the original
//! destination, and an inbound one on the server's 15006 with the original destination; a pod
//! outside the mesh reaches its peers directly. With sidestep's redirection off, the connections
//! would reach the peers' addresses (nothing listens there) and the test would fail.
//!
//! The real ztunnel is not built here: its source comes only from GitHub, which CI does not
//! reach (docs/RELIABILITY.md, "Ambient", records a manual run against an unmodified ztunnel).
//!
//! Needs root; skips otherwise.

#[path = "agent_support/mod.rs"]
mod agent_support;

use std::time::Duration;

use agent_support::{Agent, Dirs, PodApi, api_pod, base_args, free_port, wait_until};
use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{ChildGuard, PodOptions, Spawn, TestEnv, skip_unless_root};

const NODE: &str = "node-1";

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// The test agent's plugin entry, reading pods (and namespaces) from the local API server.
fn plugin_json(kubeconfig: &std::path::Path) -> String {
    json!({
        "type": "sidestep",
        "pin_root": "__PIN_ROOT__",
        "state_dir": "__STATE_DIR__",
        "log_level": "__LOG_LEVEL__",
        "pod_namespace": "__POD_NAMESPACE__",
        "pod_source": "api",
        "kubernetes": {"kubeconfig": kubeconfig.display().to_string(), "pod_read_retries": 5}
    })
    .to_string()
}

/// The stand-in's JSON lines so far.
fn lines(z: &ChildGuard) -> Vec<Value> {
    z.stdout()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn zds_events(z: &ChildGuard, kind: &str, uid: &str) -> usize {
    lines(z)
        .iter()
        .filter(|l| l["zds"] == kind && l["uid"] == uid)
        .count()
}

/// The accepted connections the stand-in reported for `workload` on `listener`.
fn accepted(z: &ChildGuard, workload: &str, listener: &str) -> Vec<Value> {
    lines(z)
        .into_iter()
        .filter(|l| l["workload"] == workload && l["listener"] == listener)
        .collect()
}

fn start_ztunnel(env: &TestEnv, uds: &std::path::Path) -> Result<ChildGuard> {
    let uds = uds.display().to_string();
    env.spawn(Spawn::new(&[probe(), "ztunnel", &uds]))
}

#[test]
fn ambient_pods_are_handed_to_ztunnel_and_captured() -> Result<()> {
    if skip_unless_root("ambient_pods_are_handed_to_ztunnel_and_captured") {
        return Ok(());
    }
    let env = TestEnv::new("ambient")?;
    let d = Dirs::new(&env)?;
    let api = PodApi::start(env.tmp_dir(), Vec::new())?;
    api.set_namespace("mesh", json!({"istio.io/dataplane-mode": "ambient"}));
    api.set_namespace("plain", json!({}));
    // Pods exist in the API before their sandboxes, as in a cluster; the plugin reads them at ADD.
    let mut optout = api_pod(NODE, "mesh", "optout", &[], false);
    optout["metadata"]["labels"]["istio.io/dataplane-mode"] = "none".into();
    let mut server_json = api_pod(NODE, "mesh", "server", &[], false);
    server_json["spec"]["serviceAccountName"] = "server-sa".into();
    for p in [
        api_pod(NODE, "mesh", "client", &[], false),
        server_json,
        optout,
        api_pod(NODE, "plain", "other", &[], false),
    ] {
        api.add(p);
    }

    d.write_primary("10-test.conflist")?;
    let uds = env.tmp_dir().join("ztunnel").join("ztunnel.sock");
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args[2] = plugin_json(&api.kubeconfig);
    args.extend(
        [
            "--node-name",
            NODE,
            "--api-kubeconfig",
            &api.kubeconfig.display().to_string(),
            "--repair",
            "false",
            "--ambient",
            "true",
            "--ztunnel-socket",
            &uds.display().to_string(),
        ]
        .map(String::from),
    );
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    ensure!(
        d.entry("10-test.conflist")?["ambient_enabled"] == true,
        "the plugin entry lacks ambient_enabled"
    );
    let node = d.node(&env, "10-test.conflist")?;
    let pod = |name: &str, ns: &str| {
        node.add_pod_with(
            name,
            PodOptions {
                namespace: ns.into(),
                ..Default::default()
            },
        )
    };
    // The pods start before ztunnel is there: captured from their first packet, pending until
    // ztunnel takes them.
    let client = pod("client", "mesh")?;
    let server = pod("server", "mesh")?;
    let optout = pod("optout", "mesh")?;
    let other = pod("other", "plain")?;
    wait_until("the pods to be pending", Duration::from_secs(10), || {
        Ok(
            api.pod("mesh", "client").context("client")?["metadata"]["annotations"]
                ["ambient.istio.io/redirection"]
                == "pending",
        )
    })
    .with_context(|| agent.log())?;
    ensure!(agent.get("/readyz")?.1.contains("ztunnel NOT connected"));

    let mut ztunnel = start_ztunnel(&env, &uds)?;
    for uid in ["uid-mesh-client", "uid-mesh-server"] {
        wait_until(
            &format!("ztunnel to get {uid}"),
            Duration::from_secs(10),
            || Ok(zds_events(&ztunnel, "add", uid) >= 1),
        )
        .with_context(|| format!("{}\n{}", ztunnel.stdout(), agent.log()))?;
    }
    wait_until("both pods to be enabled", Duration::from_secs(10), || {
        Ok(["client", "server"].iter().all(|n| {
            api.pod("mesh", n).is_some_and(|p| {
                p["metadata"]["annotations"]["ambient.istio.io/redirection"] == "enabled"
            })
        }))
    })
    .with_context(|| agent.log())?;
    let all = lines(&ztunnel);
    let server_add = all
        .iter()
        .find(|l| l["zds"] == "add" && l["uid"] == "uid-mesh-server")
        .context("no Add for the server")?;
    ensure!(
        server_add["name"] == "server"
            && server_add["namespace"] == "mesh"
            && server_add["sa"] == "server-sa"
            && server_add["fds"] == 1,
        "{server_add}"
    );
    ensure!(
        !all.iter()
            .any(|l| l["uid"] == "uid-mesh-optout" || l["uid"] == "uid-plain-other"),
        "ztunnel was given a pod outside the mesh: {all:?}"
    );
    ensure!(agent.get("/readyz")?.1.contains("ztunnel connected"));

    // Outbound: the client app's connect lands on ztunnel's 15001 in the client's own netns.
    let server_ip = server.ipv4.to_string();
    let to_server = format!("{server_ip}:80");
    let out = client.run(&env, 1000, &[probe(), "connect", &to_server])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_until("the outbound connection", Duration::from_secs(5), || {
        Ok(!accepted(&ztunnel, "uid-mesh-client", "15001").is_empty())
    })?;
    let conn = &accepted(&ztunnel, "uid-mesh-client", "15001")[0];
    ensure!(conn["orig_v4"]["addr"] == to_server.as_str(), "{conn}");
    ensure!(
        accepted(&ztunnel, "uid-mesh-server", "15006").is_empty(),
        "the outbound connection reached the server's pod"
    );

    // Inbound: from a pod outside the mesh, to the server's port 8080: ztunnel's 15006 in the
    // server's netns, with the original destination as its local address (sk_assign).
    let to_server_8080 = format!("{server_ip}:8080");
    let out = other.run(&env, 1000, &[probe(), "connect", &to_server_8080])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_until("the inbound connection", Duration::from_secs(5), || {
        Ok(!accepted(&ztunnel, "uid-mesh-server", "15006").is_empty())
    })?;
    let conn = &accepted(&ztunnel, "uid-mesh-server", "15006")[0];
    ensure!(
        conn["orig_v4"]["addr"] == to_server_8080.as_str()
            && conn["local"] == to_server_8080.as_str()
            && conn["peer"]
                .as_str()
                .is_some_and(|p| p.starts_with(&format!("{}:", other.ipv4))),
        "{conn}"
    );
    // HBONE's 15008 is never captured: the server's ztunnel takes it on 15008 itself.
    let to_hbone = format!("{server_ip}:15008");
    ensure!(
        other
            .run(&env, 1000, &[probe(), "connect", &to_hbone])?
            .status
            .success()
    );
    wait_until("the HBONE connection", Duration::from_secs(5), || {
        Ok(!accepted(&ztunnel, "uid-mesh-server", "15008").is_empty())
    })?;

    // Outside the mesh: the opted-out pod's connections go where they were sent.
    let _listener = other.spawn(
        &env,
        Spawn::new(&[
            probe(),
            "proxy",
            &format!("{}:9090", other.ipv4),
            "-",
            "--no-forward",
        ]),
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let to_other = format!("{}:9090", other.ipv4);
    let out = optout.run(&env, 1000, &[probe(), "connect", &to_other])?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        text.contains(&format!("\"peer\":\"{to_other}\"")),
        "the opted-out pod was captured: {text}"
    );

    // ztunnel restarts: the new connection's snapshot carries both pods again.
    ztunnel.terminate(Duration::from_secs(5))?;
    let ztunnel = start_ztunnel(&env, &uds)?;
    wait_until("the snapshot", Duration::from_secs(10), || {
        let l = lines(&ztunnel);
        Ok(l.iter().any(|e| e["zds"] == "snapshot-sent")
            && zds_events(&ztunnel, "add", "uid-mesh-client") == 1
            && zds_events(&ztunnel, "add", "uid-mesh-server") == 1)
    })
    .with_context(|| format!("{}\n{}", ztunnel.stdout(), agent.log()))?;

    // The client's DEL: ztunnel is told to drop it.
    node.remove_pod(&client)?;
    wait_until("the Del", Duration::from_secs(10), || {
        Ok(zds_events(&ztunnel, "del", "uid-mesh-client") == 1)
    })
    .with_context(|| agent.log())?;
    ensure!(zds_events(&ztunnel, "del", "uid-mesh-server") == 0);
    drop((server, optout, other));
    drop(node);
    Ok(())
}
