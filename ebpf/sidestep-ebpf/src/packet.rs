//! The Ethernet/IP/TCP headers the tc programs read, and the one parser they share. It runs for
//! every packet they see, so each header is read with one load (a `bpf_skb_load_bytes` per field
//! cost eight helper calls a packet) and the ethertype comes from the skb itself.

use aya_ebpf::programs::TcContext;
use sidestep_abi::{linux, v4_mapped};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const IPV6_HLEN: usize = core::mem::size_of::<Ipv6Head>();
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// The fixed IPv4 header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv4Head {
    pub ver_ihl: u8,
    _tos: u8,
    _total_len: u16,
    _id: u16,
    _frag: u16,
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
/// TCP are not followed: such packets are left alone.
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
