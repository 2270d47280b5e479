//! What runs on the node, as the agent can see it without the API server: the plugin's state
//! records, and the pod network namespaces.
//!
//! Pod netns are found two ways:
//! - bind mounts under the netns directories (default /run/netns), where containerd
//!   (`cni-<uuid>`) and CRI-O keep every pod sandbox's netns; `netns-prefix` narrows them;
//! - with `scan-proc` and no prefix, `/proc/*/ns/net` of every process, for runtimes that keep no
//!   bind mount. The host netns (ours, PID 1's) is never a pod.
//!
//! A netns found only through /proc is anybody's: root in a pod can `unshare -Urn`, put another
//! pod's address on a dummy interface, and so pass for that pod when repair matches netns to
//! pods by address (and have repair delete, label or enrol it). Such a netns belongs to a user
//! namespace of the process's own making, while a runtime makes pod netns from the node's user
//! namespace, so one found only through /proc is a pod's only when it belongs to the node's user
//! namespace ([`sidestep::userns::owned_by_ours`]: an ioctl on the netns, nothing entered), or when
//! a record of the plugin names it (a sandbox the runtime gave the plugin, such as a
//! `hostUsers: false` pod's, whose netns its own user namespace owns). Any other is left out
//! before anything reads from inside it. A bind mount under the netns directories is the
//! runtime's (a pod cannot make one there), so it counts whatever user namespace owns it: a
//! `hostUsers: false` pod the runtime keeps there is reported and repaired as any other.
//!
//! Each is identified by its cookie (read from inside it, as enrolment does), so a record, a map
//! entry and a live netns are compared by the one key the data path uses.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use sidestep::netns::Netns;

/// A record as the agent lists pods: the library's lenient view of the plugin's records.
pub use sidestep::statedir::RecordSummary as Record;
use sidestep::statedir::StateDir;

/// The records of the state directory, by file; unreadable ones are skipped with a warning.
pub fn records(state_dir: &Path) -> BTreeMap<PathBuf, Record> {
    StateDir::new(state_dir).summaries()
}

/// Names of record files (cheap: no parsing), for counting ADDs and DELs between scans.
pub fn record_names(state_dir: &Path) -> Vec<String> {
    StateDir::new(state_dir).record_names()
}

/// How many FAIL_OPEN markers (pods let through uncaptured) the plugin left.
pub fn failopen_markers(state_dir: &Path) -> usize {
    StateDir::new(state_dir).marker_names().len()
}

/// A live pod network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveNetns {
    pub path: PathBuf,
    pub cookie: u64,
    /// Processes in it (0 for a netns kept only by its bind mount, e.g. a pause-less sandbox).
    pub processes: usize,
}

/// Where to look, from the settings.
#[derive(Debug, Clone)]
pub struct Scan<'a> {
    pub netns_dirs: &'a [PathBuf],
    pub prefix: &'a str,
    pub scan_proc: bool,
    pub proc_dir: &'a Path,
    /// The netns the plugin's records name (the path as the plugin wrote it, and the cookie):
    /// pod sandboxes whatever user namespace owns them.
    pub recorded: &'a [(PathBuf, u64)],
}

