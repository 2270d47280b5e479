//! cgroup/getpeername4 and getpeername6: a redirected app sees its original peer, as it does
//! under iptables REDIRECT, rather than the proxy's loopback listener.

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use sidestep_abi::{linux, socket_side, v4_mapped};

use crate::{
    context::{load, load_ip6, store, store_ip6},
    maps::socket_orig_dst,
    policy::is_loopback,
};

const ALLOW: i32 = 1;

#[cgroup_sock_addr(getpeername4)]
pub fn sidestep_getpeername4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the kernel hands us a valid bpf_sock_addr for the duration of the call.
    unsafe { rewrite_peer(&ctx, false) };
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn sidestep_getpeername6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    unsafe { rewrite_peer(&ctx, true) };
    ALLOW
}

/// # Safety
/// `ctx` must be the live context of a getpeername program.
#[inline(always)]
unsafe fn rewrite_peer(ctx: &SockAddrContext, ipv6: bool) {
    let sa = ctx.sock_addr;
    // Every redirect rewrites the peer to a loopback proxy port, and a passthrough record (no
    // rewrite) names the peer itself: any other peer is answered as the kernel has it, without
    // a storage lookup (issue 38). This runs for every getpeername on the node.
    // SAFETY: 4-byte readable context fields, read one at a time.
    let peer = unsafe {
        if ipv6 {
            load_ip6(&raw const (*sa).user_ip6)
        } else {
            v4_mapped(load(&raw const (*sa).user_ip4))
        }
    };
    if !is_loopback(&peer) {
        return;
    }
    // SAFETY: context pointer field.
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    // SAFETY: `sk` is this context's socket, checked non-null.
    let orig = unsafe { socket_orig_dst(sk.cast(), None) };
    if orig.is_null() {
        return;
    }
    // SAFETY: non-null storage, copied out.
    let orig = unsafe { *orig };
    // Only the connecting side has its peer rewritten; a proxy's accepted socket sees the app.
    if orig.side != socket_side::CLIENT {
        return;
    }
    // SAFETY: writable fields of a getpeername program's context, one word at a time.
    unsafe {
        if ipv6 {
            store_ip6(&raw mut (*sa).user_ip6, orig.addr);
        } else if orig.family == linux::AF_INET {
            store(&raw mut (*sa).user_ip4, orig.addr[3]);
        } else {
            return;
        }
        store(&raw mut (*sa).user_port, orig.port_be as u32);
    }
}
