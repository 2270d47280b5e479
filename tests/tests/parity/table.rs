//! The scenario table and its vocabulary: who connects (`Src`), to where (`Dst`), in which
//! family, under which set of annotations, and the rows where sidestep differs from Istio on
//! purpose (`Intended`). Kept apart from the machinery that runs it so the table reads as a spec.

use crate::NODE_PORT;

/// Who connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Src {
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
    /// The app of pod Q, on the second network (S's net1).
    Net1Pod,
    /// The app in S, from a socket bound to net1 with SO_BINDTODEVICE first.
    AppDev,
}

impl Src {
    pub(super) fn name(self) -> &'static str {
        match self {
            Src::App => "app",
            Src::Proxy => "proxy",
            Src::ProxyGid => "gid1337",
            Src::AppBound => "app@.6",
            Src::ProxyBound => "proxy@.6",
            Src::OtherPod => "pod P",
            Src::Node => "node",
            Src::Net1Pod => "pod Q",
            Src::AppDev => "app%net1",
        }
    }
}

/// Where it connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dst {
    /// S's own pod IP.
    SelfIp,
    /// 127.0.0.1 / ::1.
    Lo1,
    /// 127.0.0.2 (IPv4 only).
    Lo2,
    /// 127.0.0.6 / ::6, the inbound passthrough source (on lo; Istio's validation dials it).
    Passthrough,
    /// The other pod's IP.
    Peer,
    /// The node's bridge address.
    Node,
    /// S's address on its second interface, net1.
    SelfNet1,
    /// The IPv6 link-local address of S's eth0, with the client's scope (IPv6 only).
    SelfLl,
    /// The IPv6 link-local address of S's net1 (IPv6 only).
    SelfNet1Ll,
    /// A secondary address added to S's eth0 after enrolment (set `LateAddrs` only).
    SelfLate,
    /// Pod Q, on the second network: routed out of S's net1.
    Net1Peer,
    /// The IPv6 link-local address of P's eth0, scoped to S's eth0 (IPv6 only).
    PeerLl,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fam {
    V4,
    V6,
    /// An IPv4 destination, IPv4-mapped, on an AF_INET6 socket.
    Mapped,
}

/// The pod annotations of one set, as istio-cni turns them into istio-iptables options. The
/// equivalent sidestep policy is derived from the same options by [`sidestep_flags`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Set {
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
    /// traffic.sidecar.istio.io/excludeInterfaces: "net1".
    ExcludeIfaces,
    /// excludeInterfaces "net1" in TPROXY mode (its RETURNs go in mangle too).
    ExcludeIfacesTproxy,
    /// No annotations; a secondary address of each family is added to S's eth0 after the
    /// enrolment (and removed after the set).
    LateAddrs,
    /// No annotations; sidestep enrolled through sidestep-cni twice, ADD for eth0 and ADD for
    /// net1 with the same container ID (Multus), against the oracle's one ruleset.
    TwoAttachments,
    /// As TwoAttachments, after sidestep-cni's DEL of the net1 attachment.
    Net1Deleted,
}

/// A deliberate difference: sidestep's outcome is asserted to be exactly this, derived from the
/// scenario (or, for `SkAssign`, from the oracle's outcome).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Intended {
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
    /// A connect to a link-local address is captured by both, but under Istio its SYN is lost:
    /// the scope binds the socket to eth0 before nat OUTPUT REDIRECTs it to ::1, which eth0
    /// cannot reach. connect6 rewrites before the scope binds anything, so the redirect
    /// reaches the proxy (15006 for the proxy's hairpin, 15001 otherwise); the scope id is not
    /// visible to a sock_addr program, so SO_ORIGINAL_DST and getpeername carry none.
    LinkLocalRedirect,
    /// An IPv6 connect from a socket bound to a captured interface (SO_BINDTODEVICE) is
    /// captured by both and reaches nobody: the proxy's loopback is not on that interface.
    /// connect6's rewrite to ::1 fails at once (ENETUNREACH); REDIRECT's SYN is lost (ETIMEDOUT).
    BoundDeviceV6,
    /// A socket bound to a loopback address (127.0.0.6) calling off the pod: connect4 refuses it
    /// (EPERM). Under Istio the route lookup refuses it (EINVAL) while `route_localnet` is off,
    /// and REDIRECT captures it once kube-proxy has turned that on; sidestep does not depend on
    /// the setting (docs/RELIABILITY.md, the threat table; bypass.rs tests both settings).
    LoopbackSourceRefused,
}

