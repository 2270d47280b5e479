//! What runs on the node, as the agent can see it without the API server: the plugin's state
//! records, and the pod network namespaces.
//!
//! Pod netns are found two ways:
//! - bind mounts under the netns directories (default /run/netns), where containerd
//!   (`cni-<uuid>`) and CRI-O keep every pod sandbox's netns; `netns-prefix` narrows them;
//! - with `scan-proc` and no prefix, `/proc/*/ns/net` of every process, for runtimes that keep no
//!   bind mount. The host netns (ours, PID 1's) is never a pod.
//!
//! Each is identified by its cookie (read from inside it, as enrolment does), so a record, a map
//! entry and a live netns are compared by the one key the data path uses.

use std::{
    collections::BTreeMap,
    fs,
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use crate::netns::Netns;

/// The fields of the plugin's `AttachmentRecord` (cni/src/state.rs) that the agent uses.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub network: String,
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
    pub netns: PathBuf,
    pub netns_cookie: u64,
    #[serde(default)]
    pub pod_name: Option<String>,
    #[serde(default)]
    pub pod_namespace: Option<String>,
    #[serde(default)]
    pub pin_root: Option<PathBuf>,
    #[serde(default)]
    pub policy: RecordPolicy,
    /// Its ADD is under way (or died before finishing).
    #[serde(default)]
    pub pending: bool,
}

/// The part of the recorded policy the agent uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordPolicy {
    #[serde(default)]
    pub exclude_interfaces: Vec<String>,
}

/// The records of the state directory, by file; unreadable ones are skipped with a warning.
pub fn records(state_dir: &Path) -> BTreeMap<PathBuf, Record> {
    let Ok(entries) = fs::read_dir(state_dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| is_record_name(p))
        .filter_map(
            |p| match fs::read(&p).map(|b| serde_json::from_slice::<Record>(&b)) {
                Ok(Ok(r)) => Some((p, r)),
                Ok(Err(e)) => {
                    tracing::warn!(record = %p.display(), error = %e, "unreadable state record");
                    None
                }
                // Removed by a DEL between listing and reading.
                Err(_) => None,
            },
        )
        .collect()
}

fn is_record_name(p: &Path) -> bool {
    p.is_file()
        && p.extension().is_some_and(|x| x == "json")
        && !p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
}

/// Names of record files (cheap: no parsing), for counting ADDs and DELs between scans.
pub fn record_names(state_dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(state_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| is_record_name(p))
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// How many FAIL_OPEN markers (pods let through uncaptured) the plugin left.
pub fn failopen_markers(state_dir: &Path) -> usize {
    fs::read_dir(state_dir.join("failopen"))
        .map(|d| d.flatten().filter(|e| is_record_name(&e.path())).count())
        .unwrap_or(0)
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
}

fn dev_ino(path: &Path) -> Option<(u64, u64)> {
    fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Every pod netns: opened (refusing the host's) and its cookie read.
pub fn live_netns(scan: &Scan<'_>) -> Vec<LiveNetns> {
    // (dev, ino) -> (path to open, processes)
    let mut found: BTreeMap<(u64, u64), (PathBuf, usize)> = BTreeMap::new();
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
                found.entry(key).or_insert((path, 0));
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
                Some((_, n)) => *n += 1,
                None if scan.scan_proc && scan.prefix.is_empty() => {
                    found.insert(key, (path, 1));
                }
                None => {}
            }
        }
    }
    found
        .into_values()
        .filter_map(|(path, processes)| {
            // The host's netns, and files that are not netns, are refused here.
            let netns = Netns::open(&path).ok()?;
            let cookie = netns
                .cookie()
                .map_err(|e| tracing::debug!(netns = %path.display(), error = %e, "no cookie"))
                .ok()?;
            Some(LiveNetns {
                path,
                cookie,
                processes,
            })
        })
        .collect()
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
        Err(crate::error::NetnsError::Open { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            Fate::Gone
        }
        // The path is there but is no netns any more (the bind mount went).
        Err(crate::error::NetnsError::NotNetns(_)) => Fate::Gone,
        Err(e) => Fate::Unknown(e.to_string()),
    }
}

/// A pod's interface and addresses, as a CNI result would give them (for repair).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAddresses {
    pub ifname: String,
    /// Address and prefix length.
    pub ips: Vec<(IpAddr, u8)>,
}

/// The first interface other than loopback that has a global address, with its addresses.
pub fn pod_addresses(netns: &Path) -> Option<PodAddresses> {
    let ns = Netns::open(netns).ok()?;
    let addrs = ns
        .run(|| {
            let mut out: Vec<(String, IpAddr, u8)> = Vec::new();
            for a in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
                if a.interface_name == "lo" {
                    continue;
                }
                let (Some(addr), Some(mask)) = (a.address, a.netmask) else {
                    continue;
                };
                let entry =
                    if let (Some(a4), Some(m4)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in()) {
                        (IpAddr::V4(a4.ip()), u32::from(m4.ip()).count_ones() as u8)
                    } else if let (Some(a6), Some(m6)) =
                        (addr.as_sockaddr_in6(), mask.as_sockaddr_in6())
                    {
                        let ip = a6.ip();
                        if ip.is_unicast_link_local() {
                            continue;
                        }
                        (IpAddr::V6(ip), u128::from(m6.ip()).count_ones() as u8)
                    } else {
                        continue;
                    };
                out.push((a.interface_name.clone(), entry.0, entry.1));
            }
            Ok(out)
        })
        .ok()?;
    let ifname = addrs.first()?.0.clone();
    Some(PodAddresses {
        ips: addrs
            .iter()
            .filter(|(n, _, _)| *n == ifname)
            .map(|(_, ip, len)| (*ip, *len))
            .collect(),
        ifname,
    })
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
