//! How a tc program gets onto a pod's interface, and how it comes off again.
//!
//! From Linux 6.6 the kernel has TCX: the attachment is a bpf_link, pinned under the pin root,
//! replaced with `BPF_LINK_UPDATE` and detached with `BPF_LINK_DETACH`. Before 6.6 (Debian 12,
//! Amazon Linux 2023, Bottlerocket and COS ship 6.1) a tc program sits on a `clsact` qdisc as a
//! `cls_bpf` filter in direct-action mode, as `tc filter add ... bpf da` puts it. A filter is no
//! file descriptor: it lives in the interface's qdisc until it is deleted, or the interface or
//! its netns goes away. So that upgrade, CHECK, status and unload find it as they find a link, a
//! filter is recorded where its link would be pinned: that path holds a pin of the *program*
//! (bpffs pins only BPF objects), and the filter itself is named by a fixed priority per use
//! ([`Slot`]) with handle 1, which makes replacing it atomic (`tc filter replace`).
//!
//! Which mechanism is used is probed, not read off the kernel version: `SIDESTEP_TC_ATTACH`
//! (`tcx` or `netlink`) forces one, which lets the netlink path be tested on any kernel.

use std::{
    fs, io,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    sync::OnceLock,
};

use aya::programs::{
    SchedClassifier, TcAttachType,
    links::FdLink,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcHandle as NlHandle, TcMessage},
};

use sidestep_abi::program_names;

use crate::{netns::Netns, pins::PinLayout, rtnl::Rtnl, sys};

/// Forces the attach mechanism (`tcx` or `netlink`); unset or `auto` probes the kernel.
pub const TC_ATTACH_ENV: &str = "SIDESTEP_TC_ATTACH";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    Tcx,
    Netlink,
}

impl std::fmt::Display for Mechanism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcx => "tcx",
            Self::Netlink => "netlink",
        })
    }
}

/// The mechanism this process attaches with: forced by [`TC_ATTACH_ENV`], else TCX when the
/// kernel has it (probed once with `prog`, any loaded sched_cls program).
pub fn mechanism(prog: &SchedClassifier) -> Mechanism {
    static CHOSEN: OnceLock<Mechanism> = OnceLock::new();
    *CHOSEN.get_or_init(|| match std::env::var(TC_ATTACH_ENV).as_deref() {
        Ok("netlink") => Mechanism::Netlink,
        Ok("tcx") => Mechanism::Tcx,
        _ if prog.fd().is_ok_and(|fd| sys::probe_tcx(fd.as_fd())) => Mechanism::Tcx,
        _ => Mechanism::Netlink,
    })
}

/// Where on an interface a program of sidestep runs, as a cls_bpf filter. The priorities keep
/// the order TCX gives (inbound capture is attached before re-routing) and stay clear of tc's
/// automatic ones (49152 and down), so an operator's own filters are never replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub attach_type: TcAttachType,
    pub priority: u16,
}

pub const INBOUND: Slot = Slot {
    attach_type: TcAttachType::Ingress,
    priority: 0x5300,
};
pub const REROUTE_INGRESS: Slot = Slot {
    attach_type: TcAttachType::Ingress,
    priority: 0x5301,
};
pub const REROUTE_EGRESS: Slot = Slot {
    attach_type: TcAttachType::Egress,
    priority: 0x5301,
};
const HANDLE: TcHandle = TcHandle::new(0, 1);

/// Attaches `prog` to `interface` of the calling thread's netns and records the attachment at
/// `pin`. Whatever `pin` recorded before is replaced: a TCX link is detached first, a filter is
/// replaced in place (no moment without a program).
pub fn attach_here(
    prog: &mut SchedClassifier,
    interface: &str,
    slot: Slot,
    pin: &Path,
) -> io::Result<()> {
    match mechanism(prog) {
        Mechanism::Tcx => {
            if pin.exists() {
                detach_here(pin, interface, slot);
            }
            let id = prog
                .attach_with_options(
                    interface,
                    slot.attach_type,
                    TcAttachOptions::TcxOrder(aya::programs::LinkOrder::default()),
                )
                .map_err(|e| {
                    io::Error::other(format!("attach tc to {interface}: {}", with_sources(&e)))
                })?;
            let link = prog.take_link(id).map_err(io::Error::other)?;
            let fd_link = FdLink::try_from(link).map_err(io::Error::other)?;
            fd_link
                .pin(pin)
                .map_err(|e| io::Error::other(format!("pin {}: {e}", pin.display())))?;
        }
        Mechanism::Netlink => {
            if pin.exists() && is_link_pin(pin) {
                // Enrolled under TCX before (a forced mechanism changed): one program per slot.
                detach_here(pin, interface, slot);
            }
            match tc::qdisc_add_clsact(interface) {
                Ok(()) => {}
                Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => {
                    return Err(io::Error::other(format!(
                        "add clsact qdisc to {interface}: {e}"
                    )));
                }
            }
            put_filter(prog, interface, slot)?;
            record(prog, pin)?;
        }
    }
    Ok(())
}

