//! Packets an ordinary client does not send, for the re-route tests (tests/tests/reroute.rs): a
//! TCP connection whose segments carry an IPv6 extension header, and a SYN split into IP
//! fragments, sent from a raw socket, whose answer (if any) is read back from another.
//! Both need CAP_NET_RAW; the VM side of the tests runs as root.

use std::{
    net::{IpAddr, SocketAddr, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::{Duration, Instant},
};

use crate::sock::{check, connect_within, sockaddr, tcp_socket};

/// An IPv6 extension header the kernel can add to every segment of a socket (RFC 3542's sticky
/// options).
#[derive(Clone, Copy)]
pub(super) enum ExtHeader {
    HopByHop,
    DestOpts,
}

/// `{"error","errno"}`, as `probe connect` prints a failed connect.
fn print_error(e: &std::io::Error) {
    println!(
        "{{\"error\":\"{e}\",\"errno\":{}}}",
        e.raw_os_error().unwrap_or(-1)
    );
}

/// Sets `ext` on an IPv6 socket: one 8-byte header holding a PadN option, which every receiver
/// accepts and skips (the kernel writes the next-header byte).
fn set_ext_header(fd: RawFd, ext: ExtHeader) -> std::io::Result<()> {
    let name = match ext {
        ExtHeader::HopByHop => libc::IPV6_HOPOPTS,
        ExtHeader::DestOpts => libc::IPV6_DSTOPTS,
    };
    // next header, length in 8-byte units beyond the first, PadN (type 1) of 4 bytes.
    let header: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
    // SAFETY: `header` is live for the call and its length is passed.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_IPV6,
            name,
            header.as_ptr().cast(),
            header.len() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `probe connect-ext ADDR --hopopts|--dstopts`: `probe connect` (without `--http`) from an IPv6
/// socket whose every segment, the SYN first, carries `ext`.
pub(super) fn connect_ext(addr: SocketAddr, ext: ExtHeader, timeout: Duration) -> i32 {
    let attempt = || -> std::io::Result<TcpStream> {
        let sock = tcp_socket(addr, libc::SOCK_NONBLOCK)?;
        set_ext_header(sock.as_raw_fd(), ext)?;
        connect_within(sock.as_raw_fd(), addr, timeout)?;
        Ok(TcpStream::from(sock))
    };
    match attempt() {
        Ok(s) => {
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            let local = s.local_addr().map(|a| a.to_string()).unwrap_or_default();
            println!("{{\"peer\":\"{peer}\",\"local\":\"{local}\",\"status\":\"\"}}");
            0
        }
        Err(e) => {
            print_error(&e);
            1
        }
    }
}

/// The Internet checksum of `parts`, concatenated (each part but the last of even length).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        for pair in part.chunks(2) {
            let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
            sum += u32::from(word);
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A TCP SYN from `src` to `dst` with the options a kernel sends (MSS, SACK permitted, window
/// scale): 32 bytes, checksummed.
fn tcp_syn(src: IpAddr, src_port: u16, dst: SocketAddr) -> [u8; 32] {
    let mut tcp = [0u8; 32];
    tcp[0..2].copy_from_slice(&src_port.to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&0x5eed_0001u32.to_be_bytes());
    tcp[12] = 8 << 4;
    tcp[13] = 0x02;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    // MSS 1460; NOP, NOP, SACK permitted; NOP, window scale 7.
    tcp[20..32].copy_from_slice(&[2, 4, 0x05, 0xb4, 1, 1, 4, 2, 1, 3, 3, 7]);
    let len = tcp.len() as u8;
    let pseudo: Vec<u8> = match (src, dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => [&s.octets()[..], &d.octets(), &[0, 6, 0, len]].concat(),
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            [&s.octets()[..], &d.octets(), &[0, 0, 0, len, 0, 0, 0, 6]].concat()
        }
        _ => panic!("probe: {src} and {dst} are of different families"),
    };
    let sum = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    tcp
}

/// The SYN's two fragments. An IPv4 first fragment carries the TCP header's first 8 bytes only
/// (ports and sequence number: less than any parser needs), the second the rest. An IPv6 one
/// carries the fixed 20-byte header and 4 option bytes behind its Fragment header: Linux
/// (RFC 7112) discards a first fragment without the whole upper-layer header, reassembling or
/// not, so a shorter one would reach nobody under either ruleset.
fn fragments(src: IpAddr, src_port: u16, dst: SocketAddr, id: u32) -> [Vec<u8>; 2] {
    let tcp = tcp_syn(src, src_port, dst);
    match (src, dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let (head, tail) = tcp.split_at(8);
            let ip = |frag: u16, payload: &[u8]| {
                let mut h = vec![0x45, 0];
                h.extend_from_slice(&(20 + payload.len() as u16).to_be_bytes());
                h.extend_from_slice(&(id as u16).to_be_bytes());
                h.extend_from_slice(&frag.to_be_bytes());
                h.extend_from_slice(&[64, 6, 0, 0]);
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                let sum = checksum(&[&h]);
                h[10..12].copy_from_slice(&sum.to_be_bytes());
                h.extend_from_slice(payload);
                h
            };
            // More Fragments on the first; the second's offset is in 8-byte units.
            [ip(0x2000, head), ip(1, tail)]
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let (head, tail) = tcp.split_at(24);
            let ip = |frag: u16, payload: &[u8]| {
                let mut h = vec![0x60, 0, 0, 0];
                h.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
                h.extend_from_slice(&[44, 64]);
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                h.extend_from_slice(&[6, 0]);
                h.extend_from_slice(&frag.to_be_bytes());
                h.extend_from_slice(&id.to_be_bytes());
                h.extend_from_slice(payload);
                h
            };
            // The M flag on the first; the offset (8-byte units) in the upper 13 bits.
            [ip(1, head), ip(3 << 3, tail)]
        }
        _ => panic!("probe: {src} and {dst} are of different families"),
    }
}

fn raw_socket(domain: libc::c_int, protocol: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: plain system call; the descriptor is owned right away.
    let fd = check(unsafe { libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) })?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Waits up to `wait` for a TCP segment from `from` to `to_port` on `rx` (a raw TCP socket) and
/// names it: `syn-ack`, `rst`, or `flags 0x..`; `none` when nothing came.
fn await_reply(rx: &OwnedFd, from: SocketAddr, to_port: u16, wait: Duration) -> String {
    let deadline = Instant::now() + wait;
    let mut buf = [0u8; 1500];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return "none".into();
        }
        let mut pfd = libc::pollfd {
            fd: rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&raw mut pfd, 1, left.as_millis().max(1) as libc::c_int) } <= 0 {
            continue;
        }
        // SAFETY: `ss` and `len` are valid for writes; `buf` for `buf.len()` bytes.
        let (n, ss) = unsafe {
            let mut ss: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            let n = libc::recvfrom(
                rx.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
                (&raw mut ss).cast(),
                &raw mut len,
            );
            (n, ss)
        };
        let Ok(n) = usize::try_from(n) else { continue };
        let pkt = &buf[..n];
        // An IPv4 raw socket gets the IP header too; an IPv6 one gets the TCP segment only, and
        // the source address from recvfrom.
        let (src_ip, tcp): (IpAddr, &[u8]) = match from {
            SocketAddr::V4(_) => {
                let ihl = usize::from(pkt.first().copied().unwrap_or(0) & 0x0f) * 4;
                if pkt.len() < ihl + 20 || ihl < 20 {
                    continue;
                }
                let s: [u8; 4] = pkt[12..16].try_into().expect("4 bytes");
                (IpAddr::from(s), &pkt[ihl..])
            }
            SocketAddr::V6(_) => {
                if pkt.len() < 20 {
                    continue;
                }
                // SAFETY: recvfrom on an AF_INET6 socket wrote a sockaddr_in6.
                let sin6: libc::sockaddr_in6 = unsafe { std::ptr::read((&raw const ss).cast()) };
                (IpAddr::from(sin6.sin6_addr.s6_addr), pkt)
            }
        };
        let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
        let dport = u16::from_be_bytes([tcp[2], tcp[3]]);
        if src_ip != from.ip() || sport != from.port() || dport != to_port {
            continue;
        }
        return match tcp[13] & 0x17 {
            0x12 => "syn-ack".into(),
            f if f & 0x04 != 0 => "rst".into(),
            f => format!("flags {f:#04x}"),
        };
    }
}

