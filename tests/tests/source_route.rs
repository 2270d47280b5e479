//! Source-routed sockets (issue 35, item 1). connect4/6 rewrite only the address passed to
//! connect(); a routing header or an IPv4 source route on the socket sends the SYN to its first
//! hop instead, around the proxy. Each attempt runs twice on one node: from a pod enrolled in
//! sidestep, and from a pod under Istio's own iptables rules (the control, where nat OUTPUT sees
//! the first hop as the destination and REDIRECTs it). The wire decides: an AF_PACKET socket on
//! the node side of each pod's veth must see no source-routed packet and no SYN to the server's
//! port, and the server must see no connection. sidestep must also refuse the option itself.
//!
//! Three ways in never meet that refusal, and are stopped on the packet instead, by the egress
//! guard (`sidestep_route_guard`, which drops a packet naming loopback as a route segment): the
//! option set through a 32-bit system call (`int 0x80`, for which the kernel runs no cgroup
//! sockopt program), set before the pod was enrolled, and a DNS query whose route travels in
//! sendmsg's control data. Needs root; skips otherwise.

// A test target's modules resolve beside it, not in a directory of its name.
#[path = "bypass/fixture.rs"]
#[allow(dead_code)] // shared with bypass.rs, which uses all of it
mod fixture;

use std::{
    net::{IpAddr, SocketAddr},
    os::unix::process::ExitStatusExt as _,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    ChildGuard, Pod, Spawn,
    istio_iptables::IstioCapture,
    net::spawn_dns_listener,
    parity::Oracle,
    skip_unless_root,
    wire::{WireWatch, is_source_routed, is_tcp_syn_to, is_udp4_to},
};

use fixture::{Fixture, json_lines, last_json};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;
/// The server's port: not one sidestep or Istio treat specially.
const PORT: u16 = 8080;
const EPERM: i64 = 1;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// One way to put a source route on an app's socket.
struct Attempt {
    what: &'static str,
    kind: &'static str,
    target: SocketAddr,
    via: IpAddr,
    /// Set the option once the (captured) connection is up, then write.
    after: bool,
    /// IPv4 source routes need CAP_NET_RAW, which root in a pod has unless it is dropped.
    uid: u32,
    /// Through the i386 setsockopt (`int 0x80`).
    compat: bool,
}

impl Attempt {
    fn args(&self) -> Vec<String> {
        let mut a = vec![
            probe().to_string(),
            "srcroute".into(),
            self.kind.into(),
            self.target.to_string(),
            "--via".into(),
            self.via.to_string(),
        ];
        if self.after {
            a.push("--after".into());
        }
        if self.compat {
            a.push("--compat".into());
        }
        a
    }
}

fn attempts(f: &Fixture, from_pod: IpAddr) -> Result<Vec<Attempt>> {
    let server4: IpAddr = f.server.ipv4.into();
    let server6: IpAddr = f
        .server
        .ipv6
        .context("dual-stack server has no IPv6")?
        .into();
    let to6 = SocketAddr::new(server6, PORT);
    let to4 = SocketAddr::new(server4, PORT);
    let attempt = |what, kind, target, via, after, uid| Attempt {
        what,
        kind,
        target,
        via,
        after,
        uid,
        compat: false,
    };
    Ok(vec![
        attempt(
            "IPV6_RTHDR (type 4), set before connect",
            "rthdr",
            to6,
            server6,
            false,
            APP_UID,
        ),
        // The pod's own address is `-o lo` for both, and connect passes it: only the routing
        // header's first hop would take it off the pod.
        attempt(
            "IPV6_RTHDR (type 4), connect to the pod's own address",
            "rthdr",
            SocketAddr::new(from_pod, PORT),
            server6,
            false,
            APP_UID,
        ),
        attempt(
            "IPV6_RTHDR (type 4), set on a captured, connected socket",
            "rthdr",
            to6,
            server6,
            true,
            APP_UID,
        ),
        attempt(
            "IPV6_2292PKTOPTIONS with a routing header",
            "pktoptions",
            to6,
            server6,
            false,
            APP_UID,
        ),
        attempt(
            "IPV6_2292PKTOPTIONS longer than a page, the routing header at its end",
            "pktoptions-long",
            to6,
            server6,
            false,
            APP_UID,
        ),
        attempt(
            "IP_OPTIONS loose source route, set before connect",
            "lsrr",
            to4,
            server4,
            false,
            0,
        ),
        attempt(
            "IP_OPTIONS loose source route, set on a captured, connected socket",
            "lsrr",
            to4,
            server4,
            true,
            0,
        ),
    ])
}

