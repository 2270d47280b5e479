//! `probe srcroute KIND ADDR --via HOP [--after]`: a TCP connect to ADDR from a socket that
//! carries a source route through HOP, the way an app would send its SYN around a capture that
//! only looks at connect()'s address. KIND:
//! - `rthdr`: `IPV6_RTHDR` with a type-4 segment routing header (no privilege needed);
//! - `pktoptions`: `IPV6_2292PKTOPTIONS` holding a type-2 routing header control message;
//! - `pktoptions-long`: the same behind a 4,200-byte control message the kernel skips, so the
//!   whole value is longer than a page (a cgroup sockopt program sees only the first page);
//! - `lsrr`: IPv4 `IP_OPTIONS` with a loose source route (needs CAP_NET_RAW);
//! - `lsrr-dns`: no socket option: one UDP datagram (a DNS query when ADDR's port is 53) sent
//!   with sendmsg and an `IP_RETOPTS` control message holding the loose source route, which no
//!   sockopt program sees (needs CAP_NET_RAW).
//!
//! With `--after`, the option is set once the connection is up, and a write follows. With
//! `--compat`, it is set through the i386 `setsockopt` system call (`int 0x80`), for which the
//! kernel runs no cgroup sockopt program; the probe prints {"compat":"ENOSYS"} and stops when
//! the kernel has no 32-bit system calls. With `--wait-file PATH`, the option is set, the probe
//! prints {"armed":true,"setsockopt":E} and waits for PATH to exist before it connects (the
//! test enrols the pod in between). Prints {"setsockopt":E,"connect":E,"stage":S} where E is 0
//! or an errno, and S names the step that ended the attempt ("done" when every step
//! succeeded); for `lsrr-dns` "connect" is sendmsg's errno.

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use crate::sock::{check, connect_within, sockaddr, tcp_socket};

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
    LsrrDns,
}

/// How and when [`srcroute`] sets the route.
pub(super) struct Options {
    /// Once the connection is up, then write.
    pub(super) after: bool,
    /// Through the i386 system call.
    pub(super) compat: bool,
    /// Wait for this file to exist between setting the option and connecting.
    pub(super) wait_file: Option<PathBuf>,
}

