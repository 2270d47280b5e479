//! Finding the cgroup2 and bpffs mounts. Nodes differ: cgroup2 may be at /sys/fs/cgroup or, on
//! hybrid hosts, /sys/fs/cgroup/unified; bpffs may not be mounted at all.

use std::{
    fs, io,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

/// The inode of the initial cgroup namespace: `PROC_CGROUP_INIT_INO` in
/// include/linux/proc_ns.h, the same on every kernel since cgroup namespaces exist (4.6).
pub const INIT_CGROUP_NS_INO: u64 = 0xEFFF_FFFB;

/// One line of /proc/self/mountinfo, the fields we use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub id: u32,
    pub parent: u32,
    /// The directory of the filesystem this mount shows. For cgroup2, relative to the reader's
    /// cgroup namespace: `/` is its root, `/..` lies above it.
    pub root: String,
    pub mount_point: PathBuf,
    pub fs_type: String,
    /// Its propagation is shared (optional field `shared:N`): a mount made on it reaches every
    /// peer of group N, in whichever mount namespace that peer is.
    pub shared: bool,
    /// It is a slave (optional field `master:N`): it receives its master's mounts, sends none.
    pub slave: bool,
}

/// Parses mountinfo text. The paths' octal escapes (`\040` for space) are decoded.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            let optional = fields.get(6..sep).unwrap_or_default();
            Some(Mount {
                id: fields.first()?.parse().ok()?,
                parent: fields.get(1)?.parse().ok()?,
                root: unescape(fields.get(3)?),
                mount_point: PathBuf::from(unescape(fields.get(4)?)),
                fs_type: fields.get(sep + 1)?.to_string(),
                shared: optional.iter().any(|f| f.starts_with("shared:")),
                slave: optional.iter().any(|f| f.starts_with("master:")),
            })
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 4 <= bytes.len()
            && let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&bytes[i + 1..i + 4]).unwrap_or(""), 8)
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

fn mounts() -> Result<Vec<Mount>, MountError> {
    let text = fs::read_to_string("/proc/self/mountinfo").map_err(MountError::MountInfo)?;
    Ok(parse_mountinfo(&text))
}

/// The cgroup2 mount point: where production attaches, and the parent of test cgroups.
pub fn cgroup2_root() -> Result<PathBuf, MountError> {
    mounts()?
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| m.mount_point)
        .ok_or(MountError::NoCgroup2)
}

/// The node's cgroup2 root, where the agent attaches when no cgroup is named.
///
/// The cgroup2 mount a process finds is the node's root only in the initial cgroup namespace,
/// and only when it shows the hierarchy from `/`. In a container with a private cgroup
/// namespace the runtime's cgroup2 mount is the container's own cgroup: links attach, the CNI
/// configuration goes in, and no pod is captured, so this refuses instead of guessing.
pub fn node_cgroup2_root() -> Result<PathBuf, MountError> {
    // PID 1's namespace is no second opinion: without hostPID, PID 1 is the container's own
    // init, in the same private namespace; the kernel's fixed inode is.
    let ns = fs::metadata("/proc/self/ns/cgroup").map_err(MountError::CgroupNamespace)?;
    node_cgroup2_root_in(&mounts()?, ns.ino())
}

/// [`node_cgroup2_root`] on mountinfo already read, for a process in cgroup namespace `ns_ino`.
pub fn node_cgroup2_root_in(mounts: &[Mount], ns_ino: u64) -> Result<PathBuf, MountError> {
    if ns_ino != INIT_CGROUP_NS_INO {
        return Err(MountError::PrivateCgroupNamespace { inode: ns_ino });
    }
    // A mount covered by another at the same place is not what its path opens.
    let covered = |m: &Mount| {
        mounts
            .iter()
            .any(|n| n.parent == m.id && n.mount_point == m.mount_point)
    };
    let visible: Vec<&Mount> = mounts
        .iter()
        .filter(|m| m.fs_type == "cgroup2" && !covered(m))
        .collect();
    if let Some(m) = visible.iter().find(|m| m.root == "/") {
        return Ok(m.mount_point.clone());
    }
    match visible.first() {
        Some(m) => Err(MountError::Cgroup2NotRoot {
            mount_point: m.mount_point.clone(),
            root: m.root.clone(),
        }),
        None => Err(MountError::NoCgroup2),
    }
}

