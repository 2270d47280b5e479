//! Removal of what killed test processes left behind.
//!
//! Drop guards do not run when a test binary is killed (Ctrl-C, SIGKILL, a CI timeout). Every
//! resource this crate creates carries the pid of the process that made it, so a later run can
//! tell leftovers of dead processes from those of live ones and remove only the former.

use std::fs;
use std::sync::Once;

use anyhow::Result;

use crate::cgroup::{Cgroup, cgroup2_mount};
use crate::env::{BPFFS, remove_pin_root};
use crate::util::{cmd, pid_alive};

static SWEEP: Once = Once::new();

/// Runs [`sweep_stale`] once per process, logging failures.
pub(crate) fn sweep_once() {
    SWEEP.call_once(|| {
        if let Err(e) = sweep_stale() {
            eprintln!("sidestep-tests: sweeping leftovers of dead test runs: {e:#}");
        }
    });
}

/// The pid inside an env id `<name>-<pid>-<counter>`.
pub(crate) fn pid_of_id(id: &str) -> Option<u32> {
    let mut it = id.rsplitn(3, '-');
    let counter = it.next()?;
    let pid = it.next()?;
    let name = it.next()?;
    if name.is_empty() || counter.parse::<u32>().is_err() {
        return None;
    }
    pid.parse().ok()
}

/// The pid encoded in a bridge name made by [`crate::node::bridge_name`].
pub(crate) fn pid_of_bridge(name: &str) -> Option<u32> {
    let hex = name.strip_prefix("ssb")?;
    if hex.len() != 10 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(&hex[..6], 16).ok()
}

fn stale(pid: u32) -> bool {
    pid != std::process::id() && !pid_alive(pid)
}

/// Removes cgroups (killing what runs in them), network namespaces, pin roots, scratch
/// directories and bridges whose creating process is dead.
pub fn sweep_stale() -> Result<()> {
    let cg2 = cgroup2_mount()?;
    for entry in fs::read_dir(&cg2)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(id) = name.strip_prefix("sidestep-test-") else {
            continue;
        };
        if !pid_of_id(id).is_some_and(stale) {
            continue;
        }
        eprintln!("sidestep-tests: removing leftovers of dead test env {id}");
        remove_netns_with_prefix(&format!("sidestep-{id}-"));
        // Dropping the adopted cgroup kills what is left in it and removes it.
        drop(Cgroup::adopt(entry.path()));
    }
    if let Ok(rd) = fs::read_dir(BPFFS) {
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_prefix("sidestep-test-") else {
                continue;
            };
            if pid_of_id(id).is_some_and(stale)
                && let Err(e) = remove_pin_root(&entry.path())
            {
                eprintln!("sidestep-tests: {e:#}");
            }
        }
    }
    // Scratch and host-local data dirs: `sidestep-{test,ipam}-<id>-<random>`.
    for entry in fs::read_dir(std::env::temp_dir())?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name
            .strip_prefix("sidestep-test-")
            .or_else(|| name.strip_prefix("sidestep-ipam-"))
        else {
            continue;
        };
        if rest
            .rsplit_once('-')
            .and_then(|(id, _)| pid_of_id(id))
            .is_some_and(stale)
            && let Err(e) = fs::remove_dir_all(entry.path())
        {
            eprintln!("sidestep-tests: rm -r {}: {e}", entry.path().display());
        }
    }
    for entry in fs::read_dir("/sys/class/net")?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if pid_of_bridge(&name).is_some_and(stale) && entry.path().join("bridge").exists() {
            eprintln!("sidestep-tests: removing leftover bridge {name}");
            if let Err(e) = cmd(&["ip", "link", "del", &name]) {
                eprintln!("sidestep-tests: {e:#}");
            }
        }
    }
    Ok(())
}

fn remove_netns_with_prefix(prefix: &str) {
    let Ok(rd) = fs::read_dir("/run/netns") else {
        return;
    };
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix)
            && let Err(e) = cmd(&["ip", "netns", "del", &name])
        {
            eprintln!("sidestep-tests: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids_and_bridges() {
        assert_eq!(pid_of_id("outbound-1234-0"), Some(1234));
        assert_eq!(pid_of_id("a-b-c-99-7"), Some(99));
        assert_eq!(pid_of_id("1234-0"), None);
        assert_eq!(pid_of_id("x-y-0"), None);
        assert_eq!(pid_of_bridge("ssb0004d20001"), Some(1234));
        assert_eq!(pid_of_bridge("ssb0004d2"), None);
        assert_eq!(pid_of_bridge("eth0"), None);
    }
}
