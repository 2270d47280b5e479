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
fn listen(addr: SocketAddr, v6only: bool) -> std::io::Result<TcpListener> {
    let sock = tcp_socket(addr, 0)?;
    let fd = sock.as_raw_fd();
    set_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
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

fn proxy(addrs: &[SocketAddr], report: &str, forward: bool, v6only: bool) -> i32 {
    let mut listeners = Vec::new();
    for addr in addrs {
        match listen(*addr, v6only) {
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
            )
        }
        _ => {
            eprintln!(
                "usage: probe connect ADDR [--http] [--bind ADDR] [--timeout-ms N] | \
                 probe udp-serve ADDR | probe udp-query ADDR [--connect] | \
                 probe proxy ADDR[,ADDR...] REPORT [--no-forward] [--v6only]"
            );
            2
        }
    };
    std::process::exit(code);
}