/// Puts `prog` into the slot's filter: replaces the filter there, or creates it.
fn put_filter(prog: &mut SchedClassifier, interface: &str, slot: Slot) -> io::Result<()> {
    let existing =
        SchedClassifierLink::attached(interface, slot.attach_type, slot.priority, HANDLE, None)?;
    let id = match prog.attach_to_link(existing) {
        Ok(id) => id,
        // No filter there yet.
        Err(_) => prog
            .attach_with_options(
                interface,
                slot.attach_type,
                TcAttachOptions::Netlink(NlOptions {
                    priority: slot.priority,
                    handle: HANDLE,
                    classid: None,
                }),
            )
            .map_err(|e| io::Error::other(format!("attach tc filter to {interface}: {e}")))?,
    };
    // Taken out of the program's link list and dropped without detaching: the filter stays in
    // the qdisc after this process exits, which is the point.
    let link = prog.take_link(id).map_err(io::Error::other)?;
    let _ = FdLink::try_from(link);
    Ok(())
}

/// Pins the program of a filter where its link would be: the record upgrade, CHECK and unload
/// find it by.
fn record(prog: &SchedClassifier, pin: &Path) -> io::Result<()> {
    let _ = fs::remove_file(pin);
    let fd = prog.fd().map_err(io::Error::other)?;
    sys::obj_pin(fd.as_fd(), pin)
        .map_err(|e| io::Error::other(format!("pin {}: {e}", pin.display())))
}

/// Whether the object pinned at `pin` is a bpf_link (TCX), not a filter's program record.
pub fn is_link_pin(pin: &Path) -> bool {
    sys::obj_get(pin).is_ok_and(|fd| sys::fd_kind(fd.as_fd()) == Some(sys::BpfFdKind::Link))
}

/// Detaches what `pin` records, from inside the interface's netns (the calling thread's), and
/// removes the pin. A filter's clsact qdisc goes too once no filter of anyone is left on it.
/// An error with its sources: aya's syscall errors keep the errno in their source, which their
/// own message leaves out (`` `bpf_mprog_attach` failed ``).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

pub fn detach_here(pin: &Path, interface: &str, slot: Slot) {
    match sys::obj_get(pin) {
        Ok(fd) if sys::fd_kind(fd.as_fd()) == Some(sys::BpfFdKind::Link) => {
            let _ = sys::link_detach(fd.as_fd());
        }
        Ok(_) => {
            if let Ok(link) = SchedClassifierLink::attached(
                interface,
                slot.attach_type,
                slot.priority,
                HANDLE,
                None,
            ) {
                use aya::programs::links::Link as _;
                let _ = link.detach();
            }
            if let Ok(ifindex) = nix::net::if_::if_nametoindex(interface) {
                remove_idle_clsact(ifindex);
            }
        }
        Err(_) => {}
    }
    let _ = fs::remove_file(pin);
}

/// Deletes the interface's clsact qdisc when neither direction has a filter: an empty clsact does
/// nothing, and unload promises to leave none of ours behind. One with anyone's filter stays.
fn remove_idle_clsact(ifindex: u32) {
    let Ok(mut rtnl) = Rtnl::open() else {
        return;
    };
    let ifindex = ifindex as i32;
    for parent in [NlHandle::MIN_INGRESS, NlHandle::MIN_EGRESS] {
        let mut query = TcMessage::with_index(ifindex);
        query.header.parent = NlHandle {
            major: u16::MAX,
            minor: parent,
        };
        match rtnl.dump(RouteNetlinkMessage::GetTrafficFilter(query)) {
            Ok(filters) if filters.is_empty() => {}
            _ => return,
        }
    }
    let mut qdisc = TcMessage::with_index(ifindex);
    qdisc.header.parent = NlHandle::CLSACT;
    qdisc.header.handle = NlHandle {
        major: u16::MAX,
        minor: 0,
    };
    if let Err(e) = rtnl.request(RouteNetlinkMessage::DelQueueDiscipline(qdisc), false) {
        tracing::debug!(ifindex, error = %e, "delete clsact");
    }
}

