//! Subcommands for the reliability and bypass tests (tests/tests/bypass.rs, churn.rs): sockets
//! prepared in the ways an application might try to escape or overload the redirection.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

use crate::sock::{
    bind, check, json_result, listen, open_connected, original_dst, set_int, sockaddr,
    stream_socket, tcp_socket,
};

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
pub(super) fn tfo(addr: SocketAddr, data: &str) -> i32 {
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
pub(super) struct SockOptions {
    pub(super) bind: Option<SocketAddr>,
    pub(super) reuseaddr: bool,
    pub(super) mark: Option<u32>,
    pub(super) fill_optmem: bool,
    pub(super) read: bool,
    pub(super) linger0: bool,
    /// Connect to this address first on the same socket (its failure is expected: a TCP socket
    /// can connect again only after a failed connect).
    pub(super) first: Option<SocketAddr>,
    pub(super) timeout: Duration,
    /// An MPTCP socket (`IPPROTO_MPTCP`): the kernel connects its first subflow, a TCP socket
    /// of its own, on the app's behalf.
    pub(super) mptcp: bool,
}

/// `probe connect-sock ADDR [--bind ADDR] [--reuseaddr] [--mark N] [--fill-optmem] [--read]
/// [--linger0] [--timeout-ms N] [--mptcp]`: a blocking connect on a socket prepared first (SO_REUSEADDR,
/// SO_MARK, SO_LINGER 0, bound, option memory filled with TCP-MD5 keys); with --read it waits for
/// the peer's reply and EOF. Prints {"peer","local","reply","md5_keys"} or
/// {"error","errno","stage"}.
pub(super) fn connect_sock(addr: SocketAddr, o: &SockOptions) -> i32 {
    let protocol = if o.mptcp { libc::IPPROTO_MPTCP } else { 0 };
    let sock = match stream_socket(addr, protocol) {
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
    let first_errno = o.first.map(|first| {
        let (ss, len) = sockaddr(first);
        // SAFETY: `ss` holds a sockaddr of length `len`.
        match check(unsafe { libc::connect(fd, (&raw const ss).cast(), len) }) {
            Ok(_) => 0,
            Err(e) => e.raw_os_error().unwrap_or(-1),
        }
    });
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a sockaddr of length `len`.
    if let Err(e) = check(unsafe { libc::connect(fd, (&raw const ss).cast(), len) }) {
        print_error("connect", &e);
        return 1;
    }
    let stream = TcpStream::from(sock);
    let orig = crate::sock::original_dst(&stream, libc::SOL_IP);
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
        "{{\"peer\":\"{peer}\",\"local\":\"{local}\",\"reply\":{},\"md5_keys\":{keys},\
         \"first_errno\":{},\"orig_v4\":{}}}",
        json_str(&reply),
        first_errno.map_or("null".into(), |e| e.to_string()),
        crate::sock::json_result(&orig)
    );
    0
}

/// `probe raw`: tries the sockets that need CAP_NET_RAW (raw IPv4 and IPv6 TCP, AF_PACKET) and
/// prints {"inet":R,"inet6":R,"packet":R}, R being {"ok":true} or {"errno":N}.
pub(super) fn raw() -> i32 {
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
pub(super) fn origdst_echo(addrs: &[SocketAddr]) -> i32 {
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

/// `probe connect-many ADDR N [--threads T] [--ports P] [--deadline-ms D] [--hold-first ADDR]`:
/// N short connections (T threads), the i-th to ADDR's port + i % P (so consecutive connections
/// have different original destinations), each expecting an origdst-echo answer naming exactly
/// that destination, each closed with RST. Stops at the deadline. With --hold-first, a connection
/// to that address is opened before the others and kept open; its getpeername after them is
/// "held_peer". Prints
/// {"done","ok","mismatch","errors","elapsed_ms","per_sec","first_problem","held_peer"}.
pub(super) fn connect_many(
    addr: SocketAddr,
    n: u64,
    threads: u64,
    ports: u64,
    deadline: Duration,
    hold_first: Option<SocketAddr>,
) -> i32 {
    let held = match hold_first.map(|a| open_connected(a, None, None, Duration::from_secs(5))) {
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            print_error("hold-first", &e);
            return 1;
        }
        None => None,
    };
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
                    let result =
                        open_connected(dst, None, None, Duration::from_secs(5)).and_then(|s| {
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
    let held_peer = held.map_or_else(
        || "null".to_string(),
        |s| match s.peer_addr() {
            Ok(a) => json_str(&a.to_string()),
            Err(e) => json_str(&format!("error: {e}")),
        },
    );
    println!(
        "{{\"done\":{done},\"ok\":{ok},\"mismatch\":{mismatch},\"errors\":{errors},\
         \"elapsed_ms\":{},\"per_sec\":{:.0},\"first_problem\":{},\"held_peer\":{held_peer}}}",
        elapsed.as_millis(),
        done as f64 / elapsed.as_secs_f64().max(1e-9),
        json_str(&first)
    );
    i32::from(done == 0)
}

/// `probe hold ADDR`: accept connections and keep each open, echoing what it sends, until the
/// peer closes. Prints {"accepted":PEER} and {"closed":PEER} lines.
pub(super) fn hold(addr: SocketAddr) -> i32 {
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
