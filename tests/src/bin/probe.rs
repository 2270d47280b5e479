//! A small test client and Envoy-like original-destination proxy. It prints what the socket API
//! reports (peer, local address, SO_ORIGINAL_DST) as JSON lines, so tests assert exact values.
//!
//! ```text
//! probe connect ADDR [--http] [--bind ADDR] [--timeout-ms N]
//!     connect (from a socket bound to --bind first, if given; within N ms, default 5000) and
//!     print {"peer","local","status"}, or {"error","errno"} when the connect fails
//! probe udp-serve ADDR               answer every datagram with "reply to <sender>"
//! probe udp-query ADDR [--connect]   send one datagram, print {"from","reply"}
//! probe proxy ADDR[,ADDR...] REPORT [--no-forward] [--v6only]
//!     listen on every ADDR (IPv6 ones with IPV6_V6ONLY under --v6only) and accept forever; per
//!     connection append {"listener","peer","local","orig_v4","orig_v6"} to REPORT (`-` for
//!     stdout) and (unless --no-forward) relay to the original destination, asking SOL_IP then
//!     SOL_IPV6 as Envoy does
//! probe tfo ADDR [--data TEXT]       TCP Fast Open: sendto(MSG_FASTOPEN) on a fresh socket, print
//!                                    {"sent","peer","local","reply"}
//! probe connect-sock ADDR [--bind ADDR] [--reuseaddr] [--mark N] [--fill-optmem] [--read]
//!       [--linger0] [--timeout-ms N]
//!     connect a socket prepared first (--fill-optmem: TCP-MD5 keys until net.core.optmem_max is
//!     used up); print {"peer","local","reply","md5_keys"} or {"error","errno","stage"}
//! probe raw                          try raw IPv4/IPv6 and AF_PACKET sockets, print the errnos
//! probe hold ADDR                    keep accepted connections open (echo), print accepts and closes
//! probe origdst-echo ADDR[,ADDR...]  answer each connection with its SO_ORIGINAL_DST, then close
//! probe connect-many ADDR N [--threads T] [--ports P] [--deadline-ms D]
//!     N short connections to ADDR's port + i % P, each checked against an origdst-echo answer
//! ```

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

const SO_ORIGINAL_DST: libc::c_int = 80;

/// SO_ORIGINAL_DST at `level`: Ok(addr) or Err(errno).
fn original_dst(sock: &TcpStream, level: libc::c_int) -> Result<SocketAddr, i32> {
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
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a),
                port,
                0,
                0,
            )))
        }
        _ => Err(-family),
    }
}

fn json_result(r: &Result<SocketAddr, i32>) -> String {
    match r {
        Ok(a) => format!("{{\"addr\":\"{a}\"}}"),
        Err(e) => format!("{{\"errno\":{e}}}"),
    }
}

/// `addr` as a sockaddr_in or sockaddr_in6, with its length.
fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
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

