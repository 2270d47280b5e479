//! tc ingress on a pod's interface: inbound capture with bpf_sk_assign.
//!
//! A new connection (a SYN) to a captured port is handed to the proxy's inbound listener as it
//! is: no NAT and no per-connection rewrite, so the proxy's accepted socket has the original
//! destination as its local address (getsockname), the client keeps its real address, and the
//! original destination is published for SO_ORIGINAL_DST. Every later packet of the connection
//! finds its socket through the kernel's ordinary lookup, so only SYNs cost more than a parse.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_CURRENT_NETNS, bpf_sock, bpf_sock_tuple},
    helpers::generated::{
        bpf_get_netns_cookie, bpf_map_lookup_elem, bpf_map_update_elem, bpf_sk_assign,
        bpf_sk_fullsock, bpf_sk_release, bpf_skc_lookup_tcp,
    },
    macros::classifier,
    programs::TcContext,
};
use sidestep_abi::{
    InterfaceKey, ListenerKey, OrigDst, PodPolicy, TupleKey, flags, iface_kind, linux, port_list,
    redirect_kind, socket_side,
};

use crate::{
    maps::{SIDESTEP_ADDRS, SIDESTEP_IFACES, SIDESTEP_LSTN, SIDESTEP_NEST, SIDESTEP_PEND},
    packet::{Segment, parse_tcp},
    policy::{self, port_listed},
};

/// Not ours: let the next program (TCX) or the default action (clsact) decide.
const NEXT: i32 = -1;
/// Delivered to the socket we assigned.
const PASS: i32 = 0;
/// Captured but no proxy listens: drop rather than deliver around the proxy (fail closed).
const DROP: i32 = 2;

const TCP_TIME_WAIT: u32 = 6;
/// bpf_sk_assign's refusal of a SO_REUSEPORT socket before Linux 6.5.
const ESOCKTNOSUPPORT: i64 = 94;
const TCP_LISTEN: u32 = 10;

/// Set by the loader when the kernel lets tc programs call bpf_get_netns_cookie (Linux 6.13+).
/// Read-only data the kernel sees frozen: on older kernels the verifier knows the value is 0,
/// never walks the helper call and removes it as dead code, so one object loads on both.
#[unsafe(no_mangle)]
static TC_NETNS_COOKIE: u8 = 0;

#[classifier]
pub fn sidestep_tc_ingress(ctx: TcContext) -> i32 {
    match parse_tcp(&ctx) {
        // Only a SYN opens a connection; everything else already has its socket.
        Some(seg) if seg.is_syn() => on_syn(&ctx, &seg),
        _ => NEXT,
    }
}

/// Whether istio-iptables' ISTIO_INBOUND chain would redirect this destination port.
#[inline(always)]
pub fn captures_port(netns_cookie: u64, pod: &PodPolicy, port: u16) -> bool {
    if pod.flags & flags::INBOUND == 0
        || port_listed(netns_cookie, port_list::INBOUND_EXCLUDE, port)
    {
        return false;
    }
    pod.flags & flags::INBOUND_ALL_PORTS != 0
        || port_listed(netns_cookie, port_list::INBOUND_INCLUDE, port)
}

/// The pod this segment is for. bpf_get_netns_cookie on an skb prefers the netns of `skb->sk`,
/// which for traffic between pods on one node is the *sender's*; so the destination address
/// decides, and the helper is used only for an skb that carries no socket (from off the node).
/// Without the helper (kernels before 6.13) such an skb is left to the kernel's lookup, where the
/// pod's sk_lookup programs name the pod and capture it, as they do for traffic from this node.
#[inline(always)]
fn destination_pod(ctx: &TcContext, seg: &Segment) -> Option<u64> {
    // SAFETY: the value is copied out at once.
    if let Some(cookie) = unsafe { SIDESTEP_ADDRS.get(seg.dst) } {
        return Some(*cookie);
    }
    // SAFETY: `sk` is a readable pointer field of __sk_buff.
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    // SAFETY: a read of this object's own frozen read-only data.
    let has_helper = unsafe { core::ptr::read_volatile(&raw const TC_NETNS_COOKIE) } != 0;
    // SAFETY: valid skb context.
    (sk.is_null() && has_helper).then(|| unsafe { bpf_get_netns_cookie(ctx.as_ptr()) })
}

