//! Loading, attaching and pinning the programs, and taking them all away again.
//!
//! `load` is also the upgrade path: when links are already pinned, the maps are reused through
//! their pins and each link (cgroup, and every pod's tc and sk_lookup link) is switched to the
//! new program with BPF_LINK_UPDATE, so no moment exists in which a socket goes uncaptured. A
//! pinned map whose layout differs from the object's stops the load before anything changes.
//!
//! Every step is safe to be killed after (the `load:*` and `upgrade:*` failpoints sit between
//! them): the next load adopts whatever is pinned and finishes the job.

use std::{
    fs,
    os::{
        fd::AsFd,
        unix::fs::{DirBuilderExt, MetadataExt},
    },
    path::{Path, PathBuf},
};

use aya::{
    EbpfLoader,
    programs::{Program, ProgramError},
};
use aya_obj::generated::bpf_attach_type;
use sidestep_abi::{globals, map_names, program_names};

use crate::{
    error::LoadError,
    mounts,
    pins::PinLayout,
    programs::{CGROUP_PROGRAMS, MAP_PROGRAMS, POD_PROGRAMS},
    sys,
};

/// The BPF object built by `cargo xtask build-ebpf`, embedded at compile time.
pub static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("SIDESTEP_BPF_OBJECT_PATH"));

/// Maps with one entry per pod, sized by `--pod-capacity` when they are created.
const POD_SIZED_MAPS: [&str; 3] = [
    map_names::POD_POLICY,
    map_names::COUNTERS,
    map_names::SOURCE_ADDRESSES,
];

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub cgroup: PathBuf,
    pub pin_root: PathBuf,
    /// Overrides the pod map's capacity; applies only when the maps are created.
    pub pod_capacity: Option<u32>,
    /// The object to load; the embedded one by default.
    pub object: Option<Vec<u8>>,
    /// Whether bpffs may be mounted where none is, and where.
    pub bpffs_mount: mounts::BpffsMount,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    /// Nothing was pinned; programs, maps and links are new.
    Fresh,
    /// Existing pins were adopted and every link now runs the new programs.
    Upgraded,
}

pub fn require_root() -> Result<(), LoadError> {
    if nix::unistd::geteuid().is_root() {
        Ok(())
    } else {
        Err(LoadError::NotRoot)
    }
}

fn mkdir_private(dir: &Path) -> Result<(), LoadError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| LoadError::Pin {
            path: dir.to_path_buf(),
            source,
        })
}

fn load_program(program: &mut Program, name: &'static str) -> Result<(), LoadError> {
    let result = match program {
        Program::CgroupSockAddr(p) => p.load(),
        Program::SockOps(p) => p.load(),
        Program::CgroupSockopt(p) => p.load(),
        Program::CgroupSkb(p) => p.load(),
        Program::SchedClassifier(p) => p.load(),
        Program::SkMsg(p) => p.load(),
        Program::SkLookup(p) => p.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    };
    result.map_err(|source| LoadError::ProgramLoad { name, source })
}

/// Loads and attaches everything at `opts.cgroup`, pinned under `opts.pin_root`.
pub fn load(opts: &LoadOptions) -> Result<LoadOutcome, LoadError> {
    require_root()?;
    mounts::ensure_bpffs(&opts.pin_root, opts.bpffs_mount)?;
    mounts::check_cgroup2_dir(&opts.cgroup)?;
    let layout = PinLayout::new(&opts.pin_root);
    // Anything pinned (also by a load killed half-way) is adopted: reused, updated, never wiped.
    let upgrading = layout.links_dir().is_dir();
    let result = load_inner(opts, &layout, upgrading);
    if result.is_err() && !upgrading {
        // A failed first load leaves nothing behind.
        let _ = unload(&opts.pin_root);
    }
    result
}

/// Loads over a pin root that lost some of its pins (bpffs unmounted, pins deleted): what is
/// still pinned is reused and every link updated, what is missing is created. Unlike [`load`]
/// it never removes the pin root on failure: a half-repaired data path still captures more than
/// none.
pub fn reload(opts: &LoadOptions) -> Result<LoadOutcome, LoadError> {
    require_root()?;
    mounts::ensure_bpffs(&opts.pin_root, opts.bpffs_mount)?;
    mounts::check_cgroup2_dir(&opts.cgroup)?;
    load_inner(opts, &PinLayout::new(&opts.pin_root), true)
}

