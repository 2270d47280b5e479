//! Outbound capture end to end: real pods from the CNI bridge plugin, an unmodified HAProxy as the
//! client's sidecar, nginx as the server, sidestep loaded into this test's own cgroup and pin root.
//! Needs root; skips otherwise.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv, haproxy, http_get, nginx, sidestep::Loaded,
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;
/// connect4/6, getpeername4/6, sendmsg4/6, recvmsg4/6, sockops, getsockopt, setsockopt, the
/// egress route guard, bind4/6.
const CGROUP_PROGRAMS: usize = 14;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// Runs `probe connect ADDR --http` in `pod` as `uid` (inside the test cgroup unless `outside`).
fn probe_connect(env: &TestEnv, pod: &Pod, uid: u32, addr: SocketAddr) -> Result<Value> {
    let target = addr.to_string();
    let out = pod.run(env, uid, &[probe(), "connect", &target, "--http"])?;
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("probe output {:?}", String::from_utf8_lossy(&out.stdout)))
}

fn counter(loaded: &Loaded, pod: &Pod, name: &str) -> Result<u64> {
    let cookie = pod.netns_cookie()?;
    let counters = loaded
        .counters(cookie)?
        .with_context(|| format!("pod {} is not enrolled", pod.name))?;
    counters[name].as_u64().context("counter missing")
}

fn can_fetch(env: &TestEnv, pod: &Pod, uid: u32, u: &str) -> bool {
    http_get(env, pod, uid, u).is_ok()
}

#[test]
fn outbound_capture_end_to_end() -> Result<()> {
    if skip_unless_root("outbound_capture_end_to_end") {
        return Ok(());
    }
    let env = TestEnv::new("outbound")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let bystander = node.add_pod("bystander")?;
    let _web80 = nginx::Server::start(&env, &server, 80)?;
    let _web8080 = nginx::Server::start(&env, &server, 8080)?;
    let body = nginx::body_for("server");
    let server_v4 = url(server.ipv4.into(), 80, "/");

    let loaded = Loaded::load(&env)?;
    // The loader exited and capture is in place: nothing of ours runs, yet the links are attached.
    let status = loaded.status()?;
    ensure!(
        status["attachments"].as_array().map(Vec::len) == Some(CGROUP_PROGRAMS),
        "{status}"
    );
    loaded.enroll(&client, &[])?;

    // Without a sidecar, a captured connect has nowhere to go: that proves capture.
    ensure!(
        !can_fetch(&env, &client, APP_UID, &server_v4),
        "captured request succeeded without a sidecar"
    );

    let mut sidecar = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let got = http_get(&env, &client, APP_UID, &server_v4)?;
    ensure!(got == body, "body {got:?}");
    sidecar.wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    ensure!(counter(&loaded, &client, "redirected_outbound")? >= 1);
    ensure!(counter(&loaded, &client, "orig_dst_hits")? >= 1);

    // The app sees the server as its peer, as under iptables REDIRECT.
    let seen = probe_connect(
        &env,
        &client,
        APP_UID,
        SocketAddr::new(server.ipv4.into(), 80),
    )?;
    ensure!(seen["peer"] == format!("{}:80", server.ipv4), "{seen}");
    ensure!(
        seen["status"].as_str().unwrap_or("").contains("200"),
        "{seen}"
    );

    // An IPv4-mapped destination on an AF_INET6 socket is captured like IPv4.
    let mapped: SocketAddr = format!("[::ffff:{}]:80", server.ipv4).parse()?;
    let seen = probe_connect(&env, &client, APP_UID, mapped)?;
    ensure!(seen["peer"] == mapped.to_string(), "{seen}");
    ensure!(
        seen["status"].as_str().unwrap_or("").contains("200"),
        "{seen}"
    );

    // Nothing else is touched: a netns that is not enrolled ...
    ensure!(can_fetch(&env, &bystander, APP_UID, &server_v4));
    // ... processes outside the test cgroup ...
    sidecar.child().kill()?;
    let out = client.run_outside_cgroup(
        &env,
        APP_UID,
        &["curl", "-sS", "--max-time", "5", &server_v4],
    )?;
    ensure!(out.status.success(), "outside the cgroup: {out:?}");
    // ... the proxy's own connections (it would loop otherwise) ...
    ensure!(
        can_fetch(&env, &client, PROXY_UID, &server_v4),
        "proxy uid was captured"
    );
    ensure!(
        !can_fetch(&env, &client, APP_UID, &server_v4),
        "app not captured"
    );
    // ... and loopback (with no sidecar, a captured connect would fail).
    let _local = client.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "127.0.0.1:9999", "-", "--no-forward"])
            .user(APP_UID, APP_UID),
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let seen = probe_connect(&env, &client, APP_UID, "127.0.0.1:9999".parse()?)?;
    ensure!(
        seen["peer"] == "127.0.0.1:9999",
        "loopback was captured: {seen}"
    );

    // Excluded ports and CIDRs, and destinations outside the include list.
    let server_8080 = url(server.ipv4.into(), 8080, "/");
    loaded.enroll(&client, &["--exclude-outbound-ports", "8080"])?;
    ensure!(
        can_fetch(&env, &client, APP_UID, &server_8080),
        "excluded port captured"
    );
    ensure!(
        !can_fetch(&env, &client, APP_UID, &server_v4),
        "port 80 no longer captured"
    );
    loaded.enroll(
        &client,
        &[
            "--exclude-outbound-ip-ranges",
            &format!("{}/32", server.ipv4),
        ],
    )?;
    ensure!(
        can_fetch(&env, &client, APP_UID, &server_v4),
        "excluded CIDR captured"
    );
    loaded.enroll(&client, &["--include-outbound-ip-ranges", "192.0.2.0/24"])?;
    ensure!(
        can_fetch(&env, &client, APP_UID, &server_v4),
        "destination outside includes captured"
    );
    loaded.enroll(
        &client,
        &[
            "--include-outbound-ip-ranges",
            &format!("{}/24", server.ipv4),
        ],
    )?;
    ensure!(
        !can_fetch(&env, &client, APP_UID, &server_v4),
        "included CIDR not captured"
    );
    ensure!(counter(&loaded, &client, "passed_outbound")? >= 3);

    loaded.unenroll(&client)?;
    ensure!(
        can_fetch(&env, &client, APP_UID, &server_v4),
        "unenrolled pod still captured"
    );
    Ok(())
}

