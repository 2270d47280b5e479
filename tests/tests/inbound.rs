//! Inbound capture (tc ingress or sk_lookup, each with bpf_sk_assign), cross-pod through HAProxy
//! sidecars on both pods. Needs root; skips otherwise.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv,
    bench::netstat::{tcp_counters, time_wait},
    haproxy, http_get, nginx,
    sidestep::Loaded,
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

// A test target's modules resolve beside it, not in a directory of its name.
#[path = "inbound/forged_v4.rs"]
mod forged_v4;
#[path = "inbound/listener_slot.rs"]
mod listener_slot;

/// Runs `probe ARGS` as root in `pod` (packet and raw sockets need CAP_NET_RAW) for a crafted
/// SYN (`vlan-syn`, `spoof-syn`), checks that it sent it, and returns its report.
fn crafted_syn(env: &TestEnv, pod: &Pod, args: &[&str]) -> Result<Value> {
    let argv = [&[probe()], args].concat();
    let out = pod.run(env, 0, &argv)?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.lines().last().unwrap_or_default())
        .with_context(|| format!("probe {} printed {text:?}: {out:?}", args[0]))?;
    ensure!(v["sent"] == 1, "{}: {v}", args[0]);
    Ok(v)
}

fn counter(loaded: &Loaded, pod: &Pod, name: &str) -> Result<u64> {
    let counters = loaded
        .counters(pod.netns_cookie()?)?
        .with_context(|| format!("pod {} is not enrolled", pod.name))?;
    counters[name].as_u64().context("counter missing")
}

#[test]
fn inbound_through_both_sidecars_v4_and_v6() -> Result<()> {
    if skip_unless_root("inbound_through_both_sidecars_v4_and_v6") {
        return Ok(());
    }
    inbound_through_both_sidecars("tc")
}

/// The same with the sk_lookup hook alone: no tc program anywhere, same outcomes.
#[test]
fn inbound_through_both_sidecars_with_the_sk_lookup_hook() -> Result<()> {
    if skip_unless_root("inbound_through_both_sidecars_with_the_sk_lookup_hook") {
        return Ok(());
    }
    inbound_through_both_sidecars("sk_lookup")
}

/// `sidestep status`'s one row for the per-pod identity programs, which sums them.
fn identity_row(status: &Value) -> Option<&Value> {
    status["programs"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == "sidestep_pod_id")
}

