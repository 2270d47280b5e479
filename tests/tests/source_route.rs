//! Source-routed sockets (issue 35, item 1). connect4/6 rewrite only the address passed to
//! connect(); a routing header or an IPv4 source route on the socket sends the SYN to its first
//! hop instead, around the proxy. Each attempt runs twice on one node: from a pod enrolled in
//! sidestep, and from a pod under Istio's own iptables rules (the control, where nat OUTPUT sees
//! the first hop as the destination and REDIRECTs it). The wire decides: an AF_PACKET socket on
//! the node side of each pod's veth must see no source-routed packet and no SYN to the server's
//! port, and the server must see no connection. sidestep must also refuse the option itself.
//! Needs root; skips otherwise.

// A test target's modules resolve beside it, not in a directory of its name.
#[path = "bypass/fixture.rs"]
#[allow(dead_code)] // shared with bypass.rs, which uses all of it
mod fixture;

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Pod, Spawn,
    istio_iptables::IstioCapture,
    parity::Oracle,
    skip_unless_root,
    wire::{WireWatch, is_source_routed, is_tcp_syn_to},
};

use fixture::{Fixture, last_json};

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
    let report = last_json(&out)?;
    let frames = watch.frames();
    let routed = frames.iter().filter(|fr| is_source_routed(fr)).count();
    let syns = frames.iter().filter(|fr| is_tcp_syn_to(fr, PORT)).count();
    eprintln!(
        "source_route: {side}: {}: {report} ({} frames on the veth, {routed} source-routed, \
         {syns} SYNs to port {PORT})",
        a.what,
        frames.len()
    );
    ensure!(
        routed == 0 && syns == 0,
        "{side}: {}: left the pod around the proxy: {routed} source-routed frames and {syns} \
         SYNs to port {PORT} on the node side of its veth ({report})",
        a.what
    );
    Ok(report)
}

#[test]
fn source_routes_never_leave_the_pod() -> Result<()> {
    if skip_unless_root("source_routes_never_leave_the_pod") {
        return Ok(());
    }
    let f = Fixture::new("srcroute", &[])?;
    // The control: a pod under Istio's own rules, with the same recording proxy.
    let istio = f.node.add_pod("istio")?;
    let mut oracle = Oracle::new(&istio);
    oracle.apply(&IstioCapture {
        ipv6: true,
        ..IstioCapture::default()
    })?;
    let _istio_proxy = fixture::recorder(
        &f.env,
        &istio,
        "127.0.0.1:15001,[::1]:15001,0.0.0.0:15006,[::]:15006",
        PROXY_UID,
    )?;
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
