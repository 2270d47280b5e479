//! Network namespaces: opening one, refusing the host's, reading its cookie, and running code
//! inside it. A visit moves the calling thread in and back (setns(2) of a network namespace is
//! per thread and remounts nothing, unlike `ip netns exec`), as the CNI reference plugins' `ns.Do`
//! does: a fresh thread per visit cost more than the rest of reading a cookie.

use std::{
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
};

use nix::sched::{CloneFlags, setns};

pub mod addresses;

const NSFS_MAGIC: i64 = 0x6e73_6673;
const SO_NETNS_COOKIE: libc::c_int = 71;

/// An open network namespace, verified not to be the host's.
#[derive(Debug)]
pub struct Netns {
    path: PathBuf,
    file: File,
    /// Read once: each read enters the netns.
    cookie: std::sync::OnceLock<u64>,
}

impl Netns {
    /// Opens a pod netns path such as /run/netns/x or /proc/PID/ns/net.
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let fs = nix::sys::statfs::fstatfs(&file).map_err(|e| NetnsError::Open {
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        if fs.filesystem_type().0 as i64 != NSFS_MAGIC {
            return Err(NetnsError::NotNetns(path.to_path_buf()));
        }
        let netns = Self {
            path: path.to_path_buf(),
            file,
            cookie: std::sync::OnceLock::new(),
        };
        if netns.is_host()? {
            return Err(NetnsError::HostNetns(path.to_path_buf()));
        }
        Ok(netns)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The namespace this value was opened and checked as. Attach to it through this fd, never
    /// by opening the path again: a `/proc/PID/ns/net` path can name another netns by then.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The opened namespace's inode (`st_dev`, `st_ino` identify it while it lives), whatever
    /// its path names by now.
    pub fn fd_metadata(&self) -> io::Result<std::fs::Metadata> {
        self.file.metadata()
    }

    /// The host netns is the one init (PID 1) lives in. Where PID 1's namespace is hidden (a
    /// sandbox), the netns this process runs in stands for it: the plugin and the agent run in the
    /// host netns.
    fn is_host(&self) -> Result<bool, NetnsError> {
        let ours = self.file.metadata().map_err(|source| NetnsError::Open {
            path: self.path.clone(),
            source,
        })?;
        let same = |path: &str| {
            std::fs::metadata(path)
                .map(|m| m.dev() == ours.dev() && m.ino() == ours.ino())
                .ok()
        };
        let own = same("/proc/self/ns/net").ok_or_else(|| NetnsError::Open {
            path: "/proc/self/ns/net".into(),
            source: io::Error::last_os_error(),
        })?;
        Ok(own || same("/proc/1/ns/net").unwrap_or(false))
    }

    /// Runs `f` with the calling thread inside this netns, and moves the thread back to the netns
    /// it was in before returning, also when `f` panics. `f` must not block on other threads
    /// doing network work for it: they stay where they are.
    pub fn run<T>(&self, f: impl FnOnce() -> io::Result<T>) -> Result<T, NetnsError> {
        let enter = |source: io::Error| NetnsError::Enter {
            path: self.path.clone(),
            source,
        };
        let home = File::open("/proc/thread-self/ns/net").map_err(enter)?;
        setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| enter(e.into()))?;
        let _back = GoHome(home);
        f().map_err(enter)
    }

    /// The netns cookie (SO_NETNS_COOKIE), the key of every per-pod map entry.
    /// A netns keeps its cookie for its whole life, so it is read once per handle.
    pub fn cookie(&self) -> Result<u64, NetnsError> {
        if let Some(c) = self.cookie.get() {
            return Ok(*c);
        }
        let c = self.run(socket_netns_cookie).map_err(|e| match e {
            NetnsError::Enter { path, source } if source.raw_os_error().is_some() => {
                NetnsError::Cookie { path, source }
            }
            other => other,
        })?;
        Ok(*self.cookie.get_or_init(|| c))
    }
}

/// Moves the thread back to its netns when a visit ends.
struct GoHome(File);

impl Drop for GoHome {
    fn drop(&mut self) {
        if let Err(e) = setns(self.0.as_fd(), CloneFlags::CLONE_NEWNET) {
            // Anything this thread did next (map writes for the wrong pod, routes, links) would
            // land in the pod's netns: stopping is the only safe outcome.
            eprintln!("sidestep: cannot return to the original network namespace: {e}");
            std::process::abort();
        }
    }
}

/// Whether a TCP socket of the calling thread's netns holds `port` (any address, IPv4 or IPv6):
/// a wildcard dual-stack bind to it fails with EADDRINUSE. A socket bound to the port without
/// listening counts too, which only errs on the safe side for the caller. Reading
/// /proc/net/tcp instead walks the machine's whole socket hash, milliseconds per ADD.
pub fn tcp_listening_on(port: u16) -> io::Result<bool> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, SockaddrIn6, bind, setsockopt, socket,
        sockopt::Ipv6V6Only,
    };
    let in_use = |r: nix::Result<()>| match r {
        Ok(()) => Ok(false),
        Err(nix::errno::Errno::EADDRINUSE) => Ok(true),
        Err(e) => Err(io::Error::from(e)),
    };
    match socket(
        AddressFamily::Inet6,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    ) {
        Ok(s) => {
            setsockopt(&s, Ipv6V6Only, &false)?;
            let any = SockaddrIn6::from(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::UNSPECIFIED,
                port,
                0,
                0,
            ));
            in_use(bind(s.as_raw_fd(), &any))
        }
        // A netns or kernel without IPv6.
        Err(nix::errno::Errno::EAFNOSUPPORT) => {
            let s = socket(
                AddressFamily::Inet,
                SockType::Stream,
                SockFlag::SOCK_CLOEXEC,
                None,
            )?;
            in_use(bind(s.as_raw_fd(), &SockaddrIn::new(0, 0, 0, 0, port)))
        }
        Err(e) => Err(e.into()),
    }
}

