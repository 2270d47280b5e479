//! Network probes: TCP connects from inside a pod, listening sockets of a process, HTTP GET
//! with curl.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::env::TestEnv;
use crate::pod::Pod;
use crate::process::{ChildGuard, Spawn};
use crate::util::tail;

/// Connects to `addr` from a thread inside `pod`'s netns until it succeeds or `timeout`
/// passes. The probing thread is in the test runner's cgroup, so programs attached to the
/// test cgroup do not see it.
pub fn wait_for_tcp(pod: &Pod, addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    pod.in_netns(|| {
        let mut last;
        loop {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(_) => return Ok(()),
                Err(e) => last = e,
            }
            if Instant::now() >= deadline {
                bail!(
                    "no TCP connect to {addr} from pod {} in {timeout:?}: {last}",
                    pod.name
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })?
}

/// One TCP connect from inside `pod` (test runner's cgroup), with a timeout.
pub fn tcp_connect(pod: &Pod, addr: SocketAddr, timeout: Duration) -> Result<()> {
    pod.in_netns(|| TcpStream::connect_timeout(&addr, timeout).map(drop))?
        .with_context(|| format!("connect to {addr} from pod {}", pod.name))
}

/// `http://<ip>:<port><path>`, with brackets for IPv6.
pub fn url(ip: IpAddr, port: u16, path: &str) -> String {
    format!("http://{}{path}", SocketAddr::new(ip, port))
}

/// GETs `url` with curl run as `uid` inside `pod` and the test cgroup (so it is subject to the
/// redirection under test). Fails on a curl error or an HTTP status >= 400.
pub fn http_get(env: &TestEnv, pod: &Pod, uid: u32, url: &str) -> Result<String> {
    let out = pod.run(
        env,
        uid,
        &[
            "curl",
            "--max-time",
            "5",
            "-sS",
            "-g",
            "--fail-with-body",
            "--noproxy",
            "*",
            url,
        ],
    )?;
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "curl {url} from pod {} as uid {uid} failed ({}): {} {}",
            pod.name,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            tail(&body, 1000)
        );
    }
    Ok(body)
}

/// TCP sockets in LISTEN state in the netns of process `pid` (from /proc/<pid>/net/tcp{,6}).
/// Reading them opens no connection, so it disturbs no counter of the code under test.
pub fn listening_sockets(pid: u32) -> Result<Vec<SocketAddr>> {
    let mut out = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let path = format!("/proc/{pid}/net/{file}");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            // No IPv6 in that netns, or the process is gone (the caller checks that).
            Err(_) => continue,
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 3 && f[3] == "0A" {
                out.push(parse_proc_addr(f[1], v6).with_context(|| format!("{path}: {line}"))?);
            }
        }
    }
    Ok(out)
}

/// Parses `0100007F:3A99` (IPv4) or 32 hex digits + port (IPv6): each 32-bit word is printed
/// in host byte order.
fn parse_proc_addr(s: &str, v6: bool) -> Result<SocketAddr> {
    let (ip, port) = s.split_once(':').context("no port")?;
    let port = u16::from_str_radix(port, 16)?;
    let word = |i: usize| -> Result<[u8; 4]> {
        let w = ip.get(i * 8..i * 8 + 8).context("short address")?;
        Ok(u32::from_str_radix(w, 16)?.to_ne_bytes())
    };
    let ip = if v6 {
        let mut b = [0u8; 16];
        for i in 0..4 {
            b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
        }
        IpAddr::V6(Ipv6Addr::from(b))
    } else {
        IpAddr::V4(Ipv4Addr::from(word(0)?))
    };
    Ok(SocketAddr::new(ip, port))
}

/// Waits until `child` listens on every address of `want`; fails early, with the child's
/// output, if it exits.
pub fn wait_listening(
    child: &mut ChildGuard,
    want: &[SocketAddr],
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + crate::scaled(timeout);
    loop {
        child.ensure_running()?;
        let have = listening_sockets(child.pid())?;
        let missing: Vec<_> = want.iter().filter(|w| !have.contains(w)).collect();
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "`{}` not listening on {missing:?} after {timeout:?} (listening: {have:?})\nstderr: {}",
                child.label(),
                tail(&child.stderr(), 4000)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts in `pod` the UDP DNS listener a proxy runs (UID and GID 1337) on `addr`: `probe
/// udp-serve` with its replies named `dns-proxy`, so that a test tells them from a real
/// server's when both see the same sender.
pub fn spawn_dns_listener(env: &TestEnv, pod: &Pod, probe: &str, addr: &str) -> Result<ChildGuard> {
    pod.spawn(
        env,
        Spawn::new(&[probe, "udp-serve", addr, "--name", "dns-proxy"]).user(1337, 1337),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_endian = "little")]
    fn parses_proc_net_addresses() {
        assert_eq!(
            parse_proc_addr("0100007F:3A99", false).unwrap(),
            "127.0.0.1:15001".parse().unwrap()
        );
        assert_eq!(
            parse_proc_addr("00000000000000000000000001000000:3A99", true).unwrap(),
            "[::1]:15001".parse().unwrap()
        );
        assert_eq!(
            parse_proc_addr("00000000000000000000000000000000:3A9E", true).unwrap(),
            "[::]:15006".parse().unwrap()
        );
    }
}