fn check(rc: libc::c_int) -> std::io::Result<libc::c_int> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A new TCP socket of `addr`'s family.
fn tcp_socket(addr: SocketAddr, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain system call; the descriptor is owned right away.
    let fd =
        check(unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags, 0) })?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn set_int(
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

fn bind(fd: RawFd, addr: SocketAddr) -> std::io::Result<()> {
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a sockaddr of length `len`.
    check(unsafe { libc::bind(fd, (&raw const ss).cast(), len) }).map(drop)
}

/// Connects a socket (bound to `source` first, if given) to `addr` within `timeout`.
fn open_connected(
    addr: SocketAddr,
    source: Option<SocketAddr>,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let sock = tcp_socket(addr, libc::SOCK_NONBLOCK)?;
    let fd = sock.as_raw_fd();
    if let Some(source) = source {
        bind(fd, source)?;
    }
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a sockaddr of length `len`.
    if let Err(e) = check(unsafe { libc::connect(fd, (&raw const ss).cast(), len) }) {
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
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
    }
    let stream = TcpStream::from(sock);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

fn connect(addr: SocketAddr, http: bool, source: Option<SocketAddr>, timeout: Duration) -> i32 {
    let sock = match open_connected(addr, source, timeout) {
        Ok(s) => s,
        Err(e) => {
            println!(
                "{{\"error\":\"{e}\",\"errno\":{}}}",
                e.raw_os_error().unwrap_or(-1)
            );
            return 1;
        }
    };
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let local = sock.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut status = String::new();
    if http {
        let _ = sock.set_read_timeout(Some(Duration::from_secs(5)));
        let mut s = &sock;
        let _ = s.write_all(b"GET / HTTP/1.0\r\nHost: probe\r\n\r\n");
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        status = body.lines().next().unwrap_or("").to_string();
    }
    println!("{{\"peer\":\"{peer}\",\"local\":\"{local}\",\"status\":\"{status}\"}}");
    0
}

fn relay(client: TcpStream, upstream: SocketAddr) {
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) else {
        return;
    };
    let (mut c2, mut s2) = match (client.try_clone(), server.try_clone()) {
        (Ok(c), Ok(s)) => (c, s),
        _ => return,
    };
    let up = std::thread::spawn(move || {
        let mut c = &client;
        let _ = std::io::copy(&mut c, &mut s2);
        let _ = s2.shutdown(std::net::Shutdown::Write);
    });
    let mut s = &server;
    let _ = std::io::copy(&mut s, &mut c2);
    let _ = c2.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}

/// A listening socket on `addr`; an IPv6 one accepts only IPv6 under `v6only`.
fn listen(addr: SocketAddr, v6only: bool, transparent: bool) -> std::io::Result<TcpListener> {
    let sock = tcp_socket(addr, 0)?;
    let fd = sock.as_raw_fd();
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

fn serve(listener: TcpListener, name: String, report: String, forward: bool) {
    for conn in listener.incoming().flatten() {
        let v4 = original_dst(&conn, libc::SOL_IP);
        let v6 = original_dst(&conn, libc::SOL_IPV6);
        let line = format!(
            "{{\"listener\":\"{name}\",\"peer\":\"{}\",\"local\":\"{}\",\"orig_v4\":{},\"orig_v6\":{}}}\n",
            conn.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
            conn.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            json_result(&v4),
            json_result(&v6)
        );
        if report == "-" {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(line.as_bytes());
            let _ = out.flush();
        } else if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&report)
        {
            let _ = f.write_all(line.as_bytes());
        }
        match (forward, v4.or(v6)) {
            (true, Ok(upstream)) => {
                std::thread::spawn(move || relay(conn, upstream));
            }
            _ => {
                let mut c = &conn;
                let _ = c.write_all(b"probe\n");
            }
        }
    }
}

fn proxy(
    addrs: &[SocketAddr],
    report: &str,
    forward: bool,
    v6only: bool,
    transparent: bool,
) -> i32 {
    let mut listeners = Vec::new();
    for addr in addrs {
        match listen(*addr, v6only, transparent) {
            Ok(l) => listeners.push((l, addr.to_string())),
            Err(e) => {
                eprintln!("probe: bind {addr}: {e}");
                return 1;
            }
        }
    }
    let threads: Vec<_> = listeners
        .into_iter()
        .map(|(l, name)| {
            let report = report.to_string();
            std::thread::spawn(move || serve(l, name, report, forward))
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    0
}

fn udp_serve(addr: SocketAddr) -> i32 {
    let Ok(sock) = std::net::UdpSocket::bind(addr) else {
        eprintln!("probe: bind {addr}");
        return 1;
    };
    let mut buf = [0u8; 512];
    while let Ok((_, from)) = sock.recv_from(&mut buf) {
        let _ = sock.send_to(format!("reply to {from}").as_bytes(), from);
    }
    0
}

fn udp_query(addr: SocketAddr, connect: bool) -> i32 {
    let bind: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .expect("literal");
    let Ok(sock) = std::net::UdpSocket::bind(bind) else {
        return 1;
    };
    let _ = sock.set_read_timeout(Some(Duration::from_secs(3)));
    let sent = if connect {
        sock.connect(addr).and_then(|()| sock.send(b"query"))
    } else {
        sock.send_to(b"query", addr)
    };
    if let Err(e) = sent {
        println!("{{\"error\":\"{e}\"}}");
        return 1;
    }
    let mut buf = [0u8; 512];
    match sock.recv_from(&mut buf) {
        Ok((n, from)) => {
            let reply = String::from_utf8_lossy(&buf[..n]);
            println!("{{\"from\":\"{from}\",\"reply\":\"{reply}\"}}");
            0
        }
        Err(e) => {
            println!("{{\"error\":\"{e}\"}}");
            1
        }
    }
}

// ---- Subcommands for the reliability and bypass tests (tests/tests/bypass.rs, churn.rs) ----

/// `{"error","errno","stage"}` for a failed step.
fn print_error(stage: &str, e: &std::io::Error) {
    println!(
        "{{\"error\":\"{e}\",\"errno\":{},\"stage\":\"{stage}\"}}",
        e.raw_os_error().unwrap_or(-1)
    );
}

/// Reads until EOF or `timeout`, whichever comes first.
fn read_reply(sock: &TcpStream, timeout: Duration) -> String {
    let _ = sock.set_read_timeout(Some(timeout));
    let mut s = sock;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim_end().to_string()
}

/// Closes with RST (SO_LINGER 0), so neither side keeps a TIME_WAIT socket.
fn set_linger0(fd: RawFd) -> std::io::Result<()> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `l` is a live linger struct and its size is passed.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const l).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// JSON string escaping for the few free-text fields.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `probe tfo ADDR [--data TEXT]`: TCP Fast Open on a fresh socket, i.e. sendto(2) with
/// MSG_FASTOPEN and the destination, no connect(2). Prints {"sent","peer","peer_after_sendto",
/// "local","reply"} (`peer` once the reply has been read).
fn tfo(addr: SocketAddr, data: &str) -> i32 {
    let sock = match tcp_socket(addr, 0) {
        Ok(s) => s,
        Err(e) => {
            print_error("socket", &e);
            return 1;
        }
    };
    let (ss, len) = sockaddr(addr);
    // SAFETY: `data` is valid for reads of its length; `ss` holds a sockaddr of length `len`.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_FASTOPEN,
            (&raw const ss).cast(),
            len,
        )
    };
    if sent < 0 {
        print_error("sendto", &std::io::Error::last_os_error());
        return 1;
    }
    let stream = TcpStream::from(sock);
    // Right after sendto the handshake may still be under way (getpeername: ENOTCONN).
    let early_peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .map_err(|e| e.raw_os_error());
    let local = stream
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let reply = read_reply(&stream, Duration::from_secs(5));
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let early = match early_peer {
        Ok(a) => format!("{{\"addr\":\"{a}\"}}"),
        Err(e) => format!("{{\"errno\":{}}}", e.unwrap_or(-1)),
    };
    println!(
        "{{\"sent\":{sent},\"peer\":\"{peer}\",\"peer_after_sendto\":{early},\"local\":\"{local}\",\"reply\":{}}}",
        json_str(&reply)
    );
    0
}

