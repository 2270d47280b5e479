//! cgroup_skb egress: no packet leaves with a loopback address as a source-route segment.
//!
//! connect4/6 and sendmsg4/6 rewrite a captured destination to loopback (the proxy's or the
//! DNS proxy's port). A socket with a source route sends that packet to the route's first hop
//! instead, and the rewritten loopback address only rides along as a later segment: the SYN (or
//! the DNS query) leaves the pod around the proxy. Istio's nat OUTPUT sees the first hop as the
//! destination and REDIRECTs it, so there the route changes nothing. `sidestep_setsockopt`
//! refuses the options, but it never sees three ways in (docs/RELIABILITY.md, the threat table):
//! a setsockopt from a 32-bit (compat) syscall, for which the kernel runs no cgroup sockopt
//! program; an option set before the pod was enrolled; and a routing header or IPv4 source route
//! passed per datagram in sendmsg's control data. All three show up here, in the packet.
//!
//! The rule needs no pod: no legitimate packet names loopback as a route segment (a receiver
//! would drop it as a martian, and loopback traffic itself is never source-routed), so any such
//! packet is a captured destination escaping, from whichever process. That matters because this
//! program runs for every egress packet under the cgroup (the cgroup2 root on a node), loopback
//! included, and cgroup_skb has no netns cookie on the kernels sidestep supports: the common
//! packet (IPv4 without options, IPv6 straight to TCP, UDP or ICMPv6) is passed after one
//! bounds check and one or two byte reads. Whatever the walk cannot follow to the end, it drops.

use aya_ebpf::{macros::cgroup_skb, programs::SkBuffContext};
use sidestep_abi::linux;

use crate::{
    context::load,
    packet::{IPV6_FRAG_OFFSET, NEXTHDR_AUTH, NEXTHDR_FRAGMENT, NEXTHDR_ROUTING, is_ext_header},
    policy,
};

const PASS: i32 = 1;
/// cgroup_skb egress: the packet is dropped, and the sender sees EPERM (TCP retransmits).
const DROP: i32 = 0;

const IPPROTO_ICMPV6: u8 = 58;
const IPV4_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
/// Extension headers followed. The kernel puts at most Hop-by-Hop, Destination Options,
/// Routing, Fragment, AH and Destination Options in front of the transport header, and a routing
/// header it builds is never past the third; a longer chain can only be crafted, and is dropped.
const MAX_EXT_HEADERS: usize = 6;
/// Routing-header addresses checked. The kernel takes up to 127 (hdr_ext_len is 8 bits); a
/// header listing more than this is dropped unread rather than passed half-read.
const MAX_SEGMENTS: u32 = 16;
/// Where a routing header's addresses start (types 0, 2 and 4 alike).
const RTHDR_ADDRS: u32 = 8;
/// Addresses an LSRR or SSRR option can hold: (40 - 3) / 4.
const MAX_IPV4_HOPS: u32 = 9;
/// Keeps an options offset (never past 40 where it is masked) in a range the verifier sees as
/// one state, whichever branch of an iteration computed it; without it the branches' exact
/// ranges multiply the states of each iteration past the verifier's limit. Read-only data, read
/// with a volatile load: LLVM, which proves the mask changes no value, cannot drop it, and the
/// verifier, which sees the frozen value, applies it.
#[unsafe(no_mangle)]
static ROUTE_GUARD_OPT_MASK: u32 = 0x3f;
/// The same for an extension-header offset: 6 headers of at most 2 KiB after 40 bytes stay under
/// 16 KiB, so the mask never changes a value.
#[unsafe(no_mangle)]
static ROUTE_GUARD_EXT_MASK: u32 = 0x3fff;

/// `value & mask`, where the mask is one of the read-only masks above.
#[inline(always)]
fn masked(value: u32, mask: &'static u32) -> u32 {
    // SAFETY: a read of this object's own read-only data.
    value & unsafe { core::ptr::read_volatile(mask) }
}