fn inbound_through_both_sidecars(hook: &str) -> Result<()> {
    let env = TestEnv::new(&format!("inbound-{}", &hook[..2]))?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let outsider = node.add_pod("outsider")?;
    let web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    let hook_args = ["--inbound-hook", hook];
    loaded.enroll(&client, &hook_args)?;
    loaded.enroll(&server, &hook_args)?;
    // What each hook leaves in the kernel: tc links per interface, or none at all.
    let tc_links = |pod: &Pod| -> Result<usize> {
        let dir = env
            .pin_root()
            .join("links/tc")
            .join(pod.netns_cookie()?.to_string());
        Ok(std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0))
    };
    let expected_tc = usize::from(hook == "tc");
    ensure!(
        tc_links(&server)? == expected_tc,
        "{hook}: {} tc links on the server",
        tc_links(&server)?
    );
    ensure!(
        env.pin_root()
            .join("links/sklookup")
            .join(server.netns_cookie()?.to_string())
            .exists(),
        "{hook}: no sk_lookup link"
    );
    // `sidestep status` names the hook and the captured interface either way.
    let status = loaded.status()?;
    let row = status["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["netns_cookie"] == server.netns_cookie().unwrap_or(0))
        .context("server not in status")?;
    ensure!(
        row["inbound_hook"] == hook
            && row["inbound_ifindexes"]
                .as_array()
                .is_some_and(|v| v.len() == 1),
        "status row: {row}"
    );
    // The two pods' identity programs are not pinned as programs; status still lists them, as
    // one row that sums them.
    let identity = identity_row(&status).context("no sidestep_pod_id row in status")?;
    ensure!(
        identity["instances"] == 2 && identity["id"] == 0,
        "{hook}: identity row {identity}"
    );
    let body = nginx::body_for("server");

    // The server is captured inbound and its sidecar is not up yet: the SYN is dropped, so even
    // an unmeshed client cannot reach the app around the proxy (fail closed).
    let v4 = url(server.ipv4.into(), 80, "/");
    ensure!(
        http_get(&env, &outsider, APP_UID, &v4).is_err(),
        "reached the app around the proxy"
    );

    let _client_proxy = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let server_proxy = haproxy::Sidecar::start(&env, &server, Default::default())?;

    // Mesh to mesh, IPv4: client app -> client HAProxy -> server HAProxy (sk_assign) -> nginx.
    ensure!(http_get(&env, &client, APP_UID, &v4)? == body);
    // The server's proxy logged the original destination it forwarded to.
    server_proxy.wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    // One count per captured connection, meshed and not: tc's own socket lookups run the pod's
    // sk_lookup program nested inside them, and that run must neither steer nor count again;
    // with the sk_lookup hook, its one run counts.
    for from in [&client, &outsider] {
        let before = counter(&loaded, &server, "redirected_inbound")?;
        for _ in 0..5 {
            ensure!(http_get(&env, from, APP_UID, &v4)? == body);
        }
        let counted = counter(&loaded, &server, "redirected_inbound")? - before;
        ensure!(
            counted == 5,
            "5 connections from {} counted {counted} times",
            from.name
        );
    }
    // nginx sees Istio's inbound passthrough source.
    let log = web.access_log();
    ensure!(log.contains("127.0.0.6"), "nginx log: {log}");
    ensure!(counter(&loaded, &server, "redirected_inbound")? >= 1);

    // Unmeshed client to meshed server, IPv6: HAProxy takes the destination from getsockname,
    // which sk_assign leaves as the original destination.
    let v6 = url(server.ipv6.context("no IPv6")?.into(), 80, "/");
    ensure!(
        http_get(&env, &outsider, APP_UID, &v6)? == body,
        "IPv6 inbound failed"
    );

    // Excluded inbound ports are not captured: 15020 reaches a plain listener directly.
    let _metrics = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "0.0.0.0:15020", "-", "--no-forward"])
            .user(APP_UID, APP_UID),
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let out = outsider.run(
        &env,
        APP_UID,
        &[
            probe(),
            "connect",
            &SocketAddr::new(server.ipv4.into(), 15020).to_string(),
        ],
    )?;
    let seen: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(seen["peer"] == format!("{}:15020", server.ipv4), "{seen}");
    ensure!(counter(&loaded, &server, "passed_inbound")? >= 1);

    // The proxy's accepted socket sees the original destination in SO_ORIGINAL_DST and
    // getsockname, and the real client as its peer.
    // The listener opens after the enrolment that names its port, as a sidecar starts after
    // CNI ADD: the sk_lookup hook knows a proxy's listener only from its listen(2).
    loaded.enroll(
        &server,
        &["--inbound-port", "15007", "--inbound-hook", hook],
    )?;
    let observer = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "0.0.0.0:15007", "-", "--no-forward"])
            .user(PROXY_UID, PROXY_UID),
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let target = SocketAddr::new(server.ipv4.into(), 8080);
    outsider.run(&env, APP_UID, &[probe(), "connect", &target.to_string()])?;
    std::thread::sleep(Duration::from_millis(200));
    let line: Value = serde_json::from_str(
        observer
            .stdout()
            .lines()
            .next()
            .context("the inbound listener saw nothing")?,
    )?;
    ensure!(line["local"] == target.to_string(), "getsockname: {line}");
    ensure!(
        line["orig_v4"]["addr"] == target.to_string(),
        "SO_ORIGINAL_DST: {line}"
    );
    ensure!(
        line["peer"]
            .as_str()
            .unwrap_or("")
            .starts_with(&outsider.ipv4.to_string()),
        "peer: {line}"
    );

    // Unenrolled, the server's links are gone; the client keeps its own.
    let server_sk_lookup = env
        .pin_root()
        .join("links/sklookup")
        .join(server.netns_cookie()?.to_string());
    loaded.unenroll(&server)?;
    let status = loaded.status()?;
    ensure!(
        status["pods"].as_array().map(Vec::len) == Some(1),
        "{status}"
    );
    let links = env.pin_root().join("links/tc");
    ensure!(
        std::fs::read_dir(&links).map(|d| d.count()).unwrap_or(0) == expected_tc,
        "tc links left for the server"
    );
    ensure!(
        !server_sk_lookup.exists(),
        "sk_lookup link left for the server"
    );
    ensure!(tc_links(&client)? == expected_tc);
    let identities = identity_row(&status).map(|p| p["instances"].clone());
    ensure!(
        identities == Some(serde_json::json!(1)),
        "identity programs after the server left: {identities:?}"
    );
    Ok(())
}

