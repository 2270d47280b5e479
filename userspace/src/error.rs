//! Errors per domain. Each message names the cause and, where there is one, the fix.

use std::{io, path::PathBuf};

/// How to give the agent the node's cgroup2 root when it cannot find it itself.
const NODE_CGROUP_FIX: &str = "Set cgroup (--cgroup, SIDESTEP_CGROUP, or the ConfigMap key) to \
    the host's cgroup2 root as mounted into the container (deploy/configmap.yaml: \
    /host/sys/fs/cgroup, or /host/sys/fs/cgroup/unified on hybrid hosts), or run the agent in the \
    host's cgroup namespace (`--cgroupns=host` for docker and podman, `cgroupns: host` in compose)";

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("cannot read /proc/self/mountinfo: {0}")]
    MountInfo(#[source] io::Error),
    #[error(
        "no cgroup2 filesystem is mounted; mount one (mount -t cgroup2 none /sys/fs/cgroup) or boot with cgroup v2"
    )]
    NoCgroup2,
    #[error(
        "{path} is not a cgroup2 directory ({reason}); pass a directory under the cgroup2 mount"
    )]
    NotCgroup2 { path: PathBuf, reason: String },
    #[error(
        "the agent runs in a private cgroup namespace (/proc/self/ns/cgroup is cgroup:[{inode}], \
         the node's is cgroup:[{init}]), so the cgroup2 mount it finds is its own container's \
         cgroup, and programs attached there would capture no pod. {fix}",
        init = crate::mounts::INIT_CGROUP_NS_INO,
        fix = NODE_CGROUP_FIX
    )]
    PrivateCgroupNamespace { inode: u64 },
    #[error(
        "the cgroup2 mount at {mount_point} shows the subtree {root}, not the node's whole \
         hierarchy (/), so programs attached there would capture only that subtree. {fix}",
        fix = NODE_CGROUP_FIX
    )]
    Cgroup2NotRoot { mount_point: PathBuf, root: String },
    #[error(
        "cannot read /proc/self/ns/cgroup to tell whether the cgroup2 mount is the node's root: \
         {0}. {fix}",
        fix = NODE_CGROUP_FIX
    )]
    CgroupNamespace(#[source] io::Error),
    #[error("cannot mount bpffs: {0}; mount it yourself with `mount -t bpf bpffs /sys/fs/bpf`")]
    Bpffs(String),
    #[error("the pin root {0} is not on a bpffs mount; choose a path under /sys/fs/bpf")]
    PinRootNotBpffs(PathBuf),
    #[error(
        "no bpffs is mounted at {path}, and a bpffs the agent mounted there would be its \
         container's alone: this is not the host's mount namespace, and the mount {path} lies on \
         ({mount_point}) is {propagation}, so the mount would not reach the host. Its pins, and \
         with them every pod's capture, would go when the container stops. Mount bpffs on the \
         host (`mount -t bpf bpffs /sys/fs/bpf`; systemd's sys-fs-bpf.mount does it at boot), or \
         let the DaemonSet mount it for the host: the /sys/fs/bpf hostPath volume mounted with \
         `mountPropagation: Bidirectional` (Kubernetes allows that only in a privileged \
         container, e.g. an init container running `mount -t bpf bpffs /sys/fs/bpf`; see \
         deploy/README.md)"
    )]
    PrivateBpffs {
        path: PathBuf,
        mount_point: PathBuf,
        propagation: &'static str,
    },
}

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
pub enum MapsError {
    #[error(
        "sidestep is not loaded at {0}: run `sidestep load --cgroup DIR --pin-root {0}` (or start the agent) first"
    )]
    NotLoaded(PathBuf),
    #[error("cannot open pinned map {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("map {map}: {source}")]
    Access {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot size per-CPU values: {0}")]
    Cpus(String),
    #[error(
        "map {map} is full{}; unenrol pods or load with a larger capacity",
        entries_note(*capacity)
    )]
    Full {
        map: &'static str,
        /// Its max_entries, or 0 where the caller did not look it up.
        capacity: u32,
    },
    #[error(
        "pod address {address} is registered to another enrolled pod (netns cookie {owner}); \
         refusing to take it over (its DEL or the agent's GC releases it)"
    )]
    AddressOwned {
        address: std::net::IpAddr,
        owner: u64,
    },
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

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{field}: invalid port {value:?} (want 1-65535)")]
    Port { field: String, value: String },
    #[error("{field}: invalid CIDR {value:?} ({reason})")]
    Cidr {
        field: String,
        value: String,
        reason: String,
    },
    #[error("{field}: invalid value {value:?} ({reason})")]
    Value {
        field: String,
        value: String,
        reason: String,
    },
    /// One list alone past the pod's share of its node-wide map, found while parsing it (so a
    /// list of thousands is never built).
    #[error(
        "{field}: more than {limit} {what}, the most one pod's lists may put in {map} \
         (docs/OPERATIONS.md, \"Per-pod map budgets\")"
    )]
    TooLong {
        field: String,
        what: &'static str,
        limit: usize,
        map: &'static str,
    },
    /// The pod's lists together past its share of a node-wide map.
    #[error(transparent)]
    OverBudget(#[from] crate::policy::OverBudget),
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
    Tproxy(#[from] crate::tproxy::TproxyError),
    #[error(transparent)]
    Userns(#[from] crate::userns::UsernsError),
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
    SkMsgUnsupported(String),
}

fn entries_note(capacity: u32) -> String {
    if capacity == 0 {
        String::new()
    } else {
        format!(" ({capacity} entries)")
    }
}