impl Kind {
    pub(super) fn parse(text: &str) -> Self {
        match text {
            "rthdr" => Kind::Rthdr,
            "pktoptions" => Kind::PktOptions,
            "pktoptions-long" => Kind::PktOptionsLong,
            "lsrr" => Kind::Lsrr,
            "lsrr-dns" => Kind::LsrrDns,
            other => panic!(
                "probe: srcroute KIND is rthdr, pktoptions, pktoptions-long, lsrr or lsrr-dns, \
                 not {other:?}"
            ),
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

fn set_route(fd: RawFd, kind: Kind, via: IpAddr, compat: bool) -> std::io::Result<()> {
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
        Kind::LsrrDns => unreachable!("lsrr-dns sets no socket option"),
    };
    if compat {
        return compat_setsockopt(fd, level, name, &value);
    }
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

/// i386's `setsockopt` system call number (arch/x86/entry/syscalls/syscall_32.tbl).
#[cfg(target_arch = "x86_64")]
const SYS32_SETSOCKOPT: u32 = 366;

/// setsockopt through `int 0x80`, the way a 32-bit process (or any process that wants to)
/// makes it: the kernel then takes it for a compat call and runs no cgroup sockopt program.
/// The value must lie below 4 GiB, where a 32-bit pointer reaches.
#[cfg(target_arch = "x86_64")]
fn compat_setsockopt(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &[u8],
) -> std::io::Result<()> {
    const PAGE: usize = 4096;
    assert!(value.len() <= PAGE, "probe: a compat value fits one page");
    // SAFETY: a fresh anonymous mapping; nothing else refers to it.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_32BIT,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the mapping is PAGE bytes, writable, and `value` is at most that long.
    unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), page.cast::<u8>(), value.len()) };
    let ret: i32;
    // SAFETY: the i386 system call ABI: number in eax, arguments in ebx, ecx, edx, esi, edi; the
    // result in eax. rbx is LLVM's, so the descriptor is swapped in and out around the call.
    // The entry clears r8-r11, declared clobbered. The value's mapping is live during the call.
    unsafe {
        std::arch::asm!(
            "xchg {fd:r}, rbx",
            "int 0x80",
            "xchg {fd:r}, rbx",
            fd = inout(reg) fd as u64 => _,
            inout("eax") SYS32_SETSOCKOPT => ret,
            in("ecx") level,
            in("edx") name,
            in("esi") page as usize as u32,
            in("edi") value.len() as u32,
            out("r8") _,
            out("r9") _,
            out("r10") _,
            out("r11") _,
        );
        libc::munmap(page, PAGE);
    }
    if ret < 0 {
        Err(std::io::Error::from_raw_os_error(-ret))
    } else {
        Ok(())
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn compat_setsockopt(
    _fd: RawFd,
    _level: libc::c_int,
    _name: libc::c_int,
    _value: &[u8],
) -> std::io::Result<()> {
    Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
}

/// Waits for `path` to exist (the test's go-ahead), for at most a minute.
fn wait_for_file(path: &std::path::Path) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// One UDP datagram to `addr` with a loose source route through `via` in sendmsg's control
/// data (`IP_RETOPTS`, the only way to give a single datagram IPv4 options).
fn sendmsg_with_route(addr: SocketAddr, via: IpAddr) -> i32 {
    let report = |sent: i32, stage: &str| {
        println!("{{\"setsockopt\":0,\"connect\":{sent},\"stage\":\"{stage}\"}}");
        0
    };
    // SAFETY: plain system call; the descriptor is owned right away.
    let fd = match check(unsafe {
        libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)
    }) {
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
        Err(e) => {
            eprintln!("probe: socket: {e}");
            return 1;
        }
    };
    let options = loose_source_route(via);
    let header = std::mem::size_of::<libc::cmsghdr>();
    // cmsghdr, then the options, padded as CMSG_SPACE wants (u64 words keep it aligned).
    let space = (header + options.len()).div_ceil(8) * 8;
    let mut control = vec![0u64; space / 8];
    {
        // SAFETY: `control` is `space` bytes, 8-aligned: room for the header and the options.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(control.as_mut_ptr().cast::<u8>(), space) };
        bytes[..8].copy_from_slice(&(header + options.len()).to_ne_bytes());
        bytes[8..12].copy_from_slice(&libc::IPPROTO_IP.to_ne_bytes());
        bytes[12..16].copy_from_slice(&libc::IP_RETOPTS.to_ne_bytes());
        bytes[header..header + options.len()].copy_from_slice(&options);
    }
    // A DNS query for example.com, type A.
    let query: &[u8] =
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01";
    let (mut ss, len) = sockaddr(addr);
    let mut iov = libc::iovec {
        iov_base: query.as_ptr().cast_mut().cast(),
        iov_len: query.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is empty.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&raw mut ss).cast();
    msg.msg_namelen = len;
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: every pointer in `msg` refers to a live buffer of the length it gives.
    match check(unsafe { libc::sendmsg(fd.as_raw_fd(), &raw const msg, 0) } as i32) {
        Ok(_) => {
            std::thread::sleep(Duration::from_millis(300));
            report(0, "done")
        }
        Err(e) => report(errno(&e), "sendmsg"),
    }
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

pub(super) fn srcroute(kind: Kind, addr: SocketAddr, via: IpAddr, opts: Options) -> i32 {
    if kind == Kind::LsrrDns {
        return sendmsg_with_route(addr, via);
    }
    let Options {
        after,
        compat,
        wait_file,
    } = opts;
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
        let set = set_route(fd, kind, via, compat);
        if compat && matches!(&set, Err(e) if e.raw_os_error() == Some(libc::ENOSYS)) {
            println!("{{\"compat\":\"ENOSYS\"}}");
            return 0;
        }
        if let Err(e) = set {
            return report(errno(&e), 0, "setsockopt");
        }
        if let Some(path) = wait_file {
            println!("{{\"armed\":true,\"setsockopt\":0}}");
            if !wait_for_file(&path) {
                eprintln!("probe: {} never appeared", path.display());
                return 1;
            }
        }
        return match connect_within(fd, addr, timeout) {
            Ok(()) => report(0, 0, "done"),
            Err(e) => report(0, errno(&e), "connect"),
        };
    }
    if let Err(e) = connect_within(fd, addr, timeout) {
        return report(0, errno(&e), "connect");
    }
    if let Err(e) = set_route(fd, kind, via, compat) {
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
