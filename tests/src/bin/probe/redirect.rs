//! The subcommands of the redirection tests: a client that prints what connect(2) saw, the
//! Envoy-like original-destination proxy, and the UDP pair for DNS capture.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    time::Duration,
};

use crate::sock::{Identity, json_result, listen_marked, open_connected_as, original_dst};

pub(super) fn connect(
    addr: SocketAddr,
    http: bool,
    source: Option<SocketAddr>,
    device: Option<&str>,
    identity: Identity,
    timeout: Duration,
) -> i32 {
    let sock = match open_connected_as(addr, source, device, identity, timeout) {
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
                std::thread::spawn(move || answer_and_drain(&conn));
            }
        }
    }
}

/// Answers "probe" and closes only once the client has: closing with the client's bytes unread
/// makes the kernel send RST, and a TFO client whose data came in the SYN (so is always unread)
/// could take that RST before its own sendto returned (ECONNRESET), if slow to be woken.
fn answer_and_drain(conn: &TcpStream) {
    let mut c = conn;
    let _ = c.write_all(b"probe\n");
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = std::io::copy(&mut c, &mut std::io::sink());
}

pub(super) fn proxy(
    addrs: &[SocketAddr],
    report: &str,
    forward: bool,
    v6only: bool,
    transparent: bool,
    accept_after: Duration,
    bind_mark: Option<i32>,
) -> i32 {
    let mut listeners = Vec::new();
    for addr in addrs {
        match listen_marked(*addr, v6only, transparent, bind_mark) {
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
            std::thread::spawn(move || {
                // A proxy slow to accept: the kernel completes handshakes meanwhile, so a client
                // can be gone before the proxy asks for its original destination.
                std::thread::sleep(accept_after);
                serve(l, name, report, forward)
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    0
}

/// Answers every datagram with "reply to <sender>", or "<name>: reply to <sender>", so that a
/// test tells which server answered when both see the same sender.
pub(super) fn udp_serve(addr: SocketAddr, name: Option<&str>, bind_mark: Option<i32>) -> i32 {
    let bound = (|| -> std::io::Result<std::net::UdpSocket> {
        let sock = nix::sys::socket::socket(
            if addr.is_ipv4() {
                nix::sys::socket::AddressFamily::Inet
            } else {
                nix::sys::socket::AddressFamily::Inet6
            },
            nix::sys::socket::SockType::Datagram,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        if let Some(mark) = bind_mark {
            crate::sock::set_int(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_MARK, mark)?;
        }
        crate::sock::bind(sock.as_raw_fd(), addr)?;
        clear_mark(sock.as_raw_fd(), bind_mark)?;
        Ok(std::net::UdpSocket::from(sock))
    })();
    let Ok(sock) = bound else {
        eprintln!("probe: bind {addr}: {bound:?}");
        return 1;
    };
    let prefix = name.map(|n| format!("{n}: ")).unwrap_or_default();
    let mut buf = [0u8; 512];
    while let Ok((_, from)) = sock.recv_from(&mut buf) {
        let _ = sock.send_to(format!("{prefix}reply to {from}").as_bytes(), from);
    }
    0
}

/// `udp-serve --bind-mark`: the socket carried the mark to bind (in an ambient pod only
/// ztunnel's marked sockets may bind its ports); cleared once bound, so that its replies stay
/// unmarked, as this stand-in's always were in the DNS parity table. (A TCP listener keeps its
/// mark, as ztunnel's does: tc's inbound capture checks it at every SYN.)
fn clear_mark(fd: std::os::fd::RawFd, bind_mark: Option<i32>) -> std::io::Result<()> {
    if bind_mark.is_some() {
        crate::sock::set_int(fd, libc::SOL_SOCKET, libc::SO_MARK, 0)?;
    }
    Ok(())
}

/// How `udp-query` prepares and addresses its socket.
pub(super) struct UdpQuery {
    /// connect(2) and send(2), rather than sendto(2).
    pub connect: bool,
    /// No bind(2) before: the kernel (or a connect program) picks the address and port, as a
    /// C or Go client's socket has it. Rust's UdpSocket always binds a port first.
    pub unbound: bool,
    /// Connect to this address first, then to the real one (a resolver moving on to another
    /// server on the same socket).
    pub first: Option<SocketAddr>,
    /// SO_MARK (ztunnel marks its own queries).
    pub mark: Option<u32>,
    /// Exhaust the socket's option memory first (IPv6 multicast memberships), so nothing more
    /// can be stored on it: a program that must record the query cannot.
    pub fill_optmem: bool,
}

/// Joins IPv6 multicast groups on `fd` until the socket's option memory (net.core.optmem_max)
/// runs out; returns how many it joined.
fn fill_optmem_v6(fd: std::os::fd::RawFd) -> usize {
    let mut joined = 0usize;
    while joined < 100_000 {
        let mut group = [0u8; 16];
        group[0] = 0xff;
        group[1] = 0x15;
        group[12..].copy_from_slice(&(joined as u32).to_be_bytes());
        let mreq = libc::ipv6_mreq {
            ipv6mr_multiaddr: libc::in6_addr { s6_addr: group },
            ipv6mr_interface: 0,
        };
        // SAFETY: `mreq` is a valid ipv6_mreq of the given size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_IPV6,
                libc::IPV6_ADD_MEMBERSHIP,
                (&raw const mreq).cast(),
                std::mem::size_of::<libc::ipv6_mreq>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            break;
        }
        joined += 1;
    }
    joined
}

/// Sends one datagram to `addr` and prints {"from","reply","local"} (`local`: getsockname once
/// sent), or {"error","stage"}.
pub(super) fn udp_query(addr: SocketAddr, q: &UdpQuery) -> i32 {
    let fail = |stage: &str, e: &dyn std::fmt::Display| {
        println!("{{\"error\":\"{e}\",\"stage\":\"{stage}\"}}");
        1
    };
    let sock = if q.unbound {
        let family = if addr.is_ipv4() {
            nix::sys::socket::AddressFamily::Inet
        } else {
            nix::sys::socket::AddressFamily::Inet6
        };
        match nix::sys::socket::socket(
            family,
            nix::sys::socket::SockType::Datagram,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        ) {
            Ok(fd) => std::net::UdpSocket::from(fd),
            Err(e) => return fail("socket", &e),
        }
    } else {
        let bind: SocketAddr = if addr.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .expect("literal");
        match std::net::UdpSocket::bind(bind) {
            Ok(s) => s,
            Err(e) => return fail("bind", &e),
        }
    };
    if let Some(mark) = q.mark
        && let Err(e) = crate::sock::set_int(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SOL_SOCKET,
            libc::SO_MARK,
            mark as libc::c_int,
        )
    {
        return fail("SO_MARK", &e);
    }
    if q.fill_optmem {
        if addr.is_ipv4() {
            return fail("fill-optmem", &"--fill-optmem needs an IPv6 server");
        }
        let joined = fill_optmem_v6(std::os::fd::AsRawFd::as_raw_fd(&sock));
        eprintln!("probe: joined {joined} multicast groups to fill the option memory");
    }
    let _ = sock.set_read_timeout(Some(Duration::from_secs(3)));
    if let Some(first) = q.first
        && let Err(e) = sock.connect(first)
    {
        return fail("first connect", &e);
    }
    let sent = if q.connect {
        sock.connect(addr).and_then(|()| sock.send(b"query"))
    } else {
        sock.send_to(b"query", addr)
    };
    if let Err(e) = sent {
        return fail("send", &e);
    }
    let local = sock.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut buf = [0u8; 512];
    match sock.recv_from(&mut buf) {
        Ok((n, from)) => {
            let reply = String::from_utf8_lossy(&buf[..n]);
            println!("{{\"from\":\"{from}\",\"reply\":\"{reply}\",\"local\":\"{local}\"}}");
            0
        }
        Err(e) => fail("receive", &e),
    }
}
