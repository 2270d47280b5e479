//! The differential parity test: one scenario table, run twice on the same topology, once through
//! Istio's real iptables ruleset (the oracle: `istio_iptables::IstioCapture` applied with
//! iptables-legacy-restore inside the pod netns, as istio-cni does) and once through sidestep
//! (loaded and enrolled with the equivalent policy). Every scenario's observable outcome must be
//! identical, or the row carries an `Intended` mark whose exact sidestep outcome is asserted.
//!
//! Topology: the subject pod `S` (the one under capture), another pod `P`, and the node (the root
//! netns, reached at the bridge address `GW`). Probe listeners report each accepted connection:
//! in S the proxy's 15001/15006/15053 (UID 1337) and app ports, in P and on the node app ports.
//!
//! The whole table runs through sidestep first, once per inbound hook (tc, sk_lookup), then
//! through the oracle. The oracle's rules are
//! removed after each set and checked gone at the end: while a REDIRECT rule exists in a netns,
//! conntrack tracks every connection there and the kernel answers SO_ORIGINAL_DST itself (which
//! is why the oracle reports a non-redirected socket's own address; see rule G below).
//!
//! Needs root; skips otherwise.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv,
    istio_iptables::{IstioCapture, Mode},
    netns,
    parity::{Listeners, Names, Oracle, Outcome, outcome, print_uncaptured, render_table},
    sidestep::Loaded,
    skip_unless_root,
};

/// Every scenario runs through sidestep with each inbound hook.
const HOOKS: [&str; 2] = ["tc", "sk_lookup"];
const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;
/// A process that is not the proxy UID but runs with the proxy's GID.
const OTHER_UID: u32 = 2000;
/// App ports listened on in the subject pod and in the other pod.
const S_PORTS: [u16; 6] = [53, 7070, 8080, 9090, 15008, 15020];
const P_PORTS: [u16; 4] = [53, 80, 8080, 15020];
const NODE_PORT: u16 = 18093;
const CONNECT_TIMEOUT_MS: &str = "2000";

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// Who connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Src {
    /// The app in S (UID/GID 1000).
    App,
    /// The proxy in S (UID/GID 1337).
    Proxy,
    /// A process in S with the proxy's GID only (UID 2000, GID 1337).
    ProxyGid,
    /// The app in S, from a socket bound to 127.0.0.6 / ::6 first.
    AppBound,
    /// The proxy in S, from a socket bound to 127.0.0.6 / ::6 first (its inbound passthrough).
    ProxyBound,
    /// The app of the other pod P.
    OtherPod,
    /// A process on the node (root netns).
    Node,
}

impl Src {
    fn name(self) -> &'static str {
        match self {
            Src::App => "app",
            Src::Proxy => "proxy",
            Src::ProxyGid => "gid1337",
            Src::AppBound => "app@.6",
            Src::ProxyBound => "proxy@.6",
            Src::OtherPod => "pod P",
            Src::Node => "node",
        }
    }
}

/// Where it connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dst {
    /// S's own pod IP.
    SelfIp,
    /// 127.0.0.1 / ::1.
    Lo1,
    /// 127.0.0.2 (IPv4 only).
    Lo2,
    /// The other pod's IP.
    Peer,
    /// The node's bridge address.
    Node,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fam {
    V4,
    V6,
    /// An IPv4 destination, IPv4-mapped, on an AF_INET6 socket.
    Mapped,
}

/// The pod annotations of one set, as istio-cni turns them into istio-iptables options. The
/// equivalent sidestep policy is derived from the same options by [`sidestep_flags`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Set {
    /// No traffic annotations; istio detects IPv6 (ISTIO_DUAL_STACK).
    Defaults,
    /// No annotations, but istio sees an IPv4-first pod and installs no ip6tables rules;
    /// sidestep is enrolled with --no-ipv6.
    V4First,
    /// As V4First, with sidestep's default policy (IPv6 captured).
    V4FirstSidestepV6,
    /// traffic.sidecar.istio.io/excludeOutboundPorts: "8080" (replaces the default 15020).
    ExcludeOutPorts,
    /// excludeOutboundIPRanges: P's addresses.
    ExcludeOutCidr,
    /// includeOutboundIPRanges: P's addresses only.
    IncludeOutCidr,
    /// includeOutboundIPRanges: "" and includeOutboundPorts: "80".
    IncludeOutPorts,
    /// includeInboundPorts: "8080".
    IncludeInPorts,
    /// includeInboundPorts: "8080,9090" with excludeInboundPorts: "9090".
    IncludeInPortsExcluded,
    /// excludeInboundPorts: "9090".
    ExcludeInPorts,
    /// includeInboundPorts: "" (no inbound capture).
    InboundOff,
    /// ISTIO_META_DNS_CAPTURE=true (istio-cni: capture all DNS).
    Dns,
    /// sidecar.istio.io/interceptionMode: TPROXY.
    Tproxy,
}

