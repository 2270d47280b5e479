//! An inbound proxy that behaves as Envoy does in Istio's TPROXY interception mode: a
//! transparent listener (IP_TRANSPARENT) whose accepted connections are forwarded to their
//! original destination (getsockname) from the client's own IP address, on a transparent
//! upstream socket that carries `--mark` (Envoy's original_src listener filter with mark 1337).
//!
//! `transparent-proxy LISTEN[,LISTEN...] [--mark N]`: one JSON line per accepted connection on
//! stdout: `{"peer","local","upstream_local","error"}`.

use std::{
    io::{self, Write as _},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream},
    thread,
};

use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, listen, setsockopt, socket,
    sockopt::{IpTransparent, Ipv6V6Only, Mark, ReuseAddr},
};

fn tcp_socket(family: AddressFamily) -> io::Result<std::os::fd::OwnedFd> {
    Ok(socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

fn family_of(addr: &SocketAddr) -> AddressFamily {
    if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn transparent_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = tcp_socket(family_of(&addr))?;
    setsockopt(&fd, ReuseAddr, &true)?;
    setsockopt(&fd, IpTransparent, &true)?;
    if addr.is_ipv6() {
        setsockopt(&fd, Ipv6V6Only, &true)?;
    }
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(addr),
    )?;
    listen(&fd, nix::sys::socket::Backlog::new(128)?)?;
    Ok(TcpListener::from(fd))
}

/// Connects to `dst` from `client`'s IP (any port), as original_src does.
fn upstream(client: IpAddr, dst: SocketAddr, mark: u32) -> io::Result<TcpStream> {
    let fd = tcp_socket(family_of(&dst))?;
    setsockopt(&fd, IpTransparent, &true)?;
    if mark != 0 {
        setsockopt(&fd, Mark, &mark)?;
    }
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    bind(raw, &SockaddrStorage::from(SocketAddr::new(client, 0)))?;
    connect(raw, &SockaddrStorage::from(dst))?;
    Ok(TcpStream::from(fd))
}

fn relay(a: TcpStream, b: TcpStream) {
    let (mut a2, mut b2) = match (a.try_clone(), b.try_clone()) {
        (Ok(x), Ok(y)) => (x, y),
        _ => return,
    };
    let t = thread::spawn(move || {
        let mut a = a;
        let mut b = b;
        let _ = io::copy(&mut a, &mut b);
        let _ = b.shutdown(Shutdown::Write);
    });
    let _ = io::copy(&mut b2, &mut a2);
    let _ = a2.shutdown(Shutdown::Write);
    let _ = t.join();
}

fn serve(listener: TcpListener, mark: u32) {
    let own_port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    for conn in listener.incoming().flatten() {
        let peer = conn.peer_addr().ok();
        let local = conn.local_addr().ok();
        // Connected to directly (a readiness check): answer instead of forwarding to ourselves.
        if local.is_some_and(|l| l.port() == own_port) {
            let _ = (&conn).write_all(b"transparent-proxy\n");
            continue;
        }
        let (line, up) = match (peer, local) {
            (Some(p), Some(l)) => match upstream(p.ip(), l, mark) {
                Ok(u) => {
                    let ul = u.local_addr().map(|a| a.to_string()).unwrap_or_default();
                    (
                        format!(r#"{{"peer":"{p}","local":"{l}","upstream_local":"{ul}"}}"#),
                        Some(u),
                    )
                }
                Err(e) => (
                    format!(r#"{{"peer":"{p}","local":"{l}","error":"{e}"}}"#),
                    None,
                ),
            },
            _ => (r#"{"error":"no address"}"#.to_string(), None),
        };
        let mut out = io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        if let Some(u) = up {
            thread::spawn(move || relay(conn, u));
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let listen_on = args.first().map(String::as_str).unwrap_or("0.0.0.0:15006");
    let mark = args
        .iter()
        .position(|a| a == "--mark")
        .and_then(|i| args.get(i + 1))
        .map_or(0, |m| m.parse().expect("--mark takes a number"));
    let mut threads = Vec::new();
    for addr in listen_on.split(',') {
        let addr: SocketAddr = addr.parse().expect("listen address");
        match transparent_listener(addr) {
            Ok(l) => threads.push(thread::spawn(move || serve(l, mark))),
            Err(e) => {
                eprintln!("transparent-proxy: listen {addr}: {e}");
                std::process::exit(1);
            }
        }
    }
    for t in threads {
        let _ = t.join();
    }
}
