//! The Ethernet/IP/TCP headers the tc programs read, and their two parsers. They run for every
//! packet the programs see, so each header is read with one load (a `bpf_skb_load_bytes` per
//! field cost eight helper calls a packet) and the ethertype comes from the skb itself.
//!
//! - [`parse_tcp`], for inbound capture: plain TCP only. Anything else passes to the kernel,
//!   whose local delivery sk_lookup covers, so it stays as cheap as it can be.
//! - [`parse_rerouted`], for re-routed interfaces: there a packet passed is *forwarded*, so it
//!   also follows IPv6 extension headers and VLAN 0 tags and reports what it cannot follow
//!   (fragments, a routing header, a truncated header) instead of taking it for "not TCP".

use aya_ebpf::{helpers::generated::bpf_skb_vlan_pop, programs::TcContext};
use sidestep_abi::{linux, v4_mapped};

use crate::context::load;

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_VID_MASK: u32 = 0x0fff;
/// The most VLAN tags a frame may carry and still be followed (the kernel strips any number).
const MAX_PRIORITY_TAGS: usize = 4;
pub const IPV6_HLEN: usize = core::mem::size_of::<Ipv6Head>();
/// The fixed TCP header: a packet with less is not a segment the kernel would accept.
pub const TCP_HLEN: usize = 20;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// The fixed IPv4 header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv4Head {
    pub ver_ihl: u8,
    _tos: u8,
    pub total_len_be: u16,
    _id: u16,
    pub frag_be: u16,
    _ttl: u8,
    pub protocol: u8,
    _check: u16,
    pub src: u32,
    pub dst: u32,
}

/// The IPv6 header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv6Head {
    _ver_class_flow: u32,
    _payload_len: u16,
    pub next_header: u8,
    _hop_limit: u8,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

/// The first 14 bytes of a TCP header, up to the flags (every TCP header has 20 or more).
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub struct TcpHead {
    pub src_port_be: u16,
    pub dst_port_be: u16,
    _seq: u32,
    _ack: u32,
    _data_offset: u8,
    pub flags: u8,
}

/// A TCP segment, as much of it as the programs decide on.
pub struct Segment {
    pub ipv6: bool,
    /// IPv4 addresses are v4-mapped.
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub tcp_flags: u8,
    /// Offset of the TCP header.
    pub l4: usize,
}

impl Segment {
    /// A SYN without ACK: a new connection.
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    }
}

/// The TCP segment in this packet, or `None` for anything else. IPv6 extension headers before
/// TCP are not followed and fragments are not told apart: such packets are left alone, which on
/// inbound means local delivery, where sidestep_sk_lookup still captures the connection (a
/// re-routed interface, whose packets are forwarded, uses [`parse_rerouted`]).
#[inline(always)]
pub fn parse_tcp(ctx: &TcContext) -> Option<Segment> {
    let ethertype = u16::from_be(ctx.skb.protocol() as u16);
    let (ipv6, src, dst, l4) = match ethertype {
        ETH_P_IP => {
            let ip: Ipv4Head = ctx.load(ETH_HLEN).ok()?;
            if ip.protocol != linux::IPPROTO_TCP as u8 {
                return None;
            }
            let ihl = ((ip.ver_ihl & 0x0f) as usize) * 4;
            if ihl < 20 {
                return None;
            }
            (false, v4_mapped(ip.src), v4_mapped(ip.dst), ETH_HLEN + ihl)
        }
        ETH_P_IPV6 => {
            let ip: Ipv6Head = ctx.load(ETH_HLEN).ok()?;
            if ip.next_header != linux::IPPROTO_TCP as u8 {
                return None;
            }
            (true, ip.src, ip.dst, ETH_HLEN + IPV6_HLEN)
        }
        _ => return None,
    };
    let tcp: TcpHead = ctx.load(l4).ok()?;
    Some(Segment {
        ipv6,
        src,
        dst,
        src_port_be: tcp.src_port_be,
        dst_port_be: tcp.dst_port_be,
        tcp_flags: tcp.flags,
        l4,
    })
}

/// IPv4's More Fragments flag and fragment offset: a packet with either set is a fragment.
const IPV4_MF_OFFSET: u16 = 0x3fff;
/// The offset bits of an IPv6 Fragment header's third and fourth bytes.
pub(crate) const IPV6_FRAG_OFFSET: u16 = 0xfff8;

pub(crate) const NEXTHDR_HOP: u8 = 0;
pub(crate) const NEXTHDR_ROUTING: u8 = 43;
pub(crate) const NEXTHDR_FRAGMENT: u8 = 44;
pub(crate) const NEXTHDR_AUTH: u8 = 51;
pub(crate) const NEXTHDR_DEST: u8 = 60;

