//! Per-pod inbound capture: the tc ingress program on the pod's interfaces, attached from inside
//! the pod netns, with TCX links pinned at `<pin_root>/links/tc/<netns cookie>/<ifname>`.

use std::{
    fs,
    os::{fd::AsFd as _, unix::fs::DirBuilderExt},
    path::Path,
};

use aya::programs::SchedClassifier;
use sidestep_abi::program_names;

use crate::{
    error::{EnrollError, LoadError},
    links::{self, detach_links_under},
    netns::Netns,
    pins::{PinLayout, REROUTE_EGRESS_SUFFIX, REROUTE_INGRESS_SUFFIX, is_reroute_pin},
    policy::InboundHook,
    tcattach,
};

/// Per-pod link directories are 0700 like the pin root the loader makes, so that no directory
/// below it is open to other users even where the pin root's own mode was loosened.
fn mkdir_private(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Interfaces of the current netns (the caller's thread), loopback excluded.
fn interfaces_here() -> std::io::Result<Vec<String>> {
    Ok(nix::net::if_::if_nameindex()?
        .iter()
        .map(|i| i.name().to_string_lossy().into_owned())
        .filter(|n| n != "lo")
        .collect())
}

/// Attaches inbound capture to `interfaces` (all but loopback when `None`) minus `excluded`.
/// Returns the interfaces captured. Re-attaching an interface replaces its link. With
/// [`InboundHook::SkLookup`] no tc program is attached (and any left from a `tc` enrolment is
/// detached): the per-netns sk_lookup link alone captures, on the interfaces returned.
pub fn attach_inbound(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
    interfaces: Option<&[String]>,
    excluded: &[String],
    hook: InboundHook,
) -> Result<Vec<(String, u32)>, EnrollError> {
    let dir = layout.pod_links_dir(netns_cookie);
    mkdir_private(&dir).map_err(|source| EnrollError::StateDir {
        path: dir.clone(),
        source,
    })?;
    let prog_path = layout.program(program_names::TC_INGRESS);
    let wanted = interfaces.map(<[String]>::to_vec);
    let excluded = excluded.to_vec();
    let dir_in = dir.clone();
    let result = netns.run(move || {
        let names = match wanted {
            Some(w) => w,
            None => interfaces_here()?,
        };
        // Only the tc hook needs the program through aya (whose first use probes the kernel).
        let mut prog = match hook {
            InboundHook::Tc => {
                Some(SchedClassifier::from_pin(&prog_path).map_err(std::io::Error::other)?)
            }
            InboundHook::SkLookup => None,
        };
        for name in &excluded {
            let pin = dir_in.join(name);
            if pin.exists() {
                tcattach::detach_here(&pin, name, tcattach::INBOUND);
            }
        }
        let mut attached = Vec::new();
        for name in names.into_iter().filter(|n| !excluded.contains(n)) {
            let pin = dir_in.join(&name);
            match prog.as_mut() {
                Some(prog) => tcattach::attach_here(prog, &name, tcattach::INBOUND, &pin)?,
                None if pin.exists() => tcattach::detach_here(&pin, &name, tcattach::INBOUND),
                None => {}
            }
            let ifindex = nix::net::if_::if_nametoindex(name.as_str())?;
            attached.push((name, ifindex));
        }
        Ok(attached)
    });
    let result = result.and_then(|attached| {
        attach_sk_lookup(layout, netns, netns_cookie)?;
        Ok(attached)
    });
    match result {
        Ok(attached) if !attached.is_empty() => {
            if hook == InboundHook::SkLookup {
                // No tc link lives here (any from an earlier `tc` enrolment was detached).
                let _ = fs::remove_dir(&dir);
            }
            Ok(attached)
        }
        // Inbound capture with nowhere to attach would leave the pod silently uncaptured.
        Ok(_) => {
            let _ = fs::remove_dir(&dir);
            Err(EnrollError::NoInterface(netns.path().to_path_buf()))
        }
        Err(e) => {
            let _ = netns.run(|| {
                detach_pins_here(&dir);
                Ok(())
            });
            let _ = detach_links_under(&dir);
            let _ = fs::remove_dir(&dir);
            Err(e.into())
        }
    }
}

/// Detaches what every pin in `dir` records (TCX links and filters), from inside the pod's netns.
fn detach_pins_here(dir: &Path) {
    for e in fs::read_dir(dir).into_iter().flat_map(|d| d.flatten()) {
        let (interface, slot) = tcattach::slot_of_pin(&e.file_name().to_string_lossy());
        tcattach::detach_here(&e.path(), &interface, slot);
    }
}

/// Detaches the tc attachment of one interface of a pod (a link, or a filter inside the pod's
/// netns while it lives) and removes its pin.
pub fn detach_link_pin(layout: &PinLayout, netns_cookie: u64, pin: &Path) {
    if tcattach::is_link_pin(pin) {
        links::detach_link(pin);
        return;
    }
    tcattach::detach_record(tcattach::find_pod_netns(layout, netns_cookie).as_ref(), pin);
}

/// The pod's sk_lookup links: its identity program first, then the shared program (the kernel's
/// listener lookup: every captured SYN with the sk_lookup hook, those tc leaves to it with tc).
/// A netns runs its sk_lookup programs in attach order, and the shared one learns the pod from
/// the identity one ([`crate::identity`]). Made with raw bpf(2) calls: loading a pinned program
/// through aya first probes the kernel's features, a dozen test loads that an ADD need not pay.
fn attach_sk_lookup(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
) -> Result<(), crate::error::NetnsError> {
    let pin = layout.sk_lookup_pin(netns_cookie);
    let id_pin = crate::identity::pin(layout, netns_cookie);
    let io = |e: std::io::Error| crate::error::NetnsError::Enter {
        path: netns.path().to_path_buf(),
        source: e,
    };
    crate::sys::failpoint("enroll:before-sk-lookup");
    let shared_attached = pin.exists() && sk_lookup_attached(&pin);
    let identity_attached = id_pin.exists() && sk_lookup_attached(&id_pin);
    for p in [&pin, &id_pin] {
        mkdir_private(p.parent().unwrap_or(layout.links_dir().as_path())).map_err(io)?;
    }
    let nsid = crate::sys::obj_get(&layout.map(sidestep_abi::map_names::POD_IDENTITY))
        .map_err(|e| io(std::io::Error::other(format!("open SIDESTEP_NSID: {e}"))))?;
    let id_prog = crate::identity::load(nsid.as_fd(), netns_cookie).map_err(io)?;
    if identity_attached {
        // A fresh program in place (the link keeps its place in the order): a reload may have
        // recreated the map the old one writes.
        let link = crate::sys::obj_get(&id_pin).map_err(io)?;
        crate::sys::link_update(link.as_fd(), id_prog.as_fd()).map_err(io)?;
    } else {
        if id_pin.exists() {
            fs::remove_file(&id_pin).map_err(io)?;
        }
        link_netns(id_prog.as_fd(), netns, &id_pin).map_err(io)?;
    }
    if shared_attached && identity_attached {
        // A re-enrolment after a reload: the link must run the program pinned now, which a
        // reload's own sweep of the links can miss for a link pinned while it ran.
        return follow_pinned_program(layout, &pin).map_err(io);
    }
    let prog = crate::sys::obj_get(&layout.program(program_names::SK_LOOKUP)).map_err(io)?;
    if shared_attached {
        // Enrolled by a version without the identity program, whose link now runs after the
        // shared one: a second shared link goes in after it, replaces the first one's pin in one
        // rename, and then the first one is detached. The pod is captured throughout.
        let old = crate::sys::obj_get(&pin).map_err(io)?;
        let staged = pin.with_file_name(format!("{netns_cookie}-new"));
        let _ = fs::remove_file(&staged);
        link_netns(prog.as_fd(), netns, &staged).map_err(io)?;
        fs::rename(&staged, &pin).map_err(io)?;
        crate::sys::link_detach(old.as_fd()).map_err(io)?;
        return Ok(());
    }
    if pin.exists() {
        // Pinned but detached (an unenrolment killed between its detach and its unlink): a new
        // link replaces it.
        fs::remove_file(&pin).map_err(io)?;
    }
    link_netns(prog.as_fd(), netns, &pin).map_err(io)
}

/// Attaches `prog` as the netns's next sk_lookup program and pins the link at `pin`.
fn link_netns(prog: std::os::fd::BorrowedFd<'_>, netns: &Netns, pin: &Path) -> std::io::Result<()> {
    let link = crate::sys::link_create(
        prog,
        netns.fd(),
        aya_obj::generated::bpf_attach_type::BPF_SK_LOOKUP,
    )
    .map_err(|e| std::io::Error::other(format!("attach sk_lookup: {e}")))?;
    crate::sys::obj_pin(link.as_fd(), pin)
        .map_err(|e| std::io::Error::other(format!("pin {}: {e}", pin.display())))
}

/// Detaches every inbound link of the pod (tc and sk_lookup). Works when the netns is already
/// gone. Idempotent.
pub fn detach_inbound(layout: &PinLayout, netns_cookie: u64) -> Result<(), LoadError> {
    // Filters first: their netns is found through the sk_lookup link.
    tcattach::detach_filter_records(layout, netns_cookie);
    // The shared program first: without it the identity program only writes a slot.
    links::detach_link(&layout.sk_lookup_pin(netns_cookie));
    links::detach_link(&crate::identity::pin(layout, netns_cookie));
    let dir = layout.pod_links_dir(netns_cookie);
    detach_links_under(&dir)?;
    match fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(LoadError::Unpin {
            path: dir,
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Whether the pod's sk_lookup link is pinned and still attached to its netns.
pub fn has_sk_lookup(layout: &PinLayout, netns_cookie: u64) -> bool {
    sk_lookup_attached(&layout.sk_lookup_pin(netns_cookie))
}

/// Whether the pod's identity link is pinned and attached (without it sk_lookup finds the pod
/// only by the addresses enrolment registered).
pub fn has_identity(layout: &PinLayout, netns_cookie: u64) -> bool {
    sk_lookup_attached(&crate::identity::pin(layout, netns_cookie))
}

/// Moves the link pinned at `pin` to the pinned sk_lookup program when it runs another one.
fn follow_pinned_program(layout: &PinLayout, pin: &std::path::Path) -> std::io::Result<()> {
    let link = crate::sys::obj_get(pin)?;
    let prog_pin = layout.program(program_names::SK_LOOKUP);
    let running = crate::sys::link_info(link.as_fd())?.prog_id;
    let pinned = aya::programs::ProgramInfo::from_pin(&prog_pin)
        .map(|i| i.id())
        .map_err(std::io::Error::other)?;
    if running != pinned {
        let prog = crate::sys::obj_get(&prog_pin)?;
        crate::sys::link_update(link.as_fd(), prog.as_fd())?;
    }
    Ok(())
}

/// Whether the netns link pinned at `pin` is attached: the kernel reports no netns once it was
/// detached, or its netns died.
fn sk_lookup_attached(pin: &std::path::Path) -> bool {
    crate::sys::obj_get(pin)
        .and_then(|link| crate::sys::link_info(link.as_fd()))
        .is_ok_and(|i| i.link_type == crate::sys::BPF_LINK_TYPE_NETNS && i.netns_ino != 0)
}

/// The interfaces of a pod that currently have a pinned inbound tc link.
pub fn attached_interfaces(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    fs::read_dir(layout.pod_links_dir(netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !is_reroute_pin(n))
                .collect()
        })
        .unwrap_or_default()
}

/// The pod's re-route link pins (`<ifname>:reroute-ingress`, `<ifname>:reroute-egress`).
pub fn reroute_pins(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    fs::read_dir(layout.pod_links_dir(netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| is_reroute_pin(n))
                .collect()
        })
        .unwrap_or_default()
}

/// One re-routed virtual interface as the data path knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RerouteInterface {
    pub key: sidestep_abi::RerouteIfKey,
    pub value: sidestep_abi::RerouteIf,
}

/// Reads what REDIRECT would use on each of `names` in the pod netns: its ifindex and MAC (what
/// the tc programs find it by) and its first IPv4 and first IPv6 address (the kernel's REDIRECT
/// takes the first address of the incoming interface). A listed interface that does not exist
/// fails: iptables would hold a rule by name until the interface appears, but a tc program needs
/// the device, and the pod must not run with a listed interface uncaptured.
pub fn reroute_interfaces(
    netns: &Netns,
    netns_cookie: u64,
    names: &[String],
    all_ranges: bool,
) -> Result<Vec<(String, RerouteInterface)>, EnrollError> {
    use sidestep_abi::{RerouteIf, RerouteIfKey, reroute_flags};
    let names = names.to_vec();
    // The closure's own errors are the interface's, not the netns's: carried out as Ok(Err).
    let found = netns.run(move || {
        let addrs: Vec<_> = nix::ifaddrs::getifaddrs()
            .map_err(std::io::Error::from)?
            .collect();
        let mut out = Vec::new();
        for name in names {
            let ifindex = match nix::net::if_::if_nametoindex(name.as_str()) {
                Ok(i) => i,
                Err(e) => {
                    return Ok(Err(format!(
                        "interface {name} does not exist in the pod netns ({e}); sidestep \
                         attaches to it at enrolment and cannot wait for it to appear"
                    )));
                }
            };
            let mut key = RerouteIfKey {
                ifindex,
                ..Default::default()
            };
            let mut value = RerouteIf {
                netns_cookie,
                flags: if all_ranges {
                    reroute_flags::ALL_RANGES
                } else {
                    0
                },
                ..Default::default()
            };
            let mut has_mac = false;
            for a in addrs.iter().filter(|a| a.interface_name == name) {
                let Some(addr) = a.address.as_ref() else {
                    continue;
                };
                if let Some(link) = addr.as_link_addr()
                    && let Some(mac) = link.addr()
                {
                    key.mac = mac;
                    has_mac = true;
                } else if let Some(v4) = addr.as_sockaddr_in()
                    && value.flags & reroute_flags::HAS_V4 == 0
                {
                    let ip = std::net::IpAddr::V4(v4.ip());
                    value.addr4 = crate::policy::address_words(&ip);
                    value.flags |= reroute_flags::HAS_V4;
                } else if let Some(v6) = addr.as_sockaddr_in6()
                    && value.flags & reroute_flags::HAS_V6 == 0
                {
                    let ip = std::net::IpAddr::V6(v6.ip());
                    value.addr6 = crate::policy::address_words(&ip);
                    value.flags |= reroute_flags::HAS_V6;
                }
            }
            if !has_mac {
                return Ok(Err(format!("interface {name} has no Ethernet address")));
            }
            out.push((name, RerouteInterface { key, value }));
        }
        Ok(Ok(out))
    })?;
    found.map_err(EnrollError::Reroute)
}

/// Attaches the re-route programs (tc ingress DNAT, tc egress reverse rewrite) to each interface,
/// pinned as `<ifname>:reroute-ingress` / `<ifname>:reroute-egress` in the pod's tc link
/// directory, and detaches those of interfaces no longer listed. On failure every re-route link
/// of the pod is gone.
pub fn attach_reroute(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
    names: &[String],
) -> Result<(), EnrollError> {
    let dir = layout.pod_links_dir(netns_cookie);
    mkdir_private(&dir).map_err(|source| EnrollError::StateDir {
        path: dir.clone(),
        source,
    })?;
    let ingress_path = layout.program(program_names::REROUTE_INGRESS);
    let egress_path = layout.program(program_names::REROUTE_EGRESS);
    let names = names.to_vec();
    let dir_in = dir.clone();
    let result = netns.run(move || {
        let wanted: Vec<String> = names
            .iter()
            .flat_map(|n| {
                [
                    format!("{n}{REROUTE_INGRESS_SUFFIX}"),
                    format!("{n}{REROUTE_EGRESS_SUFFIX}"),
                ]
            })
            .collect();
        for e in fs::read_dir(&dir_in)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_reroute_pin(&name) && !wanted.contains(&name) {
                let (interface, slot) = tcattach::slot_of_pin(&name);
                tcattach::detach_here(&e.path(), &interface, slot);
            }
        }
        if names.is_empty() {
            return Ok(());
        }
        let mut ingress =
            SchedClassifier::from_pin(&ingress_path).map_err(std::io::Error::other)?;
        let mut egress = SchedClassifier::from_pin(&egress_path).map_err(std::io::Error::other)?;
        for name in &names {
            for (prog, slot, suffix) in [
                (
                    &mut ingress,
                    tcattach::REROUTE_INGRESS,
                    REROUTE_INGRESS_SUFFIX,
                ),
                (&mut egress, tcattach::REROUTE_EGRESS, REROUTE_EGRESS_SUFFIX),
            ] {
                let pin = dir_in.join(format!("{name}{suffix}"));
                tcattach::attach_here(prog, name, slot, &pin).map_err(|e| {
                    std::io::Error::other(format!("re-route {:?}: {e}", slot.attach_type))
                })?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        detach_reroute(layout, netns, netns_cookie);
        return Err(e.into());
    }
    Ok(())
}

/// Detaches the pod's re-route links only (the inbound ones stay).
pub fn detach_reroute(layout: &PinLayout, netns: &Netns, netns_cookie: u64) {
    let dir = layout.pod_links_dir(netns_cookie);
    let _ = netns.run(|| {
        for e in fs::read_dir(&dir).into_iter().flat_map(|d| d.flatten()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_reroute_pin(&name) {
                let (interface, slot) = tcattach::slot_of_pin(&name);
                tcattach::detach_here(&e.path(), &interface, slot);
            }
        }
        Ok(())
    });
    // Empty once nothing else is attached; a directory with inbound links stays.
    let _ = fs::remove_dir(&dir);
}

/// The re-routed interfaces of a pod that have both links pinned.
pub fn rerouted_interfaces(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    let names: Vec<String> = fs::read_dir(layout.pod_links_dir(netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names
        .iter()
        .filter_map(|n| n.strip_suffix(REROUTE_INGRESS_SUFFIX))
        .filter(|i| names.contains(&format!("{i}{REROUTE_EGRESS_SUFFIX}")))
        .map(str::to_string)
        .collect()
}
