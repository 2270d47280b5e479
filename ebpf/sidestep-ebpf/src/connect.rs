//! cgroup/connect4 and cgroup/connect6: outbound capture.
//!
//! A captured connect is rewritten to the proxy's port on loopback, and the original destination
//! is kept in the socket's local storage for sockops, getpeername and SO_ORIGINAL_DST. An unbound
//! socket is first bound to the pod's address, so the connection runs from the pod's address to
//! the loopback listener, as REDIRECT's does.

use aya_ebpf::{
    EbpfContext,
    bindings::{bpf_sock, sockaddr},
    helpers::{
        bpf_get_current_uid_gid,
        generated::{bpf_bind, bpf_get_netns_cookie, bpf_setsockopt, bpf_skc_to_mptcp_sock},
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use sidestep_abi::{OrigDst, defaults, flags, linux, redirect_kind, rule, socket_side, v4_mapped};

use crate::{
    ambient,
    context::{load, load_ip6, store, store_ip6},
    debuglog,
    maps::{SIDESTEP_ORIG, socket_orig_dst},
    policy::{self, Connect, LOOPBACK4_BE, LOOPBACK6, Verdict},
};

/// sock_addr verdicts: let the connect proceed, or fail it with EPERM.
const ALLOW: i32 = 1;
const REFUSE: i32 = 0;

#[cgroup_sock_addr(connect4)]
pub fn sidestep_connect4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the kernel hands us a valid bpf_sock_addr for the duration of the call.
    if unsafe { connect(&ctx, false) } {
        ALLOW
    } else {
        REFUSE
    }
}

#[cgroup_sock_addr(connect6)]
pub fn sidestep_connect6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    if unsafe { connect(&ctx, true) } {
        ALLOW
    } else {
        REFUSE
    }
}

