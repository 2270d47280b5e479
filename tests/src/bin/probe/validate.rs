//! The meshes' own checks that a pod's traffic is captured, run as their init containers run them
//! (docs/research/istio-cni.md, section 4), so the tests hold sidestep to the contracts an
//! unmodified Istio or Linkerd pod enforces before its app starts.
//!
//! `istio-validate [--v6]` is `istio-iptables --run-validation`: as the proxy's UID it listens on
//! 127.0.0.1:15001 and 127.0.0.1:15006 ([::1] for IPv6, SO_REUSEADDR and SO_REUSEPORT), dials
//! 127.0.0.6:15002 ([::6]) from 127.0.0.1 every second, and passes only when an accepted
//! connection's SO_ORIGINAL_DST port is 15002. Exit 0, or 126 after 5 s (the code istio-cni's
//! repair controller looks for).
//!
//! `linkerd-validate LISTEN CONNECT` is `linkerd-network-validator`: it listens on LISTEN
//! (0.0.0.0:4140, the outbound proxy port), connects to CONNECT (1.1.1.1:20001, nothing listens
//! there), and passes when the 64-byte token its own listener writes comes back on that
//! connection. Exit 0, or 95 after 10 s.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    sync::mpsc,
    time::{Duration, Instant},
};

use super::sock::{self, original_dst};

const ISTIO_FAILED: i32 = 126;
const LINKERD_FAILED: i32 = 95;
const PROBE_PORT: u16 = 15002;

fn listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let sock = sock::tcp_socket(addr, 0)?;
    let fd = sock.as_raw_fd();
    sock::set_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    sock::set_int(fd, libc::SOL_SOCKET, libc::SO_REUSEPORT, 1)?;
    sock::bind(fd, addr)?;
    // SAFETY: plain system call on an open socket.
    sock::check(unsafe { libc::listen(fd, 16) })?;
    Ok(TcpListener::from(sock))
}

/// Accepts forever on `listener`, sending each connection's stream to `found`.
fn serve(listener: TcpListener, found: mpsc::Sender<TcpStream>) {
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            if found.send(stream).is_err() {
                return;
            }
        }
    });
}

pub(super) fn istio(v6: bool, timeout: Duration) -> i32 {
    let (local, probe): (std::net::IpAddr, std::net::IpAddr) = if v6 {
        ("::1".parse().unwrap(), "::6".parse().unwrap())
    } else {
        ("127.0.0.1".parse().unwrap(), "127.0.0.6".parse().unwrap())
    };
    let (tx, rx) = mpsc::channel();
    let mut listening = 0;
    for port in [15001, 15006] {
        match listener(SocketAddr::new(local, port)) {
            Ok(l) => {
                serve(l, tx.clone());
                listening += 1;
            }
            Err(e) => eprintln!("istio-validate: listen {local}:{port}: {e}"),
        }
    }
    if listening == 0 {
        eprintln!("istio-validate: no listener available");
        return ISTIO_FAILED;
    }
    let level = if v6 { libc::IPPROTO_IPV6 } else { libc::SOL_IP };
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let target = SocketAddr::new(probe, PROBE_PORT);
        match sock::open_connected(
            target,
            Some(SocketAddr::new(local, 0)),
            None,
            Duration::from_secs(1),
        ) {
            Ok(_client) => {}
            Err(e) => eprintln!("istio-validate: connecting to {target}: {e}"),
        }
        while let Ok(mut accepted) = rx.recv_timeout(Duration::from_millis(200)) {
            let orig = original_dst(&accepted, level);
            let _ = accepted.write_all(
                orig.map(|a| a.port().to_string())
                    .unwrap_or_default()
                    .as_bytes(),
            );
            match orig {
                Ok(a) if a.port() == PROBE_PORT => {
                    println!(
                        "{{\"passed\":true,\"listener\":\"{}\",\"orig\":\"{a}\"}}",
                        accepted
                            .local_addr()
                            .map(|l| l.to_string())
                            .unwrap_or_default()
                    );
                    return 0;
                }
                other => eprintln!("istio-validate: accepted a probe from nowhere: {other:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(800));
    }
    eprintln!("istio-validate: iptables validation failed; workload is not ready for Istio");
    ISTIO_FAILED
}

pub(super) fn linkerd(listen: SocketAddr, connect: SocketAddr, timeout: Duration) -> i32 {
    let token: String = {
        let mut bytes = [0u8; 63];
        if std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .is_err()
        {
            return LINKERD_FAILED;
        }
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        bytes
            .iter()
            .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
            .chain(std::iter::once('\n'))
            .collect()
    };
    let server = match listener(listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("linkerd-validate: listen {listen}: {e}");
            return LINKERD_FAILED;
        }
    };
    let sent = token.clone();
    std::thread::spawn(move || {
        for mut stream in server.incoming().flatten() {
            let _ = stream.write_all(sent.as_bytes());
        }
    });
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match sock::open_connected(connect, None, None, Duration::from_secs(1)) {
            Ok(mut stream) => {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
                let mut got = vec![0u8; token.len()];
                if stream.read_exact(&mut got).is_ok() && got == token.as_bytes() {
                    println!("{{\"passed\":true,\"connected\":\"{connect}\"}}");
                    return 0;
                }
                eprintln!("linkerd-validate: {connect} answered without the token");
            }
            Err(e) => eprintln!("linkerd-validate: connecting to {connect}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    LINKERD_FAILED
}
