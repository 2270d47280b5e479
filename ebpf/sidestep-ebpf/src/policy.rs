//! The capture decision, in istio-iptables' rule order, and the lookups it needs.

use aya_ebpf::btf_maps::lpm_trie::Key;
use sidestep_abi::{
    CIDR_KEY_FIXED_BITS, CidrKey, Counters, InterfaceKey, PodPolicy, PortKey, cidr_list, defaults,
    flags, iface_kind, is_v4_mapped, linux, pod_source_flags, port_list, redirect_kind, route_via,
    rule,
};

use crate::maps::{
    SIDESTEP_ADDRS, SIDESTEP_CIDRS, SIDESTEP_IFACES, SIDESTEP_POD, SIDESTEP_PORTS, SIDESTEP_SRC,
    SIDESTEP_SRCR, SIDESTEP_STATS,
};

/// `127.0.0.1` in network byte order.
pub const LOOPBACK4_BE: u32 = 0x7f00_0001_u32.to_be();
/// `127.0.0.6`, Istio's inbound passthrough source, in network byte order.
pub const PASSTHROUGH4_BE: u32 = 0x7f00_0006_u32.to_be();
pub const LOOPBACK6: [u32; 4] = [0, 0, 0, 1_u32.to_be()];
pub const PASSTHROUGH6: [u32; 4] = [0, 0, 0, 6_u32.to_be()];

#[inline(always)]
pub fn pod_policy(netns_cookie: u64) -> Option<PodPolicy> {
    // SAFETY: the value is copied out at once, before any map update could reuse the slot.
    unsafe { SIDESTEP_POD.get(netns_cookie) }.copied()
}

#[inline(always)]
pub fn port_listed(netns_cookie: u64, list: u32, port: u16) -> bool {
    let key = PortKey {
        netns_cookie,
        list,
        port: port as u32,
    };
    SIDESTEP_PORTS.get_ptr(key).is_some()
}

#[inline(always)]
pub fn cidr_listed(netns_cookie: u64, list: u32, addr: &[u32; 4]) -> bool {
    cidr_value(netns_cookie, list, addr).is_some()
}

/// The value of the longest prefix of `list` that covers `addr`.
#[inline(always)]
fn cidr_value(netns_cookie: u64, list: u32, addr: &[u32; 4]) -> Option<u8> {
    // Full-length key: the trie returns the longest stored prefix that covers the address.
    let key = Key::new(
        CIDR_KEY_FIXED_BITS + 128,
        CidrKey::new(netns_cookie, list, addr_bytes(addr)),
    );
    SIDESTEP_CIDRS.get(&key).copied()
}

/// `addr` (IPv6 words in network byte order) as its 16 bytes in network order.
#[inline(always)]
pub fn addr_bytes(addr: &[u32; 4]) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    let mut i = 0;
    while i < 4 {
        let word = addr[i].to_ne_bytes();
        bytes[i * 4] = word[0];
        bytes[i * 4 + 1] = word[1];
        bytes[i * 4 + 2] = word[2];
        bytes[i * 4 + 3] = word[3];
        i += 1;
    }
    bytes
}

/// Whether a connect to a destination off the pod leaves through one of the pod's excluded
/// interfaces, as istio-iptables' `-o <nic> -j RETURN` sees it: the device the socket is bound
/// to, else the device of the pod's route to it (its routes, as enrolment read them, are
/// entries of the `cidr_list::ROUTE` list).
#[inline(always)]
fn leaves_excluded_interface(c: &Connect) -> bool {
    if c.bound_dev_if != 0 {
        let key = InterfaceKey {
            netns_cookie: c.netns_cookie,
            ifindex: c.bound_dev_if,
            _reserved: 0,
        };
        // SAFETY: the value is read at once.
        return unsafe { SIDESTEP_IFACES.get(key) }.is_some_and(|k| *k == iface_kind::EXCLUDED);
    }
    cidr_value(c.netns_cookie, cidr_list::ROUTE, &c.dst) == Some(route_via::EXCLUDED)
}

/// Whether `addr` is one of this pod's own addresses (one hash lookup).
#[inline(always)]
pub fn is_pod_address(netns_cookie: u64, addr: &[u32; 4]) -> bool {
    // SAFETY: the value is read at once.
    unsafe { SIDESTEP_ADDRS.get(addr) }.is_some_and(|owner| *owner == netns_cookie)
}

/// Adds to this pod's counters on the current CPU. Pods are enrolled with a zeroed entry.
#[inline(always)]
pub fn count(netns_cookie: u64, bump: impl FnOnce(&mut Counters)) {
    if let Some(counters) = SIDESTEP_STATS.get_ptr_mut(netns_cookie) {
        // SAFETY: per-CPU slot, so no other program writes it concurrently.
        bump(unsafe { &mut *counters });
    }
}