fn load_inner(
    opts: &LoadOptions,
    layout: &PinLayout,
    upgrading: bool,
) -> Result<LoadOutcome, LoadError> {
    let cgroup = fs::File::open(&opts.cgroup).map_err(|source| LoadError::OpenCgroup {
        path: opts.cgroup.clone(),
        source,
    })?;
    let cgroup_id = cgroup
        .metadata()
        .map_err(|source| LoadError::OpenCgroup {
            path: opts.cgroup.clone(),
            source,
        })?
        .ino();
    for dir in [layout.maps_dir(), layout.progs_dir(), layout.links_dir()] {
        mkdir_private(&dir)?;
    }

    let support = crate::features::probe();
    if !support.missing.is_empty() {
        return Err(LoadError::KernelLacks {
            release: support.release,
            missing: support.missing,
        });
    }
    let mut loader = EbpfLoader::new();
    let tc_netns_cookie = u8::from(support.tc_netns_cookie);
    loader.override_global(globals::TC_NETNS_COOKIE, &tc_netns_cookie, true);
    // sk_msg caps the peer's queue by reading kernel struct fields at these offsets. Unresolved,
    // they stay 0 and the program redirects nothing (enrolment refuses sk_msg then, too).
    let (msg_sk_redir, rmem_alloc, rcvbuf) = match crate::btf::sock_offsets() {
        Ok(o) => (o.msg_sk_redir, o.rmem_alloc, o.rcvbuf),
        Err(e) => {
            tracing::warn!(
                "sk_msg is unavailable: cannot resolve struct sock offsets ({e}); pods keep the TCP path"
            );
            (0, 0, 0)
        }
    };
    loader.override_global(globals::SK_MSG_REDIR_OFFSET, &msg_sk_redir, true);
    loader.override_global(globals::SK_RMEM_ALLOC_OFFSET, &rmem_alloc, true);
    loader.override_global(globals::SK_RCVBUF_OFFSET, &rcvbuf, true);
    // The loader runs in the node's netns (the agent is hostNetwork): its sockets are the node's,
    // whose connections to ambient pods (kubelet's probes) the pods' inbound capture passes.
    let node_netns_cookie = match crate::netns::node_netns_cookie() {
        Ok(Some(cookie)) => cookie,
        Ok(None) => {
            tracing::warn!(
                "this process is not in the node's network namespace (init's): ambient pods' \
                 inbound capture takes the node's own connections too (kubelet's probes go \
                 through ztunnel); run the agent with hostNetwork"
            );
            0
        }
        Err(e) => {
            tracing::warn!(
                "cannot read this netns's cookie ({e}): ambient pods' inbound capture takes the \
                 node's own connections too (kubelet's probes go through ztunnel)"
            );
            0
        }
    };
    loader.override_global(globals::NODE_NETNS_COOKIE, &node_netns_cookie, true);
    let map_paths: Vec<(&str, PathBuf)> =
        map_names::ALL.iter().map(|n| (*n, layout.map(n))).collect();
    for (name, path) in &map_paths {
        loader.map_pin_path(name, path.as_path());
    }
    if let Some(cap) = opts.pod_capacity {
        for name in POD_SIZED_MAPS {
            loader.map_max_entries(name, cap);
        }
    }
    let object = opts.object.as_deref().unwrap_or(BPF_OBJECT);
    // aya reuses a pinned map as it is; one whose layout changed would only surface as a
    // verifier rejection that names neither the map nor the fix.
    let replaced = check_pinned_maps(layout, object, opts.pod_capacity)?;
    if !replaced.is_empty()
        && opts.pod_capacity.is_none()
        && let Some(pods) = pinned_max_entries(layout, map_names::POD_POLICY)
    {
        // The replacement holds one entry per pod, as many as the pinned pod map.
        loader.map_max_entries(map_names::COUNTERS, pods);
    }
    for stale in &replaced {
        tracing::warn!(
            map = stale.map,
            changes = %stale.changes,
            "layout changed; the pinned statistics map is replaced and its counts restart at 0"
        );
        fs::remove_file(&stale.path).map_err(|source| LoadError::Unpin {
            path: stale.path.clone(),
            source,
        })?;
    }
    let mut ebpf = loader.load(object).map_err(LoadError::Object)?;
    sys::failpoint("load:after-maps");

    // Load every program before touching any link, so a verifier rejection changes nothing.
    for name in CGROUP_PROGRAMS
        .iter()
        .map(|s| s.name)
        .chain(POD_PROGRAMS)
        .chain(MAP_PROGRAMS)
    {
        let program = ebpf
            .program_mut(name)
            .ok_or(LoadError::MissingProgram(name))?;
        load_program(program, name)?;
    }
    // sk_msg runs on the sockets of the sockhash; attaching again replaces the old program.
    let sockets = layout.map(map_names::SOCKETS);
    let sockets_map = aya::maps::MapData::from_pin(&sockets).map_err(|e| LoadError::Pin {
        path: sockets.clone(),
        source: std::io::Error::other(e),
    })?;
    let sk_msg = ebpf
        .program(program_names::SK_MSG)
        .ok_or(LoadError::MissingProgram(program_names::SK_MSG))?;
    let sk_msg_fd = sk_msg.fd().map_err(|source| LoadError::ProgramLoad {
        name: program_names::SK_MSG,
        source,
    })?;
    sys::prog_attach(
        sk_msg_fd.as_fd(),
        sockets_map.fd().as_fd(),
        bpf_attach_type::BPF_SK_MSG_VERDICT,
    )
    .map_err(|source| LoadError::Attach {
        name: program_names::SK_MSG,
        cgroup: sockets.clone(),
        source,
    })?;
    sys::failpoint("load:after-sk-msg");
    // Per-pod and per-map programs are pinned only (for bpftool and status); enrolment attaches
    // the tc program inside each pod netns.
    for name in POD_PROGRAMS.into_iter().chain(MAP_PROGRAMS) {
        let program = ebpf
            .program_mut(name)
            .ok_or(LoadError::MissingProgram(name))?;
        let path = layout.program(name);
        if path.exists() {
            fs::remove_file(&path).map_err(|source| LoadError::Unpin {
                path: path.clone(),
                source,
            })?;
        }
        program.pin(&path).map_err(|e| LoadError::Pin {
            path,
            source: std::io::Error::other(e),
        })?;
    }
    sys::failpoint("load:after-pod-programs");
    if upgrading {
        update_pod_links(layout, &ebpf)?;
    }

    for (i, spec) in CGROUP_PROGRAMS.into_iter().enumerate() {
        if i == CGROUP_PROGRAMS.len() / 2 {
            sys::failpoint("load:mid-links");
        }
        let program = ebpf
            .program_mut(spec.name)
            .ok_or(LoadError::MissingProgram(spec.name))?;
        let prog_fd = program
            .fd()
            .map_err(|source| LoadError::ProgramLoad {
                name: spec.name,
                source,
            })?
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| LoadError::Pin {
                path: layout.program(spec.name),
                source,
            })?;
        let link_path = layout.cgroup_link(spec.attach_point);
        if link_path.exists() {
            let link = sys::obj_get(&link_path).map_err(|source| LoadError::Pin {
                path: link_path.clone(),
                source,
            })?;
            let info = sys::link_info(link.as_fd()).map_err(|source| LoadError::Pin {
                path: link_path.clone(),
                source,
            })?;
            if info.cgroup_id != cgroup_id {
                return Err(LoadError::OtherCgroup {
                    pin_root: layout.root().to_path_buf(),
                    pinned: info.cgroup_id,
                    requested: cgroup_id,
                });
            }
            sys::link_update(link.as_fd(), prog_fd.as_fd()).map_err(|source| {
                LoadError::Replace {
                    path: link_path.clone(),
                    source,
                }
            })?;
        } else {
            let link = sys::link_create(prog_fd.as_fd(), cgroup.as_fd(), spec.attach_type)
                .map_err(|source| LoadError::Attach {
                    name: spec.name,
                    cgroup: opts.cgroup.clone(),
                    source,
                })?;
            sys::obj_pin(link.as_fd(), &link_path).map_err(|source| LoadError::Pin {
                path: link_path.clone(),
                source,
            })?;
        }
        let prog_path = layout.program(spec.name);
        if prog_path.exists() {
            fs::remove_file(&prog_path).map_err(|source| LoadError::Unpin {
                path: prog_path.clone(),
                source,
            })?;
        }
        sys::obj_pin(prog_fd.as_fd(), &prog_path).map_err(|source| LoadError::Pin {
            path: prog_path,
            source,
        })?;
    }
    sys::failpoint("load:after-links");
    write_build_marker(layout, &build_marker(object))?;
    // On every load, not only the one that replaced the map: a load that stopped after the
    // replacement leaves the next one nothing to notice.
    reseed_counters(layout)?;
    tracing::info!(
        pin_root = %layout.root().display(),
        cgroup = %opts.cgroup.display(),
        upgrading,
        "programs attached and pinned"
    );
    Ok(if upgrading {
        LoadOutcome::Upgraded
    } else {
        LoadOutcome::Fresh
    })
}

