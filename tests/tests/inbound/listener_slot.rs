//! A pod's listener slot in `SIDESTEP_LSTN` (issue 35, item 6). tc ingress registers the proxy's
//! listener there when it leaves a SYN onto a TIME_WAIT 4-tuple to the kernel, keyed by the pod
//! the destination address names. Interface indexes repeat across netns (eth0 is the same index
//! in most pods), so the interface alone did not prove that the netns tc runs in is that pod's: a
//! SYN crafted to another pod's MAC with the victim's address as destination registered the
//! other pod's listener as the victim's, and the victim's sk_lookup then handed its captured
//! inbound to a socket of another netns.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt,
};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv, bench::netstat::time_wait_to, faults::bpftool,
    sidestep::Loaded,
};

use super::{PROXY_UID, crafted_syn, probe};

/// The crafted SYN's source port, and the TIME_WAIT 4-tuple's remote port in the other pod.
const SPORT: u16 = 41999;
/// A port the victim captures, on which nothing listens in the victim.
const PORT: u16 = 8080;
const INBOUND_PORT: u32 = 15006;

pub(super) fn a_crafted_syn_cannot_register_another_pods_listener() -> Result<()> {
    let env = TestEnv::new("inbound-slot")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let attacker = node.add_pod("attacker")?;
    let victim = node.add_pod("victim")?;
    let other = node.add_pod("other")?;
    ensure!(
        victim.ifindex("eth0")? == other.ifindex("eth0")?,
        "the pods' eth0 indexes differ ({} and {}), so this topology cannot show the attack",
        victim.ifindex("eth0")?,
        other.ifindex("eth0")?
    );
    // Before either pod is enrolled: a TIME_WAIT socket in the other pod whose 4-tuple is
    // (victim's address:PORT, attacker's address:SPORT), which tc finds for the crafted SYN.
    time_wait_in(&other, victim.ipv4, attacker.ipv4)?;
    ensure!(
        time_wait_to(&other, attacker.ipv4)? >= 1,
        "no TIME_WAIT socket to {} in the other pod",
        attacker.ipv4
    );

    let loaded = Loaded::load(&env)?;
    // The victim with the sk_lookup hook: whatever its slot holds takes its captured inbound.
    loaded.enroll(&victim, &["--inbound-hook", "sk_lookup"])?;
    loaded.enroll(&other, &["--inbound-hook", "tc"])?;
    let listen = format!("0.0.0.0:{INBOUND_PORT}");
    let mut other_proxy = other.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", &listen, "-", "--no-forward"]).user(PROXY_UID, PROXY_UID),
    )?;
    sidestep_tests::wait_listening(
        &mut other_proxy,
        &[listen.parse()?],
        Duration::from_secs(10),
    )?;
    let victim_cookie = victim.netns_cookie()?;
    ensure!(
        slot_holders(&loaded)?.iter().all(|c| *c != victim_cookie),
        "the victim has a listener before any SYN (nothing listens there)"
    );

    // The victim's address, the other pod's MAC.
    crafted_syn(
        &env,
        &attacker,
        &[
            "vlan-syn",
            "eth0",
            &other.mac("eth0")?,
            &attacker.ipv4.to_string(),
            &SocketAddr::new(IpAddr::V4(victim.ipv4), PORT).to_string(),
            "--tags",
            "0",
            "--sport",
            &SPORT.to_string(),
            "--wait-ms",
            "500",
        ],
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let holders = slot_holders(&loaded)?;
    ensure!(
        !holders.contains(&victim_cookie),
        "a SYN crafted to the other pod registered its listener as the victim's (slots of \
         netns {holders:?})"
    );
    // The control: the other pod's own listener is in its own slot, so the lookup that the
    // crafted SYN made could have found it.
    ensure!(
        holders.contains(&other.netns_cookie()?),
        "the other pod's proxy is not in its own slot: {holders:?}"
    );
    Ok(())
}

/// Leaves a TIME_WAIT socket in `pod` whose local end is `local`:PORT and whose remote end is
/// `remote`:SPORT: both addresses go on the pod's lo for one connection, whose server side
/// closes first, then come off again (the TIME_WAIT socket stays for a minute).
fn time_wait_in(pod: &Pod, local: Ipv4Addr, remote: Ipv4Addr) -> Result<()> {
    let (local_cidr, remote_cidr) = (format!("{local}/32"), format!("{remote}/32"));
    pod.ip(&["addr", "add", &local_cidr, "dev", "lo"])?;
    pod.ip(&["addr", "add", &remote_cidr, "dev", "lo"])?;
    let made = pod.in_netns(|| -> Result<()> {
        let server = TcpListener::bind(SocketAddrV4::new(local, PORT))?;
        let client = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        setsockopt(&client, sockopt::ReuseAddr, &true)?;
        bind(
            client.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(remote, SPORT)),
        )?;
        connect(
            client.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(local, PORT)),
        )?;
        let (accepted, _) = server.accept()?;
        // The server side closes first, so its socket is the one left in TIME_WAIT.
        drop(accepted);
        std::thread::sleep(Duration::from_millis(100));
        drop(client);
        Ok(())
    });
    let _ = pod.ip(&["addr", "del", &local_cidr, "dev", "lo"]);
    let _ = pod.ip(&["addr", "del", &remote_cidr, "dev", "lo"]);
    made??;
    let deadline = Instant::now() + Duration::from_secs(5);
    while time_wait_to(pod, remote)? == 0 {
        if Instant::now() > deadline {
            bail!("the connection in {} did not reach TIME_WAIT", pod.name);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The netns cookies that have a listener on the inbound port in `SIDESTEP_LSTN`.
fn slot_holders(loaded: &Loaded) -> Result<Vec<u64>> {
    let pin = loaded.pin_root().join("maps/SIDESTEP_LSTN");
    let pin = pin.to_str().context("pin path is not UTF-8")?;
    let dump = bpftool(&["map", "dump", "pinned", pin])?;
    let entries = dump.as_array().context("bpftool map dump: not a list")?;
    let mut holders = Vec::new();
    for entry in entries {
        let (cookie, port) = listener_key(entry)
            .with_context(|| format!("bpftool map dump: unexpected entry {entry}"))?;
        if port == INBOUND_PORT {
            holders.push(cookie);
        }
    }
    Ok(holders)
}

/// (netns cookie, port) of a `ListenerKey` as bpftool prints it: by field with BTF, else as the
/// key's bytes.
fn listener_key(entry: &Value) -> Option<(u64, u32)> {
    if let Some(key) = entry.get("formatted").and_then(|f| f.get("key")) {
        return Some((key["netns_cookie"].as_u64()?, key["port"].as_u64()? as u32));
    }
    let bytes: Vec<u8> = entry["key"]
        .as_array()?
        .iter()
        .map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
        .collect::<Option<_>>()?;
    let cookie = u64::from_ne_bytes(bytes.get(0..8)?.try_into().ok()?);
    let port = u32::from_ne_bytes(bytes.get(12..16)?.try_into().ok()?);
    Some((cookie, port))
}
