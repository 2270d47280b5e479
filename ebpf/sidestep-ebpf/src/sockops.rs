//! sock_ops: hands the original destination from the app's redirected socket to the proxy's
//! accepted socket, and cleans up when a redirected socket closes.
//!
//! - TCP_CONNECT_CB (the client's SYN is about to leave; its source port is known): publish the
//!   4-tuple in `SIDESTEP_PEND`. A connection rewritten to a loopback proxy port (outbound, DNS)
//!   asks for nothing more: the proxy's accepted socket claims its entry, and one nobody claimed
//!   (the handshake failed) is overwritten by the next captured connect on that 4-tuple, removed
//!   by the next uncaptured one, or evicted. The other records ask for state callbacks.
//! - PASSIVE_ESTABLISHED_CB (an accepted socket): claim a pending entry into the socket's storage.
//! - STATE_CB to TCP_CLOSE on a socket that asked for it: drop an entry nobody claimed.
//! - TCP_CONNECT_CB on a socket of the node's own netns to an ambient pod: record it, so the
//!   pod's inbound capture passes it (`ambient::node_socket_record`); the app's accepted socket
//!   (PASSIVE_ESTABLISHED_CB) drops it, or STATE_CB when the handshake fails.

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        BPF_SOCK_OPS_TCP_LISTEN_CB, BPF_TCP_CLOSE, bpf_sock_ops,
    },
    helpers::generated::bpf_get_netns_cookie,
    macros::sock_ops,
    programs::SockOpsContext,
};
use sidestep_abi::{
    ListenerKey, OrigDst, TupleKey, flags, linux, redirect_kind, socket_side, v4_mapped,
};

use crate::{
    context::{load, load_ip6},
    maps::{SIDESTEP_LSTN, SIDESTEP_PEND, SIDESTEP_POD, SIDESTEP_SOCKS, socket_orig_dst},
};

#[sock_ops]
pub fn sidestep_sockops(ctx: SockOpsContext) -> u32 {
    // SAFETY: the kernel hands us a valid bpf_sock_ops for the duration of the call.
    unsafe { handle(&ctx) };
    // sock_ops programs return 1 for "handled"; the value does not affect the socket.
    1
}

/// # Safety
/// `ctx` must be the live context of a sock_ops program.
#[inline(always)]
unsafe fn handle(ctx: &SockOpsContext) {
    let ops = ctx.ops;
    // SAFETY: 4-byte context field.
    let op = unsafe { load(&raw const (*ops).op) };
    match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            // SAFETY: forwarded from our caller.
            unsafe { on_connect(ctx) }
        }
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            // SAFETY: forwarded from our caller.
            unsafe { on_accepted(ctx) }
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            // SAFETY: forwarded from our caller.
            unsafe { on_established(ctx) }
        }
        BPF_SOCK_OPS_TCP_LISTEN_CB => {
            // SAFETY: forwarded from our caller.
            unsafe { on_listen(ctx) }
        }
        BPF_SOCK_OPS_STATE_CB => {
            // SAFETY: args[1] is the new state for STATE_CB.
            let new_state = unsafe { load(&raw const (*ops).__bindgen_anon_1.args[1]) };
            if new_state == BPF_TCP_CLOSE {
                // SAFETY: forwarded from our caller.
                if let Some(key) = unsafe { client_tuple(ctx) } {
                    let _ = SIDESTEP_PEND.remove(key);
                }
            }
        }
        _ => {}
    }
}

/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn full_socket(ops: *mut bpf_sock_ops) -> *mut core::ffi::c_void {
    // SAFETY: `is_fullsock` and `sk` are readable context fields; `sk` is only valid on full sockets.
    unsafe {
        if load(&raw const (*ops).is_fullsock) == 0 {
            return core::ptr::null_mut();
        }
        (*ops).__bindgen_anon_2.sk.cast()
    }
}

