//! Ambient: only ztunnel may own the in-pod ports (issue 35, item 3). sidestep steers an ambient
//! pod's captured traffic to whatever listens on 15001, 15006, 15008 and 15053 in the pod, and its
//! ADD does not wait for ztunnel, so an app that took one of them first would receive captured
//! traffic with no policy applied. cgroup/bind4/6 refuse those binds to any socket without
//! ztunnel's mark (which takes CAP_NET_ADMIN or CAP_NET_RAW to set), and sock_ops registers only
//! a marked listener for sk_lookup: a socket bound before the pod was enrolled, listening after,
//! must not be handed the pod's inbound connections. Sidecar pods keep the kernel's behaviour, as
//! under istio-iptables. Needs root; skips otherwise.

use std::{
    net::{TcpListener, UdpSocket},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv, sidestep::Loaded, skip_unless_root,
};

const APP_UID: u32 = 1000;
/// ztunnel's in-pod socket mark (Istio's InpodMark).
const ZTUNNEL_MARK: &str = "1337";
const EPERM: i64 = 1;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// `probe bind ADDR ARGS` in `pod` as `uid`: its JSON answer.
fn bind(env: &TestEnv, pod: &Pod, uid: u32, addr: &str, args: &[&str]) -> Result<Value> {
    let mut argv = vec![probe(), "bind", addr];
    argv.extend_from_slice(args);
    let out = pod.run(env, uid, &argv)?;
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("probe said {:?}", String::from_utf8_lossy(&out.stdout)))
}