/// sendto(2) of `bytes` on `fd` to `addr`, a socket address of `len` bytes.
fn send_to<A>(fd: &OwnedFd, bytes: &[u8], addr: &A, len: libc::socklen_t) -> std::io::Result<()> {
    // SAFETY: `bytes` and `addr` are live for the call, and the caller passes `addr`'s length.
    check(unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            0,
            std::ptr::from_ref(addr).cast(),
            len,
        ) as libc::c_int
    })
    .map(drop)
}

/// A source port for a crafted SYN: from the pid, so that concurrent probes differ.
fn crafted_sport() -> u16 {
    20000 + (std::process::id() % 20000) as u16
}

/// Opens the reply socket, runs `send` (which returns how many packets it sent), waits for what
/// comes back from `dst` to `sport`, and prints `{"sport","sent","reply"}` (or the error).
fn exchange(
    dst: SocketAddr,
    sport: u16,
    wait: Duration,
    send: impl FnOnce() -> std::io::Result<usize>,
) -> i32 {
    let domain = if dst.is_ipv6() {
        libc::AF_INET6
    } else {
        libc::AF_INET
    };
    let run = || -> std::io::Result<(usize, String)> {
        // Opened first, so no answer can come before it listens.
        let rx = raw_socket(domain, libc::IPPROTO_TCP)?;
        let sent = send()?;
        Ok((sent, await_reply(&rx, dst, sport, wait)))
    };
    match run() {
        Ok((sent, reply)) => {
            println!("{{\"sport\":{sport},\"sent\":{sent},\"reply\":\"{reply}\"}}");
            0
        }
        Err(e) => {
            print_error(&e);
            1
        }
    }
}