/// The connection seen from this socket: (local addr, local port, remote addr, remote port).
///
/// # Safety
/// `ops` must be a live sock_ops context.
#[inline(always)]
unsafe fn endpoints(ops: *mut bpf_sock_ops) -> ([u32; 4], u16, [u32; 4], u16) {
    // SAFETY: 4-byte context fields, read one at a time. Every field is read on every path so that
    // each load keeps a constant offset; the verifier rejects a context pointer LLVM has offset.
    unsafe {
        let family = load(&raw const (*ops).family);
        let local4 = load(&raw const (*ops).local_ip4);
        let remote4 = load(&raw const (*ops).remote_ip4);
        let local6 = load_ip6(&raw const (*ops).local_ip6);
        let remote6 = load_ip6(&raw const (*ops).remote_ip6);
        let (local, remote) = if family == linux::AF_INET as u32 {
            (v4_mapped(local4), v4_mapped(remote4))
        } else {
            (local6, remote6)
        };
        let local_port = load(&raw const (*ops).local_port) as u16;
        // remote_port holds the big-endian port in its upper 16 bits on little-endian hosts.
        let remote_port = u16::from_be((load(&raw const (*ops).remote_port) >> 16) as u16);
        (local, local_port, remote, remote_port)
    }
}

/// The pending-map key for a client (connecting) socket.
///
/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn client_tuple(ctx: &SockOpsContext) -> Option<TupleKey> {
    // SAFETY: forwarded from our caller.
    let (local, local_port, remote, remote_port) = unsafe { endpoints(ctx.ops) };
    // SAFETY: valid sock_ops context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    Some(TupleKey::new(
        netns_cookie,
        (local, local_port),
        (remote, remote_port),
    ))
}

/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn on_connect(ctx: &SockOpsContext) {
    // SAFETY: forwarded from our caller.
    let sk = unsafe { full_socket(ctx.ops) };
    if sk.is_null() {
        return;
    }
    // Only sockets that connect4/6 redirected carry storage; of the rest only the node's own
    // connections to ambient pods are of interest.
    // SAFETY: `sk` is this context's full socket.
    let orig = unsafe { socket_orig_dst(sk, None) };
    if orig.is_null() {
        // Read once for the three checks below: this runs for every uncaptured connect.
        // SAFETY: forwarded from our caller.
        let Some(key) = (unsafe { client_tuple(ctx) }) else {
            return;
        };
        // A loopback peer arrives on lo, where sk_lookup asks nothing, and is never an ambient
        // pod's address: only an unclaimed redirect on the same 4-tuple is of interest.
        if crate::policy::is_loopback(&key.server_addr) {
            forget_unclaimed_redirect(key);
            return;
        }
        // SAFETY: forwarded from our caller.
        unsafe {
            on_self_connect(ctx, key);
            on_node_connect(ctx, key);
        }
        return;
    }
    // SAFETY: non-null storage of this socket.
    let orig: OrigDst = unsafe { *orig };
    // SAFETY: forwarded from our caller.
    let Some(key) = (unsafe { client_tuple(ctx) }) else {
        return;
    };
    if SIDESTEP_PEND.insert(key, orig, 0).is_ok() && !is_claimed_by_the_proxy(orig.kind) {
        // SAFETY: forwarded from our caller.
        unsafe { ask_for_state_callbacks(ctx) };
    }
}

/// Kinds whose connection goes to a loopback proxy port, where the proxy's accepted socket
/// claims the record. Their client asks for no state callbacks: those would run sockops at every
/// state change of every captured connection only to delete an entry that is nearly always
/// claimed already (issue 38).
#[inline(always)]
fn is_claimed_by_the_proxy(kind: u16) -> bool {
    kind == redirect_kind::OUTBOUND || kind == redirect_kind::DNS
}

/// An uncaptured connection to a loopback address (`key`, as its client sees it) takes the
/// 4-tuple an earlier captured one may have published and nobody claimed (its handshake failed):
/// remove that record, or the proxy accepting this connection would report the old destination
/// rather than netfilter's ENOENT. Only captured records have a loopback peer, so no other record
/// is touched.
#[inline(always)]
fn forget_unclaimed_redirect(key: TupleKey) {
    // Loopback connections of the node's other namespaces are far more common than a pod's own;
    // a lookup without the bucket lock that a delete takes sets them apart.
    if SIDESTEP_POD.get_ptr(key.netns_cookie).is_some() {
        let _ = SIDESTEP_PEND.remove(key);
    }
}