/// Extension headers followed before TCP. The kernel sends at most Hop-by-Hop, Destination
/// Options (twice), Routing, Fragment and AH in front of TCP; more is a crafted chain, and a
/// constant bound keeps the loop verifiable.
const MAX_EXT_HEADERS: usize = 8;

/// The fixed TCP header, loaded whole so that a truncated one is seen as such.
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct TcpFixed {
    head: TcpHead,
    _window: u16,
    _check: u16,
    _urgent: u16,
}

/// What [`parse_rerouted`] found.
pub enum Parsed {
    /// A TCP segment whose header it reached.
    Tcp(Segment),
    /// Not TCP (UDP, ICMP, ESP, a non-IP frame...): iptables' `-p tcp` would not match it either.
    Other,
    /// TCP, or possibly TCP, whose header cannot be reached or rewritten: an IPv4 fragment, an
    /// IPv6 Fragment or Routing header in front of TCP (or of headers that may lead to it), a
    /// chain longer than [`MAX_EXT_HEADERS`], a truncated header. `dst` is the IP destination
    /// (v4-mapped for IPv4), which every fragment carries.
    Opaque { ipv6: bool, dst: [u32; 4] },
    /// An IP header too short to read (the kernel drops it anyway), or a frame behind more VLAN
    /// tags than the parser pops.
    Broken,
}

/// Whether IPv6 next header `next` is one the loop follows, i.e. TCP may come after it.
#[inline(always)]
pub(crate) fn is_ext_header(next: u8) -> bool {
    matches!(
        next,
        NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_FRAGMENT | NEXTHDR_AUTH | NEXTHDR_DEST
    )
}

/// The segment whose TCP header starts at `l4`, or `Opaque` when the packet ends before the
/// fixed header does.
#[inline(always)]
fn tcp_at(ctx: &TcContext, ipv6: bool, src: [u32; 4], dst: [u32; 4], l4: usize) -> Parsed {
    let Ok(tcp) = ctx.load::<TcpFixed>(l4) else {
        return Parsed::Opaque { ipv6, dst };
    };
    Parsed::Tcp(Segment {
        ipv6,
        src,
        dst,
        src_port_be: tcp.head.src_port_be,
        dst_port_be: tcp.head.dst_port_be,
        tcp_flags: tcp.head.flags,
        l4,
    })
}

/// The packet on a re-routed interface, as far as a DNAT needs it. Unlike [`parse_tcp`] it
/// follows IPv6 Hop-by-Hop, Destination Options and AH headers to TCP (ip6tables' `-p tcp`
/// skips them, so Istio REDIRECTs such a connection), and tells a packet it cannot follow
/// (`Opaque`) from one that is not TCP (`Other`): passing the former would forward a connection
/// around the proxy.
#[inline(always)]
///
/// On `ingress` it first brings the frame to what the stack will get ([`untag_priority`]);
/// egress frames are parsed as they are.
pub fn parse_rerouted(ctx: &TcContext, ingress: bool) -> Parsed {
    if ingress {
        match untag_priority(ctx) {
            Untag::Done => {}
            Untag::NotDeliveredHere => return Parsed::Other,
            Untag::Failed => return Parsed::Broken,
        }
    }
    match u16::from_be(ctx.skb.protocol() as u16) {
        ETH_P_IP => rerouted_v4(ctx),
        ETH_P_IPV6 => rerouted_v6(ctx),
        _ => Parsed::Other,
    }
}

/// What [`untag_priority`] left.
enum Untag {
    /// The frame's payload is what the stack will get on this interface.
    Done,
    /// Tagged with a VLAN other than 0: the kernel hands it to that VLAN's device (a capture of
    /// its own) or drops it; either way not to this interface's IP stack.
    NotDeliveredHere,
    /// More priority tags than it pops, or a pop failed: the packet cannot be followed.
    Failed,
}

fn is_vlan(ethertype: u16) -> bool {
    ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD
}