#[inline(always)]
fn on_syn(ctx: &TcContext, seg: &Segment) -> i32 {
    let Some(netns_cookie) = destination_pod(ctx, seg) else {
        return NEXT;
    };
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return NEXT;
    };
    let dst_port = u16::from_be(seg.dst_port_be);
    // Ambient: kubelet's probes reach the app directly, SNATed on the node (Istio's node rules)
    // or opened by a socket of the node (sidestep's record of it).
    let probe = crate::ambient::is_ambient(&pod)
        && (crate::ambient::is_probe_source(&seg.src)
            || crate::ambient::is_from_node_socket(
                seg.src,
                u16::from_be(seg.src_port_be),
                seg.dst,
                dst_port,
            ));
    if probe || !captures_port(netns_cookie, &pod, dst_port) {
        policy::count(netns_cookie, |c| c.passed_inbound += 1);
        return NEXT;
    }
    // A retransmitted SYN belongs to a handshake already under way: leave it to that socket.
    // A SYN onto a TIME_WAIT 4-tuple is left to the kernel too: assigned here, the new request
    // socket could not be hashed beside the TIME_WAIT one and the SYN would be lost. The kernel
    // recycles the TIME_WAIT socket and looks up a listener, which `sidestep_sk_lookup` steers
    // to the proxy.
    let mut tuple = socket_tuple(seg, seg.dst_port_be);
    let mut listener_tuple = socket_tuple(seg, pod.inbound_port.to_be());
    if let Some(state) = lookup_state(ctx, &mut tuple, seg.ipv6)
        && state != TCP_LISTEN
    {
        if state == TCP_TIME_WAIT {
            remember_listener(ctx, &mut listener_tuple, seg.ipv6, netns_cookie, &pod);
        }
        return NEXT;
    }
    let (listener, looked_up_in) = lookup(ctx, &mut listener_tuple, seg.ipv6);
    let Some(listener) = listener else {
        return DROP;
    };
    // SAFETY: `listener` is a referenced socket from skc_lookup; state is a sock_common field.
    let is_listener =
        unsafe { (*listener).state } == TCP_LISTEN && is_the_pods_proxy(&pod, listener);
    let assigned = if is_listener {
        // SAFETY: the skb is at tc ingress and `listener` a referenced socket.
        unsafe { bpf_sk_assign(ctx.as_ptr(), listener.cast(), 0) }
    } else {
        -1
    };
    if assigned == -ESOCKTNOSUPPORT {
        // Before Linux 6.5 tc cannot assign a SO_REUSEPORT listener (HAProxy's and Envoy's
        // are). The kernel's own lookup can: the pod's sk_lookup program steers this SYN to
        // the proxy, from the listener map, so the listener must be in it.
        if captures_on_interface(ctx, netns_cookie) {
            register_listener(&pod, netns_cookie, looked_up_in, listener);
        }
        // SAFETY: releases the reference skc_lookup took.
        unsafe { bpf_sk_release(listener.cast()) };
        return NEXT;
    }
    // SAFETY: releases the reference skc_lookup took.
    unsafe { bpf_sk_release(listener.cast()) };
    if assigned != 0 {
        return DROP;
    }
    let key = TupleKey::new(
        netns_cookie,
        (seg.src, u16::from_be(seg.src_port_be)),
        (seg.dst, dst_port),
    );
    let orig = OrigDst {
        addr: seg.dst,
        port_be: seg.dst_port_be,
        kind: redirect_kind::INBOUND,
        family: if seg.ipv6 {
            linux::AF_INET6
        } else {
            linux::AF_INET
        },
        side: socket_side::ACCEPTED,
    };
    let _ = SIDESTEP_PEND.insert(key, orig, 0);
    policy::count(netns_cookie, |c| c.redirected_inbound += 1);
    PASS
}