/// Returns whether the connect may proceed: false only when it must be captured and cannot be.
///
/// # Safety
/// `ctx` must be the live context of a connect4 or connect6 program.
#[inline(always)]
unsafe fn connect(ctx: &SockAddrContext, ipv6: bool) -> bool {
    // SAFETY: valid context for a sock_addr program.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return true;
    };
    let sa = ctx.sock_addr;
    // SAFETY: every field below is a 4-byte context field of bpf_sock_addr, read one at a time.
    let (dst, dst_port_be, protocol, sk) = unsafe {
        let dst = if ipv6 {
            load_ip6(&raw const (*sa).user_ip6)
        } else {
            v4_mapped(load(&raw const (*sa).user_ip4))
        };
        (
            dst,
            load(&raw const (*sa).user_port) as u16,
            load(&raw const (*sa).protocol),
            (*sa).__bindgen_anon_1.sk,
        )
    };
    if sk.is_null() {
        return true;
    }
    // SAFETY: `sk` is the kernel's full socket for this call; src fields and mark are 4-byte reads.
    let (bound_src, mark, bound_dev_if) = unsafe {
        let src = if ipv6 {
            load_ip6(&raw const (*sk).src_ip6)
        } else {
            v4_mapped(load(&raw const (*sk).src_ip4))
        };
        (
            src,
            load(&raw const (*sk).mark),
            load(&raw const (*sk).bound_dev_if),
        )
    };
    let uid_gid = bpf_get_current_uid_gid();
    let decision = Connect {
        netns_cookie,
        policy: &pod,
        uid: uid_gid as u32,
        gid: (uid_gid >> 32) as u32,
        dst,
        dst_port: u16::from_be(dst_port_be),
        bound_src,
        protocol,
        mark,
        bound_dev_if,
    };
    let ambient_passthrough = ambient::is_orig_src_passthrough(&decision);
    let tproxy_passthrough = ambient_passthrough || policy::is_tproxy_passthrough(&decision);
    let verdict = if ambient_passthrough {
        Verdict::redirect(0, redirect_kind::TPROXY_PASSTHROUGH, rule::AMBIENT_ORIG_SRC)
    } else if tproxy_passthrough {
        Verdict::redirect(
            0,
            redirect_kind::TPROXY_PASSTHROUGH,
            rule::TPROXY_PASSTHROUGH,
        )
    } else {
        policy::outbound_verdict(&decision)
    };
    if pod.flags & flags::DEBUG != 0 {
        debuglog::connect(
            ctx,
            netns_cookie,
            &dst,
            decision.dst_port,
            decision.uid,
            verdict.kind,
            verdict.rule,
        );
    }
    let Verdict { port, kind, .. } = verdict;
    if verdict.is_refused() {
        return false;
    }
    if verdict.is_pass() {
        // A socket connected again (UDP, or TCP after a failed connect) must not keep the
        // original destination of an earlier captured connect: getpeername, sockops and
        // SO_ORIGINAL_DST would report it for a connection that was never redirected.
        // SAFETY: `sk` is this context's full socket, checked non-null above.
        let _ = unsafe { SIDESTEP_ORIG.delete(sk) };
        if protocol == linux::IPPROTO_TCP {
            // SAFETY: as above.
            if let Some(app) = unsafe { mptcp_app_socket(sk) } {
                // SAFETY: a socket the kernel just returned for this one.
                let _ = unsafe { SIDESTEP_ORIG.delete(app.cast()) };
            }
        }
        policy::count(netns_cookie, |c| c.passed_outbound += 1);
        return true;
    }
    let v4 = sidestep_abi::is_v4_mapped(&dst);
    let mut orig = OrigDst {
        addr: dst,
        port_be: dst_port_be,
        kind,
        family: if v4 { linux::AF_INET } else { linux::AF_INET6 },
        side: socket_side::CLIENT,
    };
    // SAFETY: a connect program's context carries a full socket, as sk_storage requires.
    let stored = unsafe { SIDESTEP_ORIG.get_or_insert_ptr_mut(ctx, Some(&mut orig)) };
    if stored.is_null() {
        // No room for the original destination (a socket can exhaust its option memory on
        // purpose): the proxy could not forward, and passing it would bypass the proxy. Refuse.
        policy::count(netns_cookie, |c| c.orig_dst_misses += 1);
        return false;
    }
    // SAFETY: non-null storage owned by this socket; a reused socket (UDP) gets the new value.
    unsafe { *stored = orig };
    if protocol == linux::IPPROTO_TCP {
        // SAFETY: `sk` is this context's full socket, checked non-null above.
        unsafe { record_on_mptcp_app_socket(sk, &mut orig) };
    }
    if tproxy_passthrough {
        // Kept as it is: the storage only lets sockops publish the 4-tuple for sk_lookup.
        // SAFETY: `sk` is the full socket checked above.
        unsafe { mark_passthrough(ctx, sk, ambient_passthrough) };
        policy::count(netns_cookie, |c| c.passed_outbound += 1);
        return true;
    }
    // SAFETY: this context's socket, unconnected, as bpf_bind requires.
    unsafe { bind_pod_source(ctx, netns_cookie, &dst, &bound_src, ipv6) };
    // SAFETY: writable fields of a connect program's context, written one word at a time.
    unsafe {
        if !ipv6 {
            store(&raw mut (*sa).user_ip4, LOOPBACK4_BE);
        } else if v4 {
            store_ip6(&raw mut (*sa).user_ip6, v4_mapped(LOOPBACK4_BE));
        } else {
            store_ip6(&raw mut (*sa).user_ip6, LOOPBACK6);
        }
        store(&raw mut (*sa).user_port, port.to_be() as u32);
    }
    if kind == sidestep_abi::redirect_kind::DNS {
        policy::count(netns_cookie, |c| c.dns_redirected += 1);
    } else {
        policy::count(netns_cookie, |c| c.redirected_outbound += 1);
    }
    true
}

/// `struct sockaddr_in`.
#[repr(C)]
struct SockaddrIn {
    family: u16,
    port_be: u16,
    addr_be: u32,
    zero: [u8; 8],
}

/// `struct sockaddr_in6`.
#[repr(C)]
struct SockaddrIn6 {
    family: u16,
    port_be: u16,
    flowinfo: u32,
    addr: [u32; 4],
    scope_id: u32,
}

