//! `sidestep status`: what is loaded, where it is attached, who is enrolled, and what it did.

use std::{
    fmt::Write as _,
    fs,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use aya::programs::ProgramInfo;
use serde::Serialize;
use sidestep_abi::{Counters, PodPolicy, flags, program_names};

use crate::{
    maps::PolicyMaps,
    mounts,
    pins::PinLayout,
    policy::InboundHook,
    programs::{CGROUP_PROGRAMS, MAP_PROGRAMS, POD_PROGRAMS},
    sys,
};

/// The pod's re-routed interfaces: those with a re-route ingress link pinned.
fn rerouted_interfaces(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    let mut v: Vec<String> = crate::podlinks::reroute_pins(layout, netns_cookie)
        .into_iter()
        .filter_map(|p| {
            p.strip_suffix(crate::pins::REROUTE_INGRESS_SUFFIX)
                .map(str::to_owned)
        })
        .collect();
    v.sort();
    v
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub pin_root: PathBuf,
    pub loaded: bool,
    pub programs: Vec<ProgramStatus>,
    pub attachments: Vec<Attachment>,
    pub pods: Vec<PodStatus>,
    pub pod_capacity: u32,
    pub kernel: KernelStatus,
}

/// The kernel facts that change how sidestep attaches (see docs/ARCHITECTURE.md, "Kernels").
#[derive(Debug, Serialize)]
pub struct KernelStatus {
    pub release: String,
    /// `tcx` (Linux 6.6+) or `netlink` (cls_bpf filters on a clsact qdisc); None when not loaded.
    pub tc_attach: Option<String>,
    /// Whether the tc program can name the pod of a SYN from off the node by its netns (6.13+).
    pub tc_netns_cookie: bool,
}

fn kernel_status(layout: &PinLayout) -> KernelStatus {
    let tc_attach = aya::programs::SchedClassifier::from_pin(
        layout.program(sidestep_abi::program_names::TC_INGRESS),
    )
    .ok()
    .map(|prog| crate::tcattach::mechanism(&prog).to_string());
    KernelStatus {
        release: crate::features::release(),
        tc_attach,
        tc_netns_cookie: crate::features::tc_netns_cookie(),
    }
}

#[derive(Debug, Serialize)]
pub struct ProgramStatus {
    pub name: String,
    /// 0 for a row that sums several programs.
    pub id: u32,
    /// How many loaded programs the row sums: 1, except for the per-pod identity programs.
    pub instances: u32,
    /// Filled only while `kernel.bpf_stats_enabled=1`.
    pub run_count: u64,
    pub run_time_ns: u64,
}

#[derive(Debug, Serialize)]
pub struct Attachment {
    pub attach_point: String,
    pub link_id: u32,
    pub prog_id: u32,
    pub cgroup: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
pub struct PodStatus {
    pub netns_cookie: u64,
    /// The pod the plugin's record names (`namespace/name`, or the name alone where the runtime
    /// gave no namespace); `None` for a netns enrolled by hand, or without a state directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// Where inbound capture hooks in: `tc`, `sk_lookup`, or `off`.
    pub inbound_hook: &'static str,
    /// Interfaces carrying the inbound tc program.
    pub interfaces: Vec<String>,
    /// Interfaces (their ifindex inside the pod) whose inbound connections are captured, by
    /// either hook.
    pub inbound_ifindexes: Vec<u32>,
    /// Re-routed virtual interfaces with their two links.
    pub rerouted: Vec<String>,
    /// The addresses captured connections leave from (`SIDESTEP_SRC`); empty: loopback.
    pub source_addresses: Vec<std::net::IpAddr>,
    pub policy: PolicySummary,
    pub counters: CounterSummary,
}

#[derive(Debug, Serialize)]
pub struct PolicySummary {
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub dns_port: u16,
    pub capture: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct CounterSummary {
    pub redirected_outbound: u64,
    pub redirected_inbound: u64,
    pub passed_outbound: u64,
    pub passed_inbound: u64,
    pub dns_redirected: u64,
    pub orig_dst_hits: u64,
    pub orig_dst_misses: u64,
    pub sk_msg_redirects: u64,
    pub sk_msg_fallbacks: u64,
}

impl From<Counters> for CounterSummary {
    fn from(c: Counters) -> Self {
        Self {
            redirected_outbound: c.redirected_outbound,
            redirected_inbound: c.redirected_inbound,
            passed_outbound: c.passed_outbound,
            passed_inbound: c.passed_inbound,
            dns_redirected: c.dns_redirected,
            orig_dst_hits: c.orig_dst_hits,
            orig_dst_misses: c.orig_dst_misses,
            sk_msg_redirects: c.sk_msg_redirects,
            sk_msg_fallbacks: c.sk_msg_fallbacks,
        }
    }
}

pub fn summarize_policy(p: &PodPolicy) -> PolicySummary {
    let names = [
        (flags::OUTBOUND, "outbound"),
        (flags::INBOUND, "inbound"),
        (flags::INBOUND_ALL_PORTS, "inbound-all-ports"),
        (flags::HAIRPIN, "hairpin"),
        (flags::DNS_CAPTURE, "dns"),
        (flags::TPROXY, "tproxy"),
        (flags::AMBIENT, "ambient"),
        (flags::IPV6, "ipv6"),
        (flags::SK_MSG, "sk_msg"),
        (flags::DEBUG, "debug-log"),
        (flags::INBOUND_SK_LOOKUP, "inbound-by-sk_lookup"),
        (flags::OUTBOUND_ALL_RANGES, "all-outbound-ranges"),
        (flags::HAS_OUT_PORT_EXCLUDES, "excluded-outbound-ports"),
        (flags::HAS_OUT_PORT_INCLUDES, "included-outbound-ports"),
        (flags::HAS_OUT_CIDR_EXCLUDES, "excluded-outbound-ranges"),
    ];
    PolicySummary {
        proxy_uid: p.proxy_uid,
        proxy_gid: p.proxy_gid,
        outbound_port: p.outbound_port,
        inbound_port: p.inbound_port,
        dns_port: p.dns_port,
        capture: names
            .iter()
            .filter(|(bit, _)| p.flags & bit != 0)
            .map(|(_, n)| *n)
            .collect(),
    }
}

/// Finds the cgroup directory whose inode is `id`, searching a few levels below the cgroup2 root.
fn cgroup_path(id: u64) -> Option<PathBuf> {
    fn walk(dir: &Path, id: u64, depth: u8) -> Option<PathBuf> {
        if fs::metadata(dir).ok()?.ino() == id {
            return Some(dir.to_path_buf());
        }
        if depth == 0 {
            return None;
        }
        fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
            .find_map(|e| walk(&e.path(), id, depth - 1))
    }
    walk(&mounts::cgroup2_root().ok()?, id, 4)
}

/// The installation's programs, with their run statistics: the pinned ones, then one row for
/// the per-pod identity programs.
pub fn programs(layout: &PinLayout) -> Vec<ProgramStatus> {
    CGROUP_PROGRAMS
        .iter()
        .map(|s| s.name)
        .chain(POD_PROGRAMS)
        .chain(MAP_PROGRAMS)
        .filter_map(|name| {
            let info = ProgramInfo::from_pin(layout.program(name)).ok()?;
            Some(ProgramStatus {
                name: name.to_string(),
                id: info.id(),
                instances: 1,
                run_count: info.run_count(),
                run_time_ns: info.run_time().as_nanos() as u64,
            })
        })
        .chain(pod_identity_programs(layout))
        .collect()
}

/// The identity programs ([`crate::identity`]), one per pod with inbound capture, summed into one
/// row. They are not pinned as programs, so they are found through their pinned links; without
/// this row their cost (every inbound SYN runs one) would be missing from status and from any
/// per-program sum built on it. None when no pod has one.
fn pod_identity_programs(layout: &PinLayout) -> Option<ProgramStatus> {
    let prog_ids: std::collections::HashSet<u32> = fs::read_dir(crate::identity::links_dir(layout))
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let link = sys::obj_get(&entry.path()).ok()?;
            sys::link_info(link.as_fd()).ok().map(|info| info.prog_id)
        })
        .collect();
    if prog_ids.is_empty() {
        return None;
    }
    let (run_count, run_time_ns) = aya::programs::loaded_programs()
        .flatten()
        .filter(|info| prog_ids.contains(&info.id()))
        .fold((0u64, 0u64), |(count, ns), info| {
            (
                count + info.run_count(),
                ns + info.run_time().as_nanos() as u64,
            )
        });
    Some(ProgramStatus {
        name: program_names::POD_IDENTITY.to_string(),
        id: 0,
        instances: prog_ids.len() as u32,
        run_count,
        run_time_ns,
    })
}

/// The pinned cgroup links that can be read back: (attach point, link).
pub fn cgroup_links(layout: &PinLayout) -> Vec<(&'static str, sys::LinkInfo)> {
    CGROUP_PROGRAMS
        .iter()
        .filter_map(|spec| {
            let link = sys::obj_get(&layout.cgroup_link(spec.attach_point)).ok()?;
            let info = sys::link_info(link.as_fd()).ok()?;
            Some((spec.attach_point, info))
        })
        .collect()
}

/// The cgroup hooks whose pinned link is missing or no longer attached to a cgroup.
pub fn detached_cgroup_links(layout: &PinLayout) -> Vec<&'static str> {
    let attached: Vec<&str> = cgroup_links(layout)
        .into_iter()
        .filter(|(_, info)| info.cgroup_id != 0)
        .map(|(attach_point, _)| attach_point)
        .collect();
    CGROUP_PROGRAMS
        .iter()
        .map(|p| p.attach_point)
        .filter(|a| !attached.contains(a))
        .collect()
}