/// A client that reuses its source ports faster than TIME_WAIT ends: each new SYN lands on a
/// 4-tuple the server pod still holds in TIME_WAIT. tc leaves such SYNs to the kernel, and
/// sk_lookup steers the kernel's TIME_WAIT recycling to the proxy; without it they were lost.
#[test]
fn port_reuse_onto_time_wait_still_reaches_the_proxy() -> Result<()> {
    if skip_unless_root("port_reuse_onto_time_wait_still_reaches_the_proxy") {
        return Ok(());
    }
    port_reuse_onto_time_wait(ProxiesListen::AfterEnrolment)
}

/// The same when the proxies listened before their pods were enrolled, as in a pod the agent
/// repairs or an ADD into a running netns: sock_ops never saw the listen(2), so tc ingress
/// registers the listener for sk_lookup when it first leaves a SYN to TIME_WAIT recycling.
/// Before that, every such SYN was refused for the whole TIME_WAIT period.
#[test]
fn port_reuse_onto_time_wait_reaches_a_proxy_that_listened_before_enrolment() -> Result<()> {
    if skip_unless_root("port_reuse_onto_time_wait_reaches_a_proxy_that_listened_before_enrolment")
    {
        return Ok(());
    }
    port_reuse_onto_time_wait(ProxiesListen::BeforeEnrolment)
}

#[derive(Clone, Copy, PartialEq)]
enum ProxiesListen {
    AfterEnrolment,
    BeforeEnrolment,
}