/// `struct tcp_md5sig` of <linux/tcp.h> (the libc crate does not have it).
#[repr(C)]
struct TcpMd5Sig {
    addr: libc::sockaddr_storage,
    flags: u8,
    prefixlen: u8,
    keylen: u16,
    ifindex: libc::c_int,
    key: [u8; 80],
}

/// Adds TCP-MD5 keys for peers in 198.18.0.0/15 until the socket's option memory
/// (net.core.optmem_max) is exhausted. Returns how many keys fit.
fn fill_optmem(fd: RawFd, family: libc::c_int) -> usize {
    let mut n = 0usize;
    while n < 1_000_000 {
        // SAFETY: TcpMd5Sig is plain data; all zero is a valid value.
        let mut key: TcpMd5Sig = unsafe { std::mem::zeroed() };
        let peer = Ipv4Addr::from(0xc612_0000u32 + n as u32);
        let target = if family == libc::AF_INET6 {
            SocketAddr::new(peer.to_ipv6_mapped().into(), 0)
        } else {
            SocketAddr::new(peer.into(), 0)
        };
        let (ss, _) = sockaddr(target);
        key.addr = ss;
        key.keylen = 80;
        // SAFETY: `key` is a live struct tcp_md5sig and its size is passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_MD5SIG,
                (&raw const key).cast(),
                std::mem::size_of::<TcpMd5Sig>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            break;
        }
        n += 1;
    }
    n
}

