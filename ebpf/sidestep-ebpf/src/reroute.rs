//! tc on a re-routed virtual interface (`istio.io/reroute-virtual-interfaces`): a stateful DNAT
//! that stands in for istio-iptables' `-i <nic> -j ISTIO_REDIRECT` (REDIRECT to the outbound
//! port, at the interface's own address).
//!
//! - Ingress: a SYN (no ACK) whose destination the pod's include ranges cover records the
//!   connection in `SIDESTEP_RNAT` (and in `SIDESTEP_PEND` for the proxy's SO_ORIGINAL_DST), then
//!   has its destination rewritten to (interface address, outbound port). Later packets of a
//!   recorded connection get the same rewrite; anything else passes untouched (replies to
//!   connections the pod made, which conntrack would not NAT either).
//! - Egress: the proxy's packets from (interface address, outbound port) to a recorded client get
//!   their source rewritten back to the original destination.
//!
//! A packet passed on ingress is forwarded by the pod, so TCP this program cannot follow to its
//! header (IPv4 fragments, an IPv6 Fragment or Routing header, a truncated header) is dropped
//! where Istio's rules would REDIRECT it: conntrack reassembles before nat, and a tc program
//! cannot. IPv6 Hop-by-Hop, Destination Options and AH headers are followed, as ip6tables'
//! `-p tcp` skips them.
//!
//! sk_assign cannot do this: the destinations are foreign, and a non-transparent listener cannot
//! answer from a foreign source.

use aya_ebpf::{
    bindings::BPF_F_PSEUDO_HDR, helpers::generated::bpf_csum_diff, macros::classifier,
    programs::TcContext,
};
use sidestep_abi::{
    OrigDst, RerouteIf, RerouteIfKey, TupleKey, cidr_list, flags, linux, redirect_kind,
    reroute_flags, socket_side,
};

use crate::{
    context::load,
    maps::{SIDESTEP_PEND, SIDESTEP_RNAT, SIDESTEP_RRIF},
    packet::{ETH_HLEN, Parsed, Segment, parse_rerouted},
    policy,
};

/// Not ours: let the next program or the default action decide.
const NEXT: i32 = -1;
/// Re-routed, but it cannot be delivered to the proxy: drop (fail closed), as REDIRECT drops a
/// packet on an interface without an address.
const DROP: i32 = 2;

const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
const IPV4_SRC_OFF: usize = ETH_HLEN + 12;
const IPV4_DST_OFF: usize = ETH_HLEN + 16;
const IPV6_SRC_OFF: usize = ETH_HLEN + 8;
const IPV6_DST_OFF: usize = ETH_HLEN + 24;
const TCP_CSUM_OFF: usize = 16;

#[repr(C)]
#[derive(Clone, Copy)]
struct EthHead {
    dst: [u8; 6],
    src: [u8; 6],
}

/// The re-routed interface this packet is on; `ingress` picks the MAC that names it.
#[inline(always)]
fn interface(ctx: &TcContext, ingress: bool) -> Option<RerouteIf> {
    let eth: EthHead = ctx.load(0).ok()?;
    // SAFETY: `ifindex` is a readable 4-byte field of __sk_buff.
    let ifindex = unsafe { load(&raw const (*ctx.skb.skb).ifindex) };
    let key = RerouteIfKey {
        ifindex,
        mac: if ingress { eth.dst } else { eth.src },
        _reserved: 0,
    };
    // SAFETY: the value is copied out at once.
    unsafe { SIDESTEP_RRIF.get(key) }.copied()
}

/// Rewrites the address at `addr_off` and the port at `port_off` (both inside the TCP/IP headers
/// of `seg`) from `old` to `new`, fixing the TCP checksum (pseudo-header included) and, for IPv4,
/// the header checksum. `seg.l4` is past any extension headers; the pseudo-header's addresses
/// are the fixed header's (a Routing header, which would change that, never gets here).
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    seg: &Segment,
    addr_off: usize,
    port_off: usize,
    old: (&[u32; 4], u16),
    new: (&[u32; 4], u16),
) -> Result<(), i64> {
    let csum = seg.l4 + TCP_CSUM_OFF;
    if seg.ipv6 {
        // SAFETY: both buffers are 16 readable bytes on this program's stack.
        let diff = unsafe {
            bpf_csum_diff(
                old.0.as_ptr().cast_mut(),
                16,
                new.0.as_ptr().cast_mut(),
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(diff);
        }
        ctx.l4_csum_replace(csum, 0, diff as u64, BPF_F_PSEUDO_HDR as u64)?;
        ctx.store(addr_off, new.0, 0)?;
    } else {
        let (from, to) = (old.0[3], new.0[3]);
        ctx.l4_csum_replace(csum, from as u64, to as u64, BPF_F_PSEUDO_HDR as u64 | 4)?;
        ctx.l3_csum_replace(IPV4_CSUM_OFF, from as u64, to as u64, 4)?;
        ctx.store(addr_off, &to, 0)?;
    }
    ctx.l4_csum_replace(csum, old.1 as u64, new.1 as u64, 2)?;
    ctx.store(port_off, &new.1, 0)?;
    Ok(())
}

/// Ingress TCP whose header cannot be reached (see [`Parsed::Opaque`]). Istio's rules would
/// reassemble it and REDIRECT it when the include ranges cover `dst`; sidestep cannot, and
/// passing it would forward it around the proxy, so it drops it (fail closed). What Istio would
/// leave alone (outside the include ranges, IPv6 of a pod without IPv6 capture) passes.
#[inline(always)]
fn on_opaque(ctx: &TcContext, ipv6: bool, dst: &[u32; 4]) -> i32 {
    let Some(iface) = interface(ctx, true) else {
        return DROP;
    };
    let netns_cookie = iface.netns_cookie;
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return DROP;
    };
    if ipv6 && pod.flags & flags::IPV6 == 0 {
        return NEXT;
    }
    if iface.flags & reroute_flags::ALL_RANGES == 0
        && !policy::cidr_listed(netns_cookie, cidr_list::OUTBOUND_INCLUDE, dst)
    {
        return NEXT;
    }
    DROP
}

