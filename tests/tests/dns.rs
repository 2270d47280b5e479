//! DNS capture: UDP (unconnected and connected) and TCP to port 53 go to the DNS listener, replies
//! carry the original server's address, and the proxy's own queries are never captured.
//! Needs root; skips otherwise.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{Node, NodeOptions, Pod, Spawn, TestEnv, sidestep::Loaded, skip_unless_root};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

fn query(env: &TestEnv, pod: &Pod, uid: u32, server: &str, connect: bool) -> Result<Value> {
    let mut argv = vec![probe(), "udp-query", server];
    if connect {
        argv.push("--connect");
    }
    let out = pod.run(env, uid, &argv)?;
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("probe said {:?}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn dns_capture_udp_and_tcp() -> Result<()> {
    if skip_unless_root("dns_capture_udp_and_tcp") {
        return Ok(());
    }
    let env = TestEnv::new("dns")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let pod = node.add_pod("app")?;
    let resolver = node.add_pod("resolver")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&pod, &["--dns-capture"])?;

    // The "proxy" DNS listener on 15053 (UDP and TCP), and a real resolver in another pod.
    let _udp4 = pod.spawn(
        &env,
        Spawn::new(&[probe(), "udp-serve", "127.0.0.1:15053"]).user(PROXY_UID, PROXY_UID),
    )?;
    let _udp6 = pod.spawn(
        &env,
        Spawn::new(&[probe(), "udp-serve", "[::1]:15053"]).user(PROXY_UID, PROXY_UID),
    )?;
    let tcp = pod.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "127.0.0.1:15053", "-", "--no-forward"])
            .user(PROXY_UID, PROXY_UID),
    )?;
    let real = format!("{}:53", resolver.ipv4);
    let _upstream = resolver.spawn(&env, Spawn::new(&[probe(), "udp-serve", "0.0.0.0:53"]))?;
    std::thread::sleep(Duration::from_millis(300));

    // Unconnected UDP: answered by the listener, reported as coming from the server asked.
    let r = query(&env, &pod, APP_UID, &real, false)?;
    ensure!(r["from"] == real, "{r}");
    ensure!(
        r["reply"]
            .as_str()
            .unwrap_or("")
            .starts_with("reply to 127.0.0.1:"),
        "not captured: {r}"
    );
    // Connected UDP.
    let r = query(&env, &pod, APP_UID, &real, true)?;
    ensure!(r["from"] == real, "{r}");
    ensure!(
        r["reply"]
            .as_str()
            .unwrap_or("")
            .starts_with("reply to 127.0.0.1:"),
        "not captured: {r}"
    );
    // IPv6 unconnected UDP.
    let real6 = format!("[{}]:53", resolver.ipv6.context("IPv6")?);
    let r = query(&env, &pod, APP_UID, &real6, false)?;
    ensure!(r["from"] == real6, "{r}");
    ensure!(
        r["reply"]
            .as_str()
            .unwrap_or("")
            .starts_with("reply to [::1]:"),
        "v6 not captured: {r}"
    );
    // The proxy's own queries reach the real server.
    let r = query(&env, &pod, PROXY_UID, &real, false)?;
    ensure!(r["from"] == real, "{r}");
    ensure!(
        r["reply"]
            .as_str()
            .unwrap_or("")
            .starts_with(&format!("reply to {}:", pod.ipv4)),
        "proxy query was captured: {r}"
    );
    // TCP to port 53 goes to the TCP listener, which sees the original server.
    pod.run(&env, APP_UID, &[probe(), "connect", &real])?;
    std::thread::sleep(Duration::from_millis(200));
    let line: Value = serde_json::from_str(tcp.stdout().lines().next().context("no TCP query")?)?;
    ensure!(line["orig_v4"]["addr"] == real, "{line}");
    let counters = loaded.counters(pod.netns_cookie()?)?.context("enrolled")?;
    ensure!(counters["dns_redirected"].as_u64() >= Some(4), "{counters}");

    // Without DNS capture, queries go straight to the server.
    loaded.enroll(&pod, &[])?;
    let r = query(&env, &pod, APP_UID, &real, false)?;
    ensure!(
        r["reply"]
            .as_str()
            .unwrap_or("")
            .starts_with(&format!("reply to {}:", pod.ipv4)),
        "captured with DNS capture off: {r}"
    );
    Ok(())
}
