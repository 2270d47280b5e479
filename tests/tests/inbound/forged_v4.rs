//! A SYN from off the pod forging an IPv4 loopback source (127.0.0.6, the proxy's inbound
//! passthrough source) into a pod whose `route_localnet` is on. kube-proxy's iptables mode turns
//! it on for the node, a new netns copies the node's IPv4 settings, and with it on the kernel
//! takes a loopback source from the wire instead of dropping it as a martian. Istio's PREROUTING
//! REDIRECTs such a SYN to the proxy; sidestep passed it to the app on its source alone.

use std::time::Duration;

use anyhow::{Result, ensure};
use sidestep_tests::{Node, NodeOptions, Spawn, TestEnv, sidestep::Loaded};

use super::{APP_UID, PROXY_UID, counter, crafted_syn, own_connections_reach_the_app, probe};

pub(super) fn a_forged_ipv4_loopback_source_is_captured_with_route_localnet() -> Result<()> {
    let env = TestEnv::new("inbound-forged4")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let attacker = node.add_pod("attacker")?;
    let server = node.add_pod("server")?;
    for key in [
        "net.ipv4.conf.all.route_localnet",
        "net.ipv4.conf.eth0.route_localnet",
    ] {
        sidestep_tests::netns::set_sysctl(&server.netns_path, key, "1")?;
    }
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&server, &[])?;
    let app_addr = format!("{}:8080", server.ipv4);
    let mut proxy = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "0.0.0.0:15006", "-", "--no-forward"])
            .user(PROXY_UID, PROXY_UID),
    )?;
    let mut app = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "0.0.0.0:8080", "-", "--no-forward"]).user(APP_UID, APP_UID),
    )?;
    sidestep_tests::wait_listening(
        &mut proxy,
        &["0.0.0.0:15006".parse()?],
        Duration::from_secs(10),
    )?;
    sidestep_tests::wait_listening(
        &mut app,
        &["0.0.0.0:8080".parse()?],
        Duration::from_secs(10),
    )?;

    let before = counter(&loaded, &server, "redirected_inbound")?;
    // A packet socket needs no route for the source.
    crafted_syn(
        &env,
        &attacker,
        &[
            "vlan-syn",
            "eth0",
            &server.mac("eth0")?,
            "127.0.0.6",
            &app_addr,
            "--tags",
            "0",
            "--wait-ms",
            "300",
        ],
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let after = counter(&loaded, &server, "redirected_inbound")?;
    ensure!(
        after > before,
        "a SYN forging 127.0.0.6 from another pod reached the app around the proxy \
         (redirected_inbound {before} -> {after})"
    );

    // The proxy's own hand-off from 127.0.0.6, and the pod's call to its own address: the app's.
    own_connections_reach_the_app(&env, &loaded, &server, &app, &app_addr, "127.0.0.6:0")
}