/// `probe frag-syn SRC DST [--wait-ms N]`: sends a SYN from SRC (an address of this netns, a
/// source port from the pid) to DST in two IP fragments (an IPv6 one with a Fragment header),
/// then prints `{"sport","sent","reply"}`, `reply` being what came back from DST within N ms
/// (default 1500): `syn-ack`, `rst`, `none`.
pub(super) fn frag_syn(src: IpAddr, dst: SocketAddr, wait: Duration) -> i32 {
    let sport = crafted_sport();
    exchange(dst, sport, wait, || {
        let domain = if dst.is_ipv6() {
            libc::AF_INET6
        } else {
            libc::AF_INET
        };
        // IPPROTO_RAW implies a header the caller writes (IP_HDRINCL, and the same for IPv6).
        let tx = raw_socket(domain, libc::IPPROTO_RAW)?;
        let (ss, len) = sockaddr(SocketAddr::new(dst.ip(), 0));
        let mut sent = 0;
        for frag in fragments(src, sport, dst, std::process::id()) {
            send_to(&tx, &frag, &ss, len)?;
            sent += 1;
        }
        Ok(sent)
    })
}

/// `probe spoof-syn SRC DST`: one plain SYN from SRC, which need not be an address of this
/// netns (a forged source; needs CAP_NET_RAW), to DST. Prints `{"sport","sent"}`: no reply can
/// come back to a forged source.
pub(super) fn spoof_syn(src: IpAddr, dst: SocketAddr) -> i32 {
    let sport = crafted_sport();
    let domain = if dst.is_ipv6() {
        libc::AF_INET6
    } else {
        libc::AF_INET
    };
    let send = || -> std::io::Result<()> {
        // IPPROTO_RAW: the packet carries its own IP header, forged source included.
        let tx = raw_socket(domain, libc::IPPROTO_RAW)?;
        let (ss, len) = sockaddr(SocketAddr::new(dst.ip(), 0));
        send_to(
            &tx,
            &ip_packet(src, dst.ip(), &tcp_syn(src, sport, dst)),
            &ss,
            len,
        )
    };
    match send() {
        Ok(()) => {
            println!("{{\"sport\":{sport},\"sent\":1}}");
            0
        }
        Err(e) => {
            print_error(&e);
            1
        }
    }
}

/// A whole, unfragmented IP packet holding `tcp` from `src` to `dst`.
fn ip_packet(src: IpAddr, dst: IpAddr, tcp: &[u8]) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut h = vec![0x45, 0];
            h.extend_from_slice(&(20 + tcp.len() as u16).to_be_bytes());
            h.extend_from_slice(&[0, 0, 0x40, 0, 64, 6, 0, 0]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let sum = checksum(&[&h]);
            h[10..12].copy_from_slice(&sum.to_be_bytes());
            h.extend_from_slice(tcp);
            h
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut h = vec![0x60, 0, 0, 0];
            h.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
            h.extend_from_slice(&[6, 64]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            h.extend_from_slice(tcp);
            h
        }
        _ => panic!("probe: {src} and {dst} are of different families"),
    }
}

const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

/// An Ethernet frame from `src_mac` to `dst_mac` holding `packet` behind `tags` VLAN tags, each
/// VLAN 0 (priority-tagged, priority 0): 802.1Q tags, the outermost an 802.1ad (QinQ service)
/// tag with `outer_ad`.
fn tagged_frame(
    (dst_mac, src_mac): ([u8; 6], [u8; 6]),
    tags: usize,
    outer_ad: bool,
    ipv6: bool,
    packet: &[u8],
) -> Vec<u8> {
    let mut f = [&dst_mac[..], &src_mac].concat();
    for i in 0..tags {
        let tpid = if i == 0 && outer_ad {
            ETH_P_8021AD
        } else {
            ETH_P_8021Q
        };
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&[0, 0]);
    }
    let ethertype: u16 = if ipv6 { 0x86dd } else { 0x0800 };
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(packet);
    f
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .trim()
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .ok()?;
    bytes.try_into().ok()
}