/// Maps that hold statistics only: when a new version changes their layout, the pinned one is
/// replaced by an empty one instead of refusing the upgrade (a new counter must not take a node
/// out of the mesh until someone runs `sidestep unload`).
const REPLACEABLE_ON_LAYOUT_CHANGE: [&str; 1] = [map_names::COUNTERS];

/// A pinned map to replace, and why.
struct StaleMap {
    map: String,
    path: PathBuf,
    changes: String,
}

/// Refuses to reuse a pinned map whose type, key size, value size or flags differ from the
/// object's: the programs would be verified against the old layout and rejected, or worse, read
/// old values with the new layout. A changed capacity is reported too, except for the maps whose
/// capacity `pod_capacity` sets at creation (the pinned size is then the operator's choice).
/// Statistics maps are returned for replacement instead.
fn check_pinned_maps(
    layout: &PinLayout,
    object: &[u8],
    pod_capacity: Option<u32>,
) -> Result<Vec<StaleMap>, LoadError> {
    let mut replace = Vec::new();
    let obj = aya_obj::Object::parse(object)
        .map_err(|e| LoadError::Object(aya::EbpfError::ParseError(e)))?;
    for (name, def) in &obj.maps {
        let path = layout.map(name);
        if !map_names::ALL.contains(&name.as_str()) || !path.exists() {
            continue;
        }
        let info = aya::maps::MapData::from_pin(&path)
            .and_then(|m| m.info())
            .map_err(|e| LoadError::Pin {
                path: path.clone(),
                source: std::io::Error::other(e),
            })?;
        let mut changes = Vec::new();
        let want_type = aya_obj::generated::bpf_map_type::try_from(def.map_type())
            .ok()
            .and_then(|t| aya::maps::MapType::try_from(t).ok());
        let have_type = info.map_type().ok();
        if want_type != have_type {
            changes.push(format!("type {have_type:?} -> {want_type:?}"));
        }
        for (what, have, want) in [
            ("key", info.key_size(), def.key_size()),
            ("value", info.value_size(), def.value_size()),
        ] {
            if have != want {
                changes.push(format!("{what} {have} -> {want} bytes"));
            }
        }
        if info.map_flags() != def.map_flags() {
            changes.push(format!(
                "flags {:#x} -> {:#x}",
                info.map_flags(),
                def.map_flags()
            ));
        }
        let sized_by_option = POD_SIZED_MAPS.contains(&name.as_str());
        let want_entries = match pod_capacity {
            Some(cap) if sized_by_option => cap,
            _ => def.max_entries(),
        };
        if info.max_entries() != want_entries && (pod_capacity.is_some() || !sized_by_option) {
            changes.push(format!(
                "max_entries {} -> {want_entries}",
                info.max_entries()
            ));
        }
        if changes.is_empty() {
            continue;
        }
        let stale = StaleMap {
            map: name.clone(),
            path,
            changes: changes.join(", "),
        };
        if !REPLACEABLE_ON_LAYOUT_CHANGE.contains(&name.as_str()) {
            return Err(LoadError::MapLayout {
                map: stale.map,
                path: stale.path,
                changes: stale.changes,
            });
        }
        replace.push(stale);
    }
    Ok(replace)
}