#[cgroup_skb(egress)]
pub fn sidestep_route_guard(ctx: SkBuffContext) -> i32 {
    // SAFETY: the kernel hands us a valid __sk_buff for the duration of the call.
    let head = unsafe { first_bytes(&ctx) }
        // The network header is not in the linear area (never for a packet the stack built, but
        // then read it the slow way rather than guess).
        .or_else(|| ctx.load::<[u8; 8]>(0).ok().map(|h| (h[0], h[6])));
    match head.map(|(ver_ihl, next_header)| classify(ver_ihl, next_header)) {
        Some(First::V4 { ihl }) => ipv4_verdict(&ctx, ihl),
        Some(First::V6 { next }) => ipv6_verdict(&ctx, next),
        Some(First::Plain) | None => PASS,
    }
}

/// What the first bytes of the network header say.
enum First {
    /// Nothing that can carry a source route: IPv4 without options, IPv6 straight to TCP, UDP
    /// or ICMPv6, or not IP at all.
    Plain,
    /// IPv4 with options; `ihl` in bytes.
    V4 { ihl: usize },
    /// IPv6 followed by something other than TCP, UDP or ICMPv6.
    V6 { next: u8 },
}

#[inline(always)]
fn classify(ver_ihl: u8, next_header: u8) -> First {
    match ver_ihl >> 4 {
        4 if ver_ihl & 0x0f == 5 => First::Plain,
        4 => First::V4 {
            ihl: ((ver_ihl & 0x0f) as usize) * 4,
        },
        6 if next_header == linux::IPPROTO_TCP as u8
            || next_header == linux::IPPROTO_UDP as u8
            || next_header == IPPROTO_ICMPV6 =>
        {
            First::Plain
        }
        6 => First::V6 { next: next_header },
        _ => First::Plain,
    }
}

/// The fast path: the version and IHL byte and the IPv6 next header byte, read straight from
/// the packet, or None when its first 8 bytes are not in the linear area.
///
/// # Safety
/// `ctx` must be the live context of a cgroup_skb program.
#[inline(always)]
unsafe fn first_bytes(ctx: &SkBuffContext) -> Option<(u8, u8)> {
    let skb = ctx.skb.skb;
    // SAFETY: 4-byte context fields, read one at a time (the verifier refuses a merged load).
    let (data, data_end) = unsafe {
        (
            load(&raw const (*skb).data) as usize,
            load(&raw const (*skb).data_end) as usize,
        )
    };
    if data + 8 > data_end {
        return None;
    }
    // SAFETY: [data, data + 8) is inside the packet's linear area, checked above.
    Some(unsafe {
        (
            (data as *const u8).read(),
            (data as *const u8).add(6).read(),
        )
    })
}

/// IPv4 with options: drop when a loose or strict source route lists an address in
/// 127.0.0.0/8. The block is walked like `sourceroute::has_source_route`: an option the walk
/// cannot follow (a length under 2, or one running past the block) hides whatever follows it, so
/// the packet counts as routed through loopback. The kernel builds no such block; only a raw
/// socket could, and receivers drop it.
///
/// Written for the verifier of every kernel sidestep supports: bytes are read from the packet
/// at a runtime offset (never indexed on the stack, which Linux 6.1 refuses), and the two loops
/// run one after the other with every offset masked, so the branches of one iteration meet the
/// loop head in one state.
#[inline(always)]
fn ipv4_verdict(ctx: &SkBuffContext, ihl: usize) -> i32 {
    if ihl <= IPV4_HLEN {
        // IHL under 5: not a header the kernel would send, and it has no options to read.
        return PASS;
    }
    let len = (ihl - IPV4_HLEN) as u32;
    let byte = |at: u32| ctx.load::<u8>(IPV4_HLEN + at as usize).ok();
    // The first LSRR or SSRR option (the kernel takes one at most): (start, length).
    let mut route: Option<(u32, u32)> = None;
    let mut at = 0u32;
    for _ in 0..linux::MAX_IPOPTLEN {
        if at >= len {
            break;
        }
        let Some(kind) = byte(at) else {
            return DROP;
        };
        if kind == linux::IPOPT_END {
            break;
        }
        if kind == linux::IPOPT_NOOP {
            at = masked(at + 1, &ROUTE_GUARD_OPT_MASK);
            continue;
        }
        let Some(option_len) = byte(at + 1).map(u32::from) else {
            return DROP;
        };
        if option_len < 2 || at + option_len > len {
            return DROP;
        }
        if kind == linux::IPOPT_LSRR || kind == linux::IPOPT_SSRR {
            route = Some((
                masked(at, &ROUTE_GUARD_OPT_MASK),
                masked(option_len, &ROUTE_GUARD_OPT_MASK),
            ));
            break;
        }
        at = masked(at + option_len, &ROUTE_GUARD_OPT_MASK);
    }
    let Some((start, option_len)) = route else {
        return PASS;
    };
    // Kind, length and pointer, then the addresses: every one of them, not only those past the
    // pointer, since the kernel writes the final destination into the last. A partial address
    // at the end is no hop anyone would use.
    for i in 0..MAX_IPV4_HOPS {
        let hop = 3 + 4 * i;
        if hop + 4 > option_len {
            return PASS;
        }
        match byte(start + hop) {
            Some(127) | None => return DROP,
            Some(_) => {}
        }
    }
    PASS
}