/// A deliberate difference: sidestep's outcome is asserted to be exactly this, derived from the
/// scenario (or, for `SkAssign`, from the oracle's outcome).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Intended {
    /// sk_assign keeps the original destination as the accepted socket's local address, where
    /// REDIRECT gives pod-ip:15006.
    SkAssign,
    /// istio installs no ip6tables rules for an IPv4-first pod; sidestep captures IPv6 outbound
    /// unless --no-ipv6.
    V6Outbound,
    /// The same for the proxy's hairpin over IPv6.
    V6Hairpin,
    /// tc ingress captures IPv6 inbound whatever the outbound IPv6 setting, so no client can
    /// reach the app around the proxy over IPv6.
    V6Inbound,
    /// sidestep never captures an excluded inbound port, even one includeInboundPorts lists
    /// (ARCHITECTURE.md); istio ignores excludeInboundPorts when includeInboundPorts is a list.
    ExcludeWins,
    /// With includeInboundPorts "" sidestep drops the hairpin too (policy unit test
    /// `empty_includes_turn_capture_off`); istio keeps the hairpin rule.
    HairpinOff,
}

impl Intended {
    fn reason(self) -> &'static str {
        match self {
            Intended::SkAssign => "sk_assign: getsockname is the original dst",
            Intended::V6Outbound => "IPv6 outbound captured (istio: no ip6tables rules)",
            Intended::V6Hairpin => "IPv6 hairpin captured (istio: no ip6tables rules)",
            Intended::V6Inbound => "IPv6 inbound captured (istio: no ip6tables rules)",
            Intended::ExcludeWins => "excluded inbound port never captured, even if listed",
            Intended::HairpinOff => "no hairpin when inbound capture is off",
        }
    }
}

struct Row {
    set: Set,
    from: Src,
    to: Dst,
    port: u16,
    fams: &'static [Fam],
    intended: Option<Intended>,
}

const fn row(set: Set, from: Src, to: Dst, port: u16, fams: &'static [Fam]) -> Row {
    Row {
        set,
        from,
        to,
        port,
        fams,
        intended: None,
    }
}

const fn mark(r: Row, why: Intended) -> Row {
    Row {
        intended: Some(why),
        ..r
    }
}

use Fam::{Mapped, V4, V6};
const V4_ONLY: &[Fam] = &[V4];
const V6_ONLY: &[Fam] = &[V6];
const BOTH: &[Fam] = &[V4, V6];
const ALL3: &[Fam] = &[V4, V6, Mapped];

