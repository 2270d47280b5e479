//! `probe bind ADDR [--udp] [--mark N] [--listen-after-ms MS]`: binds one socket to ADDR (an
//! IPv6 one v6-only), marked first with N if given, and prints {"bound":ADDR} or
//! {"errno":E,"stage":S}. With --listen-after-ms (TCP), it then waits, listens, prints
//! {"listening":ADDR} and one {"accepted":PEER} line per connection until killed: a socket bound
//! before its pod was enrolled and listening after.

use std::{
    io::Write as _,
    net::{SocketAddr, TcpListener},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use crate::sock::{bind, check, set_int};

pub(super) struct BindOptions {
    pub udp: bool,
    pub mark: Option<i32>,
    pub listen_after: Option<Duration>,
}

pub(super) fn bind_port(addr: SocketAddr, o: &BindOptions) -> i32 {
    let fail = |stage: &str, e: &std::io::Error| {
        println!(
            "{{\"errno\":{},\"stage\":\"{stage}\"}}",
            e.raw_os_error().unwrap_or(-1)
        );
        0
    };
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let ty = if o.udp {
        libc::SOCK_DGRAM
    } else {
        libc::SOCK_STREAM
    };
    // SAFETY: plain system call; the descriptor is owned right away.
    let sock = match check(unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, 0) }) {
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
        Err(e) => return fail("socket", &e),
    };
    let fd = sock.as_raw_fd();
    if let Some(mark) = o.mark
        && let Err(e) = set_int(fd, libc::SOL_SOCKET, libc::SO_MARK, mark)
    {
        return fail("SO_MARK", &e);
    }
    if addr.is_ipv6()
        && let Err(e) = set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)
    {
        return fail("IPV6_V6ONLY", &e);
    }
    if let Err(e) = bind(fd, addr) {
        return fail("bind", &e);
    }
    println!("{{\"bound\":\"{addr}\"}}");
    let _ = std::io::stdout().flush();
    let Some(wait) = o.listen_after.filter(|_| !o.udp) else {
        return 0;
    };
    std::thread::sleep(wait);
    // SAFETY: plain system call on an open socket.
    if let Err(e) = check(unsafe { libc::listen(fd, 16) }) {
        return fail("listen", &e);
    }
    println!("{{\"listening\":\"{addr}\"}}");
    let _ = std::io::stdout().flush();
    let listener = TcpListener::from(sock);
    for conn in listener.incoming() {
        match conn.and_then(|c| c.peer_addr()) {
            Ok(peer) => println!("{{\"accepted\":\"{peer}\"}}"),
            Err(e) => println!("{{\"error\":\"{e}\"}}"),
        }
        let _ = std::io::stdout().flush();
    }
    0
}
