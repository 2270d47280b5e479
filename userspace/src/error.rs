//! Loading and enrolment errors, and every domain's error re-exported, so that callers have one
//! place to name them. Each domain's enum lives beside its code (`mounts`, `maps`, `netns`,
//! `policy`, `tproxy`, `userns`). Each message names the cause and, where there is one, the fix.

use std::{io, path::PathBuf};

pub use crate::{
    maps::MapsError, mounts::MountError, netns::NetnsError, policy::PolicyError,
    tproxy::TproxyError, userns::UsernsError,
};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("sidestep needs root (CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root")]
    NotRoot,
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error("cannot open cgroup {path}: {source}")]
    OpenCgroup { path: PathBuf, source: io::Error },
    #[error("cannot parse the embedded BPF object: {0}")]
    Object(#[source] aya::EbpfError),
    #[error("the BPF object has no program {0}; rebuild with `cargo xtask build`")]
    MissingProgram(&'static str),
    #[error(
        "Linux {release} lacks what sidestep needs: {}. sidestep needs Linux 6.1 or later with \
         CONFIG_CGROUP_BPF, CONFIG_BPF_SYSCALL, CONFIG_NET_CLS_BPF and BTF; nothing was loaded",
        missing.join("; ")
    )]
    KernelLacks {
        release: String,
        missing: Vec<String>,
    },
    #[error(
        "the kernel refused program {name}: {source}. sidestep needs Linux 6.1 or later with CONFIG_CGROUP_BPF and BTF"
    )]
    ProgramLoad {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("cannot attach {name} to {cgroup}: {source}")]
    Attach {
        name: &'static str,
        cgroup: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot pin {path}: {source}")]
    Pin { path: PathBuf, source: io::Error },
    #[error("cannot replace the program behind {path}: {source}")]
    Replace { path: PathBuf, source: io::Error },
    #[error(
        "the pinned links under {pin_root} are attached to cgroup id {pinned}, not {requested}; unload first"
    )]
    OtherCgroup {
        pin_root: PathBuf,
        pinned: u64,
        requested: u64,
    },
    #[error("cannot remove {path}: {source}")]
    Unpin { path: PathBuf, source: io::Error },
    #[error(
        "map {map} layout changed ({changes}); the pinned {path} cannot serve the new programs. \
         Run `sidestep unload` first (pods lose capture until they are enrolled again), or load \
         a build with the old layout"
    )]
    MapLayout {
        map: String,
        path: PathBuf,
        changes: String,
    },
    #[error("re-seeding the replaced counters map for the enrolled pods: {0}")]
    ReseedCounters(#[source] MapsError),
}

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Pins(#[from] LoadError),
    #[error(transparent)]
    Tproxy(#[from] TproxyError),
    #[error(transparent)]
    Userns(#[from] UsernsError),
    #[error("cannot create {path}: {source}")]
    StateDir { path: PathBuf, source: io::Error },
    #[error(
        "{0} has no interface for inbound capture (all excluded, or none but lo); name one with --interface, or turn inbound capture off with --include-inbound-ports ''"
    )]
    NoInterface(PathBuf),
    #[error(
        "{path} has {count} interfaces besides lo, more than the {max} an enrolment captures without being told which (each is a map entry, and with the tc hook a link; root in a pod can add thousands); name the pod's with --interface"
    )]
    TooManyInterfaces {
        path: PathBuf,
        count: usize,
        max: usize,
    },
    /// A re-routed virtual interface cannot be captured (missing, no MAC, or its ifindex and MAC
    /// already belong to another pod).
    #[error("istio.io/reroute-virtual-interfaces: {0}")]
    Reroute(String),
    /// sk_msg needs `struct sock` offsets from the kernel's BTF to bound the peer's queue.
    #[error(
        "sk_msg cannot be enabled on this kernel: {0}. Without them it could not bound what it queues on the proxy's socket; enrol without --sk-msg (sidestep.io/sk-msg)"
    )]
    SkMsgUnsupported(#[from] crate::btf::BtfError),
}