/// The scenario table: every row runs once per listed family, against both implementations.
#[rustfmt::skip]
const TABLE: &[Row] = {
    use Src::{App, AppBound, OtherPod, Proxy, ProxyBound, ProxyGid};
    use Intended::*;
    use Set::*;
    use Dst::{Lo1, Lo2, Peer, SelfIp};
    &[
        // Outbound from the app: captured, the default excluded port, the node, port 53 without DNS.
        row(Defaults, App, Peer, 80, ALL3),
        row(Defaults, App, Peer, 15020, BOTH),
        row(Defaults, App, Dst::Node, NODE_PORT, BOTH),
        row(Defaults, App, Peer, 53, V4_ONLY),
        // The proxy's own traffic, by UID and by GID.
        row(Defaults, Proxy, Peer, 80, BOTH),
        row(Defaults, ProxyGid, Peer, 80, BOTH),
        // Own pod IP: the app is not captured; the proxy hairpins, except to 15008 and excluded ports.
        row(Defaults, App, SelfIp, 8080, BOTH),
        row(Defaults, Proxy, SelfIp, 8080, BOTH),
        row(Defaults, Proxy, SelfIp, 15008, BOTH),
        row(Defaults, Proxy, SelfIp, 15020, V4_ONLY),
        row(Defaults, ProxyGid, SelfIp, 8080, BOTH),
        // Loopback: only the proxy to 127.0.0.x other than 127.0.0.1 hairpins.
        row(Defaults, App, Lo1, 8080, BOTH),
        row(Defaults, App, Lo2, 8080, V4_ONLY),
        row(Defaults, Proxy, Lo1, 8080, BOTH),
        row(Defaults, Proxy, Lo2, 8080, V4_ONLY),
        // Sockets bound to the inbound passthrough address first.
        row(Defaults, ProxyBound, SelfIp, 8080, BOTH),
        row(Defaults, AppBound, SelfIp, 8080, BOTH),
        row(Defaults, AppBound, Peer, 80, BOTH),
        // Inbound from another pod and from the node.
        mark(row(Defaults, OtherPod, SelfIp, 8080, BOTH), SkAssign),
        mark(row(Defaults, OtherPod, SelfIp, 9090, V4_ONLY), SkAssign),
        row(Defaults, OtherPod, SelfIp, 15020, BOTH),
        row(Defaults, OtherPod, SelfIp, 15008, V4_ONLY),
        row(Defaults, OtherPod, SelfIp, 15021, V4_ONLY),
        mark(row(Defaults, Src::Node, SelfIp, 8080, BOTH), SkAssign),
        row(Defaults, Src::Node, SelfIp, 15020, V4_ONLY),

        // TPROXY interception: inbound keeps the original destination (no Intended mark: iptables'
        // TPROXY and sk_assign agree), the hairpin and outbound are as in REDIRECT mode.
        row(Tproxy, OtherPod, SelfIp, 8080, BOTH),
        row(Tproxy, OtherPod, SelfIp, 15020, V4_ONLY),
        row(Tproxy, Src::Node, SelfIp, 8080, V4_ONLY),
        row(Tproxy, Proxy, SelfIp, 8080, BOTH),
        row(Tproxy, ProxyBound, SelfIp, 8080, V4_ONLY),
        row(Tproxy, App, SelfIp, 8080, V4_ONLY),
        row(Tproxy, App, Peer, 80, BOTH),

        // IPv4-first pod: istio has no ip6tables rules. sidestep with --no-ipv6 ...
        row(V4First, App, Peer, 80, ALL3),
        row(V4First, Proxy, SelfIp, 8080, V6_ONLY),
        row(V4First, App, Lo1, 8080, V6_ONLY),
        mark(row(V4First, OtherPod, SelfIp, 8080, V6_ONLY), V6Inbound),
        // ... and with its default (IPv6 captured).
        mark(row(V4FirstSidestepV6, App, Peer, 80, V6_ONLY), V6Outbound),
        mark(row(V4FirstSidestepV6, Proxy, SelfIp, 8080, V6_ONLY), V6Hairpin),
        mark(row(V4FirstSidestepV6, OtherPod, SelfIp, 8080, V6_ONLY), V6Inbound),
        mark(row(V4FirstSidestepV6, Src::Node, SelfIp, 8080, V6_ONLY), V6Inbound),

        // excludeOutboundPorts 8080: wins over capture and hairpin; 15020 is no longer excluded.
        row(ExcludeOutPorts, App, Peer, 8080, BOTH),
        row(ExcludeOutPorts, App, Peer, 80, V4_ONLY),
        row(ExcludeOutPorts, App, Peer, 15020, BOTH),
        row(ExcludeOutPorts, Proxy, SelfIp, 15020, BOTH),
        row(ExcludeOutPorts, Proxy, SelfIp, 8080, BOTH),
        mark(row(ExcludeOutPorts, OtherPod, SelfIp, 8080, V4_ONLY), SkAssign),

        // excludeOutboundIPRanges P.
        row(ExcludeOutCidr, App, Peer, 80, ALL3),
        row(ExcludeOutCidr, App, Dst::Node, NODE_PORT, BOTH),
        row(ExcludeOutCidr, Proxy, SelfIp, 8080, V4_ONLY),

        // includeOutboundIPRanges P only.
        row(IncludeOutCidr, App, Peer, 80, BOTH),
        row(IncludeOutCidr, App, Dst::Node, NODE_PORT, BOTH),
        row(IncludeOutCidr, App, Lo1, 8080, V4_ONLY),
        row(IncludeOutCidr, Proxy, SelfIp, 8080, V4_ONLY),

        // includeOutboundPorts 80 with no included range.
        row(IncludeOutPorts, App, Peer, 80, BOTH),
        row(IncludeOutPorts, App, Peer, 8080, BOTH),
        row(IncludeOutPorts, App, Dst::Node, NODE_PORT, V4_ONLY),
        row(IncludeOutPorts, Proxy, Peer, 80, V4_ONLY),

        // includeInboundPorts 8080; the hairpin ignores the inbound lists.
        mark(row(IncludeInPorts, OtherPod, SelfIp, 8080, BOTH), SkAssign),
        row(IncludeInPorts, OtherPod, SelfIp, 7070, BOTH),
        row(IncludeInPorts, Src::Node, SelfIp, 7070, V4_ONLY),
        row(IncludeInPorts, Proxy, SelfIp, 7070, BOTH),
        mark(row(IncludeInPortsExcluded, OtherPod, SelfIp, 9090, BOTH), ExcludeWins),

        // excludeInboundPorts 9090 (15020 stays excluded).
        row(ExcludeInPorts, OtherPod, SelfIp, 9090, BOTH),
        row(ExcludeInPorts, Src::Node, SelfIp, 9090, V4_ONLY),
        mark(row(ExcludeInPorts, OtherPod, SelfIp, 7070, V4_ONLY), SkAssign),
        row(ExcludeInPorts, OtherPod, SelfIp, 15020, V4_ONLY),
        row(ExcludeInPorts, Proxy, SelfIp, 9090, V4_ONLY),

        // No inbound capture.
        row(InboundOff, OtherPod, SelfIp, 8080, BOTH),
        mark(row(InboundOff, Proxy, SelfIp, 8080, BOTH), HairpinOff),
        row(InboundOff, App, Peer, 80, V4_ONLY),

        // DNS capture (all port-53 TCP from non-proxy owners, wherever it goes).
        row(Dns, App, Peer, 53, BOTH),
        row(Dns, Proxy, Peer, 53, BOTH),
        row(Dns, ProxyGid, Peer, 53, V4_ONLY),
        row(Dns, App, Lo1, 53, BOTH),
        row(Dns, App, Lo2, 53, V4_ONLY),
        row(Dns, App, SelfIp, 53, BOTH),
        row(Dns, Proxy, SelfIp, 53, BOTH),
        row(Dns, Proxy, SelfIp, 8080, V4_ONLY),
        row(Dns, ProxyGid, SelfIp, 53, BOTH),
        row(Dns, ProxyGid, Lo1, 53, V4_ONLY),
        row(Dns, App, SelfIp, 8080, V4_ONLY),
        row(Dns, App, Peer, 80, V4_ONLY),
        mark(row(Dns, OtherPod, SelfIp, 53, V4_ONLY), SkAssign),
    ]
};