/// IPv6 past a fixed header whose next header is `next`: drop when a routing header lists a
/// loopback address, when one lists more addresses than are checked, when there are two, or
/// when the chain of extension headers is longer than is followed. The chain is walked first
/// and the routing header's addresses read after, in two loops one after the other.
#[inline(always)]
fn ipv6_verdict(ctx: &SkBuffContext, mut next: u8) -> i32 {
    let mut off = IPV6_HLEN as u32;
    // The routing header: (offset, hdr_ext_len).
    let mut routing: Option<(u32, u8)> = None;
    let mut ended = false;
    for _ in 0..MAX_EXT_HEADERS {
        if !is_ext_header(next) {
            // The transport header (or ESP, or no next header): nothing further can route.
            ended = true;
            break;
        }
        // Every extension header is at least 8 bytes; these 4 hold its next header, its length
        // and, for a Fragment header, the offset.
        let Ok(h) = ctx.load::<[u8; 4]>(off as usize) else {
            // Truncated: the kernel sends no such packet, and an unread header may route.
            return DROP;
        };
        let len = match next {
            NEXTHDR_AUTH => (u32::from(h[1]) + 2) * 4,
            NEXTHDR_FRAGMENT => {
                if u16::from_be_bytes([h[2], h[3]]) & IPV6_FRAG_OFFSET != 0 {
                    // A later fragment: what follows is data, and a routing header would sit
                    // in front of the Fragment header, already read.
                    ended = true;
                    break;
                }
                8
            }
            NEXTHDR_ROUTING => {
                if routing.is_some() {
                    // Two routing headers: no socket builds that.
                    return DROP;
                }
                routing = Some((off, h[1]));
                (u32::from(h[1]) + 1) * 8
            }
            _ => (u32::from(h[1]) + 1) * 8,
        };
        next = h[0];
        off = masked(off + len, &ROUTE_GUARD_EXT_MASK);
    }
    // Still an extension header after the last one followed: a chain no socket builds.
    if !ended && is_ext_header(next) {
        return DROP;
    }
    match routing {
        Some((at, hdr_ext_len)) if routes_through_loopback(ctx, at, hdr_ext_len) => DROP,
        _ => PASS,
    }
}

/// Whether the routing header at `off`, of length field `hdr_ext_len`, lists a loopback address
/// (::1, or a v4-mapped address in 127.0.0.0/8), or more addresses than [`MAX_SEGMENTS`]. Every
/// 16 bytes past its first 8 are read as an address, whatever the type: types 0, 2 and 4 lay
/// them out so (a segment routing header's TLVs, if any, are read as addresses too, which can
/// only drop more).
#[inline(always)]
fn routes_through_loopback(ctx: &SkBuffContext, off: u32, hdr_ext_len: u8) -> bool {
    let count = u32::from(hdr_ext_len / 2);
    if count > MAX_SEGMENTS {
        return true;
    }
    for i in 0..MAX_SEGMENTS {
        if i >= count {
            return false;
        }
        let at = masked(off + RTHDR_ADDRS + i * 16, &ROUTE_GUARD_EXT_MASK);
        let Ok(addr) = ctx.load::<[u32; 4]>(at as usize) else {
            return true;
        };
        // The words as read from the packet: network order, as every address in the maps.
        if policy::is_loopback(&addr) {
            return true;
        }
    }
    false
}
