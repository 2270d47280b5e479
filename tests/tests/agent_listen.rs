//! Where the agent's endpoints listen (`listen`). Bound to `127.0.0.1:PORT` it answers on
//! loopback and on no other local address: not another loopback address, not IPv6 loopback,
//! not the node's own addresses. Bound to `:PORT`, the form of the default, it answers on
//! every address of both families, which the DaemonSet's probes need: they GET the pod IP,
//! the node's address under hostNetwork, IPv4 or IPv6 as the cluster is. Needs root.

mod agent_support;

use std::{
    io::ErrorKind,
    net::{IpAddr, SocketAddr, TcpStream},
    process::Command,
    time::Duration,
};

use agent_support::{Agent, Dirs, base_args, free_port, http_get};
use anyhow::{Result, bail, ensure};
use serde_json::Value;
use sidestep_tests::{TestEnv, skip_unless_root};

/// The node's source address towards the outside, if it has a route there (`ip route get`
/// sends nothing).
fn node_address(to: &str) -> Option<IpAddr> {
    let out = Command::new("ip")
        .args(["-j", "route", "get", to])
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v[0]["prefsrc"].as_str()?.parse().ok()
}

/// Every local address the test tries besides 127.0.0.1.
fn other_addresses() -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = vec!["127.0.0.2".parse().unwrap(), "::1".parse().unwrap()];
    v.extend(node_address("1.1.1.1"));
    v.extend(node_address("2606:4700:4700::1111"));
    v
}

fn refused(addr: SocketAddr) -> Result<()> {
    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Ok(()),
        Err(e) => bail!("connect to {addr}: {e}, want connection refused"),
        Ok(_) => bail!("{addr} accepted a connection"),
    }
}

fn answers(addr: SocketAddr) -> Result<()> {
    let (code, body) = http_get(addr, "/healthz")?;
    ensure!(code == 200, "{addr}/healthz: {code} {body}");
    Ok(())
}

#[test]
fn agent_listens_where_it_is_told() -> Result<()> {
    if skip_unless_root("agent_listens_where_it_is_told") {
        return Ok(());
    }
    let env = TestEnv::new("agent-listen")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let others = other_addresses();
    eprintln!("local addresses tried besides 127.0.0.1: {others:?}");
    if !others.iter().any(|a| !a.is_loopback()) {
        // A machine without network (xtask's VMs have none) has nothing to refuse or answer on
        // besides loopback; adding an address to the host's own interfaces is not for a test.
        eprintln!(
            "skipping agent_listens_where_it_is_told: needs a non-loopback address on this machine, found only {others:?}"
        );
        return Ok(());
    }

    // base_args binds 127.0.0.1:PORT.
    let port = free_port()?;
    let mut agent = Agent::start(&env, &base_args(&env, &d, port), port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    answers(SocketAddr::from(([127, 0, 0, 1], port)))?;
    for a in &others {
        refused(SocketAddr::new(*a, port))?;
    }
    ensure!(agent.log().contains(&format!("addr=127.0.0.1:{port}")));
    agent.child.terminate(Duration::from_secs(10))?;

    // `:PORT`: every address, both families, in one socket.
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    let i = args.iter().position(|a| a == "--listen").unwrap_or(0) + 1;
    args[i] = format!(":{port}");
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    answers(SocketAddr::from(([127, 0, 0, 1], port)))?;
    for a in &others {
        answers(SocketAddr::new(*a, port))?;
    }
    ensure!(
        agent.log().contains(&format!("addr=:{port}")),
        "{}",
        agent.log()
    );
    agent.child.terminate(Duration::from_secs(10))?;
    agent_support::uninstall(&env, &d)?;
    Ok(())
}
