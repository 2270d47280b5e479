//! What the node changes on the host, found and undone precisely: cgroups, mounts, processes,
//! iptables chains and sysctls. Other users' tests run on this machine at the same time, so
//! everything here acts only on what it can prove is the node's own: paths under its scratch
//! directory or its cgroup, and chains that were not there before `up`.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::cmd::Cmd;

// --- cgroups ------------------------------------------------------------------------------

/// Every cgroup hierarchy's mount point: the v1 controllers and the hybrid cgroup2 at
/// /sys/fs/cgroup/unified. runc creates a pod's path in all of them, so the node's subtree
/// exists (and must be removed) in all of them.
pub fn cgroup_mounts() -> Result<Vec<PathBuf>> {
    let mut mounts: Vec<PathBuf> = mountinfo()?
        .into_iter()
        .filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2")
        .map(|m| m.mount_point)
        .collect();
    mounts.sort();
    mounts.dedup();
    Ok(mounts)
}

/// xtask's own cgroup: the memory hierarchy's path when there is one (on this machine the
/// session's processes sit in a memory cgroup of their own and at the root elsewhere), else the
/// cgroup2 path. The node's subtree goes below it, never at a hierarchy's root.
pub fn own_cgroup() -> Result<String> {
    let text = fs::read_to_string("/proc/self/cgroup")?;
    let path_of = |want: &str| {
        text.lines().find_map(|l| {
            let mut fields = l.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            controllers
                .split(',')
                .any(|c| c == want)
                .then(|| path.to_owned())
        })
    };
    Ok(path_of("memory")
        .or_else(|| {
            text.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        })
        .unwrap_or_else(|| "/".into()))
}

/// Create `relative` (e.g. `/process_api/x/sidestep-e2e/etcd`) in every hierarchy and return
/// the directories that did not exist before, parents first, for teardown to remove.
pub fn create_cgroup(relative: &str) -> Result<Vec<PathBuf>> {
    let mut created = Vec::new();
    for mount in cgroup_mounts()? {
        let mut dir = mount.clone();
        for part in relative.split('/').filter(|p| !p.is_empty()) {
            let parent = dir.clone();
            dir.push(part);
            if dir.is_dir() {
                continue;
            }
            fs::create_dir(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
            created.push(dir.clone());
            // A new v1 cpuset has no CPUs and no memory nodes, and takes no process until it
            // has some: give it the parent's.
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(value) = fs::read_to_string(parent.join(file)) {
                    fs::write(dir.join(file), value.trim())
                        .with_context(|| format!("writing {}/{file}", dir.display()))?;
                }
            }
        }
    }
    Ok(created)
}

/// The `cgroup.procs` files of `relative` in every hierarchy, for a daemon to write itself into.
pub fn cgroup_procs_files(relative: &str) -> Result<Vec<PathBuf>> {
    Ok(cgroup_mounts()?
        .into_iter()
        .map(|m| join_cgroup(&m, relative).join("cgroup.procs"))
        .collect())
}

pub fn join_cgroup(mount: &Path, relative: &str) -> PathBuf {
    mount.join(relative.trim_start_matches('/'))
}

/// The directories of a tree (a cgroup subtree, say), deepest first.
pub fn dir_tree(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        if let Ok(entries) = fs::read_dir(&dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                }
            }
        }
        if dir.is_dir() {
            dirs.push(dir);
        }
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    dirs
}

/// Every process in a cgroup subtree.
pub fn cgroup_tree_pids(root: &Path) -> BTreeSet<i32> {
    dir_tree(root)
        .iter()
        .filter_map(|d| fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|s| {
            s.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

// --- processes ----------------------------------------------------------------------------

/// Whether `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.split_whitespace().next()?.to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

pub fn signal(pid: i32, sig: i32) {
    if pid > 1 {
        // SAFETY: kill(2) has no memory-safety preconditions; a stale pid only gets ESRCH.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// SIGTERM, then SIGKILL after `grace`; waits until the process is gone.
pub fn stop(pid: i32, grace: Duration) {
    signal(pid, libc::SIGTERM);
    let start = Instant::now();
    while alive(pid) {
        if start.elapsed() > grace {
            signal(pid, libc::SIGKILL);
            if start.elapsed() > grace + Duration::from_secs(5) {
                return;
            }
        }
        sleep(Duration::from_millis(100));
    }
}

/// The node's programs whose command line mentions `dir`: containerd's shims (`-address
/// <dir>/...`) outlive a killed containerd as children of PID 1. Only the node's own programs
/// (by their `comm`), so a user's `less <dir>/logs/kubelet.log` is left alone.
pub fn pids_mentioning(dir: &Path) -> BTreeSet<i32> {
    let needle = dir.as_os_str().as_bytes();
    let me = std::process::id() as i32;
    let mut pids = BTreeSet::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if !["containerd", "kube", "etcd"]
            .iter()
            .any(|p| comm.starts_with(p))
        {
            continue;
        }
        if let Ok(cmdline) = fs::read(entry.path().join("cmdline"))
            && cmdline.windows(needle.len()).any(|w| w == needle)
            && alive(pid)
        {
            pids.insert(pid);
        }
    }
    pids
}

// --- mounts -------------------------------------------------------------------------------

pub struct Mount {
    pub mount_point: PathBuf,
    pub fstype: String,
}

/// /proc/self/mountinfo, with the octal escapes (`\040` for a space) decoded.
pub fn mountinfo() -> Result<Vec<Mount>> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            Some(Mount {
                mount_point: PathBuf::from(unescape(fields.get(4)?)),
                fstype: fields.get(dash + 1)?.to_string(),
            })
        })
        .collect())
}

fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Ok(v) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mount points at or below `dir`, deepest first, so each is unmounted before its parent.
pub fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut points: Vec<PathBuf> = mountinfo()?
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    Ok(points)
}

/// Where the host's bpffs is mounted.
pub const BPFFS: &str = "/sys/fs/bpf";

/// A mount's propagation as findmnt prints it (`private`, `shared`, `private,slave`...), or
/// None when nothing is mounted exactly there.
pub fn propagation(point: &Path) -> Result<Option<String>> {
    let out = Cmd::new("findmnt")
        .args(["--noheadings", "--output", "PROPAGATION", "--mountpoint"])
        .arg(point)
        .read();
    Ok(out
        .ok()
        .map(|o| o.trim().to_owned())
        .filter(|o| !o.is_empty()))
}

pub fn make_propagation(point: &Path, flag: &str) -> Result<()> {
    Cmd::new("mount").arg(flag).arg(point).read()?;
    Ok(())
}

/// Bind-mount `dir` onto itself and make it (recursively) shared.
pub fn bind_shared(dir: &Path) -> Result<()> {
    Cmd::new("mount").arg("--bind").arg(dir).arg(dir).read()?;
    make_propagation(dir, "--make-rshared")
}

/// umount(2), falling back to a lazy detach for a mount that is still busy.
pub fn unmount(point: &Path) -> Result<()> {
    let path = CString::new(point.as_os_str().as_bytes())?;
    // SAFETY: `path` is a valid NUL-terminated string that outlives both calls.
    let plain = unsafe { libc::umount2(path.as_ptr(), 0) };
    if plain == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    let lazy = unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    if lazy == 0 {
        return Ok(());
    }
    Err(std::io::Error::last_os_error()).with_context(|| format!("umount {}", point.display()))
}

// --- iptables -----------------------------------------------------------------------------

/// Both backends and families: kubelet uses `iptables` from PATH (nft on Debian 12), and a
/// chain left in either would be ours to remove.
const IPTABLES: &[&str] = &[
    "iptables-nft",
    "ip6tables-nft",
    "iptables-legacy",
    "ip6tables-legacy",
];
const TABLES: &[&str] = &["filter", "nat", "mangle"];

/// `"<binary> <table> <chain>"` for every KUBE-* and CNI-* chain on the host now.
pub fn kube_chains() -> BTreeSet<String> {
    let mut chains = BTreeSet::new();
    for bin in IPTABLES.iter().filter(|b| crate::cmd::on_path(b)) {
        for table in TABLES {
            let Ok(rules) = Cmd::new(bin).args(["-w", "5", "-t", table, "-S"]).read() else {
                continue;
            };
            for line in rules.lines() {
                if let Some(chain) = line.strip_prefix("-N ")
                    && (chain.starts_with("KUBE-") || chain.starts_with("CNI-"))
                {
                    chains.insert(format!("{bin} {table} {chain}"));
                }
            }
        }
    }
    chains
}

/// Delete the chains in `now` that were not in `before`: first every rule that jumps to one,
/// then the chain itself.
pub fn remove_new_chains(before: &BTreeSet<String>) -> Vec<String> {
    let new: Vec<String> = kube_chains().difference(before).cloned().collect();
    for key in &new {
        let mut parts = key.split(' ');
        let (Some(bin), Some(table), Some(chain)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let rules = Cmd::new(bin)
            .args(["-w", "5", "-t", table, "-S"])
            .read()
            .unwrap_or_default();
        for rule in rules.lines() {
            let words = split_rule(rule);
            let jumps = words
                .windows(2)
                .any(|w| (w[0] == "-j" || w[0] == "-g") && w[1] == chain);
            if words.first().map(String::as_str) == Some("-A") && jumps {
                let _ = Cmd::new(bin)
                    .args(["-w", "5", "-t", table, "-D"])
                    .args(&words[1..])
                    .read();
            }
        }
        let _ = Cmd::new(bin)
            .args(["-w", "5", "-t", table, "-F", chain])
            .read();
        let _ = Cmd::new(bin)
            .args(["-w", "5", "-t", table, "-X", chain])
            .read();
    }
    new
}

/// Split an `iptables -S` line into words; comments are double-quoted and may hold spaces.
fn split_rule(rule: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in rule.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            _ => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

// --- sysctls ------------------------------------------------------------------------------

/// What the node changes for the whole host: kubelet writes these six at start (with
/// `protectKernelDefaults: false`, its default) and the bridge plugin with `isGateway` turns on
/// forwarding. `up` records them first and writes them back as soon as kubelet has started.
pub const SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
];

pub fn read_sysctl(name: &str) -> Option<String> {
    fs::read_to_string(Path::new("/proc/sys").join(name))
        .ok()
        .map(|v| v.trim().to_owned())
}

/// Write back recorded values; returns the ones that had changed.
pub fn restore_sysctls(recorded: &[(String, String)]) -> Vec<String> {
    let mut changed = Vec::new();
    for (name, value) in recorded {
        if read_sysctl(name).as_deref() != Some(value.as_str()) {
            let _ = fs::write(Path::new("/proc/sys").join(name), value);
            changed.push(format!("{name}={value}"));
        }
    }
    changed
}

/// A free TCP port on 127.0.0.1, as the kernel hands it out.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_rules_split_like_the_shell() {
        assert_eq!(
            split_rule(r#"-A OUTPUT -m comment --comment "kubelet firewall" -j KUBE-FIREWALL"#),
            [
                "-A",
                "OUTPUT",
                "-m",
                "comment",
                "--comment",
                "kubelet firewall",
                "-j",
                "KUBE-FIREWALL"
            ]
        );
        assert_eq!(unescape(r"/tmp/a\040b"), "/tmp/a b");
    }
}