fn dev_ino(path: &Path) -> Option<(u64, u64)> {
    fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// A netns the scan found, before it is opened.
struct Found {
    path: PathBuf,
    processes: usize,
    /// Under a netns directory (the runtime's bind mount), not only through a process.
    bind_mounted: bool,
}

/// Every pod netns: opened (refusing the host's, and those only a process vouches for that are
/// no pod's: see the module's doc) and its cookie read.
pub fn live_netns(scan: &Scan<'_>) -> Vec<LiveNetns> {
    let mut found: BTreeMap<(u64, u64), Found> = BTreeMap::new();
    for dir in scan.netns_dirs {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            if !e.file_name().to_string_lossy().starts_with(scan.prefix) {
                continue;
            }
            let path = e.path();
            if let Some(key) = dev_ino(&path) {
                found.entry(key).or_insert(Found {
                    path,
                    processes: 0,
                    bind_mounted: true,
                });
            }
        }
    }
    if let Ok(entries) = fs::read_dir(scan.proc_dir) {
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let path = e.path().join("ns/net");
            let Some(key) = dev_ino(&path) else { continue };
            match found.get_mut(&key) {
                Some(f) => f.processes += 1,
                None if scan.scan_proc && scan.prefix.is_empty() => {
                    found.insert(
                        key,
                        Found {
                            path,
                            processes: 1,
                            bind_mounted: false,
                        },
                    );
                }
                None => {}
            }
        }
    }
    let recorded = recorded_netns(scan);
    found
        .into_values()
        .filter_map(|f| {
            // The host's netns, and files that are not netns, are refused here.
            let netns = Netns::open(&f.path).ok()?;
            if !f.bind_mounted && !is_pod_sandbox(&netns, &recorded) {
                return None;
            }
            let cookie = netns
                .cookie()
                .map_err(|e| tracing::debug!(netns = %f.path.display(), error = %e, "no cookie"))
                .ok()?;
            Some(LiveNetns {
                path: f.path,
                cookie,
                processes: f.processes,
            })
        })
        .collect()
}

/// The recorded netns by what their paths name now: (dev, ino) -> the cookies records give it
/// (more than one only for a stale `/proc/PID` path whose PID another process has now).
fn recorded_netns(scan: &Scan<'_>) -> BTreeMap<(u64, u64), BTreeSet<u64>> {
    let mut out: BTreeMap<(u64, u64), BTreeSet<u64>> = BTreeMap::new();
    for (path, cookie) in scan.recorded {
        if let Some(key) = dev_ino(&agent_view(path, scan.proc_dir)) {
            out.entry(key).or_default().insert(*cookie);
        }
    }
    out
}

/// Whether a netns that only a process vouches for is a pod's: it belongs to the node's user
/// namespace, or a record names this very netns (the inode its recorded path names now, and the
/// recorded cookie, which no other netns ever has). Anything else is left out without a look
/// inside: neither its user namespace nor the netns itself is entered.
fn is_pod_sandbox(netns: &Netns, recorded: &BTreeMap<(u64, u64), BTreeSet<u64>>) -> bool {
    let owner = sidestep::userns::owned_by_ours(netns);
    if matches!(owner, Ok(true)) {
        return true;
    }
    // The open fd's inode: the path may name another netns by now.
    let key = netns.fd_metadata().ok().map(|m| (m.dev(), m.ino()));
    if let Some(cookies) = key.and_then(|k| recorded.get(&k))
        && netns.cookie().is_ok_and(|c| cookies.contains(&c))
    {
        return true;
    }
    tracing::debug!(
        netns = %netns.path().display(),
        owner = %match owner {
            Ok(_) => "another user namespace".to_owned(),
            Err(e) => e.to_string(),
        },
        "left out: a netns found only through a process, which belongs to a user namespace \
         other than the node's and which no record names (made by a process, such as \
         `unshare -Urn` in a pod, not a sandbox the runtime made)"
    );
    false
}

/// What became of a recorded netns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Still the same netns.
    Alive,
    /// The path is gone, or now names another netns: the pod is gone.
    Gone,
    /// The agent cannot tell (the path's directory is not visible here, or opening failed for
    /// another reason): never collected on this.
    Unknown(String),
}

/// A netns path as the plugin wrote it (the host's view), as the agent sees it: `/proc/...`
/// lives under `proc_dir` when the host's /proc is mounted elsewhere.
pub fn agent_view(path: &Path, proc_dir: &Path) -> PathBuf {
    match path.strip_prefix("/proc") {
        Ok(rest) if proc_dir != Path::new("/proc") => proc_dir.join(rest),
        _ => path.to_path_buf(),
    }
}