/// SO_ORIGINAL_DST over IPv6 with an Envoy-like proxy (HAProxy 2.6 never asks for
/// IP6T_SO_ORIGINAL_DST), and netfilter's answers for sockets that were not redirected.
#[test]
fn original_destination_v4_v6_and_errors() -> Result<()> {
    if skip_unless_root("original_destination_v4_v6_and_errors") {
        return Ok(());
    }
    let env = TestEnv::new("origdst")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let server_v6 = server.ipv6.context("dual-stack pod has no IPv6")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;

    let mut proxies = Vec::new();
    for listen in ["[::1]:15001", "127.0.0.1:15001", "127.0.0.1:9999"] {
        let mut argv = vec![probe(), "proxy", listen, "-"];
        if listen.ends_with("9999") {
            argv.push("--no-forward");
        }
        proxies.push(client.spawn(&env, Spawn::new(&argv).user(PROXY_UID, PROXY_UID))?);
    }
    std::thread::sleep(Duration::from_millis(300));

    let v6_target = SocketAddr::new(server_v6.into(), 80);
    let seen = probe_connect(&env, &client, APP_UID, v6_target)?;
    ensure!(seen["peer"] == v6_target.to_string(), "{seen}");
    ensure!(
        seen["status"].as_str().unwrap_or("").contains("200"),
        "v6 relay failed: {seen}"
    );
    let v4_target = SocketAddr::new(server.ipv4.into(), 80);
    let seen = probe_connect(&env, &client, APP_UID, v4_target)?;
    ensure!(
        seen["status"].as_str().unwrap_or("").contains("200"),
        "v4 relay failed: {seen}"
    );
    // Loopback is not captured: the listener on 9999 gets a socket nobody redirected.
    probe_connect(&env, &client, APP_UID, "127.0.0.1:9999".parse()?)?;

    std::thread::sleep(Duration::from_millis(200));
    let mut lines = Vec::new();
    for p in &proxies {
        let text = p.stdout();
        let line = text
            .lines()
            .next()
            .with_context(|| format!("a proxy saw nothing: {text:?}"))?;
        lines.push(serde_json::from_str::<Value>(line)?);
    }
    // IPv6: SOL_IP fails as netfilter's IPv4 hook would (ENOENT), SOL_IPV6 answers.
    ensure!(lines[0]["orig_v4"]["errno"] == 2, "{}", lines[0]);
    ensure!(
        lines[0]["orig_v6"]["addr"] == v6_target.to_string(),
        "{}",
        lines[0]
    );
    ensure!(lines[0]["local"] == "[::1]:15001", "{}", lines[0]);
    // IPv4: SOL_IP answers; SOL_IPV6 on an IPv4 socket is the kernel's EOPNOTSUPP, as under
    // iptables (netfilter is never asked).
    ensure!(
        lines[1]["orig_v4"]["addr"] == v4_target.to_string(),
        "{}",
        lines[1]
    );
    ensure!(
        lines[1]["orig_v6"]["errno"] == libc_eopnotsupp(),
        "{}",
        lines[1]
    );
    // Not redirected: netfilter's ENOENT.
    ensure!(lines[2]["orig_v4"]["errno"] == 2, "{}", lines[2]);
    ensure!(
        lines[2]["orig_v6"]["errno"] == libc_eopnotsupp(),
        "{}",
        lines[2]
    );
    ensure!(counter(&loaded, &client, "orig_dst_misses")? >= 2);
    drop(proxies);
    Ok(())
}

