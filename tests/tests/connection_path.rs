//! The per-connection path (issue 38): what the app and an unmodified proxy see must not depend
//! on how long a record lives or when it is cleaned up. Each test names the record-keeping it
//! would catch going wrong: an unclaimed record read by a later connection on its 4-tuple, a
//! reused source port reporting the destination of the port's last connection, and an app's
//! original peer lost to newer connections. Real pods from the CNI bridge plugin, sidestep in
//! this test's own cgroup and pin root. Needs root; skips otherwise.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv,
    loadgen::{self, OUTBOUND},
    net::wait_listening,
    process::ChildGuard,
    sidestep::Loaded,
    skip_unless_root,
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// `probe connect-sock TO --bind FROM --reuseaddr [extra]` in the pod as the app.
fn connect_from(
    env: &TestEnv,
    pod: &Pod,
    from: SocketAddr,
    to: &str,
    extra: &[&str],
) -> Result<Value> {
    let from = from.to_string();
    let mut argv = vec![probe(), "connect-sock", to, "--bind", &from, "--reuseaddr"];
    argv.extend_from_slice(extra);
    let out = pod.run(env, APP_UID, &argv)?;
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "connect-sock said {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// An Envoy-like proxy on the outbound port that reports each connection and forwards nothing.
fn start_proxy(env: &TestEnv, pod: &Pod) -> Result<ChildGuard> {
    let argv = [probe(), "proxy", OUTBOUND, "-", "--no-forward"];
    let mut proxy = pod.spawn(env, Spawn::new(&argv).user(PROXY_UID, PROXY_UID))?;
    wait_listening(&mut proxy, &[OUTBOUND.parse()?], Duration::from_secs(10))?;
    Ok(proxy)
}

/// A captured connect whose handshake fails leaves a record nobody claims. A later connection
/// that the pod's app makes straight to the proxy's port, from the pod's own address and the
/// same port, is not captured: the proxy must get netfilter's ENOENT for it, not the failed
/// connection's destination.
#[test]
fn an_unclaimed_record_is_not_read_by_an_uncaptured_connection_on_its_tuple() -> Result<()> {
    if skip_unless_root("an_unclaimed_record_is_not_read_by_an_uncaptured_connection_on_its_tuple")
    {
        return Ok(());
    }
    let env = TestEnv::new("unclaimed")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;
    let source = SocketAddr::new(client.ipv4.into(), 47211);
    let target = SocketAddr::new(server.ipv4.into(), 80).to_string();

    // Nothing listens on the outbound port yet: the redirected SYN is refused.
    let refused = connect_from(&env, &client, source, &target, &[])?;
    ensure!(
        refused["stage"] == "connect" && refused["errno"] == 111,
        "a captured connect with no proxy listening was not refused: {refused}"
    );
    let proxy = start_proxy(&env, &client)?;
    let direct = connect_from(&env, &client, source, OUTBOUND, &["--read", "--linger0"])?;
    ensure!(direct["local"] == source.to_string(), "{direct}");
    let seen = proxy.stdout_json_lines(1, Duration::from_secs(5))?;
    ensure!(
        seen[0]["peer"] == source.to_string() && seen[0]["orig_v4"]["errno"] == 2,
        "an uncaptured connection on a failed redirect's 4-tuple got its destination: {}",
        seen[0]
    );
    Ok(())
}

/// A source port is reused, from the pod's own address to the proxy's port, once its earlier
/// connection has left TIME_WAIT (tcp_tw_reuse=2 reuses a loopback 4-tuple after a second). The
/// new connection reports its own destination, to the proxy and to the app's getpeername.
#[test]
fn a_port_reused_after_time_wait_carries_the_new_destination() -> Result<()> {
    if skip_unless_root("a_port_reused_after_time_wait_carries_the_new_destination") {
        return Ok(());
    }
    let env = TestEnv::new("reuseport")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;
    let proxy = start_proxy(&env, &client)?;
    let source = SocketAddr::new(client.ipv4.into(), 47212);
    let first = SocketAddr::new(server.ipv4.into(), 80).to_string();
    let second = SocketAddr::new(server.ipv4.into(), 8080).to_string();

    // The app reads the proxy's answer and closes after the proxy has: the app's socket is the
    // one left in TIME_WAIT, holding the 4-tuple the second connection takes over.
    let app = connect_from(&env, &client, source, &first, &["--read"])?;
    ensure!(
        app["peer"] == first && app["local"] == source.to_string(),
        "{app}"
    );
    std::thread::sleep(Duration::from_millis(1500));
    let app = connect_from(&env, &client, source, &second, &["--read"])?;
    ensure!(
        app["peer"] == second && app["local"] == source.to_string(),
        "the app's getpeername on a reused port: {app}"
    );
    let seen = proxy.stdout_json_lines(2, Duration::from_secs(5))?;
    for (line, want) in seen.iter().zip([&first, &second]) {
        ensure!(
            line["peer"] == source.to_string() && line["orig_v4"]["addr"] == *want,
            "the proxy's SO_ORIGINAL_DST on a reused port, expected {want}: {line}"
        );
    }
    Ok(())
}

/// An app's getpeername on a connection that stays open while 100,000 newer captured
/// connections come and go (more than every per-connection map holds, and several times the
/// ephemeral port range) still names the peer the app dialled.
#[test]
fn getpeername_outlives_100k_newer_connections() -> Result<()> {
    if skip_unless_root("getpeername_outlives_100k_newer_connections") {
        return Ok(());
    }
    let env = TestEnv::new("outlive")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    // Nothing listens here: a connection that escaped capture would be refused and counted.
    let sink = node.add_pod("sink")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;
    let _echo = loadgen::origdst_echo(&env, &client, probe(), PROXY_UID)?;

    let n: u64 = 100_000;
    let deadline = Duration::from_secs(240) * sidestep_tests::time_scale();
    let held = format!("{}:9999", sink.ipv4);
    let v = loadgen::ConnectMany {
        probe: probe(),
        uid: APP_UID,
        base: format!("{}:10000", sink.ipv4),
        connections: n,
        deadline,
        hold_first: Some(held.clone()),
    }
    .run(&env, &client)?;
    ensure!(
        v["done"] == n && v["ok"] == n,
        "{n} newer connections not all captured within {deadline:?}: {v}"
    );
    ensure!(
        v["held_peer"] == held,
        "getpeername after {n} newer connections: {v}"
    );
    Ok(())
}
