//! Bypass attempts from a captured pod, as the app's UID (issue 7). Each attempt either reaches the
//! proxy's listener (the proxy reports the original destination the app asked for), or is pinned
//! down as exactly the boundary Istio's iptables capture has too, with the reason next to it.
//!
//! Topology: a client pod enrolled in sidestep, with a recording "proxy" (`probe proxy
//! --no-forward`, UID 1337) on 127.0.0.1:15001, [::1]:15001 and *:15006; a server pod (not
//! enrolled) with a recording listener on *:8080. A connection shows up on exactly one of them:
//! on the proxy when it was captured, on the server when it went around the proxy.
//! Needs root; skips otherwise.

// A test target's modules resolve beside it, not in a directory of its name.
#[path = "bypass/fixture.rs"]
mod fixture;

use std::{net::IpAddr, time::Duration};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use sidestep_tests::{
    Spawn,
    net::spawn_dns_listener,
    netns, skip_unless_root,
    wire::{WireWatch, is_tcp_syn_to},
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;
/// The server's TCP port: not one sidestep or Istio treat specially.
const PORT: u16 = 8080;
/// UDP ports on the server: a plain one, and DNS.
const UDP_PORT: u16 = 5300;
const UDP6_PORT: u16 = 5301;
const ENOENT: i64 = 2;
const EPERM: i64 = 1;
const ENETUNREACH: i64 = 101;
const ECONNREFUSED: i64 = 111;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

use fixture::{Fixture, connected, failed_with, ip_of, json_lines, last_json};

#[test]
fn ipv6_and_ipv4_mapped() -> Result<()> {
    if skip_unless_root("ipv6_and_ipv4_mapped") {
        return Ok(());
    }
    let f = Fixture::new("bypass-v6", &[])?;
    let v4 = f.server_v4();
    let v6 = f.server_v6()?;
    let mapped = format!("[::ffff:{}]:{PORT}", f.server.ipv4);

    // sidestep captures IPv6 by default (what Istio does for a pod with IPv6).
    let m = f.mark();
    let v = f.app(&["connect-sock", &v6, "--read"])?;
    connected("IPv6", &v)?;
    ensure!(
        v["peer"] == v6,
        "getpeername6 should report the original peer: {v}"
    );
    f.captured("IPv6 (default policy)", m, &v6)?;

    // An AF_INET6 socket to an IPv4-mapped address is IPv4 on the wire: captured as IPv4.
    let m = f.mark();
    let v = f.app(&["connect-sock", &mapped, "--read"])?;
    connected("IPv4-mapped", &v)?;
    ensure!(v["peer"] == mapped, "{v}");
    let line = f.captured("IPv4-mapped IPv6 (default policy)", m, &v4)?;
    ensure!(line["listener"] == "127.0.0.1:15001", "{line}");

    // The server's link-local address, with the client's eth0 as its scope: ip6tables' OUTPUT
    // chain matches it like any address off lo, so Istio captures it.
    let ll = f.server.link_local("eth0")?;
    let scope = f.client.ifindex("eth0")?;
    let target = format!("[{ll}%{scope}]:{PORT}");
    // getpeername reports the address without its scope: a getpeername program can rewrite the
    // address and port, and bpf_sock_addr has no scope field.
    let unscoped = format!("[{ll}]:{PORT}");
    let m = f.mark();
    let v = f.app(&["connect-sock", &target, "--read"])?;
    connected("IPv6 link-local", &v)?;
    ensure!(v["peer"] == unscoped, "{v}");
    f.captured("IPv6 link-local of another pod", m, &unscoped)?;

    // IPv4 only (--no-ipv6): IPv6 goes straight out. This is Istio's boundary: for a pod that
    // it does not see as IPv6, istio-iptables builds no ip6tables rules at all, so IPv6 leaves
    // uncaptured there too.
    f.loaded.enroll(&f.client, &["--no-ipv6"])?;
    let m = f.mark();
    let v = f.app(&["connect-sock", &v6, "--read"])?;
    connected("IPv6, --no-ipv6", &v)?;
    f.direct(
        "IPv6 with only IPv4 configured (--no-ipv6)",
        m,
        f.client_v6()?,
    )?;
    // IPv4 and IPv4-mapped are still captured: they are IPv4.
    let m = f.mark();
    connected(
        "IPv4-mapped, --no-ipv6",
        &f.app(&["connect-sock", &mapped, "--read"])?,
    )?;
    f.captured("IPv4-mapped IPv6 with --no-ipv6", m, &v4)?;
    let m = f.mark();
    connected("IPv4, --no-ipv6", &f.app(&["connect-sock", &v4, "--read"])?)?;
    f.captured("IPv4 with --no-ipv6", m, &v4)?;
    Ok(())
}

#[test]
fn udp_goes_direct_and_dns_is_captured() -> Result<()> {
    if skip_unless_root("udp_goes_direct_and_dns_is_captured") {
        return Ok(());
    }
    let f = Fixture::new("bypass-udp", &[])?;
    let udp4 = format!("{}:{UDP_PORT}", f.server.ipv4);
    let udp6 = format!("[{}]:{UDP6_PORT}", f.server.ipv6.context("IPv6")?);
    let dns = format!("{}:53", f.server.ipv4);
    let mut servers = Vec::new();
    for addr in [
        format!("0.0.0.0:{UDP_PORT}"),
        format!("[::]:{UDP6_PORT}"),
        "0.0.0.0:53".to_string(),
    ] {
        servers.push(
            f.server
                .spawn(&f.env, Spawn::new(&[probe(), "udp-serve", &addr]))?,
        );
    }
    // The DNS listener the proxy would run (only used with DNS capture on).
    servers.push(spawn_dns_listener(
        &f.env,
        &f.client,
        probe(),
        "127.0.0.1:15053",
    )?);
    std::thread::sleep(Duration::from_millis(300));
    // The servers in the server pod answer without a name, the DNS listener with its own.
    let from_client = |v: &Value| {
        v["reply"]
            .as_str()
            .is_some_and(|r| r.starts_with(&format!("reply to {}:", f.client.ipv4)))
    };
    let from_client6 = |v: &Value| {
        v["reply"].as_str().is_some_and(|r| {
            r.starts_with(&format!(
                "reply to [{}]:",
                f.client.ipv6.unwrap_or(std::net::Ipv6Addr::UNSPECIFIED)
            ))
        })
    };

    // UDP that is not DNS is never captured, connected or not. Istio's boundary: istio-iptables
    // redirects only TCP (plus DNS when DNS capture is on); other UDP leaves the pod as sent.
    for connect in [false, true] {
        let mode = if connect { "connected" } else { "unconnected" };
        let mut args = vec!["udp-query", udp4.as_str()];
        if connect {
            args.push("--connect");
        }
        let v = f.app(&args)?;
        ensure!(
            v["from"] == udp4 && from_client(&v),
            "{mode} UDP was diverted: {v}"
        );
        eprintln!("bypass: {mode} UDP to a non-DNS port: not captured (Istio's boundary): {v}");
        let mut args = vec!["udp-query", udp6.as_str()];
        if connect {
            args.push("--connect");
        }
        let v = f.app(&args)?;
        ensure!(
            v["from"] == udp6 && from_client6(&v),
            "{mode} UDP/IPv6 was diverted: {v}"
        );
        // DNS capture is off: port 53 is just UDP too (Istio: no DNS rules without DNS capture).
        let mut args = vec!["udp-query", dns.as_str()];
        if connect {
            args.push("--connect");
        }
        let v = f.app(&args)?;
        ensure!(
            v["from"] == dns && from_client(&v),
            "{mode} DNS captured while off: {v}"
        );
    }

    // With DNS capture, port 53 is captured both ways and answered by the local listener,
    // reported as coming from the server.
    f.loaded.enroll(&f.client, &["--dns-capture"])?;
    for connect in [false, true] {
        let mode = if connect { "connected" } else { "unconnected" };
        let mut args = vec!["udp-query", dns.as_str()];
        if connect {
            args.push("--connect");
        }
        let v = f.app(&args)?;
        ensure!(v["from"] == dns, "{mode} DNS: {v}");
        ensure!(
            v["reply"]
                .as_str()
                .is_some_and(|r| r.starts_with("dns-proxy: reply to ")),
            "{mode} DNS with --dns-capture was not captured: {v}"
        );
        eprintln!("bypass: {mode} UDP to port 53 with --dns-capture: captured: {v}");
        // Other UDP still goes direct.
        let mut args = vec!["udp-query", udp4.as_str()];
        if connect {
            args.push("--connect");
        }
        let v = f.app(&args)?;
        ensure!(
            v["from"] == udp4 && from_client(&v),
            "{mode} UDP with DNS capture: {v}"
        );
    }
    drop(servers);
    Ok(())
}

/// A TcpExt counter of the client pod's netns (`/proc/net/netstat`, read by a process in it).
fn tcp_ext(f: &Fixture, name: &str) -> Result<u64> {
    let out = f.run(Spawn::new(&["cat", "/proc/net/netstat"]))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (
        lines.next().context("no TcpExt header")?,
        lines.next().context("no TcpExt values")?,
    );
    let i = names
        .split_whitespace()
        .position(|n| n == name)
        .with_context(|| format!("no TcpExt {name}"))?;
    values
        .split_whitespace()
        .nth(i)
        .context("short TcpExt line")?
        .parse()
        .context("TcpExt value")
}

/// getpeername right after the TFO sendto: the original peer (getpeername4/6 report it as for a
/// connect), or ENOTCONN while the handshake is still under way (sendto does not wait for it).
fn peer_is(v: &Value, orig: &str) -> bool {
    v["peer_after_sendto"]["addr"] == orig || v["peer_after_sendto"]["errno"] == 107
}

/// `sendto(MSG_FASTOPEN)` connects without connect(2), but the kernel's tcp_sendmsg_fastopen()
/// goes through __inet_stream_connect(), which runs the cgroup connect4/connect6 hook first (the
/// sk_prot->pre_connect call), so the destination is rewritten like a connect's.
#[test]
fn tcp_fast_open_is_captured() -> Result<()> {
    if skip_unless_root("tcp_fast_open_is_captured") {
        return Ok(());
    }
    let mut f = Fixture::new("bypass-tfo", &[])?;
    let v4 = f.server_v4();
    let v6 = f.server_v6()?;
    // A new netns starts with net.ipv4.tcp_fastopen=1 (client side on, cookie needed): the
    // first sendto sends a SYN with a cookie request, the data follows the handshake.
    let m = f.mark();
    let v = f.app(&["tfo", &v4])?;
    ensure!(v["reply"] == "probe" && v["sent"].as_u64() > Some(0), "{v}");
    ensure!(peer_is(&v, &v4), "{v}");
    eprintln!("bypass: TFO cookie request, the app saw {v}");
    f.captured(
        "TCP Fast Open (sendto MSG_FASTOPEN, cookie request)",
        m,
        &v4,
    )?;
    let m = f.mark();
    ensure!(f.app(&["tfo", &v6])?["reply"] == "probe");
    f.captured("TCP Fast Open over IPv6", m, &v6)?;

    // 0x607: client on, data in the SYN without a cookie, server on for every listener without
    // a cookie. The SYN itself carries the data and the proxy's listener accepts it at once
    // (TcpExt TCPFastOpenPassive counts it): still captured.
    netns::set_sysctl(&f.client.netns_path, "net.ipv4.tcp_fastopen", "1543")?;
    // A listener takes its server-side TFO setting at listen(2): restart the recorder.
    f.start_proxy()?;
    let active = tcp_ext(&f, "TCPFastOpenActive")?;
    let passive = tcp_ext(&f, "TCPFastOpenPassive")?;
    let resets = tcp_ext(&f, "TCPAbortOnClose")?;
    let m = f.mark();
    let v = f.app(&["tfo", &v4, "--data", "data-in-syn"])?;
    ensure!(v["reply"] == "probe" && peer_is(&v, &v4), "{v}");
    eprintln!("bypass: TFO data-in-SYN, the app saw {v}");
    f.captured("TCP Fast Open with data in the SYN", m, &v4)?;
    let (active2, passive2) = (
        tcp_ext(&f, "TCPFastOpenActive")?,
        tcp_ext(&f, "TCPFastOpenPassive")?,
    );
    ensure!(
        active2 > active && passive2 > passive,
        "the SYN carried no data: TCPFastOpenActive {active}->{active2}, Passive {passive}->{passive2}"
    );
    // The recorder must not close on the SYN's unread data (RST): a client slow to wake from
    // sendto then took the reset as the sendto's ECONNRESET, a failure of the fixture.
    let resets2 = tcp_ext(&f, "TCPAbortOnClose")?;
    ensure!(
        resets2 == resets,
        "a side closed with data unread (TCPAbortOnClose {resets}->{resets2})"
    );
    eprintln!(
        "bypass: TFO data-in-SYN: TCPFastOpenActive {active}->{active2}, TCPFastOpenPassive {passive}->{passive2}"
    );
    Ok(())
}

#[test]
fn socket_options_and_addresses() -> Result<()> {
    if skip_unless_root("socket_options_and_addresses") {
        return Ok(());
    }
    let f = Fixture::new("bypass-sock", &[])?;
    let v4 = f.server_v4();
    let v6 = f.server_v6()?;
    let client_v4 = IpAddr::from(f.client.ipv4);

    // Bound to the pod's own address first: still captured, and the proxy sees that source.
    let m = f.mark();
    let bind = format!("{}:0", f.client.ipv4);
    let v = f.app(&["connect", &v4, "--bind", &bind])?;
    ensure!(v["peer"] == v4, "{v}");
    let line = f.captured("connect on a socket bound to the pod IP", m, &v4)?;
    ensure!(ip_of(&line["peer"])? == client_v4, "{line}");
    let m = f.mark();
    let bind6 = format!("[{}]:0", f.client_v6()?);
    f.app(&["connect", &v6, "--bind", &bind6])?;
    let line = f.captured("connect on a socket bound to the pod IPv6", m, &v6)?;
    ensure!(ip_of(&line["peer"])? == f.client_v6()?, "{line}");

    // MPTCP (IPPROTO_MPTCP, unprivileged): the kernel connects the first subflow, a TCP socket
    // of its own, and runs the connect hook on it. Istio REDIRECTs that subflow's SYN (it is
    // TCP on the wire), and the proxy's plain listener makes the connection fall back to TCP.
    // The app must also see the peer it dialled, as under REDIRECT.
    for target in [&v4, &v6] {
        let m = f.mark();
        let v = f.app(&["connect-sock", target, "--mptcp", "--read"])?;
        connected("MPTCP", &v)?;
        ensure!(v["peer"] == *target, "MPTCP getpeername: {v}");
        f.captured("MPTCP", m, target)?;
    }

    // Bound to 127.0.0.6 (the proxy's inbound passthrough source), to a remote address. The
    // kernel refuses a loopback source off the host (EINVAL) unless `route_localnet` is on:
    // kube-proxy turns it on for the node, a new netns copies the node's IPv4 settings, and the
    // node answers ARP from a loopback source only with it on the veth too. Istio's `-o lo -s
    // 127.0.0.6` RETURN does not match such a SYN, so its capture takes it; sidestep refuses the
    // connect under both settings, and nothing reaches the wire.
    let watch = WireWatch::start(f.client.node_side_ifindex("eth0")?)?;
    // A warm neighbour entry for the server, as a pod that talks to it has: otherwise the ARP
    // request from a loopback source is what the server drops, and the SYN never gets its turn.
    let server_mac = f.server.mac("eth0")?;
    let server_v4 = f.server.ipv4.to_string();
    f.client.ip(&[
        "neigh",
        "replace",
        &server_v4,
        "lladdr",
        &server_mac,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ])?;
    for route_localnet in ["0", "1"] {
        set_route_localnet(&f, route_localnet)?;
        let what = format!("remote connect bound to 127.0.0.6, route_localnet={route_localnet}");
        let m = f.mark();
        let v = f.app(&["connect-sock", &v4, "--bind", "127.0.0.6:0"])?;
        let syns = watch
            .frames()
            .iter()
            .filter(|fr| is_tcp_syn_to(fr, PORT))
            .count();
        ensure!(
            syns == 0,
            "{what}: {syns} SYNs to port {PORT} left the pod ({v})"
        );
        failed_with(&what, &v, EPERM)?;
        f.nowhere(&what, m)?;
    }
    set_route_localnet(&f, "0")?;

    // The proxy's own ports, directly: they reach the proxy, which gets ENOENT for the original
    // destination, as under iptables (the app talks to its sidecar; that is not a way around
    // it).
    for (target, listener) in [
        ("127.0.0.1:15001", "127.0.0.1:15001"),
        ("[::1]:15001", "[::1]:15001"),
        ("127.0.0.1:15006", "0.0.0.0:15006"),
    ] {
        let m = f.mark();
        connected(target, &f.app(&["connect-sock", target, "--read"])?)?;
        let (proxy, server) = f.new_lines(m);
        ensure!(
            server.is_empty() && proxy.len() == 1,
            "{target}: {proxy:?} {server:?}"
        );
        ensure!(proxy[0]["listener"] == listener, "{target}: {}", proxy[0]);
        ensure!(
            proxy[0]["orig_v4"]["errno"] == ENOENT || proxy[0]["orig_v6"]["errno"] == ENOENT,
            "{target}: {}",
            proxy[0]
        );
        eprintln!(
            "bypass: direct connect to {target}: reaches the proxy: {}",
            proxy[0]
        );
    }

    // SO_MARK needs CAP_NET_ADMIN, or since Linux 5.17 CAP_NET_RAW as well (sk_setsockopt's
    // sockopt_ns_capable check for either): the app, with neither, cannot set it on 6.1 or 6.12.
    let m = f.mark();
    let v = f.app(&["connect-sock", &v4, "--mark", "1337"])?;
    ensure!(v["stage"] == "SO_MARK", "{v}");
    failed_with("SO_MARK as the app", &v, EPERM)?;
    f.nowhere("SO_MARK as the app", m)?;
    // Root can, and is still captured: sidestep never looks at marks (Istio's REDIRECT-mode nat
    // rules do not either; 1337 is the mark Istio's TPROXY mode uses).
    let m = f.mark();
    let v = last_json(&f.run(Spawn::new(&[
        probe(),
        "connect-sock",
        &v4,
        "--mark",
        "1337",
        "--read",
    ]))?)?;
    connected("SO_MARK 1337 as root", &v)?;
    f.captured("SO_MARK 1337 (root, not the proxy UID)", m, &v4)?;

    // Raw and packet sockets need CAP_NET_RAW. Without it (the app) there is no way to put a
    // TCP segment on the wire except connect(2)/sendmsg(2), which the hooks see. With it, a
    // process writes packets below every socket hook, and AF_PACKET below netfilter too, which is
    // why Istio's app containers run without NET_RAW: the same boundary.
    let v = f.app(&["raw"])?;
    for family in ["inet", "inet6", "packet"] {
        ensure!(
            v[family]["errno"] == EPERM,
            "{family} raw socket as the app: {v}"
        );
    }
    eprintln!("bypass: raw sockets without CAP_NET_RAW: {v}");

    // 0.0.0.0 as a destination means "this host" to the kernel, which turns it into 127.0.0.1
    // before the nat rules run, so ISTIO_OUTPUT's `-d 127.0.0.1` rule lets it through; sidestep
    // treats it the same: not captured, and it reaches nothing outside the pod.
    let any = format!("0.0.0.0:{PORT}");
    let m = f.mark();
    let _ = f.app(&["connect-sock", &any, "--read"])?;
    f.nowhere("connect to 0.0.0.0 (kernel: this host)", m)?;
    Ok(())
}

#[test]
fn privileged_escapes_need_capabilities() -> Result<()> {
    if skip_unless_root("privileged_escapes_need_capabilities") {
        return Ok(());
    }
    let f = Fixture::new("bypass-priv", &[])?;
    let v4 = f.server_v4();

    // A second netns inside the pod needs CAP_SYS_ADMIN: the app cannot make one.
    let out = f.run(Spawn::new(&["unshare", "-n", "true"]).user(APP_UID, APP_UID))?;
    ensure!(!out.status.success(), "unshare -n worked as the app");
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "{out:?}"
    );
    // With it (root), the new netns is not enrolled, so nothing in it is captured: its connect
    // is not rewritten even with a listener on its own 127.0.0.1:15001 (it fails with
    // ENETUNREACH: the new netns has only lo). Istio's boundary too: its rules live in the pod's
    // netns and do not apply to another one. (A root process that also has CAP_NET_ADMIN can
    // wire that netns to the outside; no capture scheme inside the pod stops that.)
    let script = format!(
        "ip link set lo up && {probe} proxy 127.0.0.1:15001 - --no-forward & p=$!; \
         sleep 0.5; {probe} connect-sock {v4} --timeout-ms 2000; \
         {probe} connect-sock 127.0.0.1:15001 --read; kill $p",
        probe = probe()
    );
    let m = f.mark();
    let out = f.run(Spawn::new(&["unshare", "-n", "sh", "-c", &script]))?;
    let lines = json_lines(&String::from_utf8_lossy(&out.stdout));
    let attempt = lines
        .iter()
        .find(|l| l.get("stage").is_some())
        .with_context(|| format!("no connect result from the nested netns: {out:?}"))?;
    failed_with("connect from a nested netns (root)", attempt, ENETUNREACH)?;
    ensure!(
        lines.iter().any(|l| l["reply"] == "probe"),
        "the nested netns' own listener was not up, so the check proves nothing: {out:?}"
    );
    f.nowhere("connect from a nested netns", m)?;
    eprintln!("bypass: nested netns (root + CAP_SYS_ADMIN): not captured (Istio's boundary)");

    // Becoming the proxy's UID needs CAP_SETUID: the app cannot.
    let out = f.run(
        Spawn::new(&[
            "setpriv",
            "--reuid=1337",
            "--regid=1337",
            "--clear-groups",
            probe(),
            "connect-sock",
            &v4,
        ])
        .user(APP_UID, APP_UID),
    )?;
    ensure!(
        !out.status.success(),
        "setpriv to the proxy UID worked as the app"
    );
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "{out:?}"
    );
    // With it (root), the process is the proxy as far as any owner match goes: not captured.
    // Istio's boundary: ISTIO_OUTPUT returns for `-m owner --uid-owner 1337` and
    // `--gid-owner 1337`, which is why the app must never run as 1337.
    let m = f.mark();
    let v = last_json(&f.run(Spawn::new(&[
        "setpriv",
        "--reuid=1337",
        "--regid=1337",
        "--clear-groups",
        probe(),
        "connect-sock",
        &v4,
        "--read",
    ]))?)?;
    connected("as the proxy UID", &v)?;
    f.direct(
        "a process that became UID 1337 (root + CAP_SETUID)",
        m,
        f.client.ipv4.into(),
    )?;
    Ok(())
}