/// Every set, in the order the table first names it.
fn sets() -> Vec<Set> {
    let mut v: Vec<Set> = Vec::new();
    for r in TABLE {
        if !v.contains(&r.set) {
            v.push(r.set);
        }
    }
    v
}

struct Topology {
    s: std::sync::Arc<Pod>,
    p: std::sync::Arc<Pod>,
    gw4: Ipv4Addr,
    gw6: Ipv6Addr,
    s6: Ipv6Addr,
    p6: Ipv6Addr,
    names: Names,
}

impl Topology {
    fn set_name(set: Set) -> &'static str {
        match set {
            Set::Defaults => "defaults",
            Set::V4First => "v4-first/--no-ipv6",
            Set::V4FirstSidestepV6 => "v4-first/ss-ipv6",
            Set::ExcludeOutPorts => "exclOutPorts=8080",
            Set::ExcludeOutCidr => "exclOutIPRanges=P",
            Set::IncludeOutCidr => "inclOutIPRanges=P",
            Set::IncludeOutPorts => "inclOutPorts=80",
            Set::IncludeInPorts => "inclInPorts=8080",
            Set::IncludeInPortsExcluded => "inclIn=8080,9090/excl=9090",
            Set::ExcludeInPorts => "exclInPorts=9090",
            Set::InboundOff => "inclInPorts=\"\"",
            Set::Dns => "dnsCapture",
            Set::Tproxy => "interceptionMode=TPROXY",
        }
    }

    /// istio-iptables' options for the set (istio-cni's view of the annotations).
    fn istio(&self, set: Set) -> IstioCapture {
        let p_ranges = format!("{}/32,{}/128", self.p.ipv4, self.p6);
        let base = IstioCapture {
            ipv6: true,
            ..IstioCapture::default()
        };
        match set {
            Set::Defaults => base,
            Set::V4First | Set::V4FirstSidestepV6 => IstioCapture {
                ipv6: false,
                ..base
            },
            Set::ExcludeOutPorts => IstioCapture {
                exclude_outbound_ports: "8080".into(),
                ..base
            },
            Set::ExcludeOutCidr => IstioCapture {
                exclude_outbound_ip_ranges: p_ranges,
                ..base
            },
            Set::IncludeOutCidr => IstioCapture {
                include_outbound_ip_ranges: p_ranges,
                ..base
            },
            Set::IncludeOutPorts => IstioCapture {
                include_outbound_ip_ranges: String::new(),
                include_outbound_ports: "80".into(),
                ..base
            },
            Set::IncludeInPorts => IstioCapture {
                include_inbound_ports: "8080".into(),
                ..base
            },
            Set::IncludeInPortsExcluded => IstioCapture {
                include_inbound_ports: "8080,9090".into(),
                exclude_inbound_ports: "9090".into(),
                ..base
            },
            Set::ExcludeInPorts => IstioCapture {
                exclude_inbound_ports: "9090".into(),
                ..base
            },
            Set::InboundOff => IstioCapture {
                include_inbound_ports: String::new(),
                ..base
            },
            Set::Dns => IstioCapture {
                dns_capture: true,
                ..base
            },
            Set::Tproxy => IstioCapture {
                mode: Mode::Tproxy,
                ..base
            },
        }
    }

    fn dest(&self, to: Dst, fam: Fam, port: u16) -> Result<SocketAddr> {
        let (v4, v6): (Ipv4Addr, Option<Ipv6Addr>) = match to {
            Dst::SelfIp => (self.s.ipv4, Some(self.s6)),
            Dst::Lo1 => (Ipv4Addr::LOCALHOST, Some(Ipv6Addr::LOCALHOST)),
            Dst::Lo2 => (Ipv4Addr::new(127, 0, 0, 2), None),
            Dst::Peer => (self.p.ipv4, Some(self.p6)),
            Dst::Node => (self.gw4, Some(self.gw6)),
        };
        let ip = match fam {
            Fam::V4 => IpAddr::V4(v4),
            Fam::V6 => IpAddr::V6(v6.context("no IPv6 form of this destination")?),
            Fam::Mapped => IpAddr::V6(v4.to_ipv6_mapped()),
        };
        Ok(SocketAddr::new(ip, port))
    }
}