impl Intended {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Intended::SkAssign => "sk_assign: getsockname is the original dst",
            Intended::V6Outbound => "IPv6 outbound captured (istio: no ip6tables rules)",
            Intended::V6Hairpin => "IPv6 hairpin captured (istio: no ip6tables rules)",
            Intended::V6Inbound => "IPv6 inbound captured (istio: no ip6tables rules)",
            Intended::ExcludeWins => "excluded inbound port never captured, even if listed",
            Intended::LinkLocalRedirect => {
                "link-local dst redirected (istio: the SYN REDIRECTed to ::1 on an eth0-bound socket is lost); no scope id"
            }
            Intended::BoundDeviceV6 => {
                "SO_BINDTODEVICE to a captured nic: fails at once, not by timeout"
            }
            Intended::LoopbackSourceRefused => {
                "loopback source off the pod: EPERM whatever route_localnet (istio: EINVAL, or REDIRECT with it on)"
            }
        }
    }
}

pub(super) struct Row {
    pub(super) set: Set,
    pub(super) from: Src,
    pub(super) to: Dst,
    pub(super) port: u16,
    pub(super) fams: &'static [Fam],
    pub(super) intended: Option<Intended>,
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
pub(super) const TABLE: &[Row] = {
    use Src::{App, AppBound, AppDev, Net1Pod, OtherPod, Proxy, ProxyBound, ProxyGid};
    use Intended::*;
    use Set::*;
    use Dst::{Lo1, Lo2, Net1Peer, Passthrough, Peer, PeerLl, SelfIp, SelfLate, SelfLl, SelfNet1, SelfNet1Ll};
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
        // istio-validation's probe: the proxy dials the passthrough address and must land on
        // the inbound listener; the app's call to it stays on lo.
        row(Defaults, Proxy, Passthrough, 8080, BOTH),
        row(Defaults, App, Passthrough, 8080, BOTH),
        // Sockets bound to the inbound passthrough address first.
        row(Defaults, ProxyBound, SelfIp, 8080, BOTH),
        row(Defaults, AppBound, SelfIp, 8080, BOTH),
        mark(row(Defaults, AppBound, Peer, 80, V4_ONLY), LoopbackSourceRefused),
        row(Defaults, AppBound, Peer, 80, V6_ONLY),
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
        // The hairpin stays without inbound capture, as Istio's does (istio-validation needs it).
        row(InboundOff, Proxy, SelfIp, 8080, BOTH),
        row(InboundOff, Proxy, Passthrough, 8080, BOTH),
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

        // Interfaces and addresses: Istio's `-A PREROUTING -p tcp -j ISTIO_INBOUND` has no `-i`
        // and no `-d`. S's second interface net1, on a second network, with its client Q:
        mark(row(Defaults, Net1Pod, SelfNet1, 8080, BOTH), SkAssign),
        row(Defaults, Net1Pod, SelfNet1, 15020, V4_ONLY),
        mark(row(Defaults, Src::Node, SelfNet1, 8080, V4_ONLY), SkAssign),
        mark(row(Defaults, Net1Pod, SelfNet1Ll, 8080, V6_ONLY), SkAssign),
        row(Defaults, App, Net1Peer, 80, ALL3),
        row(Defaults, AppDev, Net1Peer, 80, V4_ONLY),
        mark(row(Defaults, AppDev, Net1Peer, 80, V6_ONLY), BoundDeviceV6),
        row(Defaults, Proxy, SelfNet1, 8080, BOTH),
        row(Defaults, App, SelfNet1, 8080, V4_ONLY),
        // ... and eth0's IPv6 link-local address.
        mark(row(Defaults, OtherPod, SelfLl, 8080, V6_ONLY), SkAssign),
        mark(row(Defaults, Proxy, SelfLl, 8080, V6_ONLY), LinkLocalRedirect),
        row(Defaults, App, SelfLl, 8080, V6_ONLY),
        mark(row(Defaults, App, PeerLl, 80, V6_ONLY), LinkLocalRedirect),

        // excludeInterfaces net1: `-i net1 -j RETURN` in PREROUTING, `-o net1 -j RETURN` in
        // OUTPUT. Inbound on net1 and outbound routed (or bound) out of it are not captured;
        // eth0 is, and the pod calling its own net1 address leaves through lo.
        row(ExcludeIfaces, Net1Pod, SelfNet1, 8080, BOTH),
        row(ExcludeIfaces, Net1Pod, SelfNet1Ll, 8080, V6_ONLY),
        row(ExcludeIfaces, Src::Node, SelfNet1, 8080, V4_ONLY),
        mark(row(ExcludeIfaces, OtherPod, SelfIp, 8080, BOTH), SkAssign),
        mark(row(ExcludeIfaces, OtherPod, SelfLl, 8080, V6_ONLY), SkAssign),
        row(ExcludeIfaces, App, Net1Peer, 80, ALL3),
        row(ExcludeIfaces, AppDev, Net1Peer, 80, BOTH),
        row(ExcludeIfaces, App, Peer, 80, BOTH),
        row(ExcludeIfaces, App, Dst::Node, NODE_PORT, V4_ONLY),
        row(ExcludeIfaces, Proxy, SelfNet1, 8080, BOTH),
        row(ExcludeIfaces, App, SelfNet1, 8080, V4_ONLY),
        row(ExcludeIfacesTproxy, Net1Pod, SelfNet1, 8080, BOTH),
        row(ExcludeIfacesTproxy, OtherPod, SelfIp, 8080, BOTH),
        row(ExcludeIfacesTproxy, App, Net1Peer, 80, V4_ONLY),
        row(ExcludeIfacesTproxy, App, Peer, 80, V4_ONLY),
        // TPROXY on the second interface.
        row(Tproxy, Net1Pod, SelfNet1, 8080, BOTH),

        // An address added to eth0 after enrolment (DHCP, SLAAC, another plugin).
        // Followed by `sidestep follow-addresses` (the agent's address follower).
        mark(row(LateAddrs, OtherPod, SelfLate, 8080, BOTH), SkAssign),
        mark(row(LateAddrs, Src::Node, SelfLate, 8080, V4_ONLY), SkAssign),
        row(LateAddrs, Proxy, SelfLate, 8080, BOTH),
        row(LateAddrs, App, SelfLate, 8080, BOTH),
        // ... and net1 captured again once an enrolment no longer excludes it.
        mark(row(LateAddrs, Net1Pod, SelfNet1, 8080, V4_ONLY), SkAssign),
        row(LateAddrs, App, Net1Peer, 80, V4_ONLY),

        // Two CNI attachments of one netns, then the DEL of one: eth0 stays captured.
        mark(row(TwoAttachments, OtherPod, SelfIp, 8080, BOTH), SkAssign),
        mark(row(TwoAttachments, OtherPod, SelfLl, 8080, V6_ONLY), SkAssign),
        mark(row(TwoAttachments, Net1Pod, SelfNet1, 8080, BOTH), SkAssign),
        mark(row(TwoAttachments, Net1Pod, SelfNet1Ll, 8080, V6_ONLY), SkAssign),
        row(TwoAttachments, Net1Pod, SelfNet1, 15020, V4_ONLY),
        row(TwoAttachments, Proxy, SelfNet1, 8080, BOTH),
        row(TwoAttachments, App, Net1Peer, 80, V4_ONLY),
        row(TwoAttachments, App, Peer, 80, V4_ONLY),
        mark(row(Net1Deleted, OtherPod, SelfIp, 8080, BOTH), SkAssign),
        mark(row(Net1Deleted, OtherPod, SelfLl, 8080, V6_ONLY), SkAssign),
        row(Net1Deleted, Proxy, SelfIp, 8080, BOTH),
        row(Net1Deleted, App, Peer, 80, V4_ONLY),
    ]
};

/// Every set, in the order the table first names it.
pub(super) fn sets() -> Vec<Set> {
    let mut v: Vec<Set> = Vec::new();
    for r in TABLE {
        if !v.contains(&r.set) {
            v.push(r.set);
        }
    }
    v
}
