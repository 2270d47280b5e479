//! TPROXY interception mode (`sidecar.istio.io/interceptionMode: TPROXY`): the app sees the real
//! client address. Checked three ways:
//! - an unmodified HAProxy sidecar (`usesrc clientip`, UID 1337 with CAP_NET_ADMIN) through
//!   sidestep, IPv4 and IPv6, meshed and unmeshed clients;
//! - differentially: an Envoy-like transparent proxy (original_src with mark 1337, run as root
//!   as Istio's TPROXY injection runs Envoy) under Istio's real TPROXY ruleset and under
//!   sidestep, with identical outcomes;
//! - the boundary: Istio's ruleset sends a UID-1337 transparent proxy's upstream through its nat
//!   hairpin rule, so that proxy cannot reach its app; sidestep lets it (an intended
//!   improvement, asserted on both sides).
//!
//! Needs root; skips otherwise.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv, haproxy, http_get,
    istio_iptables::{IstioCapture, Mode},
    nginx,
    parity::Oracle,
    sidestep::Loaded,
    skip_unless_root, url, wait_for_tcp,
};

const APP_UID: u32 = 1000;

fn transparent_proxy() -> &'static str {
    env!("CARGO_BIN_EXE_transparent-proxy")
}

/// The client address nginx saw, from `GET /whoami` (`remote=<ip>:<port> local=...`).
fn seen_by_app(env: &TestEnv, from: &Pod, server_ip: IpAddr) -> Result<IpAddr> {
    let body = http_get(env, from, APP_UID, &url(server_ip, 80, "/whoami"))?;
    let remote = body
        .split_whitespace()
        .find_map(|w| w.strip_prefix("remote="))
        .with_context(|| format!("no remote= in {body:?}"))?;
    let ip = remote
        .rsplit_once(':')
        .map(|(ip, _)| ip)
        .context("remote has no port")?;
    ip.parse().with_context(|| format!("remote address {ip:?}"))
}

/// `ip rule` and `ip route` state of the pod that TPROXY mode adds, and the sysctl.
fn tproxy_routing(pod: &Pod) -> Result<(bool, bool, String)> {
    let rules = pod.ip(&["rule", "show"])?;
    let route = pod.ip(&["route", "show", "table", "133"])?;
    let accept = pod.in_netns(|| {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_fwmark_accept").unwrap_or_default()
    })?;
    Ok((
        rules.contains("fwmark 0x539 lookup 133"),
        route.contains("local default dev lo"),
        accept.trim().to_string(),
    ))
}

#[test]
fn tproxy_mode_app_sees_the_real_client_through_haproxy() -> Result<()> {
    if skip_unless_root("tproxy_mode_app_sees_the_real_client_through_haproxy") {
        return Ok(());
    }
    let env = TestEnv::new("tproxy-haproxy")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let outsider = node.add_pod("outsider")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;
    loaded.enroll(&server, &["--interception-mode", "TPROXY"])?;
    ensure!(
        tproxy_routing(&server)? == (true, true, "1".into()),
        "TPROXY routing not installed: {:?}",
        tproxy_routing(&server)?
    );
    let _client_proxy = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let server_proxy = haproxy::Sidecar::start(
        &env,
        &server,
        haproxy::SidecarConfig {
            transparent: true,
            ..Default::default()
        },
    )?;

    // Mesh to mesh: client app -> client HAProxy -> server HAProxy (sk_assign) -> nginx, which
    // sees the client pod's address, not 127.0.0.6.
    let seen = seen_by_app(&env, &client, server.ipv4.into())?;
    ensure!(
        seen == IpAddr::from(client.ipv4),
        "nginx saw {seen}, want the client pod {}",
        client.ipv4
    );
    server_proxy.wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    // Unmeshed client, both families.
    ensure!(seen_by_app(&env, &outsider, server.ipv4.into())? == IpAddr::from(outsider.ipv4));
    let v6 = server.ipv6.context("no IPv6")?;
    let outsider_v6 = outsider.ipv6.context("no IPv6")?;
    ensure!(seen_by_app(&env, &outsider, v6.into())? == IpAddr::from(outsider_v6));
    // The app calling its own pod over lo is not a TPROXY passthrough: it still works, and
    // sees itself.
    ensure!(seen_by_app(&env, &server, server.ipv4.into())? == IpAddr::from(server.ipv4));

    // Unenrolment takes the routing away again.
    loaded.unenroll(&server)?;
    ensure!(
        tproxy_routing(&server)? == (false, false, "0".into()),
        "TPROXY routing left behind: {:?}",
        tproxy_routing(&server)?
    );
    Ok(())
}

