//! cgroup/getsockopt: SO_ORIGINAL_DST (SOL_IP) and IP6T_SO_ORIGINAL_DST (SOL_IPV6), answered as
//! netfilter answers them: the v4 option for IPv4 connections, the v6 option for IPv6 ones, and
//! ENOENT for a connection sidestep did not redirect.

use aya_ebpf::{
    EbpfContext, helpers::generated::bpf_get_netns_cookie, macros::cgroup_sockopt,
    programs::SockoptContext,
};
use sidestep_abi::linux;

use crate::{
    context::{load, store},
    maps::socket_orig_dst,
    policy,
};

/// Let the (possibly rewritten) result through to the caller.
const PASS: i32 = 1;
const SOCKADDR_IN_LEN: usize = 16;
const SOCKADDR_IN6_LEN: usize = 28;
const EINVAL: i32 = 22;

#[cgroup_sockopt(getsockopt)]
pub fn sidestep_getsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: the kernel hands us a valid bpf_sockopt for the duration of the call.
    unsafe { handle(&ctx) };
    PASS
}

/// # Safety
/// `ctx` must be the live context of a getsockopt program.
#[inline(always)]
unsafe fn handle(ctx: &SockoptContext) {
    let so = ctx.sockopt;
    // SAFETY: 4-byte context fields.
    let (level, optname) =
        unsafe { (load(&raw const (*so).level), load(&raw const (*so).optname)) };
    if optname != linux::SO_ORIGINAL_DST || (level != linux::SOL_IP && level != linux::SOL_IPV6) {
        return;
    }
    // SAFETY: context pointer fields.
    let (sk, optval, optval_end) = unsafe {
        (
            (*so).__bindgen_anon_1.sk,
            (*so).__bindgen_anon_2.optval.cast::<u8>(),
            (*so).__bindgen_anon_3.optval_end.cast::<u8>(),
        )
    };
    if sk.is_null() {
        return;
    }
    // SAFETY: valid sockopt context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: `sk` is this context's socket, checked non-null.
    let orig = unsafe { socket_orig_dst(sk.cast(), None) };
    let want_family = if level == linux::SOL_IP {
        linux::AF_INET
    } else {
        linux::AF_INET6
    };
    // SAFETY: non-null storage of this socket, copied out.
    let orig = (!orig.is_null()).then(|| unsafe { *orig });
    // Our record comes first: conntrack, if some rule loaded it, would name our own listener.
    let Some(orig) = orig.filter(|o| o.family == want_family) else {
        // SAFETY: 4-byte context field and socket field.
        let (retval, sk_family) =
            unsafe { (load(&raw const (*so).retval), load(&raw const (*sk).family)) };
        // Leave alone what the kernel answered itself, and SOL_IPV6 on an IPv4 socket, which the
        // kernel refuses (EOPNOTSUPP) before netfilter would be asked.
        if retval == 0 || (level == linux::SOL_IPV6 && sk_family == u32::from(linux::AF_INET)) {
            return;
        }
        // Not redirected: outside the mesh keep the kernel's error; inside, netfilter's ENOENT.
        if policy::pod_policy(netns_cookie).is_some() {
            policy::count(netns_cookie, |c| c.orig_dst_misses += 1);
            // SAFETY: writable context field.
            unsafe { store(&raw mut (*so).retval, -linux::ENOENT) };
        }
        return;
    };
    let len = if want_family == linux::AF_INET {
        SOCKADDR_IN_LEN
    } else {
        SOCKADDR_IN6_LEN
    };
    // SAFETY: pointer arithmetic only; the bound is checked before any write.
    if unsafe { optval.add(len) } > optval_end {
        // SAFETY: writable context field.
        unsafe { store(&raw mut (*so).retval, -EINVAL) };
        return;
    }
    let family = want_family.to_ne_bytes();
    let port = orig.port_be.to_ne_bytes();
    // SAFETY: [optval, optval + len) lies inside the buffer, checked above.
    unsafe {
        optval.write(family[0]);
        optval.add(1).write(family[1]);
        optval.add(2).write(port[0]);
        optval.add(3).write(port[1]);
        if want_family == linux::AF_INET {
            // sockaddr_in: 4-byte address, then 8 bytes of zero.
            write_word(optval.add(4), orig.addr[3]);
            write_word(optval.add(8), 0);
            write_word(optval.add(12), 0);
        } else {
            // sockaddr_in6: flowinfo, 16-byte address, scope id.
            write_word(optval.add(4), 0);
            write_word(optval.add(8), orig.addr[0]);
            write_word(optval.add(12), orig.addr[1]);
            write_word(optval.add(16), orig.addr[2]);
            write_word(optval.add(20), orig.addr[3]);
            let first = orig.addr[0].to_ne_bytes();
            let scope = if first[0] == 0xfe && first[1] & 0xc0 == 0x80 {
                load(&raw const (*sk).bound_dev_if)
            } else {
                0
            };
            write_word(optval.add(24), scope);
        }
        // optlen and retval one at a time, or LLVM fuses them into a rejected 8-byte store.
        store(&raw mut (*so).optlen, len as i32);
        store(&raw mut (*so).retval, 0);
    }
    policy::count(netns_cookie, |c| c.orig_dst_hits += 1);
}

/// # Safety
/// `dst..dst + 4` must be writable.
#[inline(always)]
unsafe fn write_word(dst: *mut u8, word: u32) {
    let bytes = word.to_ne_bytes();
    // SAFETY: the caller guarantees the four bytes are in bounds.
    unsafe {
        dst.write(bytes[0]);
        dst.add(1).write(bytes[1]);
        dst.add(2).write(bytes[2]);
        dst.add(3).write(bytes[3]);
    }
}
