//! cgroup/sendmsg4/6 and recvmsg4/6: DNS capture for unconnected UDP.
//!
//! A datagram to port 53 from a non-proxy identity goes to the DNS listener on loopback, from the
//! pod's address as under REDIRECT; the server it was meant for is kept on the socket, and
//! replies from the listener are reported as coming from that server, as conntrack's reverse NAT
//! would. A socket that queries several servers in turn gets each reply attributed to the server
//! of its latest query.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_uid_gid, generated::bpf_get_netns_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use sidestep_abi::{OrigDst, flags, is_v4_mapped, linux, redirect_kind, socket_side, v4_mapped};

use crate::{
    context::{load, load_ip6, store, store_ip6},
    maps::socket_orig_dst,
    policy::{self, Connect, LOOPBACK4_BE, LOOPBACK6},
};

const ALLOW: i32 = 1;
/// sendmsg fails with EPERM.
const REFUSE: i32 = 0;
const DNS_PORT_BE: u16 = 53_u16.to_be();

#[cgroup_sock_addr(sendmsg4)]
pub fn sidestep_sendmsg4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the kernel hands us a valid bpf_sock_addr for the duration of the call.
    if unsafe { send(&ctx, false) } {
        ALLOW
    } else {
        REFUSE
    }
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sidestep_sendmsg6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    if unsafe { send(&ctx, true) } {
        ALLOW
    } else {
        REFUSE
    }
}

#[cgroup_sock_addr(recvmsg4)]
pub fn sidestep_recvmsg4(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    unsafe { receive(&ctx, false) };
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn sidestep_recvmsg6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    unsafe { receive(&ctx, true) };
    ALLOW
}

/// Returns whether the datagram may go: false only when it must be captured and cannot be, or
/// when the capture decision refuses it.
///
/// # Safety
/// `ctx` must be the live context of a sendmsg program.
#[inline(always)]
unsafe fn send(ctx: &SockAddrContext, ipv6: bool) -> bool {
    let sa = ctx.sock_addr;
    // SAFETY: 4-byte context field.
    let port_be = unsafe { load(&raw const (*sa).user_port) } as u16;
    if port_be != DNS_PORT_BE {
        return true;
    }
    // SAFETY: valid sock_addr context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return true;
    };
    if pod.flags & flags::DNS_CAPTURE == 0 {
        return true;
    }
    // SAFETY: context pointer field.
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    if sk.is_null() {
        return true;
    }
    // SAFETY: 4-byte context fields and socket fields, one word at a time.
    let (dst, bound_src, bound_dev_if, mark) = unsafe {
        let (dst, src) = if ipv6 {
            (
                load_ip6(&raw const (*sa).user_ip6),
                load_ip6(&raw const (*sk).src_ip6),
            )
        } else {
            (
                v4_mapped(load(&raw const (*sa).user_ip4)),
                v4_mapped(load(&raw const (*sk).src_ip4)),
            )
        };
        (
            dst,
            src,
            load(&raw const (*sk).bound_dev_if),
            load(&raw const (*sk).mark),
        )
    };
    let uid_gid = bpf_get_current_uid_gid();
    // The same ISTIO_OUTPUT decision as connect: excluded ports, the proxy's identity, IPv6 off.
    let verdict = policy::outbound_verdict(&Connect {
        netns_cookie,
        policy: &pod,
        uid: uid_gid as u32,
        gid: (uid_gid >> 32) as u32,
        dst,
        dst_port: 53,
        bound_src,
        protocol: linux::IPPROTO_UDP,
        // Ambient mode tells ztunnel's own queries by it.
        mark,
        bound_dev_if,
    });
    if verdict.is_refused() {
        return false;
    }
    if verdict.kind != redirect_kind::DNS {
        return true;
    }
    let v4 = is_v4_mapped(&dst);
    let mut orig = OrigDst {
        addr: dst,
        port_be,
        kind: redirect_kind::DNS,
        family: if v4 { linux::AF_INET } else { linux::AF_INET6 },
        side: socket_side::CLIENT,
    };
    // SAFETY: `sk` is this context's socket.
    let stored = unsafe { socket_orig_dst(sk.cast(), Some(&mut orig)) };
    if stored.is_null() {
        // No room for the server's address (a socket can exhaust its option memory on purpose):
        // the reply could not be attributed, and sending it on would bypass the DNS proxy.
        // Refused, as connect refuses in the same case.
        policy::count(netns_cookie, |c| c.orig_dst_misses += 1);
        return false;
    }
    // SAFETY: non-null storage of this socket.
    unsafe { *stored = orig };
    // The datagram leaves from the pod's address, as REDIRECT leaves its source, unless the
    // socket is bound to an address (which the kernel then uses). A dual-stack socket's datagram
    // to an IPv4-mapped server keeps the source the kernel picks.
    let src = if policy::is_unspecified(&bound_src) && (!ipv6 || !v4) {
        policy::redirect_source(netns_cookie, &dst)
    } else {
        None
    };
    // SAFETY: writable context fields, one word at a time.
    unsafe {
        match src {
            Some(src) if ipv6 => store_ip6(&raw mut (*sa).msg_src_ip6, src),
            Some(src) => store(&raw mut (*sa).msg_src_ip4, src[3]),
            None => {}
        }
        if !ipv6 {
            store(&raw mut (*sa).user_ip4, LOOPBACK4_BE);
        } else if v4 {
            store_ip6(&raw mut (*sa).user_ip6, v4_mapped(LOOPBACK4_BE));
        } else {
            store_ip6(&raw mut (*sa).user_ip6, LOOPBACK6);
        }
        store(&raw mut (*sa).user_port, pod.dns_port.to_be() as u32);
    }
    policy::count(netns_cookie, |c| c.dns_redirected += 1);
    true
}

/// # Safety
/// `ctx` must be the live context of a recvmsg program.
#[inline(always)]
unsafe fn receive(ctx: &SockAddrContext, ipv6: bool) {
    let sa = ctx.sock_addr;
    // SAFETY: context pointer field.
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    // SAFETY: `sk` is this context's socket.
    let orig = unsafe { socket_orig_dst(sk.cast(), None) };
    if orig.is_null() {
        return;
    }
    // SAFETY: non-null storage, copied out.
    let orig = unsafe { *orig };
    if orig.kind != redirect_kind::DNS {
        return;
    }
    // SAFETY: 4-byte context fields.
    let (src, src_port_be) = unsafe {
        let src = if ipv6 {
            load_ip6(&raw const (*sa).user_ip6)
        } else {
            v4_mapped(load(&raw const (*sa).user_ip4))
        };
        (src, load(&raw const (*sa).user_port) as u16)
    };
    // Only replies from the pod's DNS listener on loopback are rewritten.
    let from_loopback = (is_v4_mapped(&src) && src[3] == LOOPBACK4_BE) || src == LOOPBACK6;
    // SAFETY: valid sock_addr context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return;
    };
    if !from_loopback || src_port_be != pod.dns_port.to_be() {
        return;
    }
    // SAFETY: writable context fields, one word at a time.
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