pub fn collect(pin_root: &Path) -> Status {
    let layout = PinLayout::new(pin_root);
    let programs = programs(&layout);
    let attachments = cgroup_links(&layout)
        .into_iter()
        .map(|(attach_point, info)| Attachment {
            attach_point: attach_point.to_string(),
            link_id: info.id,
            prog_id: info.prog_id,
            cgroup: cgroup_path(info.cgroup_id),
        })
        .collect();
    let (pods, pod_capacity) = match PolicyMaps::open(pin_root) {
        Ok(maps) => {
            let mut ifindexes = maps.inbound_ifindexes_by_pod();
            let pods = maps
                .pods()
                .into_iter()
                .map(|(cookie, policy)| PodStatus {
                    netns_cookie: cookie,
                    pod: None,
                    container_id: None,
                    inbound_hook: if policy.flags & flags::INBOUND == 0 {
                        "off"
                    } else if policy.flags & flags::INBOUND_SK_LOOKUP != 0 {
                        InboundHook::SkLookup.as_str()
                    } else {
                        InboundHook::Tc.as_str()
                    },
                    interfaces: crate::podlinks::attached_interfaces(&layout, cookie),
                    inbound_ifindexes: ifindexes.remove(&cookie).unwrap_or_default(),
                    rerouted: rerouted_interfaces(&layout, cookie),
                    source_addresses: maps.source_addresses(cookie),
                    policy: summarize_policy(&policy),
                    counters: maps.counters(cookie).into(),
                })
                .collect();
            (pods, maps.pod_capacity)
        }
        Err(_) => (Vec::new(), 0),
    };
    Status {
        pin_root: pin_root.to_path_buf(),
        loaded: layout.is_loaded(),
        programs,
        attachments,
        pods,
        pod_capacity,
        kernel: kernel_status(&layout),
    }
}