/// Every enrolled pod has an entry in the counters map (the programs count only for pods that
/// have one, as enrolment arranges), also after the map was replaced; existing counts stay.
fn reseed_counters(layout: &PinLayout) -> Result<(), LoadError> {
    let mut maps =
        crate::maps::PolicyMaps::open(layout.root()).map_err(LoadError::ReseedCounters)?;
    for (netns_cookie, _) in maps.pods() {
        maps.ensure_counters(netns_cookie)
            .map_err(LoadError::ReseedCounters)?;
    }
    Ok(())
}

fn pinned_max_entries(layout: &PinLayout, map: &str) -> Option<u32> {
    let info = aya::maps::MapData::from_pin(layout.map(map)).and_then(|m| m.info());
    info.ok().map(|i| i.max_entries())
}

/// Switches every pod's pinned tc and sk_lookup link to the newly loaded program
/// (BPF_LINK_UPDATE: atomic, so the pod is never without inbound capture). A link whose netns
/// or interface is already gone is left to the reconcile's garbage collection.
fn update_pod_links(layout: &PinLayout, ebpf: &aya::Ebpf) -> Result<(), LoadError> {
    let fd = |name: &'static str| -> Result<std::os::fd::OwnedFd, LoadError> {
        let program = ebpf.program(name).ok_or(LoadError::MissingProgram(name))?;
        let fd = program
            .fd()
            .map_err(|source| LoadError::ProgramLoad { name, source })?;
        fd.as_fd()
            .try_clone_to_owned()
            .map_err(|source| LoadError::Pin {
                path: layout.program(name),
                source,
            })
    };
    let tc_prog = fd(program_names::TC_INGRESS)?;
    let lookup_prog = fd(program_names::SK_LOOKUP)?;
    let reroute_in = fd(program_names::REROUTE_INGRESS)?;
    let reroute_eg = fd(program_names::REROUTE_EGRESS)?;
    let mut pins = Vec::new();
    let (mut updated, mut gone) = (0usize, 0usize);
    if let Ok(pods) = fs::read_dir(layout.links_dir().join("tc")) {
        for pod in pods.flatten() {
            // Filters (kernels without TCX) are switched inside their netns.
            if let Ok(cookie) = pod.file_name().to_string_lossy().parse::<u64>() {
                let (u, g) =
                    crate::tcattach::update_filter_records(layout, cookie).map_err(|source| {
                        LoadError::Replace {
                            path: pod.path(),
                            source,
                        }
                    })?;
                updated += u;
                gone += g;
            }
            if let Ok(ifaces) = fs::read_dir(pod.path()) {
                pins.extend(
                    ifaces
                        .flatten()
                        .filter(|i| crate::tcattach::is_link_pin(&i.path()))
                        .map(|i| {
                            let name = i.file_name().to_string_lossy().into_owned();
                            let prog = if name.ends_with(crate::pins::REROUTE_INGRESS_SUFFIX) {
                                reroute_in.as_fd()
                            } else if name.ends_with(crate::pins::REROUTE_EGRESS_SUFFIX) {
                                reroute_eg.as_fd()
                            } else {
                                tc_prog.as_fd()
                            };
                            (i.path(), prog)
                        }),
                );
            }
        }
    }
    if let Ok(pods) = fs::read_dir(layout.links_dir().join("sklookup")) {
        pins.extend(pods.flatten().map(|p| (p.path(), lookup_prog.as_fd())));
    }
    for (i, (pin, prog)) in pins.iter().enumerate() {
        if i == 1 {
            sys::failpoint("upgrade:mid-pod-links");
        }
        let result = sys::obj_get(pin).and_then(|link| sys::link_update(link.as_fd(), *prog));
        match result {
            Ok(()) => updated += 1,
            // The kernel detached it with its netns or interface.
            Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => gone += 1,
            Err(source) => {
                return Err(LoadError::Replace {
                    path: pin.clone(),
                    source,
                });
            }
        }
    }
    tracing::info!(updated, gone, "per-pod links switched to the new programs");
    Ok(())
}