/// `load` leaves capture running with no process; `unload` leaves nothing of ours.
#[test]
fn load_survives_the_loader_and_unload_leaves_nothing() -> Result<()> {
    if skip_unless_root("load_survives_the_loader_and_unload_leaves_nothing") {
        return Ok(());
    }
    let env = TestEnv::new("lifecycle")?;
    let pin_root = env.pin_root().display().to_string();
    // Before load, enrolment fails and says how to fix it.
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("pod")?;
    let netns = pod.netns_path.display().to_string();
    let err =
        sidestep_tests::sidestep::sidestep(&["enroll", "--pin-root", &pin_root, "--netns", &netns])
            .expect_err("enrolled without programs");
    ensure!(format!("{err:#}").contains("sidestep load"), "{err:#}");

    let loaded = Loaded::load(&env)?;
    // The host network namespace is never enrolled.
    for host in ["/proc/self/ns/net", "/proc/1/ns/net"] {
        if let Err(err) = sidestep_tests::sidestep::sidestep(&[
            "enroll",
            "--pin-root",
            &pin_root,
            "--netns",
            host,
        ]) {
            let msg = format!("{err:#}");
            ensure!(
                msg.contains("host network namespace") || msg.contains("denied"),
                "{msg}"
            );
        } else {
            anyhow::bail!("enrolled the host netns via {host}");
        }
    }
    ensure!(loaded.status()?["pods"].as_array().map(Vec::len) == Some(0));
    let status = loaded.status()?;
    let map_ids = map_ids(env.pin_root())?;
    ensure!(map_ids.len() >= 6, "maps {map_ids:?}");
    let prog_ids: Vec<u64> = status["programs"]
        .as_array()
        .context("programs")?
        .iter()
        .filter_map(|p| p["id"].as_u64())
        .collect();
    // Plus tc ingress, sk_lookup and the two re-route programs (attached per pod at
    // enrolment) and sk_msg (attached to the sockhash).
    ensure!(prog_ids.len() == CGROUP_PROGRAMS + 5, "{status}");
    let cgroup = env.cgroup_path().display().to_string();
    let shown = std::process::Command::new("bpftool")
        .args(["cgroup", "show", &cgroup])
        .output()?;
    let shown = String::from_utf8_lossy(&shown.stdout);
    for name in [
        "sidestep_connect4",
        "sidestep_sockops",
        "sidestep_getsockopt",
    ] {
        ensure!(shown.contains(name), "{name} not attached: {shown}");
    }
    // Loading again over the pins is an upgrade in place, not a second set of links.
    let again = sidestep_tests::sidestep::sidestep(&[
        "load",
        "--cgroup",
        &cgroup,
        "--pin-root",
        &env.pin_root().display().to_string(),
    ])?;
    ensure!(String::from_utf8_lossy(&again.stdout).contains("upgraded"));
    let status = loaded.status()?;
    ensure!(
        status["attachments"].as_array().map(Vec::len) == Some(CGROUP_PROGRAMS),
        "{status}"
    );

    loaded.unload()?;
    ensure!(!env.pin_root().exists(), "pin root left behind");
    let shown = std::process::Command::new("bpftool")
        .args(["cgroup", "show", &cgroup])
        .output()?;
    ensure!(
        String::from_utf8_lossy(&shown.stdout).trim().is_empty(),
        "still attached: {}",
        String::from_utf8_lossy(&shown.stdout)
    );
    // Program and map objects are freed asynchronously (RCU); give the kernel a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let progs = std::process::Command::new("bpftool")
            .args(["prog", "show"])
            .output()?;
        let progs = String::from_utf8_lossy(&progs.stdout).to_string();
        let left: Vec<u64> = prog_ids
            .iter()
            .copied()
            .filter(|id| progs.lines().any(|l| l.starts_with(&format!("{id}:"))))
            .collect();
        let maps = std::process::Command::new("bpftool")
            .args(["map", "show"])
            .output()?;
        let maps = String::from_utf8_lossy(&maps.stdout).to_string();
        let left_maps: Vec<u64> = map_ids
            .iter()
            .copied()
            .filter(|id| maps.lines().any(|l| l.starts_with(&format!("{id}:"))))
            .collect();
        if left.is_empty() && left_maps.is_empty() {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "programs {left:?} and maps {left_maps:?} still loaded"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// IDs of the maps pinned under the pin root, from bpftool.
fn map_ids(pin_root: &std::path::Path) -> Result<Vec<u64>> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(pin_root.join("maps"))? {
        let path = entry?.path();
        let out = std::process::Command::new("bpftool")
            .args([
                "map",
                "show",
                "pinned",
                &path.display().to_string(),
                "--json",
            ])
            .output()?;
        let v: Value = serde_json::from_slice(&out.stdout)?;
        ids.push(
            v["id"]
                .as_u64()
                .with_context(|| format!("no id for {}", path.display()))?,
        );
    }
    Ok(ids)
}

fn libc_eopnotsupp() -> i64 {
    95
}

/// The proxy's SO_ORIGINAL_DST outlives the app's socket, as a conntrack entry does: a proxy slow
/// to accept still learns where an app that has already closed was going. It does not outlive
/// the 4-tuple: the app calling the proxy's port itself from the same source port afterwards
/// gets netfilter's ENOENT, not the earlier connection's destination.
#[test]
fn original_destination_outlives_the_client_but_not_its_tuple() -> Result<()> {
    if skip_unless_root("original_destination_outlives_the_client_but_not_its_tuple") {
        return Ok(());
    }
    let env = TestEnv::new("origlife")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;
    // Longer than a second, so that the second connection may reuse the first one's 4-tuple
    // from TIME_WAIT (tcp_tw_reuse=2 on loopback).
    let accept_after = Duration::from_millis(1500);
    let ms = accept_after.as_millis().to_string();
    let argv = [
        probe(),
        "proxy",
        "127.0.0.1:15001",
        "-",
        "--no-forward",
        "--accept-after-ms",
        &ms,
    ];
    let proxy = client.spawn(&env, Spawn::new(&argv).user(PROXY_UID, PROXY_UID))?;
    std::thread::sleep(Duration::from_millis(300));

    let target = SocketAddr::new(server.ipv4.into(), 80).to_string();
    let source = "0.0.0.0:47123";
    let connect = |to: &str, extra: &[&str]| -> Result<Value> {
        let mut argv = vec![probe(), "connect-sock", to, "--bind", source, "--reuseaddr"];
        argv.extend_from_slice(extra);
        let out = client.run(&env, APP_UID, &argv)?;
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    // Connects and closes while the proxy has not accepted yet.
    let redirected = connect(&target, &[])?;
    ensure!(
        redirected["local"] == "127.0.0.1:47123" && redirected["peer"] == target,
        "{redirected}"
    );
    let first = proxy.stdout_json_lines(1, accept_after * 4)?;
    ensure!(
        first[0]["peer"] == "127.0.0.1:47123" && first[0]["orig_v4"]["addr"] == target,
        "the proxy accepted after the app closed and lost its destination: {}",
        first[0]
    );
    // The same 4-tuple, straight to the proxy's port.
    let direct = connect("127.0.0.1:15001", &["--read", "--linger0"])?;
    ensure!(direct["local"] == "127.0.0.1:47123", "{direct}");
    let lines = proxy.stdout_json_lines(2, Duration::from_secs(5))?;
    ensure!(
        lines[1]["peer"] == "127.0.0.1:47123" && lines[1]["orig_v4"]["errno"] == 2,
        "a direct connection on a redirected connection's 4-tuple got its destination: {}",
        lines[1]
    );
    Ok(())
}