impl Status {
    /// The human-readable form.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if !self.loaded {
            let _ = writeln!(
                out,
                "sidestep is not loaded at {} (run `sidestep load`).",
                self.pin_root.display()
            );
            return out;
        }
        let _ = writeln!(out, "sidestep at {}", self.pin_root.display());
        let _ = writeln!(
            out,
            "kernel {}: tc attach {}, tc netns cookie {}",
            self.kernel.release,
            self.kernel.tc_attach.as_deref().unwrap_or("?"),
            if self.kernel.tc_netns_cookie {
                "yes"
            } else {
                "no (6.13+)"
            }
        );
        let _ = writeln!(out, "\nPROGRAMS ({}):", self.programs.len());
        let _ = writeln!(
            out,
            "  {:<24} {:>6} {:>12} {:>12}",
            "NAME", "ID", "RUNS", "AVG NS"
        );
        for p in &self.programs {
            let avg = p.run_time_ns.checked_div(p.run_count).unwrap_or(0);
            // A summed row has no one id; it shows how many programs it sums instead.
            let id = if p.id == 0 {
                format!("{}×", p.instances)
            } else {
                p.id.to_string()
            };
            let _ = writeln!(
                out,
                "  {:<24} {:>6} {:>12} {:>12}",
                p.name, id, p.run_count, avg
            );
        }
        let _ = writeln!(out, "\nATTACHMENTS ({}):", self.attachments.len());
        for a in &self.attachments {
            let cg = a
                .cgroup
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "?".into());
            let _ = writeln!(
                out,
                "  {:<14} link {:>5} prog {:>5} cgroup {}",
                a.attach_point, a.link_id, a.prog_id, cg
            );
        }
        let _ = writeln!(
            out,
            "\nPODS ({} of {} slots):",
            self.pods.len(),
            self.pod_capacity
        );
        for pod in &self.pods {
            let p = &pod.policy;
            let c = &pod.counters;
            let inbound = match pod.inbound_hook {
                "tc" => format!("inbound tc on [{}]", pod.interfaces.join(",")),
                "sk_lookup" => format!(
                    "inbound sk_lookup on ifindex [{}]",
                    pod.inbound_ifindexes
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                other => format!("inbound {other}"),
            };
            let rerouted = if pod.rerouted.is_empty() {
                String::new()
            } else {
                format!("  re-routed [{}]", pod.rerouted.join(","))
            };
            // Ambient mode keeps ztunnel's mark and mask in the identity fields.
            let proxy = if p.capture.contains(&"ambient") {
                format!("ztunnel mark {:#x}/{:#x}", p.proxy_uid, p.proxy_gid)
            } else {
                format!("proxy uid {} gid {}", p.proxy_uid, p.proxy_gid)
            };
            let source = if pod.source_addresses.is_empty() {
                "loopback".to_owned()
            } else {
                pod.source_addresses
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            };
            if let Some(name) = &pod.pod {
                let _ = writeln!(out, "  {name}");
            }
            let _ = writeln!(
                out,
                "  netns {:<8} {inbound}{rerouted}  {proxy}  ports out {} in {} dns {}  source {source}  [{}]",
                pod.netns_cookie,
                p.outbound_port,
                p.inbound_port,
                p.dns_port,
                p.capture.join(",")
            );
            let _ = writeln!(
                out,
                "      redirected out {} in {} dns {}  passed out {} in {}  original-dst hits {} misses {}  sk_msg {} (to TCP {})",
                c.redirected_outbound,
                c.redirected_inbound,
                c.dns_redirected,
                c.passed_outbound,
                c.passed_inbound,
                c.orig_dst_hits,
                c.orig_dst_misses,
                c.sk_msg_redirects,
                c.sk_msg_fallbacks
            );
        }
        out
    }
}