/// Checks that `dir` is a directory on a cgroup2 filesystem.
pub fn check_cgroup2_dir(dir: &Path) -> Result<(), MountError> {
    let stat = nix::sys::statfs::statfs(dir).map_err(|e| MountError::NotCgroup2 {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    if stat.filesystem_type() != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
        return Err(MountError::NotCgroup2 {
            path: dir.to_path_buf(),
            reason: "not on a cgroup2 filesystem".into(),
        });
    }
    Ok(())
}

/// The inode of the initial PID namespace: `PROC_PID_INIT_INO` in include/linux/proc_ns.h, fixed
/// since Linux 3.8.
pub const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;

/// Where bpffs is mounted when nothing is: the pin roots' usual parent.
pub const BPFFS: &str = "/sys/fs/bpf";

/// Whether the loader may mount bpffs itself where none is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BpffsMount {
    /// Wherever none is: `sidestep load` and the tests run on a host, where a mount is the
    /// host's (a fresh machine has no bpffs, and the loader mounts it as Cilium and bpftool do).
    Anywhere,
    /// Only where the mount is the host's and so outlives the process ([`check_mount_is_the_hosts`]):
    /// the agent, which runs in a container.
    OnlyTheHosts,
}

/// Makes sure the pin root's parent lives on bpffs, mounting bpffs at /sys/fs/bpf when nothing is
/// mounted there and `policy` allows it.
pub fn ensure_bpffs(pin_root: &Path, policy: BpffsMount) -> Result<(), MountError> {
    let bpffs = Path::new(BPFFS);
    if !is_bpffs(pin_root.parent().unwrap_or(bpffs))
        && pin_root.starts_with(bpffs)
        && !is_bpffs(bpffs)
    {
        if policy == BpffsMount::OnlyTheHosts {
            check_mount_is_the_hosts(bpffs)?;
        }
        fs::create_dir_all(bpffs).map_err(|e| MountError::Bpffs(e.to_string()))?;
        nix::mount::mount(
            Some("bpffs"),
            bpffs,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            Some("mode=0700"),
        )
        .map_err(|e| MountError::Bpffs(format!("mount -t bpf bpffs {}: {e}", bpffs.display())))?;
        tracing::info!(path = %bpffs.display(), "mounted bpffs");
    }
    let parent = pin_root.parent().unwrap_or(bpffs);
    if !is_bpffs(parent) {
        return Err(MountError::PinRootNotBpffs(pin_root.to_path_buf()));
    }
    Ok(())
}

/// Refuses to mount at `target` unless the mount would be the host's.
///
/// Every pin lives in the bpffs that holds the pin root. A bpffs that only the agent's own mount
/// namespace sees goes away with the container: once its last process exits, the namespace, the
/// mount and its pins are gone, every pinned link detaches, and every pod runs uncaptured until
/// a new agent loads into empty maps. A mount at `target` is the host's when:
/// 1. the process is in the host's mount namespace: its PID namespace is the initial one (whose
///    inode is fixed) and PID 1, then the host's init, shares its mount namespace. In a container
///    without hostPID, PID 1 is the container's own first process, which proves nothing, so
/// 2. otherwise the mount `target` lies on must be shared (`shared:N` in mountinfo): a mount on
///    it propagates to its peers, the host's /sys/fs/bpf among them when the DaemonSet mounts the
///    hostPath with `mountPropagation: Bidirectional`. `HostToContainer` makes it a slave, which
///    receives the host's mounts and sends none; `None` makes it private.
pub fn check_mount_is_the_hosts(target: &Path) -> Result<(), MountError> {
    if in_host_mount_namespace() {
        return Ok(());
    }
    check_mount_propagates(&mounts()?, target)
}