/// Runs `a` in `pod` while watching its veth; fails if anything source-routed, or any SYN to the
/// server's port, crossed it. Returns the probe's report.
fn run_watched(f: &Fixture, pod: &Pod, a: &Attempt, side: &str) -> Result<Value> {
    let watch = WireWatch::start(pod.node_side_ifindex("eth0")?)?;
    let argv = a.args();
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let out = pod.run_with(
        &f.env,
        Spawn::new(&argv).user(a.uid, a.uid),
        std::time::Duration::from_secs(30),
    )?;
    // A kernel booted with ia32_emulation=0 has no int 0x80 gate: the probe dies of SIGSEGV.
    if a.compat && out.status.signal() == Some(libc::SIGSEGV) {
        return Ok(serde_json::json!({ "compat": "SIGSEGV" }));
    }
    let report = last_json(&out)?;
    check_wire(&watch, &report, a.what, side)?;
    Ok(report)
}

/// Whether the probe found no 32-bit system calls; the row is skipped, said so on stderr.
fn no_compat(report: &Value, what: &str) -> bool {
    let missing = !report["compat"].is_null();
    if missing {
        eprintln!(
            "source_route: SKIPPED {what}: this kernel has no 32-bit system calls \
             (int 0x80: {}), so a compat setsockopt cannot be made",
            report["compat"]
        );
    }
    missing
}

/// Fails if anything source-routed, or any SYN to the server's port, crossed the watched veth.
fn check_wire(watch: &WireWatch, report: &Value, what: &str, side: &str) -> Result<()> {
    let frames = watch.frames();
    let routed = frames.iter().filter(|fr| is_source_routed(fr)).count();
    let syns = frames.iter().filter(|fr| is_tcp_syn_to(fr, PORT)).count();
    eprintln!(
        "source_route: {side}: {what}: {report} ({} frames on the veth, {routed} source-routed, \
         {syns} SYNs to port {PORT})",
        frames.len()
    );
    ensure!(
        routed == 0 && syns == 0,
        "{side}: {what}: left the pod around the proxy: {routed} source-routed frames and \
         {syns} SYNs to port {PORT} on the node side of its veth ({report})"
    );
    Ok(())
}

/// A pod under Istio's own rules with the same recording proxy, the control; the rules are not
/// applied yet.
fn istio_pod(f: &Fixture) -> Result<(Arc<Pod>, Oracle, ChildGuard)> {
    let istio = f.node.add_pod("istio")?;
    let oracle = Oracle::new(&istio);
    let proxy = fixture::recorder(
        &f.env,
        &istio,
        "127.0.0.1:15001,[::1]:15001,0.0.0.0:15006,[::]:15006",
        PROXY_UID,
    )?;
    Ok((istio, oracle, proxy))
}

fn istio_rules() -> IstioCapture {
    IstioCapture {
        ipv6: true,
        ..IstioCapture::default()
    }
}