/// The cookie of the netns the calling thread is in.
pub fn socket_netns_cookie() -> io::Result<u64> {
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            std::ptr::from_mut(&mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The node's netns cookie, as the loader sees it: the calling thread's, unless init (PID 1) is
/// visibly in another netns, where the caller is not on the node's network (a container without
/// hostNetwork that shares the host's PIDs) and `None` is the answer. Where init's netns cannot be
/// read (a PID namespace of its own), the thread's stands for it, as for [`Netns`]'s host check.
pub fn node_netns_cookie() -> io::Result<Option<u64>> {
    let ours = std::fs::metadata("/proc/thread-self/ns/net")?;
    if let Ok(init) = std::fs::metadata("/proc/1/ns/net")
        && (init.dev(), init.ino()) != (ours.dev(), ours.ino())
    {
        return Ok(None);
    }
    socket_netns_cookie().map(Some)
}

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("cannot open network namespace {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{0} is not a network namespace")]
    NotNetns(PathBuf),
    #[error(
        "{0} is the host network namespace; sidestep never enrols it (hostNetwork pods are not captured)"
    )]
    HostNetns(PathBuf),
    #[error("cannot enter network namespace {path}: {source}")]
    Enter { path: PathBuf, source: io::Error },
    #[error("cannot read the cookie of network namespace {path}: {source}")]
    Cookie { path: PathBuf, source: io::Error },
}

#[cfg(test)]
mod tests {
    #[test]
    fn tcp_listening_on_sees_a_listener_of_this_netns() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(super::tcp_listening_on(port).unwrap());
        drop(l);
        assert!(!super::tcp_listening_on(port).unwrap());
        let l6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(l6) = l6 {
            let port = l6.local_addr().unwrap().port();
            assert!(super::tcp_listening_on(port).unwrap());
        }
    }
}