/// Binds a captured socket that has no local address yet to the source REDIRECT would leave it
/// ([`policy::redirect_source`]). The app's `getsockname` and the proxy's `getpeername` then show
/// the pod's address rather than loopback, and a socket that connects again elsewhere (UDP keeps
/// its first source) does not try to leave the pod from 127.0.0.1. Port 0 leaves the port to
/// connect (IP_BIND_ADDRESS_NO_PORT). A failure (the address is gone, the socket holds a port
/// already) keeps the loopback source: capture does not depend on it.
///
/// # Safety
/// `ctx` must be the live context of a connect4 or connect6 program.
#[inline(always)]
unsafe fn bind_pod_source(
    ctx: &SockAddrContext,
    netns_cookie: u64,
    dst: &[u32; 4],
    bound_src: &[u32; 4],
    ipv6: bool,
) {
    if !policy::is_unspecified(bound_src) {
        return;
    }
    let Some(src) = policy::redirect_source(netns_cookie, dst) else {
        return;
    };
    // SAFETY: bpf_bind copies `addr_len` bytes of the initialised sockaddr on our stack.
    unsafe {
        if ipv6 {
            let mut sa = SockaddrIn6 {
                family: linux::AF_INET6,
                port_be: 0,
                flowinfo: 0,
                addr: src,
                scope_id: 0,
            };
            let _ = bpf_bind(
                ctx.sock_addr,
                (&raw mut sa).cast::<sockaddr>(),
                core::mem::size_of::<SockaddrIn6>() as i32,
            );
        } else {
            let mut sa = SockaddrIn {
                family: linux::AF_INET,
                port_be: 0,
                addr_be: src[3],
                zero: [0; 8],
            };
            let _ = bpf_bind(
                ctx.sock_addr,
                (&raw mut sa).cast::<sockaddr>(),
                core::mem::size_of::<SockaddrIn>() as i32,
            );
        }
    }
}

/// The app's MPTCP socket when `sk` is the first subflow of one, which the kernel connects on
/// the app's behalf (so this hook sees the subflow, never the socket the app holds).
///
/// # Safety
/// `sk` must be the full socket of this connect program's context.
#[inline(always)]
unsafe fn mptcp_app_socket(sk: *mut bpf_sock) -> Option<*mut core::ffi::c_void> {
    // SAFETY: the helper takes any socket and returns NULL unless it is an MPTCP subflow.
    let msk = unsafe { bpf_skc_to_mptcp_sock(sk.cast()) };
    (!msk.is_null()).then_some(msk.cast())
}

/// Gives the app's MPTCP socket the original destination too: getpeername on it must return the
/// peer the app dialled, as under REDIRECT. Capture does not depend on it (the subflow carries
/// the record sockops and the proxy use), so a failure here refuses nothing.
///
/// # Safety
/// `sk` must be the full socket of this connect program's context.
#[inline(always)]
unsafe fn record_on_mptcp_app_socket(sk: *mut bpf_sock, orig: &mut OrigDst) {
    // SAFETY: forwarded from our caller.
    let Some(app) = (unsafe { mptcp_app_socket(sk) }) else {
        return;
    };
    // SAFETY: a socket the kernel returned for this one, as sk_storage accepts.
    let stored = unsafe { socket_orig_dst(app, Some(orig)) };
    if !stored.is_null() {
        // SAFETY: non-null storage owned by the app's socket.
        unsafe { *stored = *orig };
    }
}

/// Gives the proxy's transparent socket the mark of its way back before its SYN is routed. With
/// `tcp_fwmark_accept` set in the pod, the app's accepted socket inherits the mark, so its
/// replies take the policy route to `lo`. TPROXY mode: the TPROXY mark, unless the proxy marked
/// the socket already (Envoy's original_src does). Ambient: ztunnel's mark becomes the connection
/// mark in its low 12 bits, as Istio's connmark gives the replies (its own mark would send
/// ztunnel's outbound traffic to `lo` too).
///
/// # Safety
/// `sk` must be the full socket of this connect program's context.
#[inline(always)]
unsafe fn mark_passthrough(ctx: &SockAddrContext, sk: *mut bpf_sock, ambient: bool) {
    // SAFETY: `mark` is a 4-byte readable field of bpf_sock.
    let current = unsafe { load(&raw const (*sk).mark) };
    let mut mark = if ambient {
        (current & !sidestep_abi::ambient::MARK_MASK) | sidestep_abi::ambient::CONN_MARK
    } else if current != 0 {
        return;
    } else {
        defaults::TPROXY_MARK
    };
    // SAFETY: connect programs may call bpf_setsockopt; the option value is 4 bytes on our stack.
    // A failure leaves the connection unmarked: its replies then miss the proxy and it fails,
    // which is what Istio's rules give a proxy that does not mark its socket.
    unsafe {
        bpf_setsockopt(
            ctx.as_ptr(),
            linux::SOL_SOCKET,
            linux::SO_MARK,
            (&raw mut mark).cast(),
            4,
        )
    };
}
