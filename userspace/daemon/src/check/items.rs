//! The items that read the node itself: kernel, BTF, cgroup2, bpffs, the CNI directories and
//! configuration, the pinned programs and the build that loaded them, the pod map's fill.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sidestep::{
    features, loader, maps::PolicyMaps, mounts, pins::PinLayout, programs::CGROUP_PROGRAMS, status,
};

use super::{
    DOC_BPFFS, DOC_BUILD, DOC_CGROUP, DOC_CNI, DOC_KERNEL, DOC_MAPS, DOC_PROGRAMS, Found, Item,
    Mode, Verdict,
};
use crate::agent::{conflist, settings::Settings};

/// A map this full fails the check: the next pods' ADDs are close to failing.
pub const FULL_AT_PERCENT: usize = 90;

pub(super) fn kernel() -> Item {
    let k = features::probe();
    Item::new(
        "kernel",
        DOC_KERNEL,
        if k.missing.is_empty() {
            Ok(format!(
                "Linux {}: every program type, map and helper loads",
                k.release
            ))
        } else {
            Err((
                format!("Linux {}: {}", k.release, k.missing.join("; ")),
                "sidestep needs Linux 6.1 or later with BTF and cgroup BPF".into(),
            ))
        },
    )
}

pub(super) fn btf() -> Item {
    match sidestep::btf::sock_offsets() {
        Ok(_) => Item::new(
            "btf",
            DOC_KERNEL,
            Ok("kernel BTF: struct sock offsets resolved (sk_msg available)".into()),
        ),
        Err(e) => Item {
            id: "btf",
            verdict: Verdict::Warn,
            line: format!("sk_msg unavailable: {e}"),
            hint: Some("only pods that ask for sk_msg (sidestep.io/sk-msg) need it".into()),
            doc: DOC_KERNEL,
        },
    }
}

pub(super) fn cgroup2(s: &Settings) -> Item {
    let dir = match &s.cgroup {
        Some(c) => Ok(c.clone()),
        None => mounts::node_cgroup2_root(),
    };
    Item::new(
        "cgroup2",
        DOC_CGROUP,
        dir.and_then(|d| mounts::check_cgroup2_dir(&d).map(|()| d))
            .map(|d| format!("cgroup2 root {} (programs attach here)", d.display()))
            .map_err(|e| {
                (
                    e.to_string(),
                    "the node's cgroup2 root must be in sight: set cgroup, or run in the host's \
                     cgroup namespace"
                        .into(),
                )
            }),
    )
}

/// The bpffs the pins live on: a bpffs, and the host's (a mount of the container's own would
/// take every pin with it when the agent's container stops).
pub fn bpffs(pin_root: &Path) -> Item {
    let dir: PathBuf = if pin_root.exists() {
        pin_root.to_path_buf()
    } else {
        pin_root.parent().unwrap_or(pin_root).to_path_buf()
    };
    let result = if !mounts::is_bpffs(&dir) {
        Err((
            format!("{} is not on a bpffs", dir.display()),
            "mount bpffs at /sys/fs/bpf on the host, and into the agent with mountPropagation: \
             Bidirectional (deploy/daemonset.yaml)"
                .into(),
        ))
    } else {
        match mounts::bpffs_is_the_hosts(&dir) {
            Ok(mounts::HostBpffs::Yes) => Ok(format!("{} is the host's bpffs", dir.display())),
            Ok(mounts::HostBpffs::Private(m)) => Err((
                format!(
                    "{} lies on a private mount ({}): it may be this container's own bpffs",
                    dir.display(),
                    m.display()
                ),
                "pins on a bpffs of the container's own die with it: mount the host's \
                 /sys/fs/bpf with mountPropagation HostToContainer or Bidirectional"
                    .into(),
            )),
            // Hardened /proc: say so rather than guess either way.
            Ok(mounts::HostBpffs::Unknown) => {
                return Item {
                    id: "bpffs",
                    verdict: Verdict::Warn,
                    line: format!(
                        "{} is a bpffs; whether it is the host's cannot be told (/proc/1/ns/mnt \
                         is not readable)",
                        dir.display()
                    ),
                    hint: Some(
                        "in a container, mount the host's /sys/fs/bpf with mountPropagation \
                         HostToContainer or Bidirectional"
                            .into(),
                    ),
                    doc: DOC_BPFFS,
                };
            }
            Err(e) => Err((e.to_string(), String::new())),
        }
    };
    Item::new("bpffs", DOC_BPFFS, result)
}