#[classifier]
pub fn sidestep_reroute_in(ctx: TcContext) -> i32 {
    let seg = match parse_rerouted(&ctx, true) {
        Parsed::Tcp(seg) => seg,
        Parsed::Other => return NEXT,
        Parsed::Opaque { ipv6, dst } => return on_opaque(&ctx, ipv6, &dst),
        // The kernel drops it too; dropping here keeps "never forwarded unparsed" unconditional.
        Parsed::Broken => return DROP,
    };
    let syn = seg.is_syn();
    let Some(iface) = interface(&ctx, true) else {
        // Not (or no longer) a known re-routed interface: a new connection here must not go
        // around the proxy.
        return if syn { DROP } else { NEXT };
    };
    let netns_cookie = iface.netns_cookie;
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return if syn { DROP } else { NEXT };
    };
    let (family, iface_addr, has_addr) = if seg.ipv6 {
        // No IPv6 capture for the pod: istio-iptables installs no ip6tables rules.
        if pod.flags & flags::IPV6 == 0 {
            return NEXT;
        }
        (
            linux::AF_INET6,
            iface.addr6,
            iface.flags & reroute_flags::HAS_V6 != 0,
        )
    } else {
        (
            linux::AF_INET,
            iface.addr4,
            iface.flags & reroute_flags::HAS_V4 != 0,
        )
    };
    let key = TupleKey::new(
        netns_cookie,
        (seg.src, u16::from_be(seg.src_port_be)),
        (iface_addr, pod.outbound_port),
    );
    let dst_off = if seg.ipv6 { IPV6_DST_OFF } else { IPV4_DST_OFF };
    let new = (&iface_addr, pod.outbound_port.to_be());
    let old = (&seg.dst, seg.dst_port_be);
    if !syn {
        // SAFETY: the value is copied out at once.
        let known = unsafe { SIDESTEP_RNAT.get(key) }.is_some_and(|o| {
            o.port_be == seg.dst_port_be
                && o.addr[0] == seg.dst[0]
                && o.addr[1] == seg.dst[1]
                && o.addr[2] == seg.dst[2]
                && o.addr[3] == seg.dst[3]
        });
        if !known {
            return NEXT;
        }
        return match rewrite(&ctx, &seg, dst_off, seg.l4 + 2, old, new) {
            Ok(()) => NEXT,
            Err(_) => DROP,
        };
    }
    // `-i <nic> [-d <include cidr>] -j ISTIO_REDIRECT`: excludeOutboundIPRanges and the port
    // lists play no part here, as in istio-iptables' PREROUTING.
    if iface.flags & reroute_flags::ALL_RANGES == 0
        && !policy::cidr_listed(netns_cookie, cidr_list::OUTBOUND_INCLUDE, &seg.dst)
    {
        policy::count(netns_cookie, |c| c.passed_outbound += 1);
        return NEXT;
    }
    if !has_addr {
        return DROP;
    }
    let orig = OrigDst {
        addr: seg.dst,
        port_be: seg.dst_port_be,
        kind: redirect_kind::REROUTE,
        family,
        side: socket_side::ACCEPTED,
    };
    // A new SYN on a reused 4-tuple replaces whatever an earlier connection left.
    if SIDESTEP_RNAT.insert(key, orig, 0).is_err() || SIDESTEP_PEND.insert(key, orig, 0).is_err() {
        return DROP;
    }
    if rewrite(&ctx, &seg, dst_off, seg.l4 + 2, old, new).is_err() {
        return DROP;
    }
    policy::count(netns_cookie, |c| c.redirected_outbound += 1);
    NEXT
}

#[classifier]
pub fn sidestep_reroute_eg(ctx: TcContext) -> i32 {
    // The proxy's segments carry extension headers only when its listener set sticky options
    // (accepted sockets inherit them) or IPsec AH applies; both are followed, at the offset found.
    // What cannot be followed passes unrewritten: egress goes into the VM, so nothing bypasses
    // the proxy, and a reply the VM does not recognise only fails that connection. The kernel
    // does not fragment the proxy's TCP (it sizes segments to the path MTU).
    let Parsed::Tcp(seg) = parse_rerouted(&ctx, false) else {
        return NEXT;
    };
    let Some(iface) = interface(&ctx, false) else {
        return NEXT;
    };
    let netns_cookie = iface.netns_cookie;
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return NEXT;
    };
    if u16::from_be(seg.src_port_be) != pod.outbound_port {
        return NEXT;
    }
    let iface_addr = if seg.ipv6 { iface.addr6 } else { iface.addr4 };
    let key = TupleKey::new(
        netns_cookie,
        (seg.dst, u16::from_be(seg.dst_port_be)),
        (seg.src, pod.outbound_port),
    );
    if key.server_addr != iface_addr {
        return NEXT;
    }
    // SAFETY: the value is copied out at once.
    let Some(orig) = (unsafe { SIDESTEP_RNAT.get(key) }).copied() else {
        return NEXT;
    };
    let src_off = if seg.ipv6 { IPV6_SRC_OFF } else { IPV4_SRC_OFF };
    match rewrite(
        &ctx,
        &seg,
        src_off,
        seg.l4,
        (&seg.src, seg.src_port_be),
        (&orig.addr, orig.port_be),
    ) {
        Ok(()) => NEXT,
        Err(_) => DROP,
    }
}