/// The sidestep enrol flags equivalent to istio's options.
fn sidestep_flags(c: &IstioCapture, capture_ipv6: bool) -> Vec<String> {
    let mut f: Vec<String> = Vec::new();
    let mut opt = |name: &str, v: &str| {
        f.push(name.to_owned());
        f.push(v.to_owned());
    };
    opt("--proxy-uid", &c.proxy_uid.to_string());
    opt("--proxy-gid", &c.proxy_gid.to_string());
    opt(
        "--include-outbound-ip-ranges",
        &c.include_outbound_ip_ranges,
    );
    opt(
        "--exclude-outbound-ip-ranges",
        &c.exclude_outbound_ip_ranges,
    );
    opt("--include-outbound-ports", &c.include_outbound_ports);
    opt("--exclude-outbound-ports", &c.exclude_outbound_ports);
    opt("--include-inbound-ports", &c.include_inbound_ports);
    opt("--exclude-inbound-ports", &c.exclude_inbound_ports);
    if c.dns_capture {
        f.push("--dns-capture".into());
    }
    if c.mode == Mode::Tproxy {
        f.push("--interception-mode".into());
        f.push("TPROXY".into());
    }
    if !capture_ipv6 {
        f.push("--no-ipv6".into());
    }
    f
}

/// One expanded scenario.
struct Scenario {
    set: Set,
    from: Src,
    dst: SocketAddr,
    fam: Fam,
    intended: Option<Intended>,
}

fn scenarios(topo: &Topology) -> Result<Vec<Scenario>> {
    let mut out = Vec::new();
    for r in TABLE {
        for fam in r.fams {
            out.push(Scenario {
                set: r.set,
                from: r.from,
                dst: topo.dest(r.to, *fam, r.port)?,
                fam: *fam,
                intended: r.intended,
            });
        }
    }
    Ok(out)
}