pub fn fate(path: &Path, cookie: u64) -> Fate {
    match path.parent() {
        Some(dir) if dir.is_dir() => {}
        // /proc/PID/ns/net: the PID directory goes with the process.
        Some(dir)
            if dir.ends_with("ns")
                && dir
                    .parent()
                    .and_then(Path::parent)
                    .is_some_and(Path::is_dir) =>
        {
            return Fate::Gone;
        }
        _ => {
            return Fate::Unknown(format!(
                "{} is not visible to the agent (mount it)",
                path.parent().unwrap_or(path).display()
            ));
        }
    }
    match Netns::open(path) {
        Ok(n) => match n.cookie() {
            Ok(c) if c == cookie => Fate::Alive,
            Ok(_) => Fate::Gone,
            Err(e) => Fate::Unknown(e.to_string()),
        },
        Err(sidestep::error::NetnsError::Open { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            Fate::Gone
        }
        // The path is there but is no netns any more (the bind mount went).
        Err(sidestep::error::NetnsError::NotNetns(_)) => Fate::Gone,
        Err(e) => Fate::Unknown(e.to_string()),
    }
}

pub use sidestep::netns::addresses::{AddressesError, PodAddresses};

/// The first interface other than loopback that has a global address, with its addresses, in
/// the netns the scan found: the one its path names now is read only if it has the scan's
/// cookie, so a process that took a scanned process's PID cannot have its netns read instead.
pub fn pod_addresses(live: &LiveNetns) -> Result<PodAddresses, AddressesError> {
    sidestep::netns::addresses::pod_addresses(&live.path, live.cookie)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_paths_seen_from_the_agent() {
        let p = Path::new("/proc/42/ns/net");
        assert_eq!(
            agent_view(p, Path::new("/host/proc")),
            Path::new("/host/proc/42/ns/net")
        );
        assert_eq!(agent_view(p, Path::new("/proc")), p);
        let n = Path::new("/var/run/netns/cni-1");
        assert_eq!(agent_view(n, Path::new("/host/proc")), n);
    }

    #[test]
    fn gone_only_when_sure() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(fate(&dir.path().join("cni-gone"), 1), Fate::Gone);
        // A plain file where the bind mount was.
        std::fs::write(dir.path().join("cni-file"), "").unwrap();
        assert_eq!(fate(&dir.path().join("cni-file"), 1), Fate::Gone);
        assert_eq!(fate(Path::new("/proc/4000000000/ns/net"), 1), Fate::Gone);
        assert!(matches!(
            fate(Path::new("/not-mounted-here/netns/x"), 1),
            Fate::Unknown(_)
        ));
    }

    /// A child process in namespaces of its own (`unshare(flags)`), until dropped.
    struct Unshared {
        pid: nix::unistd::Pid,
        go: Option<std::os::fd::OwnedFd>,
    }

    impl Unshared {
        fn new(flags: libc::c_int) -> Self {
            use std::os::fd::AsRawFd as _;
            let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
            let (go_r, go_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
            // SAFETY: the child makes raw system calls only (close, unshare, write, read,
            // _exit), so forking the multithreaded test process is sound.
            match unsafe { nix::unistd::fork() }.unwrap() {
                nix::unistd::ForkResult::Child => unsafe {
                    // SAFETY: raw syscalls on fds this process holds; `_exit` never returns.
                    libc::close(ready_r.as_raw_fd());
                    libc::close(go_w.as_raw_fd());
                    let status = [u8::from(libc::unshare(flags) == 0)];
                    libc::write(ready_w.as_raw_fd(), status.as_ptr().cast(), 1);
                    let mut byte = [0u8; 1];
                    libc::read(go_r.as_raw_fd(), byte.as_mut_ptr().cast(), 1);
                    libc::_exit(0)
                },
                nix::unistd::ForkResult::Parent { child } => {
                    drop((ready_w, go_r));
                    let mut status = [0u8; 1];
                    let n = nix::unistd::read(ready_r.as_raw_fd(), &mut status).unwrap();
                    assert_eq!((n, status[0]), (1, 1), "unshare({flags:#x}) failed");
                    Self {
                        pid: child,
                        go: Some(go_w),
                    }
                }
            }
        }
    }

    impl Drop for Unshared {
        fn drop(&mut self) {
            if let Some(go) = self.go.take() {
                let _ = nix::unistd::write(&go, &[1]);
            }
            let _ = nix::sys::wait::waitpid(self.pid, None);
        }
    }

    /// A netns that only a process vouches for is a pod's when the node's user namespace owns
    /// it, or a record names it; one a process made in a user namespace of its own (as
    /// `unshare -Urn` in a pod does) is left out. Needs root (a netns in ours).
    #[test]
    fn a_netns_in_a_nested_user_namespace_is_no_pod_unless_recorded() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let pod = Unshared::new(libc::CLONE_NEWNET);
        let nested = Unshared::new(libc::CLONE_NEWUSER | libc::CLONE_NEWNET);
        // A /proc of these two processes only, with the real ns files behind it.
        let proc_dir = tempfile::tempdir().unwrap();
        for u in [&pod, &nested] {
            let dir = proc_dir.path().join(u.pid.to_string()).join("ns");
            std::fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::symlink(format!("/proc/{}/ns/net", u.pid), dir.join("net")).unwrap();
        }
        let netns_path = |u: &Unshared| PathBuf::from(format!("/proc/{}/ns/net", u.pid));
        let cookie = |u: &Unshared| Netns::open(&netns_path(u)).unwrap().cookie().unwrap();
        let live = |recorded: &[(PathBuf, u64)]| -> Vec<u64> {
            let scan = Scan {
                netns_dirs: &[],
                prefix: "",
                scan_proc: true,
                proc_dir: proc_dir.path(),
                recorded,
            };
            live_netns(&scan).into_iter().map(|l| l.cookie).collect()
        };
        assert!(sidestep::userns::owned_by_ours(&Netns::open(&netns_path(&pod)).unwrap()).unwrap());
        assert!(
            !sidestep::userns::owned_by_ours(&Netns::open(&netns_path(&nested)).unwrap()).unwrap()
        );
        assert_eq!(live(&[]), [cookie(&pod)]);
        // A record of the nested one's sandbox (a `hostUsers: false` pod's): it counts.
        let mut both = live(&[(netns_path(&nested), cookie(&nested))]);
        both.sort_unstable();
        let mut want = [cookie(&pod), cookie(&nested)];
        want.sort_unstable();
        assert_eq!(both, want);
        // A record that names its path with another cookie (a PID taken over) does not.
        assert_eq!(live(&[(netns_path(&nested), cookie(&pod))]), [cookie(&pod)]);
    }

    #[test]
    fn records_are_read_tolerantly() {
        let dir = tempfile::tempdir().unwrap();
        let rec = serde_json::json!({
            "format": 1, "network": "n", "containerID": "c", "ifname": "eth0",
            "netns": "/run/netns/x", "netnsCookie": 7, "interfaces": ["eth0"],
            "podName": "web", "podNamespace": "shop", "mesh": "istio", "policy": {},
            "pinRoot": "/sys/fs/bpf/sidestep", "createdUnix": 1, "futureField": true
        });
        std::fs::write(dir.path().join("c@eth0.json"), rec.to_string()).unwrap();
        std::fs::write(dir.path().join("bad@eth0.json"), "{").unwrap();
        std::fs::write(dir.path().join(".c@eth0.json.tmp.1"), "{").unwrap();
        std::fs::create_dir(dir.path().join("failopen")).unwrap();
        std::fs::write(dir.path().join("failopen/d@eth0.json"), "{}").unwrap();
        let r = records(dir.path());
        assert_eq!(r.len(), 1);
        let (_, rec) = r.into_iter().next().unwrap();
        assert_eq!(rec.netns_cookie, 7);
        assert_eq!(rec.pod_name.as_deref(), Some("web"));
        assert_eq!(record_names(dir.path()).len(), 2);
        assert_eq!(failopen_markers(dir.path()), 1);
    }
}
