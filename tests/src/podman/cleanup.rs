//! What podman leaves behind when it fails half-way or its test is killed: libcni result
//! caches, host mounts under a scratch directory, cgroup v1 directories runc made for the cgroup
//! parent, and whole private storages of dead test processes.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::mount::{MntFlags, umount2};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use super::{CNI_CACHE, Podman, which};
use crate::netns;
use crate::sweep::pid_of_id;
use crate::util::pid_alive;

/// libcni's cached results for one container on `network`.
pub(super) fn cache_files(network: &str, container_id: &str) -> Vec<PathBuf> {
    let prefix = format!("{network}-{container_id}-");
    fs::read_dir(CNI_CACHE)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Mount points in /proc/self/mountinfo, in mount order.
pub(super) fn mount_points() -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .collect()
}

/// Lazily unmounts everything mounted under `dir` (podman's shm for a pod), deepest first.
pub(super) fn unmount_under(dir: &Path, errors: &mut Vec<String>) {
    let mut under: Vec<PathBuf> = mount_points()
        .into_iter()
        .filter(|m| m.starts_with(dir))
        .collect();
    under.reverse();
    for m in under {
        if let Err(e) = umount2(&m, MntFlags::MNT_DETACH) {
            errors.push(format!("umount {}: {e}", m.display()));
        }
    }
}

/// `<v1 hierarchy>/<rel>` for every cgroup v1 hierarchy that has it.
pub(super) fn v1_cgroup_dirs(rel: &str) -> Vec<PathBuf> {
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        return Vec::new();
    }
    v1_mounts()
        .into_iter()
        .map(|m| m.join(rel))
        .filter(|d| d.is_dir())
        .collect()
}

/// Mount points of cgroup v1 hierarchies.
pub(super) fn v1_mounts() -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            (post.split_whitespace().next()? == "cgroup")
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .collect()
}

/// Kills what is left in a cgroup v1 subtree and removes it, deepest first.
pub(super) fn remove_cgroup_tree(dir: &Path) -> Result<()> {
    let children: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    for c in &children {
        remove_cgroup_tree(c)?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for pid in fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
        {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).with_context(|| format!("rmdir {}", dir.display())),
        }
    }
}

/// Removes what killed podman tests left behind, which the generic sweep does not know:
/// - for a scratch directory of a dead process that holds a podman configuration, every pod
///   and container of that storage, with that configuration, so that podman runs CNI DEL and
///   removes its netns and mounts (call this before [`TestEnv::new`], whose sweep deletes
///   those directories);
/// - libcni result caches of the networks of dead processes, with the netns each names (a
///   concurrent test's sweep may have deleted the configuration first);
/// - cgroup v1 directories `sidestep-test-<id>` of dead processes;
/// - host mounts under scratch directories of dead processes.
pub fn sweep_stale() {
    let dead = |id: &str| pid_of_id(id).is_some_and(|p| p != std::process::id() && !pid_alive(p));
    let tmp = std::env::temp_dir();
    let stale_id = |name: &str| -> Option<String> {
        let rest = name.strip_prefix("sidestep-test-")?;
        let (id, _) = rest.rsplit_once('-')?;
        dead(id).then(|| id.to_owned())
    };
    if let Ok(rd) = fs::read_dir(&tmp) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = stale_id(&name) else { continue };
            let dir = e.path().join("podman");
            if !dir.join("containers.conf").is_file() || which("podman").is_none() {
                continue;
            }
            eprintln!("sidestep-tests: removing podman pods of dead test env {id}");
            // Dropping it removes the pods and containers of that storage.
            drop(Podman {
                conf: dir.join("containers.conf"),
                storage_conf: dir.join("storage.conf"),
                net_dir: dir.join("cni.d"),
                rootfs: dir.join("rootfs"),
                cgroup_parent: format!("/sidestep-test-{id}"),
                pods: Mutex::new(Vec::new()),
                dir,
            });
        }
    }
    if let Ok(rd) = fs::read_dir(CNI_CACHE) {
        for e in rd.flatten() {
            let Ok(cache) = fs::read(e.path()) else {
                continue;
            };
            let Ok(cache) = serde_json::from_slice::<Value>(&cache) else {
                continue;
            };
            // Network names are `sidestep-test-<env id>-<node counter>` (see Node).
            let stale_network = cache["networkName"]
                .as_str()
                .and_then(|n| n.strip_prefix("sidestep-test-"))
                .and_then(|n| n.rsplit_once('-'))
                .is_some_and(|(id, _)| dead(id));
            if !stale_network {
                continue;
            }
            for iface in cache["result"]["interfaces"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if let Some(ns) = iface["sandbox"].as_str().map(Path::new)
                    && ns.parent() == Some(Path::new(netns::NETNS_DIR))
                    && ns
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("netns-"))
                    && ns.exists()
                {
                    eprintln!(
                        "sidestep-tests: removing leftover podman netns {}",
                        ns.display()
                    );
                    let _ = umount2(ns, MntFlags::MNT_DETACH);
                    let _ = fs::remove_file(ns);
                }
            }
            let _ = fs::remove_file(e.path());
        }
    }
    for m in v1_mounts() {
        let Ok(rd) = fs::read_dir(&m) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.strip_prefix("sidestep-test-").is_some_and(dead)
                && let Err(err) = remove_cgroup_tree(&e.path())
            {
                eprintln!("sidestep-tests: {err:#}");
            }
        }
    }
    let mut stale: Vec<PathBuf> = mount_points()
        .into_iter()
        .filter(|m| {
            m.strip_prefix(&tmp)
                .ok()
                .and_then(|r| r.components().next())
                .and_then(|c| stale_id(&c.as_os_str().to_string_lossy()))
                .is_some()
        })
        .collect();
    stale.reverse();
    for m in stale {
        let _ = umount2(&m, MntFlags::MNT_DETACH);
    }
}