/// How `probe connect-sock` prepares its socket.
struct SockOptions {
    bind: Option<SocketAddr>,
    reuseaddr: bool,
    mark: Option<u32>,
    fill_optmem: bool,
    read: bool,
    linger0: bool,
    timeout: Duration,
}

/// `probe connect-sock ADDR [--bind ADDR] [--reuseaddr] [--mark N] [--fill-optmem] [--read]
/// [--linger0] [--timeout-ms N]`: a blocking connect on a socket prepared first (SO_REUSEADDR,
/// SO_MARK, SO_LINGER 0, bound, option memory filled with TCP-MD5 keys); with --read it waits for
/// the peer's reply and EOF. Prints {"peer","local","reply","md5_keys"} or
/// {"error","errno","stage"}.
fn connect_sock(addr: SocketAddr, o: &SockOptions) -> i32 {
    let sock = match tcp_socket(addr, 0) {
        Ok(s) => s,
        Err(e) => {
            print_error("socket", &e);
            return 1;
        }
    };
    let fd = sock.as_raw_fd();
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let prepared = (|| -> Result<(), (&str, std::io::Error)> {
        if o.reuseaddr {
            set_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)
                .map_err(|e| ("SO_REUSEADDR", e))?;
        }
        if let Some(mark) = o.mark {
            set_int(fd, libc::SOL_SOCKET, libc::SO_MARK, mark as libc::c_int)
                .map_err(|e| ("SO_MARK", e))?;
        }
        if o.linger0 {
            set_linger0(fd).map_err(|e| ("SO_LINGER", e))?;
        }
        if let Some(source) = o.bind {
            bind(fd, source).map_err(|e| ("bind", e))?;
        }
        Ok(())
    })();
    if let Err((stage, e)) = prepared {
        print_error(stage, &e);
        return 1;
    }
    let keys = if o.fill_optmem {
        fill_optmem(fd, family)
    } else {
        0
    };
    let _ = set_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        o.timeout.as_millis().min(i32::MAX as u128) as libc::c_int,
    );
    let tv = libc::timeval {
        tv_sec: o.timeout.as_secs() as libc::time_t,
        tv_usec: o.timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: `tv` is a live timeval and its size is passed. SO_SNDTIMEO bounds connect(2).
    let _ = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&raw const tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a sockaddr of length `len`.
    if let Err(e) = check(unsafe { libc::connect(fd, (&raw const ss).cast(), len) }) {
        print_error("connect", &e);
        return 1;
    }
    let stream = TcpStream::from(sock);
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let local = stream
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let reply = if o.read {
        read_reply(&stream, o.timeout)
    } else {
        String::new()
    };
    println!(
        "{{\"peer\":\"{peer}\",\"local\":\"{local}\",\"reply\":{},\"md5_keys\":{keys}}}",
        json_str(&reply)
    );
    0
}

/// `probe raw`: tries the sockets that need CAP_NET_RAW (raw IPv4 and IPv6 TCP, AF_PACKET) and
/// prints {"inet":R,"inet6":R,"packet":R}, R being {"ok":true} or {"errno":N}.
fn raw() -> i32 {
    let attempts: [(&str, libc::c_int, libc::c_int, libc::c_int); 3] = [
        ("inet", libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP),
        ("inet6", libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_TCP),
        (
            "packet",
            libc::AF_PACKET,
            libc::SOCK_RAW,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        ),
    ];
    let mut parts = Vec::new();
    for (name, domain, ty, proto) in attempts {
        // SAFETY: plain system call; the descriptor is closed right away.
        let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
        if fd < 0 {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(-1);
            parts.push(format!("\"{name}\":{{\"errno\":{e}}}"));
        } else {
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            parts.push(format!("\"{name}\":{{\"ok\":true}}"));
        }
    }
    println!("{{{}}}", parts.join(","));
    0
}