pub(super) fn cni_dirs(s: &Settings) -> Item {
    let missing: Vec<String> = [&s.cni_bin_dir, &s.cni_conf_dir]
        .into_iter()
        .filter(|d| !d.is_dir())
        .map(|d| d.display().to_string())
        .collect();
    Item::new(
        "cni-dirs",
        DOC_CNI,
        if missing.is_empty() {
            Ok(format!(
                "CNI bin {} and conf {}",
                s.cni_bin_dir.display(),
                s.cni_conf_dir.display()
            ))
        } else {
            Err((
                format!("missing: {}", missing.join(", ")),
                "mount the host's CNI bin and conf directories, the ones the container runtime \
                 is configured with (containerd: plugins.'io.containerd.cri.v1.runtime'.cni)"
                    .into(),
            ))
        },
    )
}

pub(super) fn conflist_item(s: &Settings, mode: Mode) -> Item {
    let name = s.cni_conf_name.as_deref();
    Item::new(
        "conflist",
        DOC_CNI,
        conflist(&s.cni_conf_dir, name, s.plugin_type(), mode == Mode::Node),
    )
}

/// The runtime's CNI configuration: readable, no competing redirector (istio-cni) anywhere, and,
/// once installed, sidestep's entry last in the chain the runtime uses.
pub fn conflist(dir: &Path, name: Option<&str>, plugin_type: &str, installed: bool) -> Found {
    let files = conflist::conf_files(dir).map_err(|e| (e.to_string(), String::new()))?;
    if files.is_empty() {
        return Err((
            format!("no CNI configuration in {}", dir.display()),
            "the primary CNI has not written its configuration yet".into(),
        ));
    }
    let mut lists = Vec::new();
    for f in &files {
        let (list, _) = conflist::read_as_list(f).map_err(|e| {
            (
                e.to_string(),
                "the runtime cannot read it either: fix or remove the file".into(),
            )
        })?;
        if conflist::count_entries(&list, "istio-cni") > 0 {
            return Err((
                format!("{} holds an istio-cni entry", f.display()),
                "istio-cni and sidestep would both redirect the pod: remove istio-cni first \
                 (Migrating from istio-cni)"
                    .into(),
            ));
        }
        lists.push((f.clone(), list));
    }
    if !installed {
        return Ok(format!("{} readable, no competing entry", files.len()));
    }
    let target = conflist::chain_target(dir, name, plugin_type)
        .ok()
        .flatten()
        .or_else(|| files.first().cloned());
    let Some((file, list)) = lists.iter().find(|(f, _)| Some(f) == target.as_ref()) else {
        return Err((
            format!("no chain to check in {}", dir.display()),
            String::new(),
        ));
    };
    let types: Vec<&str> = list["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("type").and_then(Value::as_str))
        .collect();
    let chain = types.join(" + ");
    match types.iter().position(|t| *t == plugin_type) {
        Some(i) if i + 1 == types.len() => Ok(format!("{}: {chain}", file.display())),
        Some(_) => Err((
            format!("{}: {chain}: {plugin_type} is not last", file.display()),
            "sidestep must run after the plugins that set up the pod's interfaces".into(),
        )),
        None => Err((
            format!("{}: {chain}: no {plugin_type} entry", file.display()),
            "the agent puts it back within seconds; if it does not, see its log (an \
             uninstall-requested drain removes it on purpose)"
                .into(),
        )),
    }
}

pub(super) fn programs(pin_root: &Path) -> Item {
    let layout = PinLayout::new(pin_root);
    let lost = loader::missing_pins(&layout);
    let detached = status::detached_cgroup_links(&layout);
    let result = if !layout.is_loaded() {
        Err((
            format!("nothing loaded at {}", pin_root.display()),
            "the agent loads the programs at start; see its log".into(),
        ))
    } else if !lost.is_empty() {
        Err((
            format!("{} pins missing (first: {})", lost.len(), lost[0].display()),
            "the agent reloads lost pins at its next reconcile".into(),
        ))
    } else if !detached.is_empty() {
        Err((
            format!("cgroup links not attached: {}", detached.join(", ")),
            "the agent reloads them at its next reconcile".into(),
        ))
    } else {
        Ok(format!(
            "{} cgroup programs attached, every pin under {}",
            CGROUP_PROGRAMS.len(),
            pin_root.display()
        ))
    };
    Item::new("programs", DOC_PROGRAMS, result)
}

pub(super) fn pod_map(pin_root: &Path) -> Item {
    let result = match PolicyMaps::open(pin_root) {
        Err(e) => Err((e.to_string(), String::new())),
        Ok(maps) => fill(maps.pods().len(), maps.pod_capacity as usize),
    };
    Item::new("maps", DOC_MAPS, result)
}

/// The pod map's fill: a failure from [`FULL_AT_PERCENT`] on.
pub fn fill(pods: usize, capacity: usize) -> Found {
    let line = format!("pod map: {pods} of {capacity} pods");
    if capacity == 0 || pods * 100 >= capacity * FULL_AT_PERCENT {
        Err((
            line,
            "raise pod-capacity (it takes a reload: sidestep unload, then the agent)".into(),
        ))
    } else {
        Ok(line)
    }
}

/// The build that loaded the programs ([`loader::build_marker`]) against this one's: the
/// embedded object, or `bpf-object` as the agent would load it.
pub(super) fn build(s: &Settings) -> Item {
    let layout = PinLayout::new(&s.pin_root);
    let object = match &s.bpf_object {
        Some(p) => std::fs::read(p).map_err(|e| format!("bpf-object {}: {e}", p.display())),
        None => Ok(loader::BPF_OBJECT.to_vec()),
    };
    let ours = match object {
        Ok(o) => loader::build_marker(&o),
        Err(e) => return Item::new("build", DOC_BUILD, Err((e, String::new()))),
    };
    match loader::pinned_build(&layout) {
        Err(e) => Item::new(
            "build",
            DOC_BUILD,
            Err((
                format!("cannot read {}: {e}", layout.build_dir().display()),
                String::new(),
            )),
        ),
        Ok(pinned) if !layout.is_loaded() => Item::warn(
            "build",
            DOC_BUILD,
            format!(
                "nothing loaded to compare with this build {ours}{}",
                pinned.map(|p| format!(" (marker {p})")).unwrap_or_default()
            ),
            "see the programs line",
        ),
        Ok(pinned) => match build_matches(pinned.as_deref(), &ours) {
            Some(found) => Item::new("build", DOC_BUILD, found),
            None => Item::warn(
                "build",
                DOC_BUILD,
                format!(
                    "the programs carry no build marker under {} (loaded by a build older than \
                     this one, {ours})",
                    layout.build_dir().display()
                ),
                "the next load or agent start marks them; `sidestep load` marks them now",
            ),
        },
    }
}

/// Whether the pinned build marker is this build's; `None` when there is none (older loads).
pub fn build_matches(pinned: Option<&str>, ours: &str) -> Option<Found> {
    let pinned = pinned?;
    Some(if pinned == ours {
        Ok(format!("the programs are this build's ({ours})"))
    } else {
        Err((
            format!("the programs were loaded by build {pinned}; this is {ours}"),
            "the agent's rollout is not finished (an agent of this build upgrades them at \
             start), or run `sidestep load` / restart the agent with this build"
                .into(),
        ))
    })
}