/// 127.0.0.0/8 or ::1.
#[inline(always)]
pub fn is_loopback(addr: &[u32; 4]) -> bool {
    if is_v4_mapped(addr) {
        addr[3].to_ne_bytes()[0] == 127
    } else {
        addr[0] == LOOPBACK6[0]
            && addr[1] == LOOPBACK6[1]
            && addr[2] == LOOPBACK6[2]
            && addr[3] == LOOPBACK6[3]
    }
}

/// 0.0.0.0 or ::, which connect turns into 127.0.0.1 or ::1 ("this host") before any route
/// lookup, so istio-iptables' `-d 127.0.0.1/32` rule sees it as 127.0.0.1.
#[inline(always)]
pub fn is_unspecified(addr: &[u32; 4]) -> bool {
    if is_v4_mapped(addr) {
        addr[3] == 0
    } else {
        (addr[0] | addr[1] | addr[2] | addr[3]) == 0
    }
}

/// The source REDIRECT leaves a captured connection, the one the route of the original
/// destination `dst` gives; None to keep the loopback source the kernel picks for the proxy's
/// address:
/// - a loopback or unspecified destination: loopback, as its own route gives;
/// - one of the pod's own IPv6 addresses (or ::6): the destination itself (RFC 6724, rule 1);
/// - an IPv6 link-local destination: None (its source would need the scope, which a sock_addr
///   program cannot see);
/// - a destination routed through another interface of a multi-homed pod (`SIDESTEP_SRCR`):
///   that interface's address;
/// - anything else: the pod's address of the family (`SIDESTEP_SRC`, the pod's primary), which
///   for IPv4 is also the source of the local route of one of the pod's addresses on its
///   network.
#[inline(always)]
pub fn redirect_source(netns_cookie: u64, dst: &[u32; 4]) -> Option<[u32; 4]> {
    if is_loopback(dst) || is_unspecified(dst) {
        return None;
    }
    let v4 = is_v4_mapped(dst);
    if !v4 && (is_pod_address(netns_cookie, dst) || is_passthrough_source(dst)) {
        return Some(*dst);
    }
    if !v4 && is_link_local6(dst) {
        return None;
    }
    // SAFETY: the value is copied out at once.
    let pod = unsafe { SIDESTEP_SRC.get(netns_cookie) }?;
    let routed = if pod.flags & pod_source_flags::ROUTES != 0 {
        let key = Key::new(
            CIDR_KEY_FIXED_BITS + 128,
            CidrKey::new(netns_cookie, cidr_list::SOURCE, addr_bytes(dst)),
        );
        SIDESTEP_SRCR.get(&key).copied()
    } else {
        None
    };
    let src = match routed {
        Some(src) => src,
        None if v4 => pod.addr4,
        None => pod.addr6,
    };
    if is_unspecified(&src) {
        None
    } else {
        Some(src)
    }
}

/// fe80::/10.
#[inline(always)]
pub fn is_link_local6(addr: &[u32; 4]) -> bool {
    addr[0].to_ne_bytes()[0] == 0xfe && addr[0].to_ne_bytes()[1] & 0xc0 == 0x80
}

/// 127.0.0.1 or ::1, or the unspecified address that becomes them.
#[inline(always)]
pub fn is_host_loopback(addr: &[u32; 4]) -> bool {
    let exact = if is_v4_mapped(addr) {
        addr[3] == LOOPBACK4_BE
    } else {
        is_loopback(addr)
    };
    exact || is_unspecified(addr)
}

#[inline(always)]
pub fn is_passthrough_source(addr: &[u32; 4]) -> bool {
    if is_v4_mapped(addr) {
        addr[3] == PASSTHROUGH4_BE
    } else {
        addr[0] == PASSTHROUGH6[0]
            && addr[1] == PASSTHROUGH6[1]
            && addr[2] == PASSTHROUGH6[2]
            && addr[3] == PASSTHROUGH6[3]
    }
}

/// `-o lo`: the destination is on the pod itself. ::6, the IPv6 inbound passthrough source
/// enrolment adds to lo, is routed over lo although it is not loopback.
#[inline(always)]
pub fn is_local_destination(c: &Connect) -> bool {
    is_loopback(&c.dst)
        || is_unspecified(&c.dst)
        || (!is_v4_mapped(&c.dst) && is_passthrough_source(&c.dst))
        || is_pod_address(c.netns_cookie, &c.dst)
}

/// Where a connect goes. A plain struct rather than an enum: every field is always initialised,
/// so LLVM cannot read a payload register on the pass path, which the verifier rejects.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Loopback port to rewrite to; 0 for pass.
    pub port: u16,
    /// A `redirect_kind` value; 0 for pass.
    pub kind: u16,
    /// The `rule` that decided, for the debug log.
    pub rule: u16,
}