/// `iface`'s MAC, asked of this netns's kernel (sysfs may be another netns's, as it is after a
/// bare setns).
fn hardware_address(iface: &str) -> std::io::Result<[u8; 6]> {
    // SAFETY: plain system call; the descriptor is owned right away.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid ifreq.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = iface.as_bytes();
    if name.len() >= ifr.ifr_name.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "IFACE: name too long",
        ));
    }
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `ifr` is a live ifreq naming the interface; the kernel writes its hardware address.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR, &raw mut ifr) })?;
    // SAFETY: SIOCGIFHWADDR filled the union's hardware-address member.
    let data = unsafe { ifr.ifr_ifru.ifru_hwaddr.sa_data };
    let mut mac = [0u8; 6];
    for (m, d) in mac.iter_mut().zip(data) {
        *m = d as u8;
    }
    Ok(mac)
}

/// How `vlan-syn` builds its frame: VLAN tags, the outer tag's kind, the source port.
pub(super) struct FrameShape {
    pub tags: usize,
    pub outer_ad: bool,
    pub sport: Option<u16>,
}

/// `probe vlan-syn IFACE DST-MAC SRC DST [--tags N] [--outer-ad] [--sport P] [--wait-ms N]`:
/// sends a SYN from SRC (port P, by default one from the pid) to DST as one Ethernet frame out of
/// IFACE (a packet socket) to DST-MAC, behind N 802.1Q tags of VLAN 0 (default 2; with
/// --outer-ad the outermost is an 802.1ad tag; 0 sends a plain frame). The kernel strips the
/// first tag before tc runs and the others after it, then delivers the packet as untagged IP: a
/// tc program that reads the frame as the wire has it sees a VLAN header where the IP packet the
/// stack gets is. Prints what `frag-syn` prints.
pub(super) fn vlan_syn(
    iface: &str,
    dst_mac: &str,
    src: IpAddr,
    dst: SocketAddr,
    shape: FrameShape,
    wait: Duration,
) -> i32 {
    let FrameShape {
        tags,
        outer_ad,
        sport,
    } = shape;
    let sport = sport.unwrap_or_else(crafted_sport);
    exchange(dst, sport, wait, || {
        let invalid =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_owned());
        let dst_mac =
            parse_mac(dst_mac).ok_or_else(|| invalid("DST-MAC: want aa:bb:cc:dd:ee:ff"))?;
        let src_mac = hardware_address(iface)?;
        let ifindex = nix::net::if_::if_nametoindex(iface).map_err(std::io::Error::from)?;
        let packet = ip_packet(src, dst.ip(), &tcp_syn(src, sport, dst));
        let macs = (dst_mac, src_mac);
        let frame = tagged_frame(macs, tags, outer_ad, dst.is_ipv6(), &packet);
        // Protocol 0: this socket only sends.
        let tx = raw_socket(libc::AF_PACKET, 0)?;
        // SAFETY: all-zero is a valid sockaddr_ll; the fields that matter are set below.
        let mut ll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        ll.sll_family = libc::AF_PACKET as u16;
        ll.sll_ifindex = ifindex as i32;
        ll.sll_halen = 6;
        ll.sll_addr[..6].copy_from_slice(&dst_mac);
        let len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        send_to(&tx, &frame, &ll, len)?;
        Ok(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_double_tagged_frame_is_laid_out_as_the_wire_has_it() {
        let (s, d): (IpAddr, SocketAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2:80".parse().unwrap());
        let packet = ip_packet(s, d.ip(), &tcp_syn(s, 1234, d));
        assert_eq!(packet.len(), 52);
        assert_eq!(checksum(&[&packet[..20]]), 0, "IPv4 header checksum");
        let f = tagged_frame(([2; 6], [4; 6]), 2, false, false, &packet);
        assert_eq!(&f[12..22], &[0x81, 0, 0, 0, 0x81, 0, 0, 0, 0x08, 0]);
        assert_eq!(&f[22..], &packet[..]);
        let qinq = tagged_frame(([2; 6], [4; 6]), 2, true, false, &packet);
        assert_eq!(&qinq[12..22], &[0x88, 0xa8, 0, 0, 0x81, 0, 0, 0, 0x08, 0]);
        assert_eq!(
            parse_mac("0a:58:c0:a8:4d:01\n"),
            Some([10, 0x58, 0xc0, 0xa8, 0x4d, 1])
        );
        assert_eq!(parse_mac("0a:58"), None);
    }
}