/// The pins a complete load leaves, that are missing under `layout`: every map, every program
/// and every cgroup link. Empty means loaded; anything else is an interrupted load or pins
/// deleted behind sidestep's back.
pub fn missing_pins(layout: &PinLayout) -> Vec<PathBuf> {
    let maps = map_names::ALL.iter().map(|n| layout.map(n));
    let programs = CGROUP_PROGRAMS
        .iter()
        .map(|s| s.name)
        .chain(POD_PROGRAMS)
        .chain(MAP_PROGRAMS)
        .map(|n| layout.program(n));
    let links = CGROUP_PROGRAMS
        .iter()
        .map(|s| layout.cgroup_link(s.attach_point));
    maps.chain(programs)
        .chain(links)
        .filter(|p| !p.exists())
        .collect()
}

/// The name of the build marker for `object` loaded by this build: `<version>-<hash>`, the
/// crate's version (bpffs refuses `.` in names, so `0.9.0` reads `0_9_0`) and 12 hex digits of
/// the object's FNV-1a hash (the object can differ within one version: `bpf-object`, a dev
/// build). FNV, not std's hasher, because another build of the same object must name it alike.
pub fn build_marker(object: &[u8]) -> String {
    let version: String = env!("CARGO_PKG_VERSION")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let hash = object.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{version}-{:012x}", hash >> 16)
}