#[test]
fn source_routes_never_leave_the_pod() -> Result<()> {
    if skip_unless_root("source_routes_never_leave_the_pod") {
        return Ok(());
    }
    let f = Fixture::new("srcroute", &[])?;
    // The control: a pod under Istio's own rules, with the same recording proxy.
    let (istio, mut oracle, _istio_proxy) = istio_pod(&f)?;
    oracle.apply(&istio_rules())?;
    let client6: IpAddr = f
        .client
        .ipv6
        .context("dual-stack client has no IPv6")?
        .into();
    let istio6: IpAddr = istio.ipv6.context("dual-stack pod has no IPv6")?.into();

    for (ours, control) in attempts(&f, client6)?.iter().zip(attempts(&f, istio6)?) {
        let before = f.mark();
        let v = run_watched(&f, &f.client, ours, "sidestep")?;
        // Refused where it is set, so nothing later depends on it.
        ensure!(
            v["setsockopt"] == EPERM,
            "sidestep: {}: the source route was accepted: {v}",
            ours.what
        );
        let (_, server) = f.new_lines(before);
        ensure!(
            server.is_empty(),
            "sidestep: {}: reached the server: {server:?}",
            ours.what
        );
        let before = f.mark();
        let v = run_watched(&f, &istio, &control, "istio")?;
        // The control sets the option: the capture, not a refusal, keeps it in.
        ensure!(
            v["setsockopt"] == 0 || control.kind.starts_with("pktoptions"),
            "istio: {}: {v}",
            control.what
        );
        let (_, server) = f.new_lines(before);
        ensure!(
            server.is_empty(),
            "istio: {}: reached the server: {server:?}",
            control.what
        );
    }
    // A pod that is not enrolled keeps the kernel's behaviour: the option is the app's own.
    let plain = f.node.add_pod("plain")?;
    let out = plain.run_with(
        &f.env,
        Spawn::new(&[
            probe(),
            "srcroute",
            "rthdr",
            &SocketAddr::new(
                f.server
                    .ipv6
                    .context("dual-stack server has no IPv6")?
                    .into(),
                PORT,
            )
            .to_string(),
            "--via",
            &f.server.ipv6.context("IPv6")?.to_string(),
        ])
        .user(APP_UID, APP_UID),
        std::time::Duration::from_secs(30),
    )?;
    let v = last_json(&out)?;
    ensure!(
        v["setsockopt"] == 0,
        "a pod outside the mesh must keep IPV6_RTHDR: {v}"
    );
    oracle.clear()?;
    Ok(())
}

/// The routes of the first test's "set before connect" rows, set through `int 0x80`.
fn compat_attempts(f: &Fixture) -> Result<Vec<Attempt>> {
    let server4: IpAddr = f.server.ipv4.into();
    let server6: IpAddr = f
        .server
        .ipv6
        .context("dual-stack server has no IPv6")?
        .into();
    Ok(vec![
        Attempt {
            what: "IPV6_RTHDR (type 4) set by a 32-bit setsockopt",
            kind: "rthdr",
            target: SocketAddr::new(server6, PORT),
            via: server6,
            after: false,
            uid: APP_UID,
            compat: true,
        },
        Attempt {
            what: "IP_OPTIONS loose source route set by a 32-bit setsockopt",
            kind: "lsrr",
            target: SocketAddr::new(server4, PORT),
            via: server4,
            after: false,
            uid: 0,
            compat: true,
        },
    ])
}