/// A socket of an enrolled pod connecting to one of the pod's own addresses: record its 4-tuple
/// (`redirect_kind::LOCAL_SELF`) so that sk_lookup, which sees the SYN arrive on the address's
/// interface rather than on lo, can tell it from a forged one. IPv6 takes a local source from
/// the wire, so every such connection is recorded. IPv4 drops one as a martian, except a
/// loopback source where `route_localnet` is on (`flags::ROUTE_LOCALNET`): there only the
/// connections from a loopback source (the proxy's hand-off from 127.0.0.6) are recorded. The
/// record goes with the socket's close, as a redirected client's does.
///
/// `key` is the connection as its client sees it, with a peer that is not loopback.
///
/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn on_self_connect(ctx: &SockOpsContext, key: TupleKey) {
    // SAFETY: 4-byte context field.
    let family = unsafe { load(&raw const (*ctx.ops).family) };
    if family != u32::from(linux::AF_INET6) && family != u32::from(linux::AF_INET) {
        return;
    }
    let (netns_cookie, local, remote) = (key.netns_cookie, key.client_addr, key.server_addr);
    let ipv4 = sidestep_abi::is_v4_mapped(&remote);
    if ipv4 {
        if !crate::policy::is_loopback(&local)
            || !crate::policy::pod_policy(netns_cookie)
                .is_some_and(|p| p.flags & flags::ROUTE_LOCALNET != 0)
        {
            return;
        }
    } else {
        // The same address on both ends, or the proxy's hand-off from ::6, covers what the pod
        // map does not name (a link-local or later address); those two ask for the pod's entry,
        // since any netns of the node makes such connections. A pod address names an enrolled
        // pod.
        let same = local[0] == remote[0]
            && local[1] == remote[1]
            && local[2] == remote[2]
            && local[3] == remote[3];
        let unnamed = same || crate::policy::is_passthrough_source(&local);
        if unnamed {
            if crate::policy::pod_policy(netns_cookie).is_none() {
                return;
            }
        } else if !crate::policy::is_pod_address(netns_cookie, &remote) {
            return;
        }
    }
    let record = OrigDst {
        addr: remote,
        port_be: key.server_port.to_be(),
        kind: redirect_kind::LOCAL_SELF,
        family: if ipv4 {
            linux::AF_INET
        } else {
            linux::AF_INET6
        },
        side: socket_side::CLIENT,
    };
    if SIDESTEP_PEND.insert(key, record, 0).is_ok() {
        // SAFETY: forwarded from our caller.
        unsafe { ask_for_state_callbacks(ctx) };
    }
}

/// A socket of the node connecting to an ambient pod (kubelet's probe): record its 4-tuple so
/// that the pod's inbound capture leaves the SYN to the app (`ambient::node_socket_record`). The
/// app's accepted socket removes the record (`ambient::forget_node_socket`); a handshake that
/// fails leaves it to this socket's close, as a redirected client's is.
///
/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn on_node_connect(ctx: &SockOpsContext, key: TupleKey) {
    if !crate::ambient::is_node_netns(key.netns_cookie) {
        return;
    }
    // SAFETY: 4-byte context field.
    let family = unsafe { load(&raw const (*ctx.ops).family) } as u16;
    let Some((key, record)) = crate::ambient::node_socket_record(
        key.client_addr,
        key.client_port,
        key.server_addr,
        key.server_port,
        family,
    ) else {
        return;
    };
    if SIDESTEP_PEND.insert(key, record, 0).is_ok() {
        // SAFETY: forwarded from our caller.
        unsafe { ask_for_state_callbacks(ctx) };
    }
}

