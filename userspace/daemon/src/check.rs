//! `sidestep check`: whether this node can run sidestep (`--pre`, before an install), and whether
//! it does (the default, node health). Each item is a pure function of what it reads, says ✔ or
//! ✖ (or `!` for what only some pods need) with a one-line hint, and links to its section in the
//! docs; the command's exit code is 0 only when no item failed. It runs on a node with the
//! agent's settings, or in the agent's pod (`kubectl exec ds/sidestep-agent -- sidestep check`).

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;
use sidestep::{
    features, loader, maps::PolicyMaps, mounts, pins::PinLayout, programs::CGROUP_PROGRAMS, status,
};

use crate::agent::{conflist, settings::Settings};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    /// Only some pods need it (sk_msg): said, but not a failure.
    Warn,
}

#[derive(Debug, Clone, Serialize)]
pub struct Item {
    pub id: &'static str,
    pub verdict: Verdict,
    pub line: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Where the docs explain it: `docs/FILE.md#anchor`.
    pub doc: &'static str,
}

impl Item {
    fn new(id: &'static str, doc: &'static str, result: Result<String, (String, String)>) -> Self {
        match result {
            Ok(line) => Self {
                id,
                verdict: Verdict::Pass,
                line,
                hint: None,
                doc,
            },
            Err((line, hint)) => Self {
                id,
                verdict: Verdict::Fail,
                line,
                hint: Some(hint),
                doc,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Before an install: what the node must offer.
    Pre,
    /// On a node that runs sidestep: also the installed parts.
    Node,
}

const DOC_KERNEL: &str = "docs/ARCHITECTURE.md#kernels-61-and-later-features-probed-at-load";
const DOC_CGROUP: &str = "docs/ARCHITECTURE.md#where-cgroup-programs-attach";
const DOC_BPFFS: &str = "docs/OPERATIONS.md#checking-a-node-sidestep-check";
const DOC_CNI: &str = "docs/OPERATIONS.md#the-plugins-configuration-sidestep-cni";
const DOC_PROGRAMS: &str = "docs/OPERATIONS.md#healthz-and-readyz";
const DOC_MAPS: &str = "docs/ARCHITECTURE.md#maps";
/// Every doc link an item can carry (tested to resolve).
pub const DOCS: [&str; 6] = [
    DOC_KERNEL,
    DOC_CGROUP,
    DOC_BPFFS,
    DOC_CNI,
    DOC_PROGRAMS,
    DOC_MAPS,
];
/// A map this full fails the check: the next pods' ADDs are close to failing.
pub const FULL_AT_PERCENT: usize = 90;

pub fn run(s: &Settings, mode: Mode) -> Vec<Item> {
    let mut items = vec![
        kernel(),
        btf(),
        cgroup2(s),
        bpffs(&s.pin_root),
        cni_dirs(s),
        conflist_item(s, mode),
    ];
    if mode == Mode::Node {
        items.push(programs(&s.pin_root));
        items.push(pod_map(&s.pin_root));
    }
    items
}

/// Whether every item passed (warnings pass).
pub fn passed(items: &[Item]) -> bool {
    items.iter().all(|i| i.verdict != Verdict::Fail)
}

pub fn render(items: &[Item]) -> String {
    let mut out = String::new();
    for i in items {
        let mark = match i.verdict {
            Verdict::Pass => "✔",
            Verdict::Fail => "✖",
            Verdict::Warn => "!",
        };
        out.push_str(&format!("{mark} {:<9} {}\n", i.id, i.line));
        if let Some(h) = &i.hint {
            out.push_str(&format!("  {:<9} {h} ({})\n", "", i.doc));
        }
    }
    let failed = items.iter().filter(|i| i.verdict == Verdict::Fail).count();
    out.push_str(&if failed == 0 {
        "all checks passed\n".to_owned()
    } else {
        format!("{failed} of {} checks failed\n", items.len())
    });
    out
}

fn kernel() -> Item {
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

fn btf() -> Item {
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

fn cgroup2(s: &Settings) -> Item {
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

fn cni_dirs(s: &Settings) -> Item {
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

fn conflist_item(s: &Settings, mode: Mode) -> Item {
    let name = s.cni_conf_name.as_deref();
    Item::new(
        "conflist",
        DOC_CNI,
        conflist(&s.cni_conf_dir, name, s.plugin_type(), mode == Mode::Node),
    )
}

/// The runtime's CNI configuration: readable, no competing redirector (istio-cni) anywhere, and,
/// once installed, sidestep's entry last in the chain the runtime uses.
pub fn conflist(
    dir: &Path,
    name: Option<&str>,
    plugin_type: &str,
    installed: bool,
) -> Result<String, (String, String)> {
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

fn programs(pin_root: &Path) -> Item {
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

fn pod_map(pin_root: &Path) -> Item {
    let result = match PolicyMaps::open(pin_root) {
        Err(e) => Err((e.to_string(), String::new())),
        Ok(maps) => fill(maps.pods().len(), maps.pod_capacity as usize),
    };
    Item::new("maps", DOC_MAPS, result)
}

/// The pod map's fill: a failure from [`FULL_AT_PERCENT`] on.
pub fn fill(pods: usize, capacity: usize) -> Result<String, (String, String)> {
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

#[cfg(test)]
mod tests;