impl Verdict {
    #[inline(always)]
    pub const fn pass(rule: u16) -> Self {
        Self {
            port: 0,
            kind: 0,
            rule,
        }
    }

    #[inline(always)]
    pub const fn redirect(port: u16, kind: u16, rule: u16) -> Self {
        Self { port, kind, rule }
    }

    /// Fail the connect or the datagram (EPERM).
    #[inline(always)]
    pub const fn refuse(rule: u16) -> Self {
        Self {
            port: 0,
            kind: redirect_kind::REFUSED,
            rule,
        }
    }

    #[inline(always)]
    pub const fn is_refused(&self) -> bool {
        self.kind == redirect_kind::REFUSED
    }

    #[inline(always)]
    pub const fn is_pass(&self) -> bool {
        self.kind == 0
    }
}

/// A connect from inside an enrolled netns, as the decision sees it.
pub struct Connect<'a> {
    pub netns_cookie: u64,
    pub policy: &'a PodPolicy,
    pub uid: u32,
    pub gid: u32,
    /// Destination, IPv4 in mapped form.
    pub dst: [u32; 4],
    pub dst_port: u16,
    /// Address the socket is already bound to (all zero when unbound).
    pub bound_src: [u32; 4],
    pub protocol: u32,
    /// The socket's SO_MARK (setting it takes CAP_NET_ADMIN).
    pub mark: u32,
    /// The device the socket is bound to (SO_BINDTODEVICE, or a link-local scope), or 0.
    pub bound_dev_if: u32,
}

/// TPROXY mode: the proxy's transparent connection to its own app, from a socket bound to the
/// remote client's address (IP_TRANSPARENT). It is never captured, and it needs the TPROXY mark
/// so that the app's replies route back to the proxy. istio-iptables sends it through its nat
/// hairpin rule when the proxy runs as its UID, which breaks it; an Envoy running as root gets
/// past that rule and marks its socket itself. Only the proxy's UID or GID, or a socket already
/// carrying the TPROXY mark (which takes CAP_NET_ADMIN to set), qualifies: an app bound to a
/// foreign address with IP_FREEBIND must not gain a spoofed connection to its pod.
#[inline(always)]
pub fn is_tproxy_passthrough(c: &Connect) -> bool {
    let p = c.policy;
    p.flags & flags::TPROXY != 0
        && c.protocol == linux::IPPROTO_TCP
        && (c.uid == p.proxy_uid || c.gid == p.proxy_gid || c.mark == defaults::TPROXY_MARK)
        && !is_unspecified(&c.bound_src)
        && !is_loopback(&c.bound_src)
        && !is_passthrough_source(&c.bound_src)
        && is_pod_address(c.netns_cookie, &c.dst)
        && !is_pod_address(c.netns_cookie, &c.bound_src)
}