/// The build marker under `layout`, if any: `Ok(None)` for a pin root loaded by a build older
/// than the marker (or not loaded at all).
pub fn pinned_build(layout: &PinLayout) -> std::io::Result<Option<String>> {
    let entries = match fs::read_dir(layout.build_dir()) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    // Two only if a load died between making the new one and removing the old: either may run.
    names.sort();
    Ok(names.pop())
}

/// Marks the pin root as loaded by `name` ([`build_marker`]), the last step of a load or upgrade:
/// an empty directory (bpffs takes directories, and an empty one changes no BPF object), the
/// older marker removed after the new one exists.
fn write_build_marker(layout: &PinLayout, name: &str) -> Result<(), LoadError> {
    let dir = layout.build_dir();
    let marker = dir.join(name);
    let pin_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LoadError::Pin { path, source }
    };
    mkdir_private(&dir)?;
    // Private as every pin (tests/tests/permissions.rs).
    match fs::DirBuilder::new().mode(0o700).create(&marker) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(pin_err(&marker)(e));
        }
        _ => {}
    }
    for e in fs::read_dir(&dir).map_err(pin_err(&dir))?.flatten() {
        if e.file_name() != name {
            fs::remove_dir(e.path()).map_err(|source| LoadError::Unpin {
                path: e.path(),
                source,
            })?;
        }
    }
    Ok(())
}

/// Detaches every pinned link and removes every pin under `pin_root`. Idempotent.
pub fn unload(pin_root: &Path) -> Result<(), LoadError> {
    require_root()?;
    if !pin_root.exists() {
        return Ok(());
    }
    let layout = PinLayout::new(pin_root);
    // Filters (kernels without TCX) are no links: each is deleted inside its pod's netns.
    if let Ok(pods) = fs::read_dir(layout.links_dir().join("tc")) {
        for pod in pods.flatten() {
            if let Ok(cookie) = pod.file_name().to_string_lossy().parse::<u64>() {
                crate::tcattach::detach_filter_records(&layout, cookie);
            }
        }
    }
    crate::links::detach_links_under(&layout.links_dir())?;
    fs::remove_dir_all(pin_root).map_err(|source| LoadError::Unpin {
        path: pin_root.to_path_buf(),
        source,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The marker is plain directories, so a plain temporary directory stands in for bpffs.
    #[test]
    fn the_build_marker_names_the_build_and_replaces_the_last() {
        let a = build_marker(b"object a");
        let b = build_marker(b"object b");
        assert_ne!(a, b);
        assert_eq!(a, build_marker(b"object a"));
        let (version, hash) = a.rsplit_once('-').unwrap();
        assert_eq!(version, env!("CARGO_PKG_VERSION").replace('.', "_"));
        assert_eq!(hash.len(), 12);
        assert!(!a.contains('.'), "bpffs refuses dots: {a}");

        let dir = tempfile::tempdir().unwrap();
        let layout = PinLayout::new(dir.path().join("sidestep"));
        assert_eq!(pinned_build(&layout).unwrap(), None);
        write_build_marker(&layout, &a).unwrap();
        assert_eq!(pinned_build(&layout).unwrap().as_deref(), Some(a.as_str()));
        write_build_marker(&layout, &b).unwrap();
        write_build_marker(&layout, &b).unwrap();
        assert_eq!(pinned_build(&layout).unwrap().as_deref(), Some(b.as_str()));
        assert_eq!(fs::read_dir(layout.build_dir()).unwrap().count(), 1);
        let mode = fs::metadata(layout.build_dir().join(&b)).unwrap().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        // Older loads have no marker, and a complete load does not need one.
        assert!(!missing_pins(&layout).contains(&layout.build_dir()));
    }
}