/// Adds state callbacks to those the socket already asks for: the helper replaces the set, and
/// another program at the node's cgroup2 root may have asked for others on the same socket.
///
/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn ask_for_state_callbacks(ctx: &SockOpsContext) {
    // SAFETY: 4-byte context field.
    let current = unsafe { load(&raw const (*ctx.ops).bpf_sock_ops_cb_flags) };
    let _ = ctx.set_cb_flags((current | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
}

/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn on_accepted(ctx: &SockOpsContext) {
    // SAFETY: forwarded from our caller.
    let (local, local_port, remote, remote_port) = unsafe { endpoints(ctx.ops) };
    // SAFETY: valid sock_ops context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let key = TupleKey::new(netns_cookie, (remote, remote_port), (local, local_port));
    // SAFETY: the value is copied out at once.
    let Some(mut orig) = (unsafe { SIDESTEP_PEND.get(key) }).copied() else {
        crate::ambient::forget_node_socket(key);
        return;
    };
    // The pod's own connection to itself was never redirected: its record only vouches for its
    // SYN to sk_lookup, and its client's close removes it.
    if orig.kind == redirect_kind::LOCAL_SELF {
        return;
    }
    orig.side = socket_side::ACCEPTED;
    // SAFETY: forwarded from our caller.
    let sk = unsafe { full_socket(ctx.ops) };
    if sk.is_null() {
        return;
    }
    // SAFETY: `sk` is this context's full socket.
    let stored = unsafe { socket_orig_dst(sk, Some(&mut orig)) };
    if !stored.is_null() {
        // SAFETY: non-null storage of this socket; overwrite a value left from an earlier claim.
        unsafe { *stored = orig };
        let _ = SIDESTEP_PEND.remove(key);
        if orig.kind == redirect_kind::OUTBOUND {
            // SAFETY: forwarded from our caller.
            unsafe {
                add_to_sockhash(
                    ctx,
                    key.netns_cookie,
                    local,
                    local_port,
                    remote,
                    remote_port,
                )
            };
        }
    }
}

/// A socket listens: if it is an enrolled pod's inbound proxy listener, remember it for
/// sk_lookup, which hands it the SYNs that the kernel's TIME_WAIT recycling looks up.
///
/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn on_listen(ctx: &SockOpsContext) {
    // SAFETY: valid sock_ops context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(pod) = crate::policy::pod_policy(netns_cookie) else {
        return;
    };
    // SAFETY: 4-byte context fields.
    let (port, family) = unsafe {
        (
            load(&raw const (*ctx.ops).local_port),
            load(&raw const (*ctx.ops).family),
        )
    };
    if port != u32::from(pod.inbound_port) || pod.flags & flags::INBOUND == 0 {
        return;
    }
    // In an ambient pod only ztunnel's marked listener takes captured inbound: a socket bound
    // before the pod was enrolled (so before the bind guard, portguard.rs) must not be chosen.
    if crate::ambient::is_ambient(&pod) {
        // SAFETY: forwarded from our caller.
        let sk = unsafe { full_socket(ctx.ops) }.cast::<aya_ebpf::bindings::bpf_sock>();
        if sk.is_null() {
            return;
        }
        // SAFETY: `sk` is this context's full socket; `mark` is a 4-byte field.
        let mark = unsafe { load(&raw const (*sk).mark) };
        if !crate::ambient::is_ztunnel_mark(&pod, mark) {
            return;
        }
    }
    let key = ListenerKey {
        netns_cookie,
        family,
        port,
    };
    // SAFETY: `ctx.ops` is the live sock_ops context the helper needs.
    let _ = SIDESTEP_LSTN.update(key, unsafe { &mut *ctx.ops }, 0);
}

/// The app's redirected socket is connected to its proxy: with sk_msg on, join the sockhash.
///
/// # Safety
/// `ctx` must be a live sock_ops context.
#[inline(always)]
unsafe fn on_established(ctx: &SockOpsContext) {
    // SAFETY: forwarded from our caller.
    let sk = unsafe { full_socket(ctx.ops) };
    if sk.is_null() {
        return;
    }
    // SAFETY: `sk` is this context's full socket.
    let orig = unsafe { socket_orig_dst(sk, None) };
    // SAFETY: non-null storage, read in place.
    if orig.is_null() || unsafe { (*orig).kind } != redirect_kind::OUTBOUND {
        return;
    }
    // SAFETY: forwarded from our caller.
    let (local, local_port, remote, remote_port) = unsafe { endpoints(ctx.ops) };
    // SAFETY: valid sock_ops context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: forwarded from our caller.
    unsafe { add_to_sockhash(ctx, netns_cookie, local, local_port, remote, remote_port) };
}

/// # Safety
/// `ctx` must be a live sock_ops context on a full socket.
#[inline(always)]
unsafe fn add_to_sockhash(
    ctx: &SockOpsContext,
    netns_cookie: u64,
    local: [u32; 4],
    local_port: u16,
    remote: [u32; 4],
    remote_port: u16,
) {
    let Some(pod) = crate::policy::pod_policy(netns_cookie) else {
        return;
    };
    if pod.flags & flags::SK_MSG == 0 {
        return;
    }
    let key = TupleKey::new(netns_cookie, (local, local_port), (remote, remote_port));
    // SAFETY: `ctx.ops` is the live sock_ops context the helper needs.
    let _ = SIDESTEP_SOCKS.update(key, unsafe { &mut *ctx.ops }, 0);
}