fn in_host_mount_namespace() -> bool {
    let ino = |p: &str| fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    ino("/proc/self/ns/pid").is_some_and(|(_, i)| i == INIT_PID_NS_INO)
        && ino("/proc/self/ns/mnt").is_some()
        && ino("/proc/self/ns/mnt") == ino("/proc/1/ns/mnt")
}

/// Rule 2 of [`check_mount_is_the_hosts`], on mountinfo already read.
pub fn check_mount_propagates(mounts: &[Mount], target: &Path) -> Result<(), MountError> {
    let under = mount_under(mounts, target);
    let propagation = match under {
        Some(m) if m.shared => return Ok(()),
        Some(m) if m.slave => "slave, as with mountPropagation: HostToContainer",
        Some(_) => "private, as with mountPropagation: None",
        None => "not in this mount namespace's mountinfo",
    };
    Err(MountError::PrivateBpffs {
        path: target.to_path_buf(),
        mount_point: under.map(|m| m.mount_point.clone()).unwrap_or_default(),
        propagation,
    })
}

/// The mount `target` lies on: the deepest mount point above it that no later mount covers.
fn mount_under<'a>(mounts: &'a [Mount], target: &Path) -> Option<&'a Mount> {
    let covered = |m: &Mount| {
        mounts
            .iter()
            .any(|n| n.parent == m.id && n.mount_point == m.mount_point)
    };
    mounts
        .iter()
        .filter(|m| target.starts_with(&m.mount_point) && !covered(m))
        .max_by_key(|m| m.mount_point.components().count())
}

/// Whether an existing bpffs is the host's, as far as this process can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostBpffs {
    /// This is the host's mount namespace, or the mount receives the host's (shared, or a slave
    /// of it: a hostPath volume with `HostToContainer` or `Bidirectional` propagation).
    Yes,
    /// A private mount: it may be this container's own bpffs, whose pins die with it.
    Private(PathBuf),
    /// Whether this is the host's mount namespace cannot be read (`/proc/1/ns/mnt`).
    Unknown,
}

/// Whether the bpffs that `path` lies on (it must exist) is the host's: pins made there outlive
/// this process's container. A mount that only receives the host's (a slave) shows the host's
/// filesystem, so its pins are the host's too; a bpffs mounted *from* it would not be
/// ([`check_mount_is_the_hosts`] asks that).
pub fn bpffs_is_the_hosts(path: &Path) -> Result<HostBpffs, MountError> {
    if in_host_mount_namespace() {
        return Ok(HostBpffs::Yes);
    }
    if fs::metadata("/proc/1/ns/mnt").is_err() {
        return Ok(HostBpffs::Unknown);
    }
    let mounts = mounts()?;
    Ok(match mount_under(&mounts, path) {
        Some(m) if m.shared || m.slave => HostBpffs::Yes,
        Some(m) => HostBpffs::Private(m.mount_point.clone()),
        None => HostBpffs::Private(path.to_path_buf()),
    })
}