/// Puts the proxy's inbound listener into `SIDESTEP_LSTN`, where `sidestep_sk_lookup` finds it
/// for the SYN that tc leaves to the kernel's TIME_WAIT recycling. sock_ops adds a listener when
/// it listens, which misses a proxy that listened before its pod was enrolled (a pod repaired by
/// the agent, an ADD into a running netns) or before a reload made a new map; without this its
/// SYNs onto TIME_WAIT 4-tuples would be refused for the whole TIME_WAIT period.
///
/// Only on an interface this pod captures inbound on: the lookup runs in the interface's netns,
/// and the key names the pod by the destination address, so the two must be the same pod (an
/// address two netns share must not let one pod's SYNs reach the other's proxy). An entry that
/// is there already is kept: the kernel drops a closed socket from the map itself, and an update
/// on every such SYN would take the listener's lock each time.
#[inline(always)]
fn remember_listener(
    ctx: &TcContext,
    listener_tuple: &mut bpf_sock_tuple,
    ipv6: bool,
    netns_cookie: u64,
    pod: &PodPolicy,
) {
    if !captures_on_interface(ctx, netns_cookie) {
        return;
    }
    let (listener, looked_up_in) = lookup(ctx, listener_tuple, ipv6);
    let Some(listener) = listener else {
        return;
    };
    register_listener(pod, netns_cookie, looked_up_in, listener);
    // SAFETY: releases the reference skc_lookup took.
    unsafe { bpf_sk_release(listener.cast()) };
}

/// Whether this skb's interface is one the pod captures inbound on with tc: the lookup runs in
/// the interface's netns, and a listener key names the pod by the destination address, so the
/// two must be the same pod (an address two netns share must not let one pod's SYNs reach the
/// other's proxy). The index alone does not prove the netns is the pod's; `register_listener`
/// checks that.
#[inline(always)]
fn captures_on_interface(ctx: &TcContext, netns_cookie: u64) -> bool {
    // SAFETY: `ifindex` is a readable 4-byte field of __sk_buff.
    let ifindex = unsafe { core::ptr::read_volatile(&raw const (*ctx.skb.skb).ifindex) };
    let iface = InterfaceKey {
        netns_cookie,
        ifindex,
        _reserved: 0,
    };
    // SAFETY: the value is read at once.
    unsafe { SIDESTEP_IFACES.get(iface) }.is_some_and(|kind| *kind == iface_kind::TC)
}

/// Whether `listener`, found on the pod's inbound port, may take its captured inbound: in an
/// ambient pod only ztunnel's socket, which carries its mark (a socket bound there before the
/// pod was enrolled, before portguard.rs, does not); in a sidecar pod whatever listens there, as
/// under REDIRECT.
#[inline(always)]
fn is_the_pods_proxy(pod: &PodPolicy, listener: *mut bpf_sock) -> bool {
    if !crate::ambient::is_ambient(pod) {
        return true;
    }
    // SAFETY: `listener` is a referenced socket from skc_lookup; the helper returns its full
    // socket, or NULL for a request or TIME_WAIT socket.
    let full = unsafe { bpf_sk_fullsock(listener) };
    if full.is_null() {
        return false;
    }
    // SAFETY: a full socket; `mark` is a 4-byte field.
    let mark = unsafe { core::ptr::read_volatile(&raw const (*full).mark) };
    crate::ambient::is_ztunnel_mark(pod, mark)
}