/// `probe origdst-echo ADDR[,ADDR...]`: an original-destination proxy that forwards nothing:
/// each accepted connection gets one line {"orig_v4":R,"orig_v6":R} and is closed. For soaks:
/// the client checks the answer, so nothing is printed per connection.
fn origdst_echo(addrs: &[SocketAddr]) -> i32 {
    let mut listeners = Vec::new();
    for addr in addrs {
        match listen(*addr, true, false) {
            Ok(l) => listeners.push(l),
            Err(e) => {
                eprintln!("probe: bind {addr}: {e}");
                return 1;
            }
        }
    }
    let threads: Vec<_> = listeners
        .into_iter()
        .map(|l| {
            std::thread::spawn(move || {
                for conn in l.incoming().flatten() {
                    let line = format!(
                        "{{\"orig_v4\":{},\"orig_v6\":{}}}\n",
                        json_result(&original_dst(&conn, libc::SOL_IP)),
                        json_result(&original_dst(&conn, libc::SOL_IPV6))
                    );
                    let mut c = &conn;
                    let _ = c.write_all(line.as_bytes());
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    0
}

/// `probe connect-many ADDR N [--threads T] [--ports P] [--deadline-ms D]`: N short connections
/// (T threads), the i-th to ADDR's port + i % P (so consecutive connections have different
/// original destinations), each expecting an origdst-echo answer naming exactly that
/// destination, each closed with RST. Stops at the deadline. Prints
/// {"done","ok","mismatch","errors","elapsed_ms","per_sec","first_problem"}.
fn connect_many(addr: SocketAddr, n: u64, threads: u64, ports: u64, deadline: Duration) -> i32 {
    use std::sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    };
    let next = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let mismatch = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let first: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let start = std::time::Instant::now();
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let (next, ok, mismatch, errors, first) = (
                next.clone(),
                ok.clone(),
                mismatch.clone(),
                errors.clone(),
                first.clone(),
            );
            std::thread::spawn(move || {
                let note = |what: String| {
                    let mut f = first.lock().unwrap_or_else(|e| e.into_inner());
                    f.get_or_insert(what);
                };
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= n || start.elapsed() >= deadline {
                        break;
                    }
                    let mut dst = addr;
                    dst.set_port(addr.port().wrapping_add((i % ports.max(1)) as u16));
                    let result = open_connected(dst, None, Duration::from_secs(5)).and_then(|s| {
                        set_linger0(s.as_raw_fd())?;
                        s.set_read_timeout(Some(Duration::from_secs(5)))?;
                        let mut line = String::new();
                        let mut r = &s;
                        r.read_to_string(&mut line)?;
                        Ok(line)
                    });
                    match result {
                        Ok(line) if line.contains(&format!("\"addr\":\"{dst}\"")) => {
                            ok.fetch_add(1, Relaxed);
                        }
                        Ok(line) => {
                            mismatch.fetch_add(1, Relaxed);
                            note(format!("{dst}: {}", line.trim_end()));
                        }
                        Err(e) => {
                            errors.fetch_add(1, Relaxed);
                            note(format!("{dst}: {e}"));
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    let elapsed = start.elapsed();
    let (ok, mismatch, errors) = (
        ok.load(Relaxed),
        mismatch.load(Relaxed),
        errors.load(Relaxed),
    );
    let done = ok + mismatch + errors;
    let first = first
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default();
    println!(
        "{{\"done\":{done},\"ok\":{ok},\"mismatch\":{mismatch},\"errors\":{errors},\
         \"elapsed_ms\":{},\"per_sec\":{:.0},\"first_problem\":{}}}",
        elapsed.as_millis(),
        done as f64 / elapsed.as_secs_f64().max(1e-9),
        json_str(&first)
    );
    i32::from(done == 0)
}

/// `probe hold ADDR`: accept connections and keep each open, echoing what it sends, until the
/// peer closes. Prints {"accepted":PEER} and {"closed":PEER} lines.
fn hold(addr: SocketAddr) -> i32 {
    let listener = match listen(addr, true, false) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("probe: bind {addr}: {e}");
            return 1;
        }
    };
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(line.as_bytes());
        let _ = out.flush();
    };
    for conn in listener.incoming().flatten() {
        let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        say(format!("{{\"accepted\":\"{peer}\"}}\n"));
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let mut c = &conn;
            while let Ok(n) = c.read(&mut buf) {
                if n == 0 || c.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            say(format!("{{\"closed\":\"{peer}\"}}\n"));
        });
    }
    0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parse = |text: &str| -> SocketAddr {
        text.parse()
            .unwrap_or_else(|_| panic!("probe: {text:?} is not an address: {args:?}"))
    };
    let addr = |i: usize| -> SocketAddr { parse(args.get(i).map(String::as_str).unwrap_or("")) };
    let option = |name: &str| -> Option<&str> {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    let flag = |name: &str| args.iter().any(|a| a == name);
    let code = match args.first().map(String::as_str) {
        Some("connect") => {
            let timeout = option("--timeout-ms")
                .map(|ms| ms.parse().expect("probe: --timeout-ms takes milliseconds"))
                .unwrap_or(5000);
            connect(
                addr(1),
                flag("--http"),
                option("--bind").map(parse),
                Duration::from_millis(timeout),
            )
        }
        Some("udp-serve") => udp_serve(addr(1)),
        Some("udp-query") => udp_query(addr(1), flag("--connect")),
        Some("proxy") => {
            let addrs: Vec<SocketAddr> = args
                .get(1)
                .map(String::as_str)
                .unwrap_or("")
                .split(',')
                .map(parse)
                .collect();
            proxy(
                &addrs,
                args.get(2).expect("report path"),
                !flag("--no-forward"),
                flag("--v6only"),
                flag("--transparent"),
            )
        }
        Some("tfo") => tfo(addr(1), option("--data").unwrap_or("probe-tfo")),
        Some("connect-sock") => connect_sock(
            addr(1),
            &SockOptions {
                bind: option("--bind").map(parse),
                reuseaddr: flag("--reuseaddr"),
                mark: option("--mark").map(|m| m.parse().expect("probe: --mark takes a number")),
                fill_optmem: flag("--fill-optmem"),
                read: flag("--read"),
                linger0: flag("--linger0"),
                timeout: Duration::from_millis(
                    option("--timeout-ms")
                        .map(|ms| ms.parse().expect("probe: --timeout-ms takes milliseconds"))
                        .unwrap_or(5000),
                ),
            },
        ),
        Some("raw") => raw(),
        Some("hold") => hold(addr(1)),
        Some("origdst-echo") => {
            let addrs: Vec<SocketAddr> = args
                .get(1)
                .map(String::as_str)
                .unwrap_or("")
                .split(',')
                .map(parse)
                .collect();
            origdst_echo(&addrs)
        }
        Some("connect-many") => {
            let num = |name: &str, default: u64| -> u64 {
                option(name)
                    .map(|v| v.parse().expect("probe: a number"))
                    .unwrap_or(default)
            };
            connect_many(
                addr(1),
                args.get(2)
                    .and_then(|n| n.parse().ok())
                    .expect("probe: connect-many ADDR N"),
                num("--threads", 4),
                num("--ports", 1),
                Duration::from_millis(num("--deadline-ms", 30_000)),
            )
        }
        _ => {
            eprintln!(
                "usage: probe connect ADDR [--http] [--bind ADDR] [--timeout-ms N] | \
                 probe udp-serve ADDR | probe udp-query ADDR [--connect] | \
                 probe proxy ADDR[,ADDR...] REPORT [--no-forward] [--v6only] | \
                 probe tfo ADDR [--data TEXT] | \
                 probe connect-sock ADDR [--bind ADDR] [--reuseaddr] [--mark N] [--fill-optmem] \
                 [--read] [--linger0] [--timeout-ms N] | probe raw | probe hold ADDR | \
                 probe origdst-echo ADDR[,ADDR...] | \
                 probe connect-many ADDR N [--threads T] [--ports P] [--deadline-ms D]"
            );
            2
        }
    };
    std::process::exit(code);
}