/// The pin-name suffix of each slot, beside the interface name.
pub fn slot_of_pin(name: &str) -> (String, Slot) {
    if let Some(i) = name.strip_suffix(crate::pins::REROUTE_INGRESS_SUFFIX) {
        (i.to_string(), REROUTE_INGRESS)
    } else if let Some(i) = name.strip_suffix(crate::pins::REROUTE_EGRESS_SUFFIX) {
        (i.to_string(), REROUTE_EGRESS)
    } else {
        (name.to_string(), INBOUND)
    }
}

/// The interface and slot a pin's file name stands for.
fn slot_of_path(pin: &Path) -> (String, Slot) {
    slot_of_pin(
        &pin.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
    )
}

/// The filter records (not TCX links) in a pod's tc link directory.
pub fn filter_records(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| !is_link_pin(p))
                .collect()
        })
        .unwrap_or_default()
}

/// The pod's netns, found from its sk_lookup link (which names the netns by inode) among the
/// netns a node keeps: runtime bind mounts under /run/netns and each process's own. Checked by
/// cookie, so an inode reused by a later netns is never taken for the pod's.
pub fn find_pod_netns(layout: &PinLayout, netns_cookie: u64) -> Option<Netns> {
    use std::os::unix::fs::MetadataExt as _;
    let ino = sys::obj_get(&layout.sk_lookup_pin(netns_cookie))
        .and_then(|l| sys::link_info(l.as_fd()))
        .ok()
        .map(|i| u64::from(i.netns_ino))
        .filter(|i| *i != 0)?;
    let bind_mounts = ["/run/netns", "/var/run/netns"]
        .into_iter()
        .filter_map(|d| fs::read_dir(d).ok())
        .flat_map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>());
    let processes = fs::read_dir("/proc")
        .into_iter()
        .flat_map(|d| d.flatten())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path().join("ns/net"));
    bind_mounts
        .chain(processes)
        .filter(|p| fs::metadata(p).is_ok_and(|m| m.ino() == ino))
        .find_map(|p| {
            let netns = Netns::open(&p).ok()?;
            (netns.cookie().ok()? == netns_cookie).then_some(netns)
        })
}

/// Deletes the filters the pod's records name, inside its netns when that still lives (a dead
/// netns took its filters with it), and removes the records. TCX links are left to the caller.
pub fn detach_filter_records(layout: &PinLayout, netns_cookie: u64) {
    let dir = layout.pod_links_dir(netns_cookie);
    let records = filter_records(&dir);
    if records.is_empty() {
        return;
    }
    let netns = find_pod_netns(layout, netns_cookie);
    for pin in records {
        detach_record(netns.as_ref(), &pin);
    }
}

/// Deletes the filter `pin` records inside `netns` and removes the pin; without the netns (it
/// died, and took its filters with it) only the pin goes.
pub fn detach_record(netns: Option<&Netns>, pin: &Path) {
    let (interface, slot) = slot_of_path(pin);
    match netns {
        Some(netns) => {
            let _ = netns.run(|| {
                detach_here(pin, &interface, slot);
                Ok(())
            });
        }
        None => {
            let _ = fs::remove_file(pin);
        }
    }
}

/// Points the pod's filters at the programs pinned now (an upgrade's new ones) and re-pins their
/// records. Returns how many were switched and how many were gone with their netns.
pub fn update_filter_records(layout: &PinLayout, netns_cookie: u64) -> io::Result<(usize, usize)> {
    let dir = layout.pod_links_dir(netns_cookie);
    let records = filter_records(&dir);
    if records.is_empty() {
        return Ok((0, 0));
    }
    let Some(netns) = find_pod_netns(layout, netns_cookie) else {
        for pin in &records {
            let _ = fs::remove_file(pin);
        }
        return Ok((0, records.len()));
    };
    let mut updated = 0;
    for pin in records {
        let (interface, slot) = slot_of_path(&pin);
        let name = if slot == INBOUND {
            program_names::TC_INGRESS
        } else if slot == REROUTE_INGRESS {
            program_names::REROUTE_INGRESS
        } else {
            program_names::REROUTE_EGRESS
        };
        let mut prog = SchedClassifier::from_pin(layout.program(name)).map_err(io::Error::other)?;
        netns
            .run(|| {
                put_filter(&mut prog, &interface, slot)?;
                record(&prog, &pin)
            })
            .map_err(io::Error::other)?;
        updated += 1;
    }
    Ok((updated, 0))
}