/// Names each pod by the plugin's record of its netns cookie (`namespace/name`).
pub fn name_pods(status: &mut Status, state_dir: &std::path::Path) {
    let records = crate::statedir::StateDir::new(state_dir).summaries();
    for pod in &mut status.pods {
        // One netns, several attachments: any record names the same pod.
        if let Some(r) = records
            .values()
            .find(|r| r.netns_cookie == pod.netns_cookie)
        {
            pod.pod = r.pod_name.as_ref().map(|name| match &r.pod_namespace {
                Some(ns) => format!("{ns}/{name}"),
                None => name.clone(),
            });
            pod.container_id = Some(r.container_id.clone());
        }
    }
}

/// `--pod` named no enrolled pod.
#[derive(Debug, thiserror::Error)]
#[error("no enrolled pod {wanted}; enrolled: {enrolled}")]
pub struct NoSuchPod {
    pub wanted: String,
    pub enrolled: String,
}

/// Keeps only the pod named `wanted` (`namespace/name`); the error lists the names there are.
pub fn only_pod(status: &mut Status, wanted: &str) -> Result<(), NoSuchPod> {
    let names: Vec<String> = status.pods.iter().filter_map(|p| p.pod.clone()).collect();
    status.pods.retain(|p| p.pod.as_deref() == Some(wanted));
    if status.pods.is_empty() {
        return Err(NoSuchPod {
            wanted: wanted.to_owned(),
            enrolled: if names.is_empty() {
                "none with a name".to_owned()
            } else {
                names.join(", ")
            },
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(name: &str, id: u32, instances: u32) -> ProgramStatus {
        ProgramStatus {
            name: name.into(),
            id,
            instances,
            run_count: 4,
            run_time_ns: 400,
        }
    }

    #[test]
    fn a_summed_row_shows_its_count_in_place_of_an_id() {
        let status = Status {
            pin_root: "/sys/fs/bpf/x".into(),
            loaded: true,
            programs: vec![
                program("sidestep_connect4", 769, 1),
                program(program_names::POD_IDENTITY, 0, 250),
            ],
            attachments: Vec::new(),
            pods: Vec::new(),
            pod_capacity: 4096,
            kernel: KernelStatus {
                release: "6.12.0".into(),
                tc_attach: Some("tcx".into()),
                tc_netns_cookie: false,
            },
        };
        let text = status.render();
        assert!(text.contains("PROGRAMS (2):"), "{text}");
        let rows: Vec<Vec<&str>> = text
            .lines()
            .filter(|l| l.trim_start().starts_with("sidestep_"))
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[0], ["sidestep_connect4", "769", "4", "100"]);
        assert_eq!(rows[1], ["sidestep_pod_id", "250×", "4", "100"]);
    }
}