/// The kernel runs no cgroup sockopt program for a compat setsockopt, so the option is set;
/// the egress guard must keep the SYN in (the connect fails), where Istio's REDIRECT does.
#[test]
fn compat_source_routes_never_leave_the_pod() -> Result<()> {
    if skip_unless_root("compat_source_routes_never_leave_the_pod") {
        return Ok(());
    }
    let f = Fixture::new("srcroute32", &[])?;
    let (istio, mut oracle, _istio_proxy) = istio_pod(&f)?;
    oracle.apply(&istio_rules())?;
    for (ours, control) in compat_attempts(&f)?.iter().zip(compat_attempts(&f)?) {
        let before = f.mark();
        let v = run_watched(&f, &f.client, ours, "sidestep")?;
        if no_compat(&v, ours.what) {
            continue;
        }
        ensure!(
            v["setsockopt"] == 0,
            "sidestep: {}: a compat setsockopt runs no sockopt program, yet it failed: {v}",
            ours.what
        );
        ensure!(
            v["connect"] != 0,
            "sidestep: {}: the connect succeeded: {v}",
            ours.what
        );
        let (proxy, server) = f.new_lines(before);
        ensure!(
            server.is_empty(),
            "sidestep: {}: reached the server: {server:?} (proxy saw {proxy:?})",
            ours.what
        );
        let before = f.mark();
        let v = run_watched(&f, &istio, &control, "istio")?;
        if no_compat(&v, control.what) {
            continue;
        }
        ensure!(v["setsockopt"] == 0, "istio: {}: {v}", control.what);
        let (_, server) = f.new_lines(before);
        ensure!(
            server.is_empty(),
            "istio: {}: reached the server: {server:?}",
            control.what
        );
    }
    oracle.clear()?;
    Ok(())
}

