//! Ambient mode through an unmodified ztunnel, when `SIDESTEP_ZTUNNEL` names its binary (built
//! with its `testing` feature, for FAKE_CA): its source comes only from GitHub, which CI does not
//! reach, so CI skips it (docs/RELIABILITY.md, "Ambient", records the runs). The node is
//! tests/tests/ambient.rs's: the real agent with `--ambient`, the plugin in the chain, the local
//! API with namespaces.
//!
//! Needs root; skips otherwise.

#[path = "agent_support/mod.rs"]
mod agent_support;
#[path = "ambient_support/mod.rs"]
mod ambient_support;

use std::time::Duration;

use agent_support::{api_pod, wait_until};
use ambient_support::{AmbientNode, NODE, probe};
use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{Spawn, TestEnv, skip_unless_root};

/// The same node with an unmodified ztunnel (`SIDESTEP_ZTUNNEL`): two ambient pods talk through
/// ztunnel's HBONE (mTLS from its test CA), the server's app sees the client's own address
/// (ztunnel delivers from it; sidestep's connection mark brings the replies back), and the
/// client sees the server's address as its peer. The namespace has STRICT mTLS: plaintext from a
/// pod outside the mesh is refused by ztunnel's policy, while the node's own request (kubelet's
/// probe) reaches the app.
#[test]
fn ambient_through_an_unmodified_ztunnel() -> Result<()> {
    if skip_unless_root("ambient_through_an_unmodified_ztunnel") {
        return Ok(());
    }
    let Some(ztunnel_bin) = std::env::var_os("SIDESTEP_ZTUNNEL") else {
        eprintln!(
            "ambient_through_an_unmodified_ztunnel: skipped (set SIDESTEP_ZTUNNEL to a ztunnel \
             binary built with --features testing)"
        );
        return Ok(());
    };
    let ztunnel_bin = ztunnel_bin.to_string_lossy().into_owned();
    let env = TestEnv::new("ambient-zt")?;
    let mut server_json = api_pod(NODE, "mesh", "server", &[], false);
    server_json["spec"]["serviceAccountName"] = "server-sa".into();
    let n = AmbientNode::start(
        &env,
        vec![
            api_pod(NODE, "mesh", "client", &[], false),
            server_json,
            api_pod(NODE, "istio-system", "ztunnel", &[], false),
        ],
    )?;
    let client = n.pod("client", "mesh")?;
    let server = n.pod("server", "mesh")?;
    // ztunnel's own pod: a netns on the node, not in the mesh.
    let zpod = n.pod("ztunnel", "istio-system")?;
    let xds = env.tmp_dir().join("ztunnel-xds.yaml");
    // STRICT mTLS in the namespace: ztunnel refuses plaintext to its pods.
    let workloads = sidestep_tests::istio_ambient::ztunnel_local_xds(
        "mesh",
        NODE,
        &[
            ("client", "default", client.ipv4),
            ("server", "server-sa", server.ipv4),
        ],
    );
    std::fs::write(
        &xds,
        sidestep_tests::istio_ambient::ztunnel_strict_mtls(&workloads, "mesh"),
    )?;
    let uds = n.uds.display().to_string();
    let xds_path = xds.display().to_string();
    let vars = [
        ("PROXY_MODE", "shared"),
        ("INPOD_UDS", uds.as_str()),
        ("FAKE_CA", "true"),
        ("XDS_ADDRESS", ""),
        ("LOCAL_XDS_PATH", xds_path.as_str()),
        ("NODE_NAME", NODE),
        ("CLUSTER_ID", "Kubernetes"),
        ("RUST_LOG", "info"),
    ];
    let ztunnel = zpod.spawn(&env, Spawn::new(&[&ztunnel_bin]).env(&vars))?;
    wait_until("ztunnel to take both pods", Duration::from_secs(30), || {
        Ok(n.annotation("mesh", "client") == "enabled"
            && n.annotation("mesh", "server") == "enabled")
    })
    .with_context(|| format!("ztunnel:\n{}\nagent:\n{}", ztunnel.stderr(), n.agent.log()))?;

    // The server's app, as an unprivileged user; it answers `probe` and reports the client.
    let app_addr = format!("{}:8080", server.ipv4);
    let app = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", &app_addr, "-", "--no-forward"]).user(1000, 1000),
    )?;
    std::thread::sleep(Duration::from_millis(300));
    // The client's request to the app as an unprivileged user: what it printed.
    let request = || -> Result<String> {
        let out = client.run_with(
            &env,
            Spawn::new(&[
                probe(),
                "connect",
                &app_addr,
                "--http",
                "--timeout-ms",
                "10000",
            ])
            .user(1000, 1000),
            Duration::from_secs(20),
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let text = request()?;
    let seen: Value = serde_json::from_str(text.trim())
        .with_context(|| format!("client printed {text:?}\nztunnel:\n{}", ztunnel.stderr()))?;
    ensure!(
        seen["status"] == "probe" && seen["peer"] == app_addr.as_str(),
        "the client got {seen}\nztunnel:\n{}{}",
        ztunnel.stdout(),
        ztunnel.stderr()
    );
    wait_until("the server app's report", Duration::from_secs(5), || {
        Ok(!app.stdout().is_empty())
    })?;
    let report: Value = serde_json::from_str(app.stdout().lines().next().unwrap_or(""))?;
    ensure!(
        report["peer"]
            .as_str()
            .is_some_and(|p| p.starts_with(&format!("{}:", client.ipv4))),
        "the server app saw {report} (want the client's address {})",
        client.ipv4
    );
    // ztunnel's access log: the connection went out through the client's ztunnel and in
    // through the server's, over HBONE, with both workloads' identities.
    let hbone = format!("dst.hbone_addr={app_addr}");
    wait_until("ztunnel's access log", Duration::from_secs(5), || {
        let log = ztunnel.stdout();
        Ok(["outbound", "inbound"].iter().all(|dir| {
            log.lines().any(|l| {
                l.contains("connection complete")
                    && l.contains(&hbone)
                    && l.contains("src.identity=\"spiffe://cluster.local/ns/mesh/sa/default\"")
                    && l.contains("dst.identity=\"spiffe://cluster.local/ns/mesh/sa/server-sa\"")
                    && l.contains(&format!("direction=\"{dir}\""))
            })
        }))
    })
    .with_context(|| ztunnel.stdout())?;

    // Plaintext to the app: from a pod outside the mesh (ztunnel's own netns) it is captured to
    // the server's 15006 and refused under STRICT mTLS; from the node (kubelet's probe) it reaches
    // the app, as istio-cni's node SNAT lets it. Without that, kubelet's probes of every pod of
    // a STRICT namespace would fail.
    let plaintext = |out: std::process::Output| String::from_utf8_lossy(&out.stdout).into_owned();
    let get_argv = [
        probe(),
        "connect",
        &app_addr,
        "--http",
        "--timeout-ms",
        "5000",
    ];
    let get = Spawn::new(&get_argv);
    let from_pod = plaintext(zpod.run_with(&env, get, Duration::from_secs(10))?);
    ensure!(
        !from_pod.contains("\"status\":\"probe\""),
        "plaintext from a pod outside the mesh reached the app: {from_pod}\nztunnel:\n{}",
        ztunnel.stdout()
    );
    let refused = format!("src.addr={}:", zpod.ipv4);
    wait_until("ztunnel's refusal", Duration::from_secs(5), || {
        Ok(ztunnel
            .stdout()
            .lines()
            .any(|l| l.contains(&refused) && l.contains("policy rejection")))
    })
    .with_context(|| ztunnel.stdout())?;
    let from_node = plaintext(env.run(get, Duration::from_secs(10))?);
    ensure!(
        from_node.contains("\"status\":\"probe\""),
        "the node's plaintext request got {from_node:?}\nztunnel:\n{}",
        ztunnel.stdout()
    );
    let gateway = format!("\"peer\":\"{}:", n.node.gateway_v4());
    let zpod_peer = format!("\"peer\":\"{}:", zpod.ipv4);
    ensure!(
        app.stdout().contains(&gateway) && !app.stdout().contains(&zpod_peer),
        "the app's report: {}",
        app.stdout()
    );

    // The namespace's label removed while both pods run: the agent takes them out of the mesh
    // and ztunnel releases them (Istio's DelWorkload). The client then reaches the app
    // directly: still captured without ztunnel's listeners, it would be refused.
    n.api.set_namespace("mesh", json!({}));
    wait_until("both pods out of the mesh", Duration::from_secs(15), || {
        Ok(n.annotation("mesh", "client").is_null() && n.annotation("mesh", "server").is_null())
    })
    .with_context(|| format!("agent:\n{}", n.agent.log()))?;
    let through_ztunnel = || {
        ztunnel
            .stdout()
            .lines()
            .filter(|l| l.contains("connection complete"))
            .count()
    };
    let before = through_ztunnel();
    let text = request()?;
    ensure!(
        text.contains("\"status\":\"probe\""),
        "the client out of the mesh got {text:?}\nagent:\n{}",
        n.agent.log()
    );
    std::thread::sleep(Duration::from_millis(500));
    ensure!(
        through_ztunnel() == before,
        "a connection of a pod out of the mesh went through ztunnel:\n{}",
        ztunnel.stdout()
    );
    Ok(())
}
