//! Inbound capture is netns-wide (Istio's `-A PREROUTING -p tcp -j ISTIO_INBOUND` has no `-i`
//! and no `-d`): an address enrolment never saw, such as the IPv6 link-local of eth0 or an
//! address added after enrolment, is captured like the pod IP, with both inbound hooks. Needs
//! root; skips otherwise.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{Node, NodeOptions, Pod, Spawn, TestEnv, sidestep::Loaded, skip_unless_root};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

#[test]
fn addresses_enrolment_never_saw_are_captured_with_sk_lookup() -> Result<()> {
    if skip_unless_root("addresses_enrolment_never_saw_are_captured_with_sk_lookup") {
        return Ok(());
    }
    unseen_addresses_are_captured("sk_lookup")
}

#[test]
fn addresses_enrolment_never_saw_are_captured_with_tc() -> Result<()> {
    if skip_unless_root("addresses_enrolment_never_saw_are_captured_with_tc") {
        return Ok(());
    }
    unseen_addresses_are_captured("tc")
}

/// The link-local address of the pod's eth0, with its scope as the client must give it.
fn link_local(pod: &Pod) -> Result<String> {
    let out = pod.ip(&["-6", "-o", "addr", "show", "dev", "eth0", "scope", "link"])?;
    let addr = out
        .split_whitespace()
        .skip_while(|w| *w != "inet6")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .context("no link-local address on eth0")?;
    Ok(addr.to_string())
}

fn unseen_addresses_are_captured(hook: &str) -> Result<()> {
    let env = TestEnv::new(&format!("nswide-{}", &hook[..2]))?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let server = node.add_pod("server")?;
    let outsider = node.add_pod("outsider")?;
    let loaded = Loaded::load(&env)?;
    // Enrolled with its pod IP alone, as a runtime reports it.
    loaded.enroll(
        &server,
        &["--inbound-hook", hook, "--pod-ip", &server.ipv4.to_string()],
    )?;
    let proxy = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "[::]:15006", "-", "--no-forward"])
            .user(PROXY_UID, PROXY_UID),
    )?;
    // The app listens on every address: anything that is not captured reaches it.
    let _app = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "[::]:8080", "-", "--no-forward"]).user(APP_UID, APP_UID),
    )?;
    std::thread::sleep(Duration::from_millis(300));

    // An address added after enrolment (DHCP, SLAAC, another plugin).
    let octets = server.ipv4.octets();
    let late = std::net::Ipv4Addr::new(octets[0], octets[1], octets[2], 200);
    server.ip(&["addr", "add", &format!("{late}/32"), "dev", "eth0"])?;
    // The outsider's eth0 is on the same bridge: its link-local route reaches the server's.
    let scope = outsider
        .ip(&["-o", "link", "show", "eth0"])?
        .split(':')
        .next()
        .context("no ifindex")?
        .trim()
        .to_string();
    let ll = link_local(&server)?;
    let targets = [
        (
            late.to_string(),
            SocketAddr::new(late.into(), 8080).to_string(),
        ),
        (ll.clone(), format!("[{ll}%{scope}]:8080")),
    ];
    for (_, target) in &targets {
        let out = outsider.run(&env, APP_UID, &[probe(), "connect", target])?;
        ensure!(
            out.status.success(),
            "{hook}: connect to {target} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    let seen: Vec<Value> = proxy
        .stdout()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    for (ip, target) in &targets {
        // getsockname at the proxy is the original destination.
        ensure!(
            seen.iter().any(|l| l["local"]
                .as_str()
                .is_some_and(|a| a.contains(ip.as_str()) && a.ends_with(":8080"))),
            "{hook}: the proxy never accepted the connection to {target} (it reached the app \
             around the proxy); the proxy saw {seen:?}"
        );
    }
    Ok(())
}
