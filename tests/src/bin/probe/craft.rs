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

/// `probe frag-syn SRC DST [--wait-ms N]`: sends a SYN from SRC (an address of this netns, a
/// source port from the pid) to DST in two IP fragments (an IPv6 one with a Fragment header),
/// then prints `{"sport","sent","reply"}`, `reply` being what came back from DST within N ms
/// (default 1500): `syn-ack`, `rst`, `none`.
pub(super) fn frag_syn(src: IpAddr, dst: SocketAddr, wait: Duration) -> i32 {
    let pid = std::process::id();
    let sport = 20000 + (pid % 20000) as u16;
    let v6 = dst.is_ipv6();
    let domain = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    let run = || -> std::io::Result<(usize, String)> {
        // Opened first, so no answer can come before it listens.
        let rx = raw_socket(domain, libc::IPPROTO_TCP)?;
        // IPPROTO_RAW implies a header the caller writes (IP_HDRINCL, and the same for IPv6).
        let tx = raw_socket(domain, libc::IPPROTO_RAW)?;
        let (ss, len) = sockaddr(SocketAddr::new(dst.ip(), 0));
        let mut sent = 0;
        for frag in fragments(src, sport, dst, pid) {
            // SAFETY: `frag` and `ss` are live for the call and their lengths are passed.
            check(unsafe {
                libc::sendto(
                    tx.as_raw_fd(),
                    frag.as_ptr().cast(),
                    frag.len(),
                    0,
                    (&raw const ss).cast(),
                    len,
                ) as libc::c_int
            })?;
            sent += 1;
        }
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