/// Brings the frame to what the stack will deliver. Before tc the kernel strips one VLAN tag
/// into the skb; after tc, behind a tag of VLAN 0 (802.1p priority tagging), it strips every
/// further tag and delivers the packet as untagged IP on this same interface, where netfilter
/// (and so Istio's REDIRECT) sees it. A parser that read the frame as the wire has it would see
/// a VLAN header there and pass a SYN the pod then forwards around the proxy. Popping those tags
/// here does what the kernel would do next, and the frame keeps its last tag in the skb for the
/// kernel to judge as before.
#[inline(always)]
fn untag_priority(ctx: &TcContext) -> Untag {
    let skb = ctx.skb.skb;
    for _ in 0..MAX_PRIORITY_TAGS {
        // SAFETY: `vlan_present` and `vlan_tci` are readable 4-byte fields of __sk_buff.
        let (present, tci) = unsafe {
            (
                load(&raw const (*skb).vlan_present),
                load(&raw const (*skb).vlan_tci),
            )
        };
        if present != 0 && tci & VLAN_VID_MASK != 0 {
            return Untag::NotDeliveredHere;
        }
        if !is_vlan(u16::from_be(ctx.skb.protocol() as u16)) {
            return Untag::Done;
        }
        if present == 0 {
            // A VLAN header the kernel did not strip before tc; nothing delivers it after tc
            // either, so dropping it changes nothing but keeps "never forwarded unparsed".
            return Untag::Failed;
        }
        // SAFETY: a tc program's own skb; the helper moves the next tag into the skb, and the
        // parser reads the packet with bpf_skb_load_bytes, never through stale pointers.
        if unsafe { bpf_skb_vlan_pop(skb) } != 0 {
            return Untag::Failed;
        }
    }
    Untag::Failed
}

#[inline(always)]
fn rerouted_v4(ctx: &TcContext) -> Parsed {
    let Ok(ip) = ctx.load::<Ipv4Head>(ETH_HLEN) else {
        return Parsed::Broken;
    };
    if ip.protocol != linux::IPPROTO_TCP as u8 {
        return Parsed::Other;
    }
    let (src, dst) = (v4_mapped(ip.src), v4_mapped(ip.dst));
    let ihl = ((ip.ver_ihl & 0x0f) as usize) * 4;
    let total = u16::from_be(ip.total_len_be) as usize;
    // A later fragment has no TCP header and a first one may hold too little of it; conntrack
    // would reassemble them, a tc program cannot. A total length short of a TCP header is a
    // truncated segment (the skb may be longer: Ethernet padding). BIG TCP GSO packets carry a
    // total length of 0, and the load in `tcp_at` still bounds them.
    if ihl < 20
        || u16::from_be(ip.frag_be) & IPV4_MF_OFFSET != 0
        || (total != 0 && total < ihl + TCP_HLEN)
    {
        return Parsed::Opaque { ipv6: false, dst };
    }
    tcp_at(ctx, false, src, dst, ETH_HLEN + ihl)
}

#[inline(always)]
fn rerouted_v6(ctx: &TcContext) -> Parsed {
    let Ok(ip) = ctx.load::<Ipv6Head>(ETH_HLEN) else {
        return Parsed::Broken;
    };
    let opaque = Parsed::Opaque {
        ipv6: true,
        dst: ip.dst,
    };
    let mut next = ip.next_header;
    let mut off = ETH_HLEN + IPV6_HLEN;
    // Set by a Fragment header (the segment may be incomplete) or a Routing header (the fixed
    // header's destination is not the final one, and the TCP checksum covers the final one).
    let mut unrewritable = false;
    for _ in 0..MAX_EXT_HEADERS {
        if next == linux::IPPROTO_TCP as u8 {
            break;
        }
        if !is_ext_header(next) {
            return Parsed::Other;
        }
        // Every extension header is at least 8 bytes; these 4 hold its next header, its length
        // and, for a Fragment header, the offset.
        let Ok(h) = ctx.load::<[u8; 4]>(off) else {
            return opaque;
        };
        let len = match next {
            NEXTHDR_AUTH => (h[1] as usize + 2) * 4,
            NEXTHDR_FRAGMENT => {
                unrewritable = true;
                if u16::from_be_bytes([h[2], h[3]]) & IPV6_FRAG_OFFSET != 0 {
                    // A later fragment: the header it names sits in the first fragment, so
                    // only a final protocol other than TCP is known not to be TCP.
                    return if h[0] == linux::IPPROTO_TCP as u8 || is_ext_header(h[0]) {
                        opaque
                    } else {
                        Parsed::Other
                    };
                }
                8
            }
            NEXTHDR_ROUTING => {
                unrewritable = true;
                (h[1] as usize + 1) * 8
            }
            _ => (h[1] as usize + 1) * 8,
        };
        next = h[0];
        off += len;
    }
    // Still an extension header after the last one followed: a chain too long to finish.
    if next != linux::IPPROTO_TCP as u8 || unrewritable {
        return opaque;
    }
    tcp_at(ctx, true, ip.src, ip.dst, off)
}