/// istio-iptables' nat OUTPUT chain (ISTIO_OUTPUT), first match wins; see ISTIO-CAPTURE.md.
/// The step numbers are the chain's rules; `tests/tests/parity.rs` checks the outcomes against
/// the real ruleset.
#[inline(always)]
pub fn outbound_verdict(c: &Connect) -> Verdict {
    let p = c.policy;
    if crate::ambient::is_ambient(p) {
        return crate::ambient::outbound_verdict(c);
    }
    // istio installs no ip6tables rules at all for a pod without IPv6.
    if !is_v4_mapped(&c.dst) && p.flags & flags::IPV6 == 0 {
        return Verdict::pass(rule::NO_IPV6);
    }
    // 1. excluded outbound ports (TCP and UDP), for everyone.
    if p.flags & flags::HAS_OUT_PORT_EXCLUDES != 0
        && port_listed(c.netns_cookie, port_list::OUTBOUND_EXCLUDE, c.dst_port)
    {
        return Verdict::pass(rule::OUT_EXCLUDED_PORT);
    }
    // Istio's validation dials ::6 ([::6]:15002) and needs the hairpin, hence its place here.
    let local_dst = is_local_destination(c);
    // `-o <nic> -j RETURN` for each excluded interface, inserted ahead of ISTIO_OUTPUT. Only
    // passes follow, so testing it after rule 1 changes no outcome. A destination on the pod
    // leaves through lo, never through an excluded interface.
    if p.flags & flags::HAS_EXCLUDED_IFACES != 0 && !local_dst && leaves_excluded_interface(c) {
        return Verdict::pass(rule::EXCLUDED_INTERFACE);
    }
    // An IPv4 socket bound to a loopback address, to a destination off the pod. The route lookup
    // refuses it (EINVAL) unless `route_localnet` is on, which kube-proxy sets on the node and a
    // new netns copies; then rule 2 below does not match it (not `-o lo`) and Istio captures it.
    // It is refused rather than redirected: no app makes such a connection on purpose. The
    // proxy's own (its hand-off from 127.0.0.6 to a pod address enrolment did not list, say)
    // goes on down the chain, which passes it as Istio's rule 5 does.
    if !local_dst
        && is_v4_mapped(&c.bound_src)
        && is_loopback(&c.bound_src)
        && c.uid != p.proxy_uid
        && c.gid != p.proxy_gid
    {
        return Verdict::refuse(rule::LOOPBACK_SOURCE_OFF_POD);
    }
    // 2. -o lo -s 127.0.0.6: the proxy's inbound passthrough to the app.
    // An unbound IPv6 socket calling ::6 gets ::6 as its source too (RFC 6724 rule 1, same
    // address first), which this rule matches; 127.0.0.6 gets lo's 127.0.0.1.
    let v6_passthrough_dst = !is_v4_mapped(&c.dst) && is_passthrough_source(&c.dst);
    if local_dst
        && (is_passthrough_source(&c.bound_src)
            || (v6_passthrough_dst && is_unspecified(&c.bound_src)))
    {
        return Verdict::pass(rule::INBOUND_PASSTHROUGH);
    }
    let proxy_uid = c.uid == p.proxy_uid;
    let proxy_gid = c.gid == p.proxy_gid;
    let tcp = c.protocol == linux::IPPROTO_TCP;
    let dns = p.flags & flags::DNS_CAPTURE != 0;
    let dns_port = dns && c.dst_port == 53;
    // The hairpin rules: TCP over lo, not to 127.0.0.1, not to the tunnel port.
    let hairpin = local_dst
        && tcp
        && p.flags & flags::HAIRPIN != 0
        && !is_host_loopback(&c.dst)
        && c.dst_port != defaults::TUNNEL_PORT;
    let inbound = |rule| Verdict::redirect(p.inbound_port, redirect_kind::INBOUND, rule);
    // 3. the proxy UID calling its own pod goes through inbound (with DNS capture, not port 53).
    if proxy_uid && hairpin && !dns_port {
        return inbound(rule::PROXY_UID_HAIRPIN);
    }
    // 4. anything else on lo that is not the proxy UID is left alone (the app calling
    // localhost); with DNS capture only TCP to ports other than 53, the rest goes on to DNS.
    let lo_return = local_dst && (!dns || (tcp && c.dst_port != 53));
    if lo_return && !proxy_uid {
        return Verdict::pass(rule::LOOPBACK_RETURN);
    }
    // 5. the proxy UID's own connections.
    if proxy_uid {
        return Verdict::pass(rule::PROXY_UID);
    }
    // 6. the same hairpin for the proxy GID; reached over lo only by what rule 4 let through,
    // i.e. with DNS capture, TCP to port 53. (7, lo and not the GID, cannot match any more.)
    if proxy_gid && hairpin {
        return inbound(rule::PROXY_GID_HAIRPIN);
    }
    // 8. the proxy GID's own connections.
    if proxy_gid {
        return Verdict::pass(rule::PROXY_GID);
    }
    // 9. DNS capture: port 53 (TCP and UDP) from anyone else, wherever it goes.
    if dns_port {
        return Verdict::redirect(p.dns_port, redirect_kind::DNS, rule::DNS);
    }
    // Only TCP is redirected from here on.
    if !tcp || p.flags & flags::OUTBOUND == 0 {
        return Verdict::pass(rule::NOT_CAPTURED_PROTOCOL);
    }
    // 10. -d 127.0.0.1 returns; every other destination on lo has returned above.
    // 11. excludeOutboundIPRanges.
    if p.flags & flags::HAS_OUT_CIDR_EXCLUDES != 0
        && cidr_listed(c.netns_cookie, cidr_list::OUTBOUND_EXCLUDE, &c.dst)
    {
        return Verdict::pass(rule::OUT_EXCLUDED_CIDR);
    }
    let redirect = |rule| Verdict::redirect(p.outbound_port, redirect_kind::OUTBOUND, rule);
    // 12. includeOutboundPorts.
    if p.flags & flags::HAS_OUT_PORT_INCLUDES != 0
        && port_listed(c.netns_cookie, port_list::OUTBOUND_INCLUDE, c.dst_port)
    {
        return redirect(rule::OUT_INCLUDED_PORT);
    }
    // 13. includeOutboundIPRanges; `*` needs no lookup.
    if p.flags & flags::OUTBOUND_ALL_RANGES != 0
        || cidr_listed(c.netns_cookie, cidr_list::OUTBOUND_INCLUDE, &c.dst)
    {
        return redirect(rule::OUT_INCLUDED_CIDR);
    }
    Verdict::pass(rule::END_OF_CHAIN)
}
