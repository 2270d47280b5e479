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

/// Creates a named network namespace owned by a new user namespace that maps its IDs
/// `0..count` (users and groups) to the host's `base..base + count`, as a `hostUsers: false`
/// pod's sandbox is. The caller owns its removal ([`delete`]); the user namespace lives as long
/// as the netns does.
pub fn create_in_userns(name: &str, base: u32, count: u32) -> Result<PathBuf> {
    use std::os::fd::AsRawFd as _;
    // Close-on-exec, so that processes other tests spawn meanwhile do not keep them open.
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (go_r, go_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: the child makes raw system calls only (unshare, write, read, _exit), all
    // async-signal-safe, so forking this multithreaded test process is sound.
    let child = match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            // SAFETY: raw syscalls on fds this process holds; `_exit` never returns. One
            // unshare makes the user namespace first, then the netns owned by it.
            unsafe {
                libc::close(ready_r.as_raw_fd());
                libc::close(go_w.as_raw_fd());
                let ok = libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) == 0;
                let status = [u8::from(ok)];
                libc::write(ready_w.as_raw_fd(), status.as_ptr().cast(), 1);
                let mut byte = [0u8; 1];
                libc::read(go_r.as_raw_fd(), byte.as_mut_ptr().cast(), 1);
                libc::_exit(0)
            }
        }
        nix::unistd::ForkResult::Parent { child } => child,
    };
    drop((ready_w, go_r));
    let result = (|| -> Result<PathBuf> {
        let mut status = [0u8; 1];
        let n = nix::unistd::read(ready_r.as_raw_fd(), &mut status)?;
        if n != 1 || status[0] != 1 {
            bail!("the child could not unshare a user and network namespace");
        }
        let map = format!("0 {base} {count}\n");
        for file in ["uid_map", "gid_map"] {
            fs::write(format!("/proc/{child}/{file}"), &map)
                .with_context(|| format!("writing {file} of {child}"))?;
        }
        cmd(&["ip", "netns", "attach", name, &child.to_string()])?;
        Ok(Path::new(NETNS_DIR).join(name))
    })();
    // An explicit byte, not EOF: a child another test forked meanwhile may hold this end.
    let _ = nix::unistd::write(&go_w, &[1]);
    drop(go_w);
    let _ = nix::sys::wait::waitpid(child, None);
    result
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