/// Waits until `child` has printed `needle`.
fn wait_for_output(child: &mut ChildGuard, needle: &str) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !child.stdout().contains(needle) {
        child.ensure_running()?;
        ensure!(
            std::time::Instant::now() < deadline,
            "no {needle} from the probe: {}",
            child.stdout()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[test]
fn only_ztunnel_binds_ztunnels_ports_in_an_ambient_pod() -> Result<()> {
    if skip_unless_root("only_ztunnel_binds_ztunnels_ports_in_an_ambient_pod") {
        return Ok(());
    }
    let env = TestEnv::new("ambient-ports")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let ambient = node.add_pod("ambient")?;
    let sidecar = node.add_pod("sidecar")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&ambient, &["--ambient"])?;
    loaded.enroll(&sidecar, &[])?;

    let ports = [
        ("0.0.0.0:15001", false),
        ("[::]:15006", false),
        ("0.0.0.0:15008", false),
        ("0.0.0.0:15053", true),
        ("[::]:15053", true),
    ];
    for (addr, udp) in ports {
        let proto: &[&str] = if udp { &["--udp"] } else { &[] };
        // The app, and root in the pod without ztunnel's mark: refused.
        for uid in [APP_UID, 0] {
            let v = bind(&env, &ambient, uid, addr, proto)?;
            ensure!(
                v["errno"] == EPERM && v["stage"] == "bind",
                "uid {uid} bound ztunnel's {addr} (udp: {udp}) in an ambient pod: {v}"
            );
        }
        // ztunnel's marked socket: bound.
        let marked = [proto, &["--mark", ZTUNNEL_MARK]].concat();
        let v = bind(&env, &ambient, 0, addr, &marked)?;
        ensure!(v["bound"] == addr, "ztunnel's bind of {addr}: {v}");
        // A sidecar pod's ports are the app's to take, as under istio-iptables.
        let v = bind(&env, &sidecar, APP_UID, addr, proto)?;
        ensure!(v["bound"] == addr, "the sidecar pod's {addr}: {v}");
    }
    // Any other port stays the app's.
    let v = bind(&env, &ambient, APP_UID, "0.0.0.0:8080", &[])?;
    ensure!(v["bound"] == "0.0.0.0:8080", "{v}");
    Ok(())
}

#[test]
fn a_listener_bound_before_enrolment_gets_no_captured_inbound() -> Result<()> {
    if skip_unless_root("a_listener_bound_before_enrolment_gets_no_captured_inbound") {
        return Ok(());
    }
    let env = TestEnv::new("ambient-early-bind")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let loaded = Loaded::load(&env)?;
    // sk_lookup takes the listener sock_ops registered at listen(2); tc looks the listener up
    // for every SYN. Each must refuse an unmarked one.
    for hook in ["sk_lookup", "tc"] {
        let ambient = node.add_pod(&format!("early-{}", hook.replace('_', "")))?;
        // The app binds 15006 before the pod is enrolled (no guard yet) and listens after.
        let mut early = ambient.spawn(
            &env,
            Spawn::new(&[
                probe(),
                "bind",
                "0.0.0.0:15006",
                "--listen-after-ms",
                "1500",
            ])
            .user(APP_UID, APP_UID),
        )?;
        wait_for_output(&mut early, "\"bound\"")?;
        loaded.enroll(&ambient, &["--ambient", "--inbound-hook", hook])?;
        wait_for_output(&mut early, "\"listening\"")?;
        // An inbound connection to the pod's app port is captured: with no ztunnel listening it
        // is refused, and the app's early socket must not receive it.
        let target = format!("{}:8080", ambient.ipv4);
        let out = client.run(
            &env,
            APP_UID,
            &[probe(), "connect", &target, "--timeout-ms", "2000"],
        )?;
        std::thread::sleep(Duration::from_millis(300));
        ensure!(
            !early.stdout().contains("\"accepted\""),
            "{hook} hook: a socket bound before enrolment, without ztunnel's mark, received \
             captured inbound: {} (client: {})",
            early.stdout(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(())
}

/// A socket that binds port 0, or listens or connects unbound, gets an ephemeral port, which
/// no bind hook sees. A pod may move `ip_local_port_range` (a safe sysctl) over ztunnel's ports;
/// enrolment reserves them in an ambient pod's netns, so taking every port the range offers still
/// yields none of them (before the fix it yielded all four).
#[test]
fn ephemeral_ports_never_take_ztunnels_in_an_ambient_pod() -> Result<()> {
    if skip_unless_root("ephemeral_ports_never_take_ztunnels_in_an_ambient_pod") {
        return Ok(());
    }
    let env = TestEnv::new("ambient-ephemeral")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let ambient = node.add_pod("ambient")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&ambient, &["--ambient"])?;
    sidestep_tests::netns::set_sysctl(
        &ambient.netns_path,
        "net.ipv4.ip_local_port_range",
        "15000 15060",
    )?;
    const ZTUNNEL_PORTS: [u16; 4] = [15001, 15006, 15008, 15053];
    // Every port of the range, as TCP then UDP sockets that bind port 0 until none is left.
    let (tcp, udp) = ambient.in_netns(|| {
        let tcp: Vec<TcpListener> = std::iter::from_fn(|| TcpListener::bind("0.0.0.0:0").ok())
            .take(100)
            .collect();
        let udp: Vec<UdpSocket> = std::iter::from_fn(|| UdpSocket::bind("0.0.0.0:0").ok())
            .take(100)
            .collect();
        let port = |a: std::io::Result<std::net::SocketAddr>| a.map(|a| a.port()).unwrap_or(0);
        (
            tcp.iter().map(|s| port(s.local_addr())).collect::<Vec<_>>(),
            udp.iter().map(|s| port(s.local_addr())).collect::<Vec<_>>(),
        )
    })?;
    for (proto, ports) in [("tcp", &tcp), ("udp", &udp)] {
        // The range was in force: the sockets took (nearly) all of it.
        ensure!(
            ports.len() >= 50 && ports.iter().all(|p| (15000..=15060).contains(p)),
            "{proto}: {} ephemeral ports, not the range's: {ports:?}",
            ports.len()
        );
        let taken: Vec<u16> = ZTUNNEL_PORTS
            .into_iter()
            .filter(|z| ports.contains(z))
            .collect();
        ensure!(
            taken.is_empty(),
            "{proto}: the app was handed ztunnel's port(s) {taken:?} as ephemeral ports"
        );
    }
    let reserved =
        sidestep_tests::netns::get_sysctl(&ambient.netns_path, "net.ipv4.ip_local_reserved_ports")?;
    ensure!(
        reserved.trim() == "15001,15006,15008,15053",
        "reserved ports: {reserved:?}"
    );
    Ok(())
}
