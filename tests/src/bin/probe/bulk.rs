//! Bulk and ping-pong traffic for the sk_msg tests (tests/tests/skmsg_bulk.rs).
//!
//! The stream is a counter pattern: 8-byte little-endian words 0, 1, 2, ... so a reader that
//! checks every word catches lost, duplicated and reordered bytes.

use std::{
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

const CHUNK: usize = 256 * 1024;
/// `SO_MEMINFO`'s slots; slot 0 is `SK_MEMINFO_RMEM_ALLOC`, slot 1 `SK_MEMINFO_RCVBUF`.
const SK_MEMINFO_VARS: usize = 9;

/// The pattern's bytes from stream offset `at` (a multiple of 8) into `buf` (a multiple of 8 long).
fn fill(buf: &mut [u8], at: u64) {
    for (i, word) in buf.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&(at / 8 + i as u64).to_le_bytes());
    }
}

/// `SO_MEMINFO` of `sock`: (receive memory allocated, receive buffer).
fn meminfo(sock: &TcpStream) -> Option<(u32, u32)> {
    let mut info = [0u32; SK_MEMINFO_VARS];
    let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
    // SAFETY: `info` is writable for `len` bytes, and the kernel writes at most that.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MEMINFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    (rc == 0).then_some((info[0], info[1]))
}

/// `probe slow-sink ADDR [--sleep-ms N] [--echo]`: a sidecar stand-in. Accepts one connection
/// and prints `{"accepted":...}`. With `--echo` it writes back whatever it reads until EOF and
/// prints `{"echoed":N}`. Otherwise it reads nothing for N ms, sampling its socket's queued
/// receive memory (SO_MEMINFO, what `ss -m` shows as r), then reads to EOF checking every word
/// and prints `{"bytes","bad_at","max_rmem","rcvbuf"}`.
pub(super) fn slow_sink(addr: SocketAddr, sleep: Duration, echo: bool) -> i32 {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            println!("{{\"error\":\"bind: {e}\"}}");
            return 1;
        }
    };
    println!("{{\"listening\":\"{addr}\"}}");
    let _ = std::io::stdout().flush();
    let Ok((mut conn, peer)) = listener.accept() else {
        println!("{{\"error\":\"accept\"}}");
        return 1;
    };
    println!("{{\"accepted\":\"{peer}\"}}");
    let _ = std::io::stdout().flush();
    if echo {
        let mut buf = vec![0u8; 64 * 1024];
        let mut echoed = 0u64;
        loop {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    echoed += n as u64;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        println!("{{\"echoed\":{echoed}}}");
        return 0;
    }
    let until = Instant::now() + sleep;
    let (mut max_rmem, mut rcvbuf) = (0u32, 0u32);
    while Instant::now() < until {
        if let Some((r, b)) = meminfo(&conn) {
            max_rmem = max_rmem.max(r);
            rcvbuf = b;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut buf = vec![0u8; CHUNK];
    let (mut bytes, mut word, mut bad_at): (u64, u64, Option<u64>) = (0, 0, None);
    // Bytes of a word split across reads wait here.
    let mut carry: Vec<u8> = Vec::with_capacity(2 * CHUNK);
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                println!("{{\"error\":\"read: {e}\",\"bytes\":{bytes}}}");
                return 1;
            }
        };
        bytes += n as u64;
        max_rmem = max_rmem.max(meminfo(&conn).map_or(0, |m| m.0));
        if bad_at.is_some() {
            continue;
        }
        carry.extend_from_slice(&buf[..n]);
        let whole = carry.len() / 8 * 8;
        for w in carry[..whole].chunks_exact(8) {
            if u64::from_le_bytes(w.try_into().expect("8 bytes")) != word {
                bad_at = Some(word * 8);
                break;
            }
            word += 1;
        }
        carry.drain(..whole);
    }
    let bad = bad_at.map_or("null".to_string(), |b| b.to_string());
    println!(
        "{{\"bytes\":{bytes},\"bad_at\":{bad},\"max_rmem\":{max_rmem},\"rcvbuf\":{rcvbuf},\"tail\":{}}}",
        carry.len()
    );
    0
}

/// `probe bulk-write ADDR BYTES`: connects and writes BYTES of the pattern as fast as it can
/// (256 KiB writes). A failed write is counted and retried after 10 ms (at most 1000 times);
/// then prints `{"written","failed_writes","last_errno","ms"}` and closes.
pub(super) fn bulk_write(addr: SocketAddr, total: u64) -> i32 {
    let mut sock = match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => {
            println!("{{\"error\":\"connect: {e}\"}}");
            return 1;
        }
    };
    let started = Instant::now();
    let mut buf = vec![0u8; CHUNK];
    let (mut written, mut failed, mut last_errno) = (0u64, 0u32, 0i32);
    while written < total && failed < 1000 {
        let len = (total - written).min(CHUNK as u64) as usize;
        fill(&mut buf[..len], written);
        let mut off = 0;
        while off < len && failed < 1000 {
            match sock.write(&buf[off..len]) {
                Ok(n) => off += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    failed += 1;
                    last_errno = e.raw_os_error().unwrap_or(-1);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        written += off as u64;
    }
    let _ = sock.shutdown(std::net::Shutdown::Write);
    // Wait for the reader to finish (its close), so the caller's timing covers the transfer.
    let mut rest = [0u8; 64];
    let _ = sock.set_read_timeout(Some(Duration::from_secs(600)));
    while matches!(sock.read(&mut rest), Ok(n) if n > 0) {}
    println!(
        "{{\"written\":{written},\"failed_writes\":{failed},\"last_errno\":{last_errno},\"ms\":{}}}",
        started.elapsed().as_millis()
    );
    i32::from(written != total)
}

/// `probe ping-pong ADDR ROUNDS SIZE`: one connection, ROUNDS times SIZE bytes out and the same
/// bytes back (from `slow-sink --echo`); prints `{"rounds","ok"}`.
pub(super) fn ping_pong(addr: SocketAddr, rounds: u64, size: usize) -> i32 {
    let mut sock = match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => {
            println!("{{\"error\":\"connect: {e}\"}}");
            return 1;
        }
    };
    let _ = sock.set_read_timeout(Some(Duration::from_secs(30)));
    let mut out = vec![0u8; size.div_ceil(8) * 8];
    let mut back = vec![0u8; out.len()];
    for round in 0..rounds {
        let at = round * out.len() as u64;
        fill(&mut out, at);
        if sock.write_all(&out).is_err() || sock.read_exact(&mut back).is_err() || back != out {
            println!("{{\"rounds\":{round},\"ok\":false}}");
            return 1;
        }
    }
    println!("{{\"rounds\":{rounds},\"ok\":true}}");
    0
}