/// Runs one connect as the scenario's source and collects what both ends saw.
fn run_one(
    env: &TestEnv,
    topo: &Topology,
    listeners: &mut Listeners,
    sc: &Scenario,
) -> Result<Outcome> {
    // Nothing may be left over from the previous scenario.
    let stale = listeners.take(Duration::ZERO)?;
    ensure!(stale.is_empty(), "late connections: {stale:?}");
    let target = sc.dst.to_string();
    let bind = match sc.fam {
        Fam::V4 => "127.0.0.6:0",
        Fam::V6 => "[::6]:0",
        Fam::Mapped => "[::ffff:127.0.0.6]:0",
    };
    let mut argv = vec![
        probe(),
        "connect",
        &target,
        "--timeout-ms",
        CONNECT_TIMEOUT_MS,
    ];
    if matches!(sc.from, Src::AppBound | Src::ProxyBound) {
        argv.extend(["--bind", bind]);
    }
    let timeout = Duration::from_secs(10);
    let (uid, gid) = match sc.from {
        Src::Proxy | Src::ProxyBound => (PROXY_UID, PROXY_UID),
        Src::ProxyGid => (OTHER_UID, PROXY_UID),
        _ => (APP_UID, APP_UID),
    };
    let spec = Spawn::new(&argv).user(uid, gid);
    let out = match sc.from {
        Src::OtherPod => topo.p.run_with(env, spec, timeout)?,
        Src::Node => env.run(spec, timeout)?,
        _ => topo.s.run_with(env, spec, timeout)?,
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let client: Value = serde_json::from_str(text.trim()).with_context(|| {
        format!(
            "probe connect printed {text:?} (stderr {:?})",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let wait = if client["errno"].is_null() {
        Duration::from_secs(2)
    } else {
        Duration::ZERO
    };
    outcome(&topo.names, &client, &listeners.take(wait)?)
}

/// Whether the accepting listener is in the subject pod (where sidestep answers getsockopt).
fn in_subject(o: &Outcome) -> bool {
    ["15001", "15006", "15053"].contains(&o.accepted.as_str()) || o.accepted.starts_with("S:")
}

/// Rule G, sidestep's documented SO_ORIGINAL_DST answer in an enrolled pod: ENOENT for every
/// query it has no redirect record for. The kernel under Istio's rules answers otherwise: the
/// REDIRECT rules turn conntrack on in the pod, so a connection nothing redirected gets its own
/// local address back. (SOL_IPV6 on an AF_INET socket fails with EOPNOTSUPP in both: the kernel
/// refuses it before netfilter is asked, and sidestep leaves that error alone.)
fn rule_g(oracle: &Outcome) -> Outcome {
    let mut o = oracle.clone();
    if !in_subject(&o) {
        return o;
    }
    let local = o.local.clone();
    for v in [&mut o.orig_v4, &mut o.orig_v6] {
        if *v == local {
            *v = "ENOENT".into();
        }
    }
    o
}

/// sidestep's exact outcome for an `Intended` row.
fn intended_outcome(why: Intended, sc: &Scenario, oracle: &Outcome, names: &Names) -> Outcome {
    let dst = names.addr(sc.dst);
    let port = sc.dst.port();
    let redirected = |accepted: &str, local: &str| Outcome {
        accepted: accepted.into(),
        local: local.into(),
        orig_v4: "ENOENT".into(),
        orig_v6: dst.clone(),
        app_peer: dst.clone(),
    };
    match why {
        Intended::SkAssign => {
            let mut o = rule_g(oracle);
            o.local = if sc.fam == Fam::V6 {
                o.orig_v6.clone()
            } else {
                o.orig_v4.clone()
            };
            o
        }
        Intended::V6Outbound => redirected("15001", "[::1]:15001"),
        Intended::V6Hairpin => redirected("15006", "[::1]:15006"),
        Intended::V6Inbound => redirected("15006", &dst),
        // Not redirected: netfilter's ENOENT, except SOL_IPV6 on an IPv4 socket, which the kernel
        // refuses itself.
        Intended::ExcludeWins | Intended::HairpinOff => Outcome {
            accepted: format!("S:{port}"),
            local: dst.clone(),
            orig_v4: "ENOENT".into(),
            orig_v6: if sc.fam == Fam::V6 {
                "ENOENT"
            } else {
                "EOPNOTSUPP"
            }
            .into(),
            app_peer: dst.clone(),
        },
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Match,
    MatchG,
    Intended(Intended),
    Mismatch,
}

fn judge(
    sc: &Scenario,
    oracle: &Outcome,
    ss: &Outcome,
    names: &Names,
) -> (Verdict, Option<Outcome>) {
    match sc.intended {
        Some(why) => {
            let want = intended_outcome(why, sc, oracle, names);
            // A mark must describe a real difference, and sidestep must do exactly what it says.
            if *ss == want && want != rule_g(oracle) {
                (Verdict::Intended(why), None)
            } else {
                (Verdict::Mismatch, Some(want))
            }
        }
        None if ss == oracle => (Verdict::Match, None),
        None if *ss == rule_g(oracle) => (Verdict::MatchG, None),
        None => (Verdict::Mismatch, Some(rule_g(oracle))),
    }
}

fn collect(
    env: &TestEnv,
    topo: &Topology,
    listeners: &mut Listeners,
    all: &[Scenario],
    mut configure: impl FnMut(Set, &mut Listeners) -> Result<()>,
) -> Result<Vec<Outcome>> {
    let mut out = Vec::with_capacity(all.len());
    for set in sets() {
        configure(set, listeners)?;
        for sc in all.iter().filter(|s| s.set == set) {
            let o = run_one(env, topo, listeners, sc).with_context(|| {
                format!(
                    "[{}] {} -> {}",
                    Topology::set_name(set),
                    sc.from.name(),
                    topo.names.addr(sc.dst)
                )
            })?;
            out.push(o);
        }
    }
    // `out` follows sets() order; put it back in table order.
    let mut order: Vec<usize> = Vec::new();
    for set in sets() {
        order.extend((0..all.len()).filter(|i| all[*i].set == set));
    }
    let mut table = vec![None; all.len()];
    for (o, i) in out.into_iter().zip(order) {
        table[i] = Some(o);
    }
    table
        .into_iter()
        .map(|o| o.context("scenario without outcome"))
        .collect()
}

#[test]
fn parity_with_istio_iptables() -> Result<()> {
    if skip_unless_root("parity_with_istio_iptables") {
        return Ok(());
    }
    let started = Instant::now();
    // Where conntrack is a module, load it up front: whether it is loaded changes the kernel's
    // SO_ORIGINAL_DST errno (ENOPROTOOPT without it), and the oracle would load it half-way.
    if std::path::Path::new("/proc/modules").exists() {
        let _ = std::process::Command::new("modprobe")
            .arg("nf_conntrack")
            .status();
    }
    let env = TestEnv::new("parity")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let s = node.add_pod("subject")?;
    let p = node.add_pod("peer")?;
    let netns_paths = [s.netns_path.clone(), p.netns_path.clone()];
    // The proxy's IPv6 passthrough source, as the sidecar needs it in both runs.
    netns::add_addr(&s.netns_name, "lo", "::6/128")?;
    let mut names = Names::default();
    let topo = Topology {
        s6: s.ipv6.context("dual-stack pod without IPv6")?,
        p6: p.ipv6.context("dual-stack pod without IPv6")?,
        gw4: node.gateway_v4(),
        gw6: node.gateway_v6().context("dual-stack node without IPv6")?,
        s: s.clone(),
        p: p.clone(),
        names: Names::default(),
    };
    names.add(topo.s.ipv4.into(), "S4");
    names.add(topo.s6.into(), "S6");
    names.add(topo.p.ipv4.into(), "P4");
    names.add(topo.p6.into(), "P6");
    names.add(topo.gw4.into(), "GW4");
    names.add(topo.gw6.into(), "GW6");
    let topo = Topology { names, ..topo };

    let wild = |ports: &[u16]| -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = ports
            .iter()
            .map(|p| SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), *p))
            .collect();
        v.extend(
            ports
                .iter()
                .map(|p| SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), *p)),
        );
        v
    };
    let mut listeners = Listeners::default();
    let start_proxy = |listeners: &mut Listeners| {
        listeners.start_transparent(
            &env,
            probe(),
            Some(&s),
            PROXY_UID,
            PROXY_UID,
            &wild(&[15001, 15006, 15053]),
            |p| p.to_string(),
        )
    };
    let mut proxy = start_proxy(&mut listeners)?;
    listeners.start(&env, probe(), Some(&s), 0, 0, &wild(&S_PORTS), |p| {
        format!("S:{p}")
    })?;
    listeners.start(&env, probe(), Some(&p), 0, 0, &wild(&P_PORTS), |p| {
        format!("P:{p}")
    })?;
    listeners.start(
        &env,
        probe(),
        None,
        0,
        0,
        &[
            SocketAddr::new(topo.gw4.into(), NODE_PORT),
            SocketAddr::new(topo.gw6.into(), NODE_PORT),
        ],
        |p| format!("node:{p}"),
    )?;
    let all = scenarios(&topo)?;
    let setup = started.elapsed();

    // sidestep first, on netns without any iptables rules, once per inbound hook. With tc the
    // proxy's listeners predate each enrolment (as for a running pod the agent repairs); with
    // sk_lookup they start after it (as after a CNI ADD, before the pod's containers start).
    let t = Instant::now();
    let mut by_hook = Vec::new();
    for hook in HOOKS {
        let loaded = Loaded::load(&env)?;
        let outcomes = collect(&env, &topo, &mut listeners, &all, |set, listeners| {
            let capture_ipv6 = set != Set::V4First;
            let mut flags = sidestep_flags(&topo.istio(set), capture_ipv6);
            flags.extend(["--inbound-hook".to_owned(), hook.to_owned()]);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            loaded.enroll(&s, &flags)?;
            if hook == "sk_lookup" {
                listeners.stop(proxy);
                proxy = start_proxy(listeners)?;
            }
            Ok(())
        })
        .with_context(|| format!("inbound hook {hook}"))?;
        loaded.unload()?;
        by_hook.push(outcomes);
    }
    let sidestep_time = t.elapsed();

    let t = Instant::now();
    let mut oracle_rules = Oracle::new(&s);
    let oracle = collect(&env, &topo, &mut listeners, &all, |set, _| {
        oracle_rules.apply(&topo.istio(set))
    });
    let oracle = match oracle {
        Ok(o) => o,
        Err(e) => bail!("{e:#}\nrules at the failure:\n{}", oracle_rules.dump()),
    };
    oracle_rules.clear()?;
    ensure!(
        oracle_rules.is_clear()?,
        "rules left:\n{}",
        oracle_rules.dump()
    );
    let oracle_time = t.elapsed();

    // The table: one sidestep column per inbound hook, each judged against the oracle.
    let mut rows = Vec::new();
    let mut counts = [[0usize; 4]; HOOKS.len()];
    let mut failures = Vec::new();
    for (i, sc) in all.iter().enumerate() {
        let mut row = vec![
            (i + 1).to_string(),
            Topology::set_name(sc.set).to_owned(),
            format!("{} -> {}", sc.from.name(), topo.names.addr(sc.dst)),
            oracle[i].to_string(),
        ];
        let mut statuses = Vec::new();
        for (h, outcomes) in by_hook.iter().enumerate() {
            let (verdict, want) = judge(sc, &oracle[i], &outcomes[i], &topo.names);
            statuses.push(match verdict {
                Verdict::Match => "match".to_owned(),
                Verdict::MatchG => "match (G)".to_owned(),
                Verdict::Intended(why) => format!("intended: {}", why.reason()),
                Verdict::Mismatch => format!(
                    "MISMATCH {} (want {})",
                    HOOKS[h],
                    want.map(|w| w.to_string()).unwrap_or_default()
                ),
            });
            counts[h][match verdict {
                Verdict::Match => 0,
                Verdict::MatchG => 1,
                Verdict::Intended(_) => 2,
                Verdict::Mismatch => 3,
            }] += 1;
            if verdict == Verdict::Mismatch && !failures.contains(&(i + 1)) {
                failures.push(i + 1);
            }
            // The second hook's column only says where it differs from the first.
            row.push(if h > 0 && outcomes[i] == by_hook[0][i] {
                "=".to_owned()
            } else {
                outcomes[i].to_string()
            });
        }
        statuses.dedup();
        row.push(statuses.join("; "));
        rows.push(row);
    }
    let mut text = String::from(
        "\nDifferential parity: Istio iptables (oracle) vs sidestep, inbound hook tc and sk_lookup\n\
         sn = getsockname at the accepting listener, od4/od6 = SO_ORIGINAL_DST at SOL_IP/SOL_IPV6, \
         pn = getpeername at the app; `=`: as with tc\n",
    );
    text.push_str(&render_table(
        &[
            "#",
            "annotations",
            "connection",
            "oracle (istio iptables)",
            "sidestep (tc)",
            "sidestep (sk_lookup)",
            "result",
        ],
        &rows,
    ));
    for (h, c) in counts.iter().enumerate() {
        text.push_str(&format!(
            "{}: {} scenarios: {} match, {} match (G), {} intended, {} mismatch\n",
            HOOKS[h],
            all.len(),
            c[0],
            c[1],
            c[2],
            c[3],
        ));
    }
    text.push_str(&format!(
        "(G) = equal once sidestep's SO_ORIGINAL_DST answer is applied: ENOENT for any socket in \
         the pod it did not redirect, where the kernel under Istio's rules answers the socket's \
         own address (conntrack, no NAT) or EOPNOTSUPP (SOL_IPV6 on an AF_INET socket)\n\
         time: setup {:.1?}, sidestep (both hooks) {:.1?}, oracle {:.1?}\n",
        setup, sidestep_time, oracle_time
    ));
    print_uncaptured(&text);

    drop(listeners);
    drop(oracle_rules);
    drop((s, p, topo));
    drop(node);
    for path in &netns_paths {
        ensure!(!path.exists(), "netns {} left behind", path.display());
    }
    ensure!(all.len() >= 60, "only {} scenarios", all.len());
    ensure!(
        failures.is_empty(),
        "scenarios {failures:?} differ (see the table)"
    );
    Ok(())
}