/// One run of the Envoy-like scenario: what the app saw, and what the proxy reported.
#[derive(Debug, PartialEq, Eq)]
struct Observed {
    app_saw: IpAddr,
    proxy_local: String,
}

fn envoy_like_round(env: &TestEnv, server: &Pod, outsider: &Pod, side: &str) -> Result<Observed> {
    let mut proxy = server.spawn(
        env,
        Spawn::new(&[transparent_proxy(), "0.0.0.0:15006", "--mark", "1337"]),
    )?;
    wait_for_tcp(server, "127.0.0.1:15006".parse()?, Duration::from_secs(5))?;
    let app_saw = seen_by_app(env, outsider, server.ipv4.into()).with_context(|| {
        format!(
            "{side}: through the transparent proxy (its first lines: {:?}; stderr {:?})",
            proxy.stdout().lines().take(4).collect::<Vec<_>>(),
            proxy.stderr()
        )
    })?;
    let line: Value = serde_json::from_str(
        proxy
            .stdout()
            .lines()
            .next()
            .context("the transparent proxy accepted nothing")?,
    )?;
    ensure!(line.get("error").is_none(), "proxy: {line}");
    proxy.kill()?;
    Ok(Observed {
        app_saw,
        proxy_local: line["local"].as_str().unwrap_or_default().to_string(),
    })
}

#[test]
fn tproxy_mode_matches_istios_ruleset_and_fixes_its_uid_hairpin() -> Result<()> {
    if skip_unless_root("tproxy_mode_matches_istios_ruleset_and_fixes_its_uid_hairpin") {
        return Ok(());
    }
    let env = TestEnv::new("tproxy-parity")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let server = node.add_pod("server")?;
    let outsider = node.add_pod("outsider")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let want = Observed {
        app_saw: outsider.ipv4.into(),
        proxy_local: format!("{}:80", server.ipv4),
    };
    let haproxy_uid_1337 = haproxy::SidecarConfig {
        transparent: true,
        ..Default::default()
    };

    // Oracle: Istio's TPROXY ruleset (mangle TPROXY, connmark, fwmark 1337 -> table 133).
    let mut oracle = Oracle::new(&server);
    oracle.apply(&IstioCapture {
        mode: Mode::Tproxy,
        ..Default::default()
    })?;
    let istio = envoy_like_round(&env, &server, &outsider, "istio")?;
    // The boundary: a UID-1337 transparent proxy's upstream matches Istio's nat hairpin rule
    // and is redirected back to 15006 from a foreign source, so the app is never reached.
    let istio_uid_proxy = {
        let _proxy = haproxy::Sidecar::start(&env, &server, haproxy_uid_1337)?;
        seen_by_app(&env, &outsider, server.ipv4.into())
    };
    oracle.clear()?;

    let loaded = Loaded::load(&env)?;
    loaded.enroll(&server, &["--interception-mode", "TPROXY"])?;
    let ours = envoy_like_round(&env, &server, &outsider, "sidestep")?;
    let ours_uid_proxy = {
        let _proxy = haproxy::Sidecar::start(&env, &server, haproxy_uid_1337)?;
        seen_by_app(&env, &outsider, server.ipv4.into())
    };
    loaded.unenroll(&server)?;

    println!("envoy-like, istio:    {istio:?}");
    println!("envoy-like, sidestep: {ours:?}");
    println!("haproxy uid 1337, istio:    {istio_uid_proxy:?}");
    println!("haproxy uid 1337, sidestep: {ours_uid_proxy:?}");
    ensure!(
        istio == want,
        "Istio's ruleset gave {istio:?}, want {want:?}"
    );
    ensure!(ours == istio, "sidestep {ours:?} != Istio {istio:?}");
    ensure!(
        istio_uid_proxy.is_err(),
        "Istio's ruleset let a UID-1337 transparent proxy through; the documented boundary moved"
    );
    ensure!(
        ours_uid_proxy? == want.app_saw,
        "sidestep: the UID-1337 transparent proxy's app did not see the client"
    );
    Ok(())
}
