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
//! tests/tests/ambient_ztunnel.rs runs the same node with an unmodified ztunnel.
//!
//! Needs root; skips otherwise.

#[path = "agent_support/mod.rs"]
mod agent_support;
#[path = "ambient_support/mod.rs"]
mod ambient_support;

use std::time::Duration;

use agent_support::{Agent, api_pod, wait_until};
use ambient_support::{AmbientNode, NODE, accepted, lines, probe, start_ztunnel, zds_events};
use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{PodOptions, Spawn, TestEnv, skip_unless_root};

#[test]
fn ambient_pods_are_handed_to_ztunnel_and_captured() -> Result<()> {
    if skip_unless_root("ambient_pods_are_handed_to_ztunnel_and_captured") {
        return Ok(());
    }
    let env = TestEnv::new("ambient")?;
    let mut optout = api_pod(NODE, "mesh", "optout", &[], false);
    optout["metadata"]["labels"]["istio.io/dataplane-mode"] = "none".into();
    let mut server_json = api_pod(NODE, "mesh", "server", &[], false);
    server_json["spec"]["serviceAccountName"] = "server-sa".into();
    let AmbientNode {
        api,
        mut agent,
        args,
        port,
        node,
        uds,
        _dirs,
    } = AmbientNode::start(
        &env,
        vec![
            api_pod(NODE, "mesh", "client", &[], false),
            server_json,
            optout,
            api_pod(NODE, "plain", "other", &[], false),
            api_pod(NODE, "later", "late", &[], false),
        ],
    )?;
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
    // ZDS opens once the agent knows the node's ambient pods.
    wait_until("ZDS to open", Duration::from_secs(10), || {
        Ok(agent.get("/readyz")?.1.contains("ztunnel NOT connected"))
    })?;

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
    let status = agent_support::status(&env)?.to_string();
    ensure!(status.contains("\"ambient\""), "sidestep status: {status}");

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

    // The agent restarts while ztunnel runs: ztunnel connects to the new agent, whose first
    // snapshot must already hold both pods (ztunnel drains what a snapshot lacks).
    agent.child.terminate(Duration::from_secs(10))?;
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    wait_until("ztunnel's second snapshot", Duration::from_secs(15), || {
        Ok(lines(&ztunnel)
            .iter()
            .filter(|l| l["zds"] == "snapshot-sent")
            .count()
            == 2)
    })
    .with_context(|| format!("{}\n{}", ztunnel.stdout(), agent.log()))?;
    let all = lines(&ztunnel);
    let second_hello = all
        .iter()
        .rposition(|l| l["zds"] == "hello")
        .context("no second hello")?;
    let snapshot: Vec<&Value> = all[second_hello..]
        .iter()
        .take_while(|l| l["zds"] != "snapshot-sent")
        .filter(|l| l["zds"] == "add")
        .collect();
    ensure!(
        ["uid-mesh-client", "uid-mesh-server"]
            .iter()
            .all(|u| snapshot.iter().any(|l| l["uid"] == *u)),
        "the snapshot after the agent's restart lacks a pod: {snapshot:?}"
    );

    // A namespace labelled ambient while its pod runs: the namespace watch has repair ask the
    // plugin again, which now enrols the pod, and the agent hands it to ztunnel.
    let late = pod("late", "later")?;
    api.add(api_pod(
        NODE,
        "later",
        "late",
        &[late.ipv4.to_string()],
        false,
    ));
    let late_netns = late.netns_path.display().to_string();
    wait_until(
        "repair to skip the late pod",
        Duration::from_secs(10),
        || {
            Ok(agent.log().lines().any(|l| {
                l.contains("leaves this pod uncaptured") && l.contains(late_netns.as_str())
            }))
        },
    )
    .with_context(|| agent.log())?;
    ensure!(zds_events(&ztunnel, "add", "uid-later-late") == 0);
    api.set_namespace("later", json!({"istio.io/dataplane-mode": "ambient"}));
    wait_until(
        "the late pod to reach ztunnel",
        Duration::from_secs(10),
        || Ok(zds_events(&ztunnel, "add", "uid-later-late") == 1),
    )
    .with_context(|| agent.log())?;
    let to_server_late = format!("{server_ip}:81");
    ensure!(
        late.run(&env, 1000, &[probe(), "connect", &to_server_late])?
            .status
            .success()
    );
    wait_until(
        "the late pod's outbound connection",
        Duration::from_secs(5),
        || {
            Ok(accepted(&ztunnel, "uid-later-late", "15001")
                .iter()
                .any(|c| c["orig_v4"]["addr"] == to_server_late.as_str()))
        },
    )?;

    // The namespace's label removed while the pod runs: the agent takes it out of the mesh, as
    // istio-cni's node agent does. ztunnel releases it, its redirection annotation goes, and its
    // connections leave uncaptured.
    api.set_namespace("later", json!({}));
    wait_until(
        "ztunnel to release the late pod",
        Duration::from_secs(10),
        || Ok(zds_events(&ztunnel, "del", "uid-later-late") == 1),
    )
    .with_context(|| agent.log())?;
    let annotations = || {
        api.pod("later", "late")
            .map(|p| p["metadata"]["annotations"].clone())
            .unwrap_or_default()
    };
    wait_until("the annotation removed", Duration::from_secs(5), || {
        Ok(annotations().get("ambient.istio.io/redirection").is_none())
    })
    .with_context(|| format!("{}", annotations()))?;
    let seen = accepted(&ztunnel, "uid-later-late", "15001").len();
    let out = late.run(&env, 1000, &[probe(), "connect", &to_server_late])?;
    ensure!(
        out.status.success(),
        "the late pod's connection after it left"
    );
    std::thread::sleep(Duration::from_millis(300));
    ensure!(
        accepted(&ztunnel, "uid-later-late", "15001").len() == seen,
        "the late pod's connection was captured after it left the mesh"
    );
    // Labelled again: back in, through repair and the plugin.
    api.set_namespace("later", json!({"istio.io/dataplane-mode": "ambient"}));
    wait_until(
        "the late pod back with ztunnel",
        Duration::from_secs(10),
        || Ok(zds_events(&ztunnel, "add", "uid-later-late") == 2),
    )
    .with_context(|| agent.log())?;

    // One pod's own label, while it runs: the opted-out pod of the ambient namespace loses its
    // `none` and joins; set to `none` again, it leaves.
    let optout_json = |labels: Value| {
        let mut p = api_pod(NODE, "mesh", "optout", &[optout.ipv4.to_string()], false);
        p["metadata"]["labels"] = labels;
        p
    };
    // First as repair finds it: opted out, skipped, and remembered as skipped.
    api.add(optout_json(json!({"istio.io/dataplane-mode": "none"})));
    let optout_netns = optout.netns_path.display().to_string();
    wait_until(
        "repair to skip the opted-out pod",
        Duration::from_secs(10),
        || {
            Ok(agent.log().lines().any(|l| {
                l.contains("leaves this pod uncaptured") && l.contains(optout_netns.as_str())
            }))
        },
    )
    .with_context(|| agent.log())?;
    api.add(optout_json(json!({})));
    wait_until("the opted-out pod to join", Duration::from_secs(10), || {
        Ok(zds_events(&ztunnel, "add", "uid-mesh-optout") == 1)
    })
    .with_context(|| agent.log())?;
    api.add(optout_json(json!({"istio.io/dataplane-mode": "none"})));
    wait_until(
        "the pod opted out again to leave",
        Duration::from_secs(10),
        || Ok(zds_events(&ztunnel, "del", "uid-mesh-optout") == 1),
    )
    .with_context(|| agent.log())?;

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

/// `sidestep ztunnel-serve`, for netns enrolled by hand: each ztunnel that connects gets every
/// workload in its snapshot, with the netns fd.
#[test]
fn ztunnel_serve_hands_its_workloads_to_each_connection() -> Result<()> {
    if skip_unless_root("ztunnel_serve_hands_its_workloads_to_each_connection") {
        return Ok(());
    }
    let env = TestEnv::new("ztunnel-serve")?;
    let node = sidestep_tests::Node::new(&env, sidestep_tests::NodeOptions::ipv4_only())?;
    let pod = node.add_pod("web")?;
    let uds = env.tmp_dir().join("zt.sock");
    let uds_s = uds.display().to_string();
    let workload = format!("uid-web,shop,web,web-sa,{}", pod.netns_path.display());
    let bin = sidestep_tests::sidestep::sidestep_bin();
    let server = env.spawn(Spawn::new(&[
        bin.to_str().context("sidestep path")?,
        "ztunnel-serve",
        "--socket",
        &uds_s,
        "--workload",
        &workload,
    ]))?;
    server.wait_stdout(&["serving 1 workloads"], Duration::from_secs(10))?;
    for round in 1..=2 {
        let mut z = start_ztunnel(&env, &uds)?;
        wait_until("the snapshot", Duration::from_secs(10), || {
            Ok(lines(&z).iter().any(|l| l["zds"] == "snapshot-sent"))
        })
        .with_context(|| format!("round {round}: {}", z.stdout()))?;
        let add = lines(&z)
            .into_iter()
            .find(|l| l["zds"] == "add")
            .context("no Add")?;
        ensure!(
            add["uid"] == "uid-web" && add["sa"] == "web-sa" && add["fds"] == 1,
            "{add}"
        );
        server.wait_stdout(&["ztunnel connected"], Duration::from_secs(10))?;
        z.terminate(Duration::from_secs(5))?;
    }
    // A malformed workload is refused before anything listens.
    let out = env.run(
        Spawn::new(&[
            bin.to_str().context("sidestep path")?,
            "ztunnel-serve",
            "--socket",
            &uds_s,
            "--workload",
            "uid-web,shop,web",
        ]),
        Duration::from_secs(10),
    )?;
    ensure!(!out.status.success());
    ensure!(String::from_utf8_lossy(&out.stderr).contains("5 fields"));
    Ok(())
}

/// `redirect_kind::NODE_SOCKET` (ebpf/sidestep-abi): a record of a node socket's connection.
const NODE_SOCKET_KIND: u64 = 6;

/// The node's own connections to an ambient pod's app (kubelet's probes) reach the app, not
/// ztunnel's 15006, as istio-cni's `--socket-exists` SNAT on the node makes them: with STRICT
/// mTLS ztunnel would refuse them as plaintext and kubelet would restart the pod. The node here
/// is a process in the machine's own netns, under the test's cgroup (kubelet runs under the
/// node's cgroup2 root, where the agent attaches in a cluster). The same connection from a pod
/// outside the mesh is still captured. No record of the node's sockets outlives its handshake.
#[test]
fn the_nodes_own_connections_reach_an_ambient_app() -> Result<()> {
    if skip_unless_root("the_nodes_own_connections_reach_an_ambient_app") {
        return Ok(());
    }
    let env = TestEnv::new("ambient-node")?;
    let n = AmbientNode::start(
        &env,
        vec![
            api_pod(NODE, "mesh", "server", &[], false),
            api_pod(NODE, "plain", "other", &[], false),
        ],
    )?;
    let server = n.pod("server", "mesh")?;
    let other = n.pod("other", "plain")?;
    let (agent, node) = (&n.agent, &n.node);
    let ztunnel = start_ztunnel(&env, &n.uds)?;
    wait_until("ztunnel to get the server", Duration::from_secs(10), || {
        Ok(zds_events(&ztunnel, "add", "uid-mesh-server") >= 1)
    })
    .with_context(|| format!("{}\n{}", ztunnel.stdout(), agent.log()))?;
    let app_port = format!("{}:8080", server.ipv4);
    let mut app = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", &app_port, "-", "--no-forward"]),
    )?;
    sidestep_tests::wait_listening(
        &mut app,
        &[app_port.parse().context("the app's address")?],
        Duration::from_secs(5),
    )?;
    let accepted_by_app = |from: &str| {
        app.stdout()
            .lines()
            .filter(|l| l.contains(&format!("\"peer\":\"{from}:")))
            .count()
    };

    // From the node: the app accepts, from the node's own address; ztunnel sees nothing.
    let gateway = node.gateway_v4().to_string();
    for _ in 0..3 {
        let out = env.run(
            Spawn::new(&[probe(), "connect", &app_port]),
            Duration::from_secs(10),
        )?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    wait_until(
        "the app to accept the node's connections",
        Duration::from_secs(5),
        || Ok(accepted_by_app(&gateway) == 3),
    )
    .with_context(|| app.stdout())?;
    ensure!(
        accepted(&ztunnel, "uid-mesh-server", "15006").is_empty(),
        "ztunnel took a connection of the node: {}",
        ztunnel.stdout()
    );

    // From a pod outside the mesh, which the node only forwards: ztunnel's 15006.
    let out = other.run(&env, 1000, &[probe(), "connect", &app_port])?;
    ensure!(out.status.success());
    wait_until(
        "ztunnel to take the pod's connection",
        Duration::from_secs(5),
        || Ok(!accepted(&ztunnel, "uid-mesh-server", "15006").is_empty()),
    )?;
    ensure!(
        accepted_by_app(&other.ipv4.to_string()) == 0,
        "{}",
        app.stdout()
    );

    // The records: none outlives its handshake. A connection the node holds open keeps none
    // once the app accepted it (they share an LRU with every pod's hand-offs), and one the pod
    // refuses (nothing listens; not captured, so the node sees the refusal) leaves none either.
    let node_records = || -> Result<usize> {
        let pending = env.pin_root().join("maps/SIDESTEP_PEND");
        let all = sidestep_tests::faults::bpftool(&[
            "map",
            "dump",
            "pinned",
            &pending.display().to_string(),
        ])?;
        Ok(all
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["formatted"]["value"]["kind"].as_u64() == Some(NODE_SOCKET_KIND))
            .count())
    };
    let held_port = format!("{}:8081", server.ipv4);
    let mut holder = server.spawn(&env, Spawn::new(&[probe(), "hold", &held_port]))?;
    sidestep_tests::wait_listening(
        &mut holder,
        &[held_port.parse().context("the holder's address")?],
        Duration::from_secs(5),
    )?;
    let _held = env.spawn(Spawn::new(&[
        probe(),
        "connect-sock",
        &held_port,
        "--read",
        "--timeout-ms",
        "30000",
    ]))?;
    wait_until(
        "the app to accept the held connection",
        Duration::from_secs(5),
        || {
            Ok(holder
                .stdout()
                .contains(&format!("\"accepted\":\"{gateway}:")))
        },
    )
    .with_context(|| holder.stdout())?;
    wait_until(
        "the held connection's record to go",
        Duration::from_secs(5),
        || Ok(node_records()? == 0),
    )?;
    let refused = env.run(
        Spawn::new(&[probe(), "connect", &format!("{}:9", server.ipv4)]),
        Duration::from_secs(10),
    )?;
    let refused = String::from_utf8_lossy(&refused.stdout).into_owned();
    ensure!(
        refused.contains(&format!("\"errno\":{}", libc::ECONNREFUSED)),
        "the node's connection to a closed port: {refused}"
    );
    wait_until(
        "the refused connection's record to go",
        Duration::from_secs(5),
        || Ok(node_records()? == 0),
    )?;
    ensure!(
        accepted(&ztunnel, "uid-mesh-server", "15006").len() == 1,
        "ztunnel took a connection of the node: {}",
        ztunnel.stdout()
    );
    drop((server, other));
    drop(n);
    Ok(())
}
