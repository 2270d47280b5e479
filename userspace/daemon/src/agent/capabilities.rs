//! Dropping every capability the running agent does not need, once start-up (load or adopt,
//! install, kubeconfig) is done and before any other thread exists (capabilities are per
//! thread, and threads inherit them from their creator).
//!
//! What stays, and why (docs/REFERENCE.md, "Capabilities", lists the same):
//! - `CAP_SYS_ADMIN`: `setns(2)` into pod network namespaces (netns cookies for reconcile),
//!   `bpf(2)` on the pinned maps, links and programs (readiness, `/metrics`, GC, reloading when
//!   the pins are gone; it also covers what `CAP_BPF` and `CAP_PERFMON` allow), and mounting bpffs
//!   again if it disappears;
//! - `CAP_NET_ADMIN`: detaching a collected pod's tc (TCX) link and attaching inbound capture
//!   during repair (netlink);
//! - `CAP_SYS_PTRACE`, only with `scan-proc`: reading other processes' `/proc/PID/ns/net`;
//! - `CAP_NET_BIND_SERVICE`, only when `listen` is a port below 1024.
//!
//! The bounding set is cut to the same list, so the plugin the agent runs for a repair (as root,
//! it gets the bounding set at exec) has no more. Cutting it needs `CAP_SETPCAP`, which goes with
//! the rest; without it the bounding set is left as the runtime made it and a warning says so.
//! `sidestep uninstall` is a process of its own (the DaemonSet's preStop hook runs it with the
//! container's capabilities), so nothing here limits it.

use caps::{CapSet, Capability, CapsHashSet};

use super::settings::Settings;

#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error("cannot read the {set:?} capability set: {source}")]
    Read {
        set: CapSet,
        source: caps::errors::CapsError,
    },
    #[error("cannot lower the {set:?} capability set to [{keep}]: {source}")]
    Lower {
        set: CapSet,
        keep: String,
        source: caps::errors::CapsError,
    },
}

/// The capabilities the running agent keeps, each with its reason.
pub fn needed(s: &Settings) -> Vec<(Capability, &'static str)> {
    let mut keep = vec![
        (
            Capability::CAP_SYS_ADMIN,
            "setns into pod netns; bpf(2) on the pins (covers CAP_BPF, CAP_PERFMON); mount bpffs",
        ),
        (
            Capability::CAP_NET_ADMIN,
            "tc (TCX) links of collected and repaired pods",
        ),
    ];
    if s.scan_proc {
        keep.push((
            Capability::CAP_SYS_PTRACE,
            "scan-proc: reading other processes' /proc/PID/ns/net",
        ));
    }
    if s.listen.port() < 1024 {
        keep.push((
            Capability::CAP_NET_BIND_SERVICE,
            "listen is a privileged port",
        ));
    }
    keep
}

fn names(set: &CapsHashSet) -> String {
    let mut v: Vec<String> = set.iter().map(ToString::to_string).collect();
    v.sort();
    v.join(", ")
}

/// Lowers the bounding, inheritable, ambient, permitted and effective sets of the calling thread
/// to [`needed`]. Returns what is kept.
pub fn drop_unneeded(s: &Settings) -> Result<CapsHashSet, CapsError> {
    let keep: CapsHashSet = needed(s).into_iter().map(|(c, _)| c).collect();
    let lower = |set: CapSet, to: &CapsHashSet| {
        caps::set(None, set, to).map_err(|source| CapsError::Lower {
            set,
            keep: names(to),
            source,
        })
    };
    let read =
        |set: CapSet| caps::read(None, set).map_err(|source| CapsError::Read { set, source });
    // Bounding first: it needs CAP_SETPCAP, which the next steps give up.
    let bounding = read(CapSet::Bounding)?;
    let extra: Vec<Capability> = bounding.difference(&keep).copied().collect();
    if !extra.is_empty() {
        if read(CapSet::Effective)?.contains(&Capability::CAP_SETPCAP) {
            for c in extra {
                caps::drop(None, CapSet::Bounding, c).map_err(|source| CapsError::Lower {
                    set: CapSet::Bounding,
                    keep: names(&keep),
                    source,
                })?;
            }
        } else {
            tracing::warn!(
                extra = %extra.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
                "no CAP_SETPCAP: the bounding set keeps capabilities the agent does not need \
                 (grant SETPCAP, or drop them in the DaemonSet)"
            );
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|source| CapsError::Lower {
        set: CapSet::Ambient,
        keep: String::new(),
        source,
    })?;
    lower(CapSet::Inheritable, &CapsHashSet::new())?;
    // Effective before permitted: effective must stay a subset of permitted at every step.
    let have = read(CapSet::Permitted)?;
    let kept: CapsHashSet = keep.intersection(&have).copied().collect();
    lower(CapSet::Effective, &kept)?;
    lower(CapSet::Permitted, &kept)?;
    Ok(kept)
}

/// Drops, and logs what stays.
pub fn drop_after_start(s: &Settings) -> Result<(), CapsError> {
    let kept = drop_unneeded(s)?;
    tracing::info!(kept = %names(&kept), "dropped every other capability");
    Ok(())
}