pub fn is_bpffs(path: &Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
        .unwrap_or(false)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
33 31 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
40 25 0:40 / /mnt/with\\040space rw - tmpfs none rw";

    #[test]
    fn finds_cgroup2_on_hybrid_hosts() {
        let mounts = parse_mountinfo(HYBRID);
        let cg2: Vec<_> = mounts.iter().filter(|m| m.fs_type == "cgroup2").collect();
        assert_eq!(cg2.len(), 1);
        assert_eq!(cg2[0].mount_point, Path::new("/sys/fs/cgroup/unified"));
    }

    #[test]
    fn decodes_octal_escapes() {
        let mounts = parse_mountinfo(HYBRID);
        assert!(
            mounts
                .iter()
                .any(|m| m.mount_point == Path::new("/mnt/with space"))
        );
    }

    #[test]
    fn node_root_needs_the_initial_namespace_and_the_whole_hierarchy() {
        let host = parse_mountinfo(HYBRID);
        assert_eq!(
            node_cgroup2_root_in(&host, INIT_CGROUP_NS_INO).unwrap(),
            Path::new("/sys/fs/cgroup/unified")
        );
        // A container in a private namespace: its own cgroup2 mount shows `/`, yet refused.
        let e = node_cgroup2_root_in(&host, 4026532512).unwrap_err();
        assert!(matches!(
            e,
            MountError::PrivateCgroupNamespace { inode: 4026532512 }
        ));
        let text = e.to_string();
        assert!(
            text.contains("private cgroup namespace") && text.contains("--cgroup"),
            "{text}"
        );
        // A subtree bind-mounted over the root's mount point hides it: refused, naming it.
        let sub_text =
            format!("{HYBRID}\n50 32 0:27 /kubepods/pod1 /sys/fs/cgroup/unified rw - cgroup2 x rw");
        let sub = parse_mountinfo(&sub_text);
        match node_cgroup2_root_in(&sub, INIT_CGROUP_NS_INO) {
            Err(MountError::Cgroup2NotRoot { mount_point, root }) => {
                assert_eq!(mount_point, Path::new("/sys/fs/cgroup/unified"));
                assert_eq!(root, "/kubepods/pod1");
            }
            other => panic!("{other:?}"),
        }
        // ... unless the whole hierarchy is mounted elsewhere too.
        let both = parse_mountinfo(&format!(
            "{sub_text}\n51 25 0:27 / /run/cg2 rw - cgroup2 none rw"
        ));
        assert_eq!(
            node_cgroup2_root_in(&both, INIT_CGROUP_NS_INO).unwrap(),
            Path::new("/run/cg2")
        );
        assert!(matches!(
            node_cgroup2_root_in(&parse_mountinfo(""), INIT_CGROUP_NS_INO),
            Err(MountError::NoCgroup2)
        ));
    }

    /// A container's view of the DaemonSet's /sys/fs/bpf hostPath, on a host without bpffs.
    fn container_view(propagation: &str) -> Vec<Mount> {
        parse_mountinfo(&format!(
            "\
600 550 0:90 / / rw - overlay overlay rw
601 600 0:23 / /sys rw,nosuid - sysfs sysfs rw
602 601 0:23 /fs/bpf /sys/fs/bpf rw,relatime {propagation} - sysfs sysfs rw"
        ))
    }

    #[test]
    fn bpffs_mounts_only_where_they_reach_the_host() {
        let bpffs = Path::new(BPFFS);
        // mountPropagation: Bidirectional: the host's /sys/fs/bpf is a peer.
        check_mount_propagates(&container_view("shared:7"), bpffs).unwrap();
        for (propagation, says) in [
            (
                "master:7",
                "slave, as with mountPropagation: HostToContainer",
            ),
            ("", "private, as with mountPropagation: None"),
        ] {
            let e = check_mount_propagates(&container_view(propagation), bpffs).unwrap_err();
            match &e {
                MountError::PrivateBpffs {
                    mount_point,
                    propagation,
                    ..
                } => {
                    assert_eq!(mount_point, Path::new("/sys/fs/bpf"));
                    assert_eq!(*propagation, says);
                }
                other => panic!("{other:?}"),
            }
            let text = e.to_string();
            for fix in [
                "mountPropagation: Bidirectional",
                "mount -t bpf bpffs /sys/fs/bpf",
            ] {
                assert!(text.contains(fix), "{text}");
            }
        }
        // No mount of its own at /sys/fs/bpf: the one below it (/sys) decides.
        let no_hostpath: Vec<Mount> = container_view("shared:7")
            .into_iter()
            .filter(|m| m.id != 602)
            .collect();
        assert!(check_mount_propagates(&no_hostpath, bpffs).is_err());
        // A private tmpfs over the shared hostPath hides it.
        let mut covered = container_view("shared:7");
        covered.extend(parse_mountinfo(
            "603 602 0:91 / /sys/fs/bpf rw - tmpfs none rw",
        ));
        assert!(check_mount_propagates(&covered, bpffs).is_err());
    }

    #[test]
    fn ignores_garbage_lines() {
        assert!(parse_mountinfo("garbage\n\n1 2 3").is_empty());
    }
}
