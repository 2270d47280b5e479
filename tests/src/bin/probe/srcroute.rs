//! `probe srcroute KIND ADDR --via HOP [--after]`: a TCP connect to ADDR from a socket that
//! carries a source route through HOP, the way an app would send its SYN around a capture that
//! only looks at connect()'s address. KIND:
//! - `rthdr`: `IPV6_RTHDR` with a type-4 segment routing header (no privilege needed);
//! - `pktoptions`: `IPV6_2292PKTOPTIONS` holding a type-2 routing header control message;
//! - `pktoptions-long`: the same behind a 4,200-byte control message the kernel skips, so the
//!   whole value is longer than a page (a cgroup sockopt program sees only the first page);
//! - `lsrr`: IPv4 `IP_OPTIONS` with a loose source route (needs CAP_NET_RAW).
//!
//! With `--after`, the option is set once the connection is up, and a write follows. Prints
//! {"setsockopt":E,"connect":E,"stage":S} where E is 0 or an errno, and S names the step that
//! ended the attempt ("done" when every step succeeded).

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, RawFd},
    time::Duration,
};

use crate::sock::{check, connect_within, tcp_socket};

/// Linux values (libc lacks the RFC 2292 and routing-header ones).
const IPV6_2292PKTOPTIONS: libc::c_int = 6;
const IPV6_2292RTHDR: libc::c_int = 5;
const IPV6_RTHDR: libc::c_int = 57;
const IPOPT_LSRR: u8 = 0x83;
const IPOPT_NOOP: u8 = 1;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Rthdr,
    PktOptions,
    PktOptionsLong,
    Lsrr,
}

impl Kind {
    pub(super) fn parse(text: &str) -> Self {
        match text {
            "rthdr" => Kind::Rthdr,
            "pktoptions" => Kind::PktOptions,
            "pktoptions-long" => Kind::PktOptionsLong,
            "lsrr" => Kind::Lsrr,
            other => panic!("probe: srcroute KIND is rthdr, pktoptions or lsrr, not {other:?}"),
        }
    }
}

/// A type-4 segment routing header whose first segment is `via`. Segment 0, the last one, is
/// the connection's own destination: the kernel writes it there when it sends.
fn segment_routing_header(via: IpAddr) -> Vec<u8> {
    let IpAddr::V6(via) = via else {
        panic!("probe: a routing header needs an IPv6 hop, not {via}");
    };
    // next header (the kernel fills it), length in 8-octet units past the first 8, type 4,
    // segments left, last entry, flags, tag.
    let mut h = vec![0, 4, 4, 1, 1, 0, 0, 0];
    h.extend_from_slice(&[0; 16]);
    h.extend_from_slice(&via.octets());
    h
}

/// A type-2 routing header (Mobile IPv6's, the only type a control message may carry) through
/// `via`, wrapped in the one control message IPV6_2292PKTOPTIONS takes.
fn pktoptions_routing_header(via: IpAddr) -> Vec<u8> {
    let IpAddr::V6(via) = via else {
        panic!("probe: a routing header needs an IPv6 hop, not {via}");
    };
    let mut rh = vec![0, 2, 2, 1, 0, 0, 0, 0];
    rh.extend_from_slice(&via.octets());
    // struct cmsghdr: size_t cmsg_len, int cmsg_level, int cmsg_type, then the data.
    let header = std::mem::size_of::<libc::cmsghdr>();
    let mut buf = Vec::with_capacity(header + rh.len());
    buf.extend_from_slice(&(header + rh.len()).to_ne_bytes());
    buf.extend_from_slice(&libc::IPPROTO_IPV6.to_ne_bytes());
    buf.extend_from_slice(&IPV6_2292RTHDR.to_ne_bytes());
    buf.extend_from_slice(&rh);
    buf
}

/// A control message of `len` data bytes at level SOL_IP, which IPV6_2292PKTOPTIONS skips.
fn skipped_control_message(len: usize) -> Vec<u8> {
    let header = std::mem::size_of::<libc::cmsghdr>();
    let mut buf = Vec::with_capacity(header + len);
    buf.extend_from_slice(&(header + len).to_ne_bytes());
    buf.extend_from_slice(&libc::IPPROTO_IP.to_ne_bytes());
    buf.extend_from_slice(&0i32.to_ne_bytes());
    buf.resize(header + len, 0);
    buf
}

/// An IPv4 loose source route through `via`, padded to a multiple of four bytes.
fn loose_source_route(via: IpAddr) -> Vec<u8> {
    let IpAddr::V4(via) = via else {
        panic!("probe: a loose source route needs an IPv4 hop, not {via}");
    };
    let mut o = vec![IPOPT_NOOP, IPOPT_LSRR, 7, 4];
    o.extend_from_slice(&via.octets());
    o
}

fn set_route(fd: RawFd, kind: Kind, via: IpAddr) -> std::io::Result<()> {
    let (level, name, value) = match kind {
        Kind::Rthdr => (libc::IPPROTO_IPV6, IPV6_RTHDR, segment_routing_header(via)),
        Kind::PktOptions => (
            libc::IPPROTO_IPV6,
            IPV6_2292PKTOPTIONS,
            pktoptions_routing_header(via),
        ),
        Kind::PktOptionsLong => (
            libc::IPPROTO_IPV6,
            IPV6_2292PKTOPTIONS,
            [
                skipped_control_message(4200),
                pktoptions_routing_header(via),
            ]
            .concat(),
        ),
        Kind::Lsrr => (libc::IPPROTO_IP, libc::IP_OPTIONS, loose_source_route(via)),
    };
    // SAFETY: `value` is valid for reads of its length.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            value.as_ptr().cast(),
            value.len() as libc::socklen_t,
        )
    })
    .map(drop)
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

pub(super) fn srcroute(kind: Kind, addr: SocketAddr, via: IpAddr, after: bool) -> i32 {
    let report = |setsockopt: i32, connect: i32, stage: &str| {
        println!("{{\"setsockopt\":{setsockopt},\"connect\":{connect},\"stage\":\"{stage}\"}}");
        0
    };
    let sock = match tcp_socket(addr, libc::SOCK_NONBLOCK) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("probe: socket: {e}");
            return 1;
        }
    };
    let fd = sock.as_raw_fd();
    let timeout = Duration::from_secs(2);
    if !after {
        if let Err(e) = set_route(fd, kind, via) {
            return report(errno(&e), 0, "setsockopt");
        }
        return match connect_within(fd, addr, timeout) {
            Ok(()) => report(0, 0, "done"),
            Err(e) => report(0, errno(&e), "connect"),
        };
    }
    if let Err(e) = connect_within(fd, addr, timeout) {
        return report(0, errno(&e), "connect");
    }
    if let Err(e) = set_route(fd, kind, via) {
        return report(errno(&e), 0, "setsockopt");
    }
    let data = b"probe-srcroute";
    // SAFETY: `data` is valid for reads of its length.
    let sent = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL) };
    match check(sent as i32) {
        Ok(_) => {
            // Give the segment time to leave before the process, and the socket, go.
            std::thread::sleep(Duration::from_millis(300));
            report(0, 0, "done")
        }
        Err(e) => report(0, errno(&e), "send"),
    }
}