/// Adds `listener` (a referenced socket the caller releases) to `SIDESTEP_LSTN` when it listens,
/// is not there yet, and was found in the pod's own netns. The interface index does not prove
/// that: indexes are per netns, so eth0 has the same one in most pods, and a SYN crafted to
/// another pod's MAC with this pod's address as destination arrives there with a matching index.
/// `looked_up_in` does: the netns cookie that the identity program of the netns where tc's
/// socket lookup ran reported (0 when none ran: a netns with no identity program, or a lookup
/// that found an established socket), so another pod's listener is never registered as this
/// pod's.
#[inline(always)]
fn register_listener(
    pod: &PodPolicy,
    netns_cookie: u64,
    looked_up_in: u64,
    listener: *mut bpf_sock,
) {
    if looked_up_in != netns_cookie {
        return;
    }
    // SAFETY: `listener` is a referenced socket from skc_lookup; both are sock_common fields.
    let (state, family) = unsafe { ((*listener).state, (*listener).family) };
    if state != TCP_LISTEN {
        return;
    }
    // The socket's own family, as sock_ops keys it: a dual-stack [::] listener is AF_INET6
    // and sk_lookup tries that key for IPv4 too.
    let key = ListenerKey {
        netns_cookie,
        family,
        port: u32::from(pod.inbound_port),
    };
    let map = core::ptr::from_ref(&SIDESTEP_LSTN).cast_mut().cast();
    let key_ptr = core::ptr::from_ref(&key).cast();
    // SAFETY: the map pointer is the BTF map definition the loader relocates (what aya's own
    // wrappers pass), the key lives on this stack. A sockhash lookup returns a referenced
    // socket, released at once.
    let present = unsafe {
        let sk = bpf_map_lookup_elem(map, key_ptr);
        if !sk.is_null() {
            bpf_sk_release(sk);
        }
        !sk.is_null()
    };
    if !present && is_the_pods_proxy(pod, listener) {
        // SAFETY: as above; the value is a referenced full listening socket, which the kernel
        // checks again (sk_fullsock, state) under its lock. A failure leaves the map as it was:
        // the SYN is then refused as before.
        let _ = unsafe { bpf_map_update_elem(map, key_ptr, listener.cast(), 0) };
    }
}

#[inline(always)]
fn socket_tuple(seg: &Segment, dst_port_be: u16) -> bpf_sock_tuple {
    // SAFETY: plain data; zero is a valid tuple.
    let mut t: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    if seg.ipv6 {
        t.__bindgen_anon_1.ipv6.saddr = seg.src;
        t.__bindgen_anon_1.ipv6.daddr = seg.dst;
        t.__bindgen_anon_1.ipv6.sport = seg.src_port_be;
        t.__bindgen_anon_1.ipv6.dport = dst_port_be;
    } else {
        t.__bindgen_anon_1.ipv4.saddr = seg.src[3];
        t.__bindgen_anon_1.ipv4.daddr = seg.dst[3];
        t.__bindgen_anon_1.ipv4.sport = seg.src_port_be;
        t.__bindgen_anon_1.ipv4.dport = dst_port_be;
    }
    t
}

/// A socket lookup in the skb's netns, and the netns cookie that netns's identity program
/// reported if the kernel ran the pod's sk_lookup programs for it (it does when no established
/// socket matches), else 0. The slot is cleared either way, so the next lookup on this CPU never
/// takes the value for its own.
#[inline(always)]
fn lookup(ctx: &TcContext, tuple: &mut bpf_sock_tuple, ipv6: bool) -> (Option<*mut bpf_sock>, u64) {
    let size = if ipv6 { 36 } else { 12 };
    let nested = SIDESTEP_NEST.get_ptr_mut(0);
    if let Some(flag) = nested {
        // SAFETY: this CPU's slot; the nested sk_lookup run reads it on the same CPU.
        unsafe { *flag = 1 };
    }
    // SAFETY: `tuple` is a valid bpf_sock_tuple of at least `size` bytes.
    let sk = unsafe {
        bpf_skc_lookup_tcp(
            ctx.as_ptr(),
            core::ptr::from_mut(tuple),
            size,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    };
    if let Some(flag) = nested {
        // SAFETY: as above.
        unsafe { *flag = 0 };
    }
    let looked_up_in = crate::sklookup::take_identity();
    ((!sk.is_null()).then_some(sk), looked_up_in)
}

/// The TCP state of the socket that owns `tuple`, if any.
#[inline(always)]
fn lookup_state(ctx: &TcContext, tuple: &mut bpf_sock_tuple, ipv6: bool) -> Option<u32> {
    let sk = lookup(ctx, tuple, ipv6).0?;
    // SAFETY: `sk` is a referenced sock_common; `state` is readable on it.
    let state = unsafe { (*sk).state };
    // SAFETY: releases the reference skc_lookup took.
    unsafe { bpf_sk_release(sk.cast()) };
    Some(state)
}
