//! Named network namespaces (`ip netns add`, so they appear in `/run/netns` as CNI expects)
//! and running code inside one on a dedicated thread with setns(2).

use std::fs::{self, File};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use nix::sched::{CloneFlags, setns};

use crate::util::{cmd, poll};

/// Where `ip netns add` bind-mounts named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// Creates a named network namespace. The caller owns its removal ([`delete`]).
pub fn create(name: &str) -> Result<PathBuf> {
    cmd(&["ip", "netns", "add", name])?;
    Ok(Path::new(NETNS_DIR).join(name))
}

/// Deletes a named network namespace; a missing one is not an error.
pub fn delete(name: &str) -> Result<()> {
    if !Path::new(NETNS_DIR).join(name).exists() {
        return Ok(());
    }
    cmd(&["ip", "netns", "del", name]).map(drop)
}

/// Names in `/run/netns`.
pub fn list() -> Result<Vec<String>> {
    match fs::read_dir(NETNS_DIR) {
        Ok(rd) => Ok(rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).context("read /run/netns"),
    }
}

/// Runs `f` on a new thread that has joined the network namespace at `netns`, and returns its
/// result. Sockets made by `f` belong to that namespace; the rest of the process is untouched
/// and nothing is remounted.
pub fn run_in<T: Send>(netns: &Path, f: impl FnOnce() -> T + Send) -> Result<T> {
    let ns = File::open(netns).with_context(|| format!("open netns {}", netns.display()))?;
    std::thread::scope(|s| {
        s.spawn(move || -> Result<T> {
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("setns {}", netns.display()))?;
            Ok(f())
        })
        .join()
        .map_err(|_| anyhow!("thread in netns {} panicked", netns.display()))?
    })
}

/// Writes a sysctl (dotted name, e.g. `net.ipv6.conf.all.accept_dad`) inside `netns`.
pub fn set_sysctl(netns: &Path, key: &str, value: &str) -> Result<()> {
    let path = sysctl_path(key);
    run_in(netns, || fs::write(&path, value))?
        .with_context(|| format!("sysctl {key}={value} in {}", netns.display()))
}

/// Reads a sysctl inside `netns`.
pub fn get_sysctl(netns: &Path, key: &str) -> Result<String> {
    let path = sysctl_path(key);
    Ok(run_in(netns, || fs::read_to_string(&path))?
        .with_context(|| format!("sysctl {key} in {}", netns.display()))?
        .trim()
        .to_owned())
}

fn sysctl_path(key: &str) -> PathBuf {
    Path::new("/proc/sys").join(key.replace('.', "/"))
}

/// Whether IPv6 is enabled on `lo` in `netns`.
pub fn ipv6_enabled(netns: &Path) -> bool {
    get_sysctl(netns, "net.ipv6.conf.lo.disable_ipv6").is_ok_and(|v| v == "0")
}

/// The netns cookie (SO_NETNS_COOKIE), the key sidestep's maps use for a pod.
pub fn cookie(netns: &Path) -> Result<u64> {
    run_in(netns, || -> Result<u64> {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").context("socket")?;
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: `sock` is an open socket; `cookie` and `len` are valid for writes and `len`
        // holds the size of `cookie`.
        let ret = unsafe {
            libc::getsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                libc::SOL_SOCKET,
                libc::SO_NETNS_COOKIE,
                (&raw mut cookie).cast(),
                &mut len,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::last_os_error()).context("getsockopt(SO_NETNS_COOKIE)");
        }
        Ok(cookie)
    })?
}

/// Waits until no IPv6 address in `name` (a netns name) is tentative (DAD still running).
pub fn wait_no_tentative(name: &str, timeout: Duration) -> Result<()> {
    poll(
        &format!("IPv6 DAD in netns {name}"),
        timeout,
        Duration::from_millis(20),
        || {
            let out = cmd(&["ip", "-n", name, "-6", "addr", "show", "tentative"])?;
            Ok(out.trim().is_empty().then_some(()))
        },
    )
}

/// Adds an address with `nodad` to a link inside `name` (a netns name); "exists" is fine.
pub fn add_addr(name: &str, dev: &str, cidr: &str) -> Result<()> {
    let mut argv = vec!["ip", "-n", name, "addr", "add", cidr, "dev", dev];
    if cidr.contains(':') {
        argv.push("nodad");
    }
    match cmd(&argv) {
        Ok(_) => Ok(()),
        Err(e) if format!("{e:#}").contains("File exists") => Ok(()),
        Err(e) => bail!("{e:#}"),
    }
}
