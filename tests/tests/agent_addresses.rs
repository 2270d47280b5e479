//! The agent follows the addresses a pod gains after its ADD (SLAAC, DHCP, a later plugin): once
//! followed, such an address is the pod's own, as Istio's `-o lo` makes it. The app calling it
//! reaches itself (not the proxy's 15001), and the map entry goes when the address does. The
//! pod is made through the chain the agent wrote (bridge + the installed plugin). Needs root.

mod agent_support;

use std::time::Duration;

use agent_support::{APP_UID, Dirs, meshed, wait_until};
use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{Spawn, TestEnv, skip_unless_root};

const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

#[test]
fn addresses_added_after_the_add_are_the_pods_own() -> Result<()> {
    if skip_unless_root("addresses_added_after_the_add_are_the_pods_own") {
        return Ok(());
    }
    let env = TestEnv::new("agent-addrs")?;
    let d = Dirs::new(&env)?;
    let (agent, node) = d.ready_agent_and_node(&env)?;
    let web = node.add_pod_with("web", meshed())?;
    let listen = |addr: &str, uid: u32| {
        web.spawn(
            &env,
            Spawn::new(&[probe(), "proxy", addr, "-", "--no-forward"]).user(uid, uid),
        )
    };
    let mut outbound = listen("0.0.0.0:15001", PROXY_UID)?;
    let mut app = listen("0.0.0.0:8080", APP_UID)?;
    let any = |port| std::net::SocketAddr::from(([0, 0, 0, 0], port));
    sidestep_tests::wait_listening(&mut outbound, &[any(15001)], Duration::from_secs(5))?;
    sidestep_tests::wait_listening(&mut app, &[any(8080)], Duration::from_secs(5))?;

    let octets = web.ipv4.octets();
    let late = std::net::Ipv4Addr::new(octets[0], octets[1], octets[2], 200);
    web.ip(&["addr", "add", &format!("{late}/32"), "dev", "eth0"])?;
    // The ADD's record reaches the follower within a second, the address change at once.
    let bound = sidestep_tests::scaled(Duration::from_secs(3));
    wait_until("the late address followed", bound, || {
        Ok(agent.metric("sidestep_late_addresses_added_total")? >= 1.0)
    })
    .with_context(|| agent.log())?;

    let target = format!("{late}:8080");
    let out = web.run(&env, APP_UID, &[probe(), "connect", &target])?;
    ensure!(
        out.status.success(),
        "connect to {target}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let accepted = |p: &sidestep_tests::ChildGuard| -> Vec<Value> {
        p.stdout()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    wait_until("the app's accept", Duration::from_secs(2), || {
        Ok(!accepted(&app).is_empty())
    })
    .with_context(|| format!("outbound listener saw {:?}", accepted(&outbound)))?;
    ensure!(
        accepted(&outbound).is_empty(),
        "the app calling its own late address was captured to 15001: {:?}",
        accepted(&outbound)
    );
    ensure!(
        accepted(&app)[0]["local"]
            .as_str()
            .is_some_and(|a| a.contains(&late.to_string()) && a.ends_with(":8080")),
        "{:?}",
        accepted(&app)
    );

    web.ip(&["addr", "del", &format!("{late}/32"), "dev", "eth0"])?;
    wait_until("the late address released", bound, || {
        Ok(agent.metric("sidestep_late_addresses_removed_total")? >= 1.0)
    })
    .with_context(|| agent.log())?;
    agent_support::uninstall(&env, &d)?;
    Ok(())
}