fn port_reuse_onto_time_wait(when: ProxiesListen) -> Result<()> {
    let env = TestEnv::new("timewait")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    let start_sidecars = || -> Result<_> {
        Ok((
            haproxy::Sidecar::start(&env, &client, Default::default())?,
            haproxy::Sidecar::start(&env, &server, Default::default())?,
        ))
    };
    let early = match when {
        ProxiesListen::BeforeEnrolment => Some(start_sidecars()?),
        ProxiesListen::AfterEnrolment => None,
    };
    loaded.enroll(&client, &["--inbound-hook", "tc"])?;
    loaded.enroll(&server, &["--inbound-hook", "tc"])?;
    let _sidecars = match early {
        Some(s) => s,
        None => start_sidecars()?,
    };
    // 101 source ports for 300 connections: most reuse a 4-tuple in TIME_WAIT on the server.
    sidestep_tests::netns::set_sysctl(
        &client.netns_path,
        "net.ipv4.ip_local_port_range",
        "40000 40100",
    )?;
    let target = url(server.ipv4.into(), 80, "/");
    // curl's own leg to the client sidecar ends in TIME_WAIT on curl's side about half the time
    // (it closes as the proxy does). Kept in the 101-port range, those loopback 4-tuples could
    // use it up and fail a connect with EADDRNOTAVAIL before any SYN left; they get their own.
    let mut argv = vec![
        "curl",
        "-sS",
        "--local-port",
        "30000-30999",
        "--max-time",
        "2",
        "-H",
        "Connection: close",
        "-o",
        "/dev/null",
    ];
    argv.extend(["-w", "%{http_code}\n"]);
    const REQUESTS: usize = 300;
    for _ in 0..REQUESTS {
        argv.push(&target);
    }
    let before = tcp_counters(&client)?;
    let out = client.run(&env, APP_UID, &argv)?;
    let ok = String::from_utf8_lossy(&out.stdout).matches("200").count();
    let retransmitted = tcp_counters(&client)?.since(before).syn_retrans;
    ensure!(
        ok == REQUESTS,
        "{ok}/{REQUESTS} requests succeeded ({retransmitted} SYNs retransmitted): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    // The client's sidecar retries a refused SYN after its 1 s RTO, so requests still succeed
    // when the TIME_WAIT path fails; only the retransmissions show it.
    ensure!(
        retransmitted == 0,
        "{retransmitted} SYNs retransmitted: SYNs onto TIME_WAIT 4-tuples were not taken by the proxy"
    );
    ensure!(
        time_wait(&server)? > 101,
        "fewer TIME_WAIT sockets than source ports: no 4-tuple was reused"
    );
    ensure!(counter(&loaded, &server, "redirected_inbound")? >= REQUESTS as u64);
    Ok(())
}

/// tc ingress registers a proxy's listener for the pod that a SYN's destination names only when
/// its socket lookup ran in that pod's netns: a SYN crafted to another pod's MAC, with the
/// victim's address as destination, must not put the other pod's listener in the victim's slot
/// (issue 35; `inbound/listener_slot.rs`).
#[test]
fn a_crafted_syn_cannot_register_another_pods_listener() -> Result<()> {
    if skip_unless_root("a_crafted_syn_cannot_register_another_pods_listener") {
        return Ok(());
    }
    listener_slot::a_crafted_syn_cannot_register_another_pods_listener()
}

/// A SYN behind two VLAN 0 (802.1p priority) tags reaches the stack as plain IP: the kernel
/// strips one tag before tc and the other after it, so tc's parser sees a VLAN header where the
/// TCP segment will be. Inbound capture must not depend on that parse. Nothing listens on the
/// SYN's port in the server pod, so only its proxy (a HAProxy sidecar on 15006) can answer with
/// a SYN-ACK: before enrolment every frame is refused (a RST: they are frames the stack takes),
/// after it, under either hook, every one gets the proxy's SYN-ACK.
#[test]
fn a_syn_behind_vlan_tags_is_captured_under_both_hooks() -> Result<()> {
    if skip_unless_root("a_syn_behind_vlan_tags_is_captured_under_both_hooks") {
        return Ok(());
    }
    let env = TestEnv::new("inbound-vlan")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let loaded = Loaded::load(&env)?;
    let mac = server.mac("eth0")?;
    let (src, dst) = (client.ipv4.to_string(), format!("{}:8080", server.ipv4));
    // Root in the client pod: a packet socket needs CAP_NET_RAW.
    let reply = |tags: &str| -> Result<String> {
        let argv = ["vlan-syn", "eth0", &mac, &src, &dst, "--tags", tags];
        let v = crafted_syn(&env, &client, &argv)?;
        Ok(v["reply"].as_str().unwrap_or_default().to_owned())
    };
    for tags in ["0", "2"] {
        let got = reply(tags)?;
        ensure!(got == "rst", "not enrolled, {tags} tags: {got}");
    }
    for hook in ["tc", "sk_lookup"] {
        loaded.enroll(&server, &["--inbound-hook", hook])?;
        let sidecar = haproxy::Sidecar::start(&env, &server, Default::default())?;
        for tags in ["0", "2"] {
            let got = reply(tags)?;
            ensure!(
                got == "syn-ack",
                "{hook} hook, {tags} tags: {got} (not the proxy's SYN-ACK)"
            );
        }
        drop(sidecar);
        loaded.unenroll(&server)?;
    }
    Ok(())
}

/// IPv6 accepts a packet from the wire whose source is one of the receiving host's own
/// addresses, and the kernel reports the pod's own IPv6 connections to itself on the address's
/// interface rather than on lo. So a local source proves nothing by itself: a SYN from another
/// pod forging the server pod's own address (or ::6, the proxy's passthrough source) must be
/// captured, as Istio's PREROUTING captures it, while the pod's real connections to itself and
/// the proxy's hand-off from ::6 still reach the app.
#[test]
fn a_forged_local_source_from_off_the_pod_is_captured() -> Result<()> {
    if skip_unless_root("a_forged_local_source_from_off_the_pod_is_captured") {
        return Ok(());
    }
    let env = TestEnv::new("inbound-forged")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let attacker = node.add_pod("attacker")?;
    let server = node.add_pod("server")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&server, &[])?;
    let server6 = server.ipv6.context("dual-stack server has no IPv6")?;
    let app_addr = format!("[{server6}]:8080");
    let mut proxy = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "[::]:15006", "-", "--no-forward"])
            .user(PROXY_UID, PROXY_UID),
    )?;
    let mut app = server.spawn(
        &env,
        Spawn::new(&[
            probe(),
            "proxy",
            "[::]:8080",
            "-",
            "--no-forward",
            "--v6only",
        ])
        .user(APP_UID, APP_UID),
    )?;
    sidestep_tests::wait_listening(
        &mut proxy,
        &["[::]:15006".parse()?],
        Duration::from_secs(10),
    )?;
    sidestep_tests::wait_listening(&mut app, &["[::]:8080".parse()?], Duration::from_secs(10))?;

    for forged in [server6.to_string(), "::6".to_string()] {
        let before = counter(&loaded, &server, "redirected_inbound")?;
        crafted_syn(&env, &attacker, &["spoof-syn", &forged, &app_addr])?;
        std::thread::sleep(Duration::from_millis(300));
        let after = counter(&loaded, &server, "redirected_inbound")?;
        // Captured, the proxy's SYN-ACK goes to the forged source, the pod itself, and the
        // kernel's lookup for it is counted too: at least one.
        ensure!(
            after > before,
            "a SYN forging {forged} from another pod was not captured (redirected_inbound \
             {before} -> {after})"
        );
    }

    // The pod's own connection to its own address, and the proxy's hand-off from ::6: the app's.
    own_connections_reach_the_app(&env, &loaded, &server, &app, &app_addr, "[::6]:0")
}