/// Sets the route on a socket of `pod` while nothing captures it, lets `capture` start capture
/// (enrolment, or Istio's rules), then connects, watching the wire. Returns the probe's report.
fn set_then_capture(
    f: &Fixture,
    pod: &Pod,
    a: &Attempt,
    side: &str,
    capture: impl FnOnce() -> Result<()>,
) -> Result<Value> {
    let go = f.env.tmp_dir().join(format!("go-{}", f.env.next_seq()));
    let watch = WireWatch::start(pod.node_side_ifindex("eth0")?)?;
    let mut argv = a.args();
    argv.extend(["--wait-file".to_string(), go.display().to_string()]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut child = pod.spawn(&f.env, Spawn::new(&argv).user(a.uid, a.uid))?;
    child.wait_stdout(&["\"armed\""], Duration::from_secs(10))?;
    capture()?;
    std::fs::write(&go, b"")?;
    ensure!(
        child.wait_timeout(Duration::from_secs(30))?.is_some(),
        "{side}: {}: the probe did not finish",
        a.what
    );
    let report = json_lines(&child.stdout())
        .pop()
        .with_context(|| format!("{side}: {}: no report: {}", a.what, child.stderr()))?;
    check_wire(&watch, &report, a.what, side)?;
    Ok(report)
}

/// A socket that set its route while its pod was not enrolled (only an agent repair enrols a
/// netns with sockets in it) and connects once it is: the sockopt program never saw the option,
/// the egress guard must keep the SYN in. Istio's control applies its rules at the same point.
#[test]
fn a_source_route_set_before_enrolment_never_leaves_the_pod() -> Result<()> {
    if skip_unless_root("a_source_route_set_before_enrolment_never_leaves_the_pod") {
        return Ok(());
    }
    let f = Fixture::new("srcroutelate", &[])?;
    let late = f.node.add_pod("late")?;
    let _late_proxy = fixture::recorder(
        &f.env,
        &late,
        "127.0.0.1:15001,[::1]:15001,0.0.0.0:15006,[::]:15006",
        PROXY_UID,
    )?;
    let (istio, mut oracle, _istio_proxy) = istio_pod(&f)?;
    let server4: IpAddr = f.server.ipv4.into();
    let server6: IpAddr = f
        .server
        .ipv6
        .context("dual-stack server has no IPv6")?
        .into();
    let rows = [
        Attempt {
            what: "IPV6_RTHDR (type 4) set before the pod was captured",
            kind: "rthdr",
            target: SocketAddr::new(server6, PORT),
            via: server6,
            after: false,
            uid: APP_UID,
            compat: false,
        },
        Attempt {
            what: "IP_OPTIONS loose source route set before the pod was captured",
            kind: "lsrr",
            target: SocketAddr::new(server4, PORT),
            via: server4,
            after: false,
            uid: 0,
            compat: false,
        },
    ];
    for a in &rows {
        let before = f.mark();
        let v = set_then_capture(&f, &late, a, "sidestep", || f.loaded.enroll(&late, &[]))?;
        ensure!(
            v["setsockopt"] == 0 && v["connect"] != 0,
            "sidestep: {}: wanted the option set (the pod was not enrolled) and the connect to \
             fail: {v}",
            a.what
        );
        let (_, server) = f.new_lines(before);
        ensure!(
            server.is_empty(),
            "sidestep: {}: reached the server: {server:?}",
            a.what
        );
        f.loaded.unenroll(&late)?;

        let before = f.mark();
        let v = set_then_capture(&f, &istio, a, "istio", || oracle.apply(&istio_rules()))?;
        ensure!(v["setsockopt"] == 0, "istio: {}: {v}", a.what);
        let (_, server) = f.new_lines(before);
        ensure!(
            server.is_empty(),
            "istio: {}: reached the server: {server:?}",
            a.what
        );
        oracle.clear()?;
    }
    Ok(())
}

/// A DNS query whose loose source route travels in sendmsg's control data (`IP_RETOPTS`): no
/// sockopt program sees it, and sendmsg4 rewrites the destination to the DNS listener, which
/// the route then carries as its last hop. Nothing may leave the pod: no source-routed frame and
/// no datagram to port 53 on its veth. (The IPv6 twin, a routing header in the control data,
/// needs a kernel with `CONFIG_IPV6_MIP6`; the guard drops it the same way.)
#[test]
fn a_dns_query_routed_by_control_message_never_leaves_the_pod() -> Result<()> {
    if skip_unless_root("a_dns_query_routed_by_control_message_never_leaves_the_pod") {
        return Ok(());
    }
    let f = Fixture::new("srcroutedns", &["--dns-capture"])?;
    let _dns = spawn_dns_listener(&f.env, &f.client, probe(), "127.0.0.1:15053")?;
    let _upstream = f.server.spawn(
        &f.env,
        Spawn::new(&[probe(), "udp-serve", "0.0.0.0:53", "--name", "upstream"]),
    )?;
    let (istio, mut oracle, _istio_proxy) = istio_pod(&f)?;
    let _istio_dns = spawn_dns_listener(&f.env, &istio, probe(), "127.0.0.1:15053")?;
    oracle.apply(&IstioCapture {
        dns_capture: true,
        ..istio_rules()
    })?;
    std::thread::sleep(Duration::from_millis(300));
    let server4: IpAddr = f.server.ipv4.into();
    let a = Attempt {
        what: "DNS query with a loose source route in sendmsg's control data",
        kind: "lsrr-dns",
        target: SocketAddr::new(server4, 53),
        via: server4,
        after: false,
        // IP_RETOPTS with a source route needs CAP_NET_RAW.
        uid: 0,
        compat: false,
    };
    for (pod, side) in [(&f.client, "sidestep"), (&istio, "istio")] {
        let watch = WireWatch::start(pod.node_side_ifindex("eth0")?)?;
        let argv = a.args();
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let out = pod.run_with(
            &f.env,
            Spawn::new(&argv).user(0, 0),
            Duration::from_secs(30),
        )?;
        let report = last_json(&out)?;
        let frames = watch.frames();
        let routed = frames.iter().filter(|fr| is_source_routed(fr)).count();
        let queries = frames.iter().filter(|fr| is_udp4_to(fr, 53)).count();
        eprintln!(
            "source_route: {side}: {}: {report} ({} frames on the veth, {routed} source-routed, \
             {queries} datagrams to port 53)",
            a.what,
            frames.len()
        );
        ensure!(
            routed == 0 && queries == 0,
            "{side}: {}: left the pod around the DNS proxy: {routed} source-routed frames and \
             {queries} datagrams to port 53 on the node side of its veth ({report})",
            a.what
        );
    }
    oracle.clear()?;
    Ok(())
}
