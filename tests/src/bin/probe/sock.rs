//! Socket plumbing that both the redirection and the bypass subcommands use: libc sockets set up
//! before bind(2), connect(2) or listen(2) (std sets no options that early), and the
//! SO_ORIGINAL_DST query with its JSON form.

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

const SO_ORIGINAL_DST: libc::c_int = 80;

/// SO_ORIGINAL_DST at `level`: Ok(addr) or Err(errno).
pub(super) fn original_dst(sock: &TcpStream, level: libc::c_int) -> Result<SocketAddr, i32> {
    let mut buf = [0u8; 28];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf and len are valid for writes of the given size.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            level,
            SO_ORIGINAL_DST,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(-1));
    }
    let family = u16::from_ne_bytes([buf[0], buf[1]]) as i32;
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    match family {
        libc::AF_INET => Ok(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]),
            port,
        ))),
        libc::AF_INET6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&buf[8..24]);
            let word =
                |at: usize| u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
            // The scope id matters for a link-local destination: a proxy cannot connect to one
            // without it.
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a),
                port,
                word(4),
                word(24),
            )))
        }
        _ => Err(-family),
    }
}

pub(super) fn json_result(r: &Result<SocketAddr, i32>) -> String {
    match r {
        Ok(a) => format!("{{\"addr\":\"{a}\"}}"),
        Err(e) => format!("{{\"errno\":{e}}}"),
    }
}

/// `addr` as a sockaddr_in or sockaddr_in6, with its length.
pub(super) fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than, and aligned for, sockaddr_in.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than, and aligned for, sockaddr_in6.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

pub(super) fn check(rc: libc::c_int) -> std::io::Result<libc::c_int> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A new TCP socket of `addr`'s family.
pub(super) fn tcp_socket(addr: SocketAddr, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    stream_socket_with(addr, flags, 0)
}

/// A stream socket of `protocol` (0 for TCP, or `IPPROTO_MPTCP`) for `addr`'s family.
pub(super) fn stream_socket(addr: SocketAddr, protocol: libc::c_int) -> std::io::Result<OwnedFd> {
    stream_socket_with(addr, 0, protocol)
}

fn stream_socket_with(
    addr: SocketAddr,
    flags: libc::c_int,
    protocol: libc::c_int,
) -> std::io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let ty = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags;
    // SAFETY: plain system call; the descriptor is owned right away.
    let fd = check(unsafe { libc::socket(domain, ty, protocol) })?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(super) fn set_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: `value` is a live c_int and its size is passed.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

pub(super) fn bind(fd: RawFd, addr: SocketAddr) -> std::io::Result<()> {
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a sockaddr of length `len`.
    check(unsafe { libc::bind(fd, (&raw const ss).cast(), len) }).map(drop)
}

/// Connects a socket (bound to `device` with SO_BINDTODEVICE and to `source` first, if given)
/// to `addr` within `timeout`.
pub(super) fn open_connected(
    addr: SocketAddr,
    source: Option<SocketAddr>,
    device: Option<&str>,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    open_connected_as(addr, source, device, Identity::default(), timeout)
}

/// How a connecting socket presents itself beyond its addresses.
#[derive(Clone, Copy, Default)]
pub(super) struct Identity {
    /// SO_MARK (ztunnel marks every socket it opens in a pod).
    pub(super) mark: Option<u32>,
    /// IP_TRANSPARENT / IPV6_TRANSPARENT, to bind a source address the netns does not own.
    pub(super) transparent: bool,
}

/// [`open_connected`] with a mark and/or a transparent socket (both need CAP_NET_ADMIN).
pub(super) fn open_connected_as(
    addr: SocketAddr,
    source: Option<SocketAddr>,
    device: Option<&str>,
    identity: Identity,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let sock = tcp_socket(addr, libc::SOCK_NONBLOCK)?;
    let fd = sock.as_raw_fd();
    if let Some(mark) = identity.mark {
        set_int(fd, libc::SOL_SOCKET, libc::SO_MARK, mark as libc::c_int)?;
    }
    if identity.transparent {
        if addr.is_ipv4() {
            set_int(fd, libc::SOL_IP, libc::IP_TRANSPARENT, 1)?;
        } else {
            set_int(fd, libc::SOL_IPV6, libc::IPV6_TRANSPARENT, 1)?;
        }
    }
    if let Some(dev) = device {
        // SAFETY: `dev` is valid for reads of its length.
        check(unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_BINDTODEVICE,
                dev.as_ptr().cast(),
                dev.len() as libc::socklen_t,
            )
        })?;
    }
    if let Some(source) = source {
        bind(fd, source)?;
    }
    connect_within(fd, addr, timeout)?;
    let stream = TcpStream::from(sock);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Connects `fd` (non-blocking) to `addr` within `timeout`.
pub(super) fn connect_within(
    fd: RawFd,
    addr: SocketAddr,
    timeout: Duration,
) -> std::io::Result<()> {
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a sockaddr of length `len`.
    match check(unsafe { libc::connect(fd, (&raw const ss).cast(), len) }) {
        Ok(_) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd.
    if check(unsafe { libc::poll(&raw mut pfd, 1, ms) })? == 0 {
        return Err(std::io::Error::from_raw_os_error(libc::ETIMEDOUT));
    }
    let mut err: libc::c_int = 0;
    let mut elen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `err` and `elen` are valid for writes of the given size.
    check(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &raw mut elen,
        )
    })?;
    if err != 0 {
        return Err(std::io::Error::from_raw_os_error(err));
    }
    Ok(())
}

/// A listening socket on `addr`; an IPv6 one accepts only IPv6 under `v6only`.
pub(super) fn listen(
    addr: SocketAddr,
    v6only: bool,
    transparent: bool,
) -> std::io::Result<TcpListener> {
    listen_marked(addr, v6only, transparent, None)
}

/// [`listen`], with SO_MARK set before the bind, as ztunnel's in-pod socket factory sets it.
pub(super) fn listen_marked(
    addr: SocketAddr,
    v6only: bool,
    transparent: bool,
    mark: Option<i32>,
) -> std::io::Result<TcpListener> {
    let sock = tcp_socket(addr, 0)?;
    let fd = sock.as_raw_fd();
    if let Some(mark) = mark {
        set_int(fd, libc::SOL_SOCKET, libc::SO_MARK, mark)?;
    }
    set_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    // iptables' TPROXY target drops packets for a listener without IP_TRANSPARENT.
    if transparent {
        set_int(fd, libc::SOL_IP, libc::IP_TRANSPARENT, 1)?;
    }
    if addr.is_ipv6() {
        set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, i32::from(v6only))?;
    }
    bind(fd, addr)?;
    // SAFETY: plain system call on an open socket.
    check(unsafe { libc::listen(fd, 128) })?;
    Ok(TcpListener::from(sock))
}