/// The pod's own connection to its own address (`app_addr`), and the proxy's hand-off from
/// `passthrough` (127.0.0.6 or ::6), both reach `app` and neither is captured inbound.
fn own_connections_reach_the_app(
    env: &TestEnv,
    loaded: &Loaded,
    server: &Pod,
    app: &ChildGuard,
    app_addr: &str,
    passthrough: &str,
) -> Result<()> {
    let before = counter(loaded, server, "redirected_inbound")?;
    let accepted_before = app.stdout().lines().count();
    let self_call = server.run(env, APP_UID, &[probe(), "connect", app_addr])?;
    ensure!(self_call.status.success(), "self call: {self_call:?}");
    let handoff = server.run(
        env,
        PROXY_UID,
        &[probe(), "connect", app_addr, "--bind", passthrough],
    )?;
    ensure!(
        handoff.status.success(),
        "hand-off from {passthrough}: {handoff:?}"
    );
    std::thread::sleep(Duration::from_millis(300));
    ensure!(
        app.stdout().lines().count() == accepted_before + 2,
        "the app did not accept the pod's own connections: {}",
        app.stdout()
    );
    ensure!(
        counter(loaded, server, "redirected_inbound")? == before,
        "the pod's own connections were captured inbound"
    );
    Ok(())
}

/// The same over IPv4, forging 127.0.0.6 into a pod whose `route_localnet` is on (kube-proxy's
/// node setting, copied into new netns), where the kernel takes a loopback source from the wire
/// (`inbound/forged_v4.rs`).
#[test]
fn a_forged_ipv4_loopback_source_is_captured_with_route_localnet() -> Result<()> {
    if skip_unless_root("a_forged_ipv4_loopback_source_is_captured_with_route_localnet") {
        return Ok(());
    }
    forged_v4::a_forged_ipv4_loopback_source_is_captured_with_route_localnet()
}
