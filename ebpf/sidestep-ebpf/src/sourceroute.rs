//! cgroup/setsockopt: no source routing from an enrolled pod.
//!
//! connect4/6 see, and rewrite, only the address passed to connect(). A socket that carries a
//! routing header (`IPV6_RTHDR`, or one inside `IPV6_2292PKTOPTIONS`) or an IPv4 source route
//! (`IP_OPTIONS` with LSRR or SSRR) sends its packets to the route's first hop instead, and the
//! rewritten loopback address only becomes the last segment: the SYN leaves the pod around the
//! proxy. Istio's nat OUTPUT sees that first hop as the destination and REDIRECTs it, so the
//! option is harmless there. sidestep cannot follow the route in a sock_addr hook, so the option
//! itself is refused (EPERM) on every socket of an enrolled pod, before or after connect, which
//! also covers a captured socket that sets it once connected. Clearing it (an empty value) is
//! allowed.
//!
//! What this hook cannot see (docs/RELIABILITY.md, the threat table): a routing header or an
//! IPv4 source route passed per datagram in sendmsg's control data (TCP ignores those; UDP
//! honours them, and the UDP it concerns is DNS; IPv4's needs CAP_NET_RAW); a setsockopt from a
//! 32-bit (compat) process, for which the kernel does not run cgroup sockopt programs; and an
//! option a socket set before its pod was enrolled (an agent repair of a running pod). Those
//! reach the packet, where `routeguard` (cgroup_skb egress) drops any that names a loopback
//! address as a route segment; refusing the option here still fails the app early and plainly
//! (EPERM at setsockopt rather than a connect that times out).

use aya_ebpf::{
    EbpfContext, helpers::generated::bpf_get_netns_cookie, macros::cgroup_sockopt,
    programs::SockoptContext,
};
use sidestep_abi::linux;

use crate::{
    context::{load, store},
    policy,
};

/// Let the option through to the kernel, unchanged.
const PASS: i32 = 1;
/// Fail the setsockopt with EPERM.
const REFUSE: i32 = 0;
/// A setsockopt program sees at most this much of the value; past it the kernel wants optlen 0
/// ("use the caller's buffer"), or older kernels fail the call with EFAULT.
const PAGE_SIZE: i32 = 4096;

#[cgroup_sockopt(setsockopt)]
pub fn sidestep_setsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: the kernel hands us a valid bpf_sockopt for the duration of the call.
    if unsafe { refuses(&ctx) } {
        REFUSE
    } else {
        PASS
    }
}

/// Whether this setsockopt sets a source route on a socket of an enrolled pod.
///
/// # Safety
/// `ctx` must be the live context of a setsockopt program.
#[inline(always)]
unsafe fn refuses(ctx: &SockoptContext) -> bool {
    let so = ctx.sockopt;
    // SAFETY: 4-byte context fields, read one at a time.
    let (level, optname, optlen) = unsafe {
        (
            load(&raw const (*so).level),
            load(&raw const (*so).optname),
            load(&raw const (*so).optlen),
        )
    };
    // An empty value clears the option: always allowed.
    let routes = optlen > 0
        && match (level, optname) {
            // Refused whatever their length: IPV6_2292PKTOPTIONS takes up to 64 KiB of control
            // messages, past what the program can read, and a routing header may sit anywhere.
            (linux::SOL_IPV6, linux::IPV6_RTHDR)
            | (linux::SOL_IPV6, linux::IPV6_2292PKTOPTIONS) => true,
            // The kernel takes at most 40 bytes, all of them readable here.
            // SAFETY: context pointer fields; the scan checks every byte against optval_end.
            (linux::SOL_IP, linux::IP_OPTIONS) => unsafe {
                has_source_route(
                    (*so).__bindgen_anon_2.optval.cast::<u8>(),
                    (*so).__bindgen_anon_3.optval_end.cast::<u8>(),
                    optlen as usize,
                )
            },
            _ => false,
        };
    if !routes {
        if optlen > PAGE_SIZE {
            // Past a page the program sees only the start; hand the caller's buffer back.
            // SAFETY: writable context field.
            unsafe { store(&raw mut (*so).optlen, 0) };
        }
        return false;
    }
    // SAFETY: valid sockopt context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    policy::pod_policy(netns_cookie).is_some()
}

/// Whether an IPv4 options block holds a loose or strict source route. A block the walk cannot
/// follow (an option length under 2, or running past what the program can see) counts as one:
/// the kernel refuses malformed options anyway, and an unread tail must not hide a route.
///
/// # Safety
/// `[optval, optval_end)` must be the readable value of this setsockopt's context.
#[inline(always)]
unsafe fn has_source_route(optval: *const u8, optval_end: *const u8, optlen: usize) -> bool {
    let len = if optlen > linux::MAX_IPOPTLEN {
        linux::MAX_IPOPTLEN
    } else {
        optlen
    };
    let mut at = 0usize;
    // Every step moves on by at least one byte, so MAX_IPOPTLEN steps cover the whole block.
    let mut step = 0;
    while step < linux::MAX_IPOPTLEN {
        step += 1;
        if at >= len {
            return false;
        }
        let kind_ptr = optval.wrapping_add(at);
        if kind_ptr.wrapping_add(1) > optval_end {
            return true;
        }
        // SAFETY: inside [optval, optval_end), checked above.
        let kind = unsafe { kind_ptr.read() };
        match kind {
            linux::IPOPT_END => return false,
            linux::IPOPT_NOOP => at += 1,
            linux::IPOPT_LSRR | linux::IPOPT_SSRR => return true,
            _ => {
                if kind_ptr.wrapping_add(2) > optval_end {
                    return true;
                }
                // SAFETY: inside [optval, optval_end), checked above.
                let option_len = unsafe { kind_ptr.add(1).read() } as usize;
                if option_len < 2 {
                    return true;
                }
                at += option_len;
            }
        }
    }
    false
}