/// KNOWN BYPASS, found while writing these tests; ignored until it is fixed.
///
/// connect4/6 keep the original destination in socket-local storage (`SIDESTEP_ORIG`), and the
/// kernel charges that storage to the socket's option memory (`sk_omem_alloc`, bounded by
/// `net.core.optmem_max`, 128 KiB by default). An unprivileged app can fill its socket's option
/// memory first, e.g. with ~960 `TCP_MD5SIG` keys for unrelated peers (no capability needed), so
/// that the storage cannot be allocated. connect4/6 then refuse the connect (EPERM) rather than
/// let it through: captured or refused, never passed.
#[test]
fn option_memory_exhaustion_does_not_bypass() -> Result<()> {
    if skip_unless_root("option_memory_exhaustion_does_not_bypass") {
        return Ok(());
    }
    let f = Fixture::new("bypass-optmem", &[])?;
    let mut problems = Vec::new();
    for target in [f.server_v4(), f.server_v6()?] {
        let m = f.mark();
        let v = f.app(&["connect-sock", &target, "--fill-optmem", "--read"])?;
        let (proxy, server) = f.new_lines(m);
        eprintln!(
            "bypass: optmem exhausted, {target}: probe {v}, proxy {proxy:?}, server {server:?}"
        );
        if !server.is_empty() {
            problems.push(format!(
                "{target}: with {} TCP-MD5 keys on the socket, the app reached the server directly: {}",
                v["md5_keys"], server[0]
            ));
        }
        if proxy.is_empty() && v["errno"] != EPERM {
            problems.push(format!(
                "{target}: neither captured nor refused with EPERM: {v}"
            ));
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(())
}

/// A socket whose captured connect failed (TCP may connect again then, and UDP always may) and
/// that connects again to a destination that passes keeps no trace of the first: getpeername
/// reports the peer it really has, as under iptables, where each connect is its own nat
/// decision. Here the first connect is TCP to port 53 with DNS capture on (sent to 15053, where
/// nothing listens), the second to an excluded port on the server.
#[test]
fn a_reconnected_socket_keeps_no_stale_original_destination() -> Result<()> {
    if skip_unless_root("a_reconnected_socket_keeps_no_stale_original_destination") {
        return Ok(());
    }
    let f = Fixture::new(
        "bypass-recon",
        &[
            "--dns-capture",
            "--exclude-outbound-ports",
            &PORT.to_string(),
        ],
    )?;
    let v4 = f.server_v4();
    let dns = format!("{}:53", f.server.ipv4);
    let m = f.mark();
    let v = f.app(&["connect-sock", &v4, "--first", &dns, "--read"])?;
    ensure!(
        v["first_errno"] == ECONNREFUSED,
        "the first, captured connect should have been refused at 15053: {v}"
    );
    connected("the second connect", &v)?;
    ensure!(
        v["peer"] == v4,
        "getpeername after a passed connect reports {} (a stale original destination), not \
         {v4}: {v}",
        v["peer"]
    );
    ensure!(
        v["orig_v4"]["addr"] != dns.as_str(),
        "SO_ORIGINAL_DST reports the first connect's destination: {v}"
    );
    f.direct(
        "the second connect (excluded port)",
        m,
        f.client.ipv4.into(),
    )?;
    Ok(())
}

/// `net.ipv4.conf.{all,eth0}.route_localnet` in the client pod, and on the node side of its
/// veth (which must answer ARP for a loopback source).
fn set_route_localnet(f: &Fixture, value: &str) -> Result<()> {
    let node_side = f.client.node_side_ifindex("eth0")?.to_string();
    let node_if = std::fs::read_dir("/sys/class/net")?
        .filter_map(Result::ok)
        .find(|e| {
            std::fs::read_to_string(e.path().join("ifindex")).is_ok_and(|i| i.trim() == node_side)
        })
        .context("the node side of the client's veth")?
        .file_name();
    let node_if = node_if.to_string_lossy();
    for dev in ["all", "eth0"] {
        let key = format!("net.ipv4.conf.{dev}.route_localnet={value}");
        run_tool(&[
            "ip",
            "netns",
            "exec",
            &f.client.netns_name,
            "sysctl",
            "-qw",
            &key,
        ])?;
    }
    let key = format!("net.ipv4.conf.{node_if}.route_localnet={value}");
    run_tool(&["sysctl", "-qw", &key])
}

fn run_tool(argv: &[&str]) -> Result<()> {
    let out = std::process::Command::new(argv[0])
        .args(&argv[1..])
        .output()?;
    ensure!(
        out.status.success(),
        "`{}`: {}",
        argv.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
