//! `excludeInterfaces` and the routes it follows: istio-iptables' `-o <nic> -j RETURN` leaves a
//! connection uncaptured when its route leaves by an excluded interface. sidestep decides by the
//! pod's routes written into the `ROUTE` list; a route it cannot pin to one interface, or too
//! many routes, must make it capture (fail closed), never fall to a shorter excluded prefix.
//! Needs root; skips otherwise.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv, faults::bpftool, sidestep::Loaded,
    skip_unless_root, wait_listening,
};

const PROBE: &str = env!("CARGO_BIN_EXE_probe");

/// The pod's policy file: `excludeInterfaces: [net1]`.
fn exclude_net1(env: &TestEnv) -> Result<String> {
    let policy = env.tmp_dir().join("exclude-net1.json");
    std::fs::write(&policy, r#"{"excludeInterfaces": ["net1"]}"#)?;
    Ok(policy.display().to_string())
}

/// Entries of the ROUTE list (ebpf/sidestep-abi, cidr_list::ROUTE = 2, stored big-endian).
fn route_list(env: &TestEnv) -> Result<Vec<Value>> {
    let trie = env
        .pin_root()
        .join("maps/SIDESTEP_CIDRS")
        .display()
        .to_string();
    let all = bpftool(&["map", "dump", "pinned", &trie])?;
    Ok(all
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["formatted"]["key"]["data"]["list_be"].as_u64() == Some(u64::from(2u32.to_be()))
        })
        .cloned()
        .collect())
}

/// A stand-in proxy on the outbound port, as the proxy UID: it prints each original
/// destination it is handed and forwards nothing.
fn outbound_proxy(env: &TestEnv, pod: &Pod) -> Result<ChildGuard> {
    let outbound = SocketAddr::from(([0, 0, 0, 0], 15001));
    let mut proxy = pod.spawn(
        env,
        Spawn::new(&[PROBE, "proxy", &outbound.to_string(), "-", "--no-forward"]).user(1337, 1337),
    )?;
    wait_listening(&mut proxy, &[outbound], Duration::from_secs(5))?;
    Ok(proxy)
}

/// Whether the app's connection to `destination` reached the proxy.
fn captured(env: &TestEnv, pod: &Pod, proxy: &ChildGuard, destination: &str) -> Result<bool> {
    // An uncaptured connection leaves by its route to nothing: it fails, and that is the answer.
    let _ = pod.run(
        env,
        1000,
        &[PROBE, "connect", destination, "--timeout-ms", "300"],
    )?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if proxy.stdout().contains(destination) {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A route the enrolment cannot pin to one interface: a multipath route whose first hop is the
/// excluded net1 and whose second is eth0, and a route through a nexthop object that the kernel
/// dumps without its device (`nexthop_compat_mode` 0), both inside 10/8, which net1 holds. Both
/// are captured; 10/8 itself is not (the exclusion is live, so the test can fail).
#[test]
fn a_route_by_several_interfaces_or_by_none_known_is_captured() -> Result<()> {
    if skip_unless_root("a_route_by_several_interfaces_or_by_none_known_is_captured") {
        return Ok(());
    }
    let env = TestEnv::new("mproute")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("multipath")?;
    let loaded = Loaded::load(&env)?;
    pod.add_veth("net1", "10.77.0.2/24")?;
    pod.ip(&["route", "add", "10.0.0.0/8", "dev", "net1"])?;
    let multipath = "route add 10.102.0.0/16 nexthop dev net1 nexthop dev eth0";
    pod.ip(&multipath.split(' ').collect::<Vec<_>>())?;
    pod.ip(&["nexthop", "add", "id", "7", "dev", "eth0"])?;
    let compat_off = std::process::Command::new("ip")
        .args(["netns", "exec", &pod.netns_name])
        .args(["sysctl", "-qw", "net.ipv4.nexthop_compat_mode=0"])
        .status()?;
    ensure!(
        compat_off.success(),
        "sysctl nexthop_compat_mode: {compat_off}"
    );
    pod.ip(&["route", "add", "10.101.0.0/16", "nhid", "7"])?;
    loaded.enroll(&pod, &["--policy", &exclude_net1(&env)?])?;

    let proxy = outbound_proxy(&env, &pod)?;
    ensure!(
        !captured(&env, &pod, &proxy, "10.100.0.7:8080")?,
        "a connection routed by net1 alone was captured: {}",
        proxy.stdout()
    );
    for destination in ["10.102.0.7:8080", "10.101.0.7:8080"] {
        ensure!(
            captured(&env, &pod, &proxy, destination)?,
            "{destination} passed uncaptured; the ROUTE list (prefix bits, value): {:?}",
            route_list(&env)?
                .iter()
                .map(|e| (
                    e["formatted"]["key"]["prefix_len"].clone(),
                    e["formatted"]["value"].clone()
                ))
                .collect::<Vec<_>>()
        );
    }
    drop(proxy);
    loaded.unenroll(&pod)?;
    loaded.unload()?;
    Ok(())
}

/// A pod with an excluded interface whose netns holds more routes than one pod may write for
/// `-o <nic>`: none is written (a part could let a destination fall to an excluded interface's
/// shorter prefix and pass), so the shared CIDR trie keeps its room and the pod stays captured.
#[test]
fn a_flood_of_routes_writes_no_exclusion_routes() -> Result<()> {
    if skip_unless_root("a_flood_of_routes_writes_no_exclusion_routes") {
        return Ok(());
    }
    let env = TestEnv::new("routecap")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("routed")?;
    let loaded = Loaded::load(&env)?;
    pod.add_veth("net1", "10.77.0.2/24")?;
    let policy = exclude_net1(&env)?;

    // A few routes: each is written, the excluded interface's among them.
    loaded.enroll(&pod, &["--policy", &policy])?;
    let few = route_list(&env)?.len();
    ensure!(
        few >= 2,
        "{few} routes written for a pod with an excluded interface"
    );

    pod.ip_batch(&env, &sidestep_tests::host_routes(300, "10.100", "net1"))?;
    loaded.enroll(&pod, &["--policy", &policy])?;
    // userspace/src/limits.rs, MAX_EXCLUSION_ROUTES (256).
    let flooded = route_list(&env)?.len();
    ensure!(
        flooded == 0,
        "{flooded} routes written for a pod past the cap of 256"
    );
    // Fail closed: the app's connection to a destination routed through net1 is captured.
    let proxy = outbound_proxy(&env, &pod)?;
    ensure!(
        captured(&env, &pod, &proxy, "10.100.0.7:8080")?,
        "not captured: {}",
        proxy.stdout()
    );
    drop(proxy);
    loaded.unenroll(&pod)?;
    loaded.unload()?;
    Ok(())
}
