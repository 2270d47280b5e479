//! A small test client and Envoy-like original-destination proxy. It prints what the socket API
//! reports (peer, local address, SO_ORIGINAL_DST) as JSON lines, so tests assert exact values.
//!
//! ```text
//! probe connect ADDR [--http]        connect, print {"peer","local"[,"status"]}
//! probe udp-serve ADDR               answer every datagram with "reply to <sender>"
//! probe udp-query ADDR [--connect]   send one datagram, print {"from","reply"}
//! probe proxy ADDR REPORT [--no-forward]
//!     accept forever; per connection append {"peer","local","orig_v4","orig_v6"} to REPORT
//!     (`-` for stdout) and
//!     (unless --no-forward) relay to the original destination, asking SOL_IP then SOL_IPV6 as
//!     Envoy does
//! ```

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream},
    os::fd::AsRawFd,
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
            Ok(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(a), port, 0, 0)))
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

fn connect(addr: SocketAddr, http: bool) -> i32 {
    let sock = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) => {
            println!("{{\"error\":\"{e}\",\"errno\":{}}}", e.raw_os_error().unwrap_or(-1));
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

fn proxy(addr: SocketAddr, report: &str, forward: bool) -> i32 {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("probe: bind {addr}: {e}");
            return 1;
        }
    };
    for conn in listener.incoming().flatten() {
        let v4 = original_dst(&conn, libc::SOL_IP);
        let v6 = original_dst(&conn, libc::SOL_IPV6);
        let line = format!(
            "{{\"peer\":\"{}\",\"local\":\"{}\",\"orig_v4\":{},\"orig_v6\":{}}}\n",
            conn.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
            conn.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            json_result(&v4),
            json_result(&v6)
        );
        if report == "-" {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(line.as_bytes());
            let _ = out.flush();
        } else if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(report) {
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
    let bind: SocketAddr = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("literal");
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
    let addr = |i: usize| -> SocketAddr {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("probe: argument {i} must be an address: {args:?}"))
    };
    let code = match args.first().map(String::as_str) {
        Some("connect") => connect(addr(1), args.iter().any(|a| a == "--http")),
        Some("udp-serve") => udp_serve(addr(1)),
        Some("udp-query") => udp_query(addr(1), args.iter().any(|a| a == "--connect")),
        Some("proxy") => proxy(
            addr(1),
            args.get(2).expect("report path"),
            !args.iter().any(|a| a == "--no-forward"),
        ),
        _ => {
            eprintln!("usage: probe connect ADDR [--http] | probe proxy ADDR REPORT [--no-forward]");
            2
        }
    };
    std::process::exit(code);
}
