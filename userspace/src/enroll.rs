//! Enrolment: the one code path by which a pod netns enters and leaves the data path. The CLI's
//! `enroll`/`unenroll`, the CNI plugin and the agent's repair all call these functions.
//!
//! Ordering makes every step safe to interrupt: rules are written before the pod entry that makes
//! the programs look at them, and the pod entry is removed before its rules.

use std::{collections::HashSet, path::Path};

use aya::maps::lpm_trie::Key;
use sidestep_abi::{CidrKey, InterfaceKey, PortKey, RerouteIfKey, flags, map_names};

use crate::{
    error::{EnrollError, MapsError},
    maps::{PolicyMaps, classify},
    netns::Netns,
    pins::PinLayout,
    policy::{CidrSet, MapEntries, Policy},
    tc, tproxy,
};

/// What an enrolment wrote, for the caller's state record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolled {
    pub netns_cookie: u64,
    pub entries: MapEntries,
    /// Interfaces that carry the inbound tc program.
    pub interfaces: Vec<String>,
}

/// Enrols the netns at `netns_path` with `policy`. Re-enrolling replaces the old policy in place.
/// Inbound capture is attached to `interfaces` (every non-loopback interface when `None`).
/// On failure nothing of this call remains.
pub fn enroll(
    pin_root: &Path,
    netns_path: &Path,
    policy: &Policy,
    interfaces: Option<&[String]>,
) -> Result<Enrolled, EnrollError> {
    policy.validate()?;
    let maps = PolicyMaps::open(pin_root)?;
    let netns = Netns::open(netns_path)?;
    enroll_netns(pin_root, maps, &netns, policy, interfaces)
}

/// [`enroll`] for a caller that already holds the netns (and maybe its cookie) and the maps,
/// so an ADD opens each once.
pub fn enroll_netns(
    pin_root: &Path,
    mut maps: PolicyMaps,
    netns: &Netns,
    policy: &Policy,
    interfaces: Option<&[String]>,
) -> Result<Enrolled, EnrollError> {
    policy.validate()?;
    let layout = PinLayout::new(pin_root);
    let netns_cookie = netns.cookie()?;
    let previous_flags = maps.pods.get(&netns_cookie, 0).ok().map(|p| p.flags);
    let was_enrolled = previous_flags.is_some();
    let entries = policy.to_map_entries(netns_cookie);
    // TPROXY's return route goes in before the pod entry that starts marking connections.
    let tproxy_mode = entries.pod.flags & flags::TPROXY != 0;
    if tproxy_mode {
        tproxy::configure(netns, true)?;
    }
    if let Err(e) = write_entries(&mut maps, netns_cookie, &entries) {
        if tproxy_mode && !was_enrolled {
            let _ = tproxy::configure(netns, false);
        }
        return Err(e.into());
    }
    crate::sys::failpoint("enroll:after-maps");
    let undo_tproxy = || {
        if tproxy_mode && !was_enrolled {
            let _ = tproxy::configure(netns, false);
        }
    };
    // Re-routed virtual interfaces skip inbound capture (istio-iptables: `-i <nic> -j RETURN`).
    let not_inbound: Vec<String> = policy
        .exclude_interfaces
        .iter()
        .chain(&policy.reroute_virtual_interfaces)
        .cloned()
        .collect();
    let attached = if entries.pod.flags & flags::INBOUND != 0 {
        match tc::attach_inbound(
            &layout,
            netns,
            netns_cookie,
            interfaces,
            &not_inbound,
            policy.inbound_hook,
        ) {
            Ok(a) => {
                crate::sys::failpoint("enroll:after-links");
                if let Err(e) = set_interfaces(&mut maps, netns_cookie, &a, was_enrolled) {
                    if !was_enrolled {
                        let _ = unenroll_cookie(&mut maps, netns_cookie);
                        let _ = tc::detach_inbound(&layout, netns_cookie);
                    }
                    undo_tproxy();
                    return Err(e.into());
                }
                a.into_iter().map(|(name, _)| name).collect()
            }
            Err(e) => {
                if !was_enrolled {
                    let _ = unenroll_cookie(&mut maps, netns_cookie);
                    let _ = tc::detach_inbound(&layout, netns_cookie);
                }
                undo_tproxy();
                return Err(e);
            }
        }
    } else {
        tc::detach_inbound(&layout, netns_cookie)?;
        Vec::new()
    };
    if let Err(e) = set_reroute(
        &layout,
        &mut maps,
        netns,
        netns_cookie,
        policy,
        was_enrolled,
    ) {
        if !was_enrolled {
            let _ = unenroll_cookie(&mut maps, netns_cookie);
            let _ = tc::detach_inbound(&layout, netns_cookie);
        }
        undo_tproxy();
        return Err(e);
    }
    if !tproxy_mode
        && previous_flags.is_some_and(|f| f & flags::TPROXY != 0)
        && let Err(e) = tproxy::configure(netns, false)
    {
        // Harmless if left: only TPROXY-marked packets take that route.
        tracing::warn!("re-enrolled in REDIRECT mode, but the TPROXY route stays: {e}");
    }
    Ok(Enrolled {
        netns_cookie,
        entries,
        interfaces: attached,
    })
}

/// Writes a pod's entries; on failure removes whatever this call added, and leaves an earlier
/// enrolment of the same cookie as it was.
pub fn write_entries(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    entries: &MapEntries,
) -> Result<(), MapsError> {
    let previous = maps.pods.get(&netns_cookie, 0).ok();
    // Netns cookies are never reused while the system runs, so a first enrolment has no old
    // entries to reconcile: skip the map scans that would make ADD cost grow with the node's pods.
    // A full pod map is reported by the kernel (E2BIG) on the counter or pod insert below.
    let (old_ports, old_cidrs): (HashSet<PortKey>, Vec<(u32, CidrKey)>) = if previous.is_some() {
        (
            port_keys(maps, netns_cookie).into_iter().collect(),
            cidr_keys(maps, netns_cookie),
        )
    } else {
        (HashSet::new(), Vec::new())
    };
    let mut added_ports = Vec::new();
    let mut added_cidrs = Vec::new();
    let result = (|| {
        for key in &entries.ports {
            if !old_ports.contains(key) {
                maps.ports
                    .insert(key, 1, 0)
                    .map_err(|e| classify(map_names::PORT_RULES, 0, e))?;
                added_ports.push(*key);
            }
        }
        for (bits, data) in &entries.cidrs {
            if !old_cidrs.contains(&(*bits, *data)) {
                maps.cidrs
                    .insert(&Key::new(*bits, *data), 1, 0)
                    .map_err(|e| classify(map_names::CIDR_RULES, 0, e))?;
                added_cidrs.push((*bits, *data));
            }
        }
        for addr in &entries.addresses {
            maps.addresses
                .insert(addr, netns_cookie, 0)
                .map_err(|e| classify(map_names::POD_ADDRESSES, 0, e))?;
        }
        if previous.is_none() {
            maps.zero_counters(netns_cookie).map_err(|e| match e {
                MapsError::Full { .. } => MapsError::Full {
                    map: map_names::POD_POLICY,
                    capacity: maps.pod_capacity,
                },
                other => other,
            })?;
        }
        crate::sys::failpoint("enroll:before-pod-entry");
        maps.pods
            .insert(netns_cookie, entries.pod, 0)
            .map_err(|e| classify(map_names::POD_POLICY, maps.pod_capacity, e))
    })();
    if let Err(e) = result {
        for key in &added_ports {
            let _ = maps.ports.remove(key);
        }
        for (bits, data) in &added_cidrs {
            let _ = maps.cidrs.remove(&Key::new(*bits, *data));
        }
        if previous.is_none() {
            let _ = maps.counters.remove(&netns_cookie);
            remove_addresses(maps, netns_cookie, &[]);
        }
        return Err(e);
    }
    // The new policy is live; rules it no longer names can go.
    for key in old_ports.iter().filter(|k| !entries.ports.contains(k)) {
        let _ = maps.ports.remove(key);
    }
    for (bits, data) in old_cidrs.iter().filter(|c| !entries.cidrs.contains(c)) {
        let _ = maps.cidrs.remove(&Key::new(*bits, *data));
    }
    if previous.is_some() {
        remove_addresses(maps, netns_cookie, &entries.addresses);
    }
    Ok(())
}

/// Removes the cookie's addresses except `keep`.
fn remove_addresses(maps: &mut PolicyMaps, netns_cookie: u64, keep: &[[u32; 4]]) {
    let stale: Vec<[u32; 4]> = maps
        .addresses
        .iter()
        .filter_map(Result::ok)
        .filter(|(addr, cookie)| *cookie == netns_cookie && !keep.contains(addr))
        .map(|(addr, _)| addr)
        .collect();
    for addr in stale {
        let _ = maps.addresses.remove(&addr);
    }
}

/// Records which interfaces carry inbound capture, replacing the pod's earlier set. A first
/// enrolment has no earlier set (netns cookies are never reused), so it skips the map scan that
/// would make ADD cost grow with the node's pods.
fn set_interfaces(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    attached: &[(String, u32)],
    was_enrolled: bool,
) -> Result<(), MapsError> {
    let keys: Vec<InterfaceKey> = attached
        .iter()
        .map(|(_, ifindex)| InterfaceKey {
            netns_cookie,
            ifindex: *ifindex,
            _reserved: 0,
        })
        .collect();
    for key in &keys {
        maps.interfaces
            .insert(key, 1, 0)
            .map_err(|e| classify(map_names::INTERFACES, 0, e))?;
    }
    if was_enrolled {
        remove_interfaces(maps, netns_cookie, &keys);
    }
    Ok(())
}

/// Re-routed virtual interfaces: their map entries, then their tc links, replacing the pod's
/// earlier set. istio-iptables adds the re-route rules only when includeOutboundIPRanges is not
/// empty (`*`, or one rule per CIDR); otherwise the interfaces only lose inbound capture.
/// On failure this call's entries and links are gone.
fn set_reroute(
    layout: &PinLayout,
    maps: &mut PolicyMaps,
    netns: &Netns,
    netns_cookie: u64,
    policy: &Policy,
    was_enrolled: bool,
) -> Result<(), EnrollError> {
    let names: &[String] = if policy.include_outbound_ip_ranges.is_empty() {
        &[]
    } else {
        &policy.reroute_virtual_interfaces
    };
    let all_ranges = matches!(policy.include_outbound_ip_ranges, CidrSet::All);
    let found = if names.is_empty() {
        Vec::new()
    } else {
        tc::reroute_interfaces(netns, netns_cookie, names, all_ranges)?
    };
    let mut added = Vec::new();
    let written = (|| {
        for (name, iface) in &found {
            if let Ok(other) = maps.reroute_ifaces.get(&iface.key, 0)
                && other.netns_cookie != netns_cookie
            {
                return Err(EnrollError::Reroute(format!(
                    "interface {name} (ifindex {}, MAC {}) has the ifindex and MAC of a \
                     re-routed interface of netns cookie {}",
                    iface.key.ifindex,
                    iface
                        .key
                        .mac
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<Vec<_>>()
                        .join(":"),
                    other.netns_cookie
                )));
            }
            maps.reroute_ifaces
                .insert(iface.key, iface.value, 0)
                .map_err(|e| classify(map_names::REROUTE_IFACES, 0, e))?;
            added.push(iface.key);
        }
        if !names.is_empty() {
            tc::attach_reroute(layout, netns, netns_cookie, names)?;
        } else if was_enrolled {
            tc::detach_reroute(layout, netns_cookie);
        }
        Ok(())
    })();
    let keep: Vec<RerouteIfKey> = found.iter().map(|(_, i)| i.key).collect();
    if let Err(e) = written {
        for key in &added {
            let _ = maps.reroute_ifaces.remove(key);
        }
        return Err(e);
    }
    // A first enrolment has nothing to replace (netns cookies are never reused).
    if was_enrolled {
        remove_reroute(maps, netns_cookie, &keep);
    }
    Ok(())
}

/// Removes the cookie's re-routed interfaces except `keep`, and, when it had some and none is
/// kept, the connections they DNATed and their unclaimed hand-overs in `SIDESTEP_PEND` (a SYN
/// refused for want of a listener leaves one). A pod that never had one costs no LRU scan.
fn remove_reroute(maps: &mut PolicyMaps, netns_cookie: u64, keep: &[RerouteIfKey]) {
    let stale: Vec<RerouteIfKey> = maps
        .reroute_ifaces
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, v)| v.netns_cookie == netns_cookie && !keep.contains(k))
        .map(|(k, _)| k)
        .collect();
    let had_some = !stale.is_empty() || !keep.is_empty();
    for key in stale {
        let _ = maps.reroute_ifaces.remove(&key);
    }
    if had_some && keep.is_empty() {
        let conns: Vec<_> = maps
            .reroute_nat
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.netns_cookie == netns_cookie)
            .collect();
        for key in conns {
            let _ = maps.reroute_nat.remove(&key);
        }
        if let Ok(mut pending) = maps.pending() {
            let stale: Vec<_> = pending
                .iter()
                .filter_map(Result::ok)
                .filter(|(k, v)| {
                    k.netns_cookie == netns_cookie && v.kind == sidestep_abi::redirect_kind::REROUTE
                })
                .map(|(k, _)| k)
                .collect();
            for key in stale {
                let _ = pending.remove(&key);
            }
        }
    }
}

fn remove_interfaces(maps: &mut PolicyMaps, netns_cookie: u64, keep: &[InterfaceKey]) {
    let stale: Vec<InterfaceKey> = maps
        .interfaces
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.netns_cookie == netns_cookie && !keep.contains(k))
        .collect();
    for key in stale {
        let _ = maps.interfaces.remove(&key);
    }
}

fn port_keys(maps: &PolicyMaps, netns_cookie: u64) -> Vec<PortKey> {
    maps.ports
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.netns_cookie == netns_cookie)
        .collect()
}

fn cidr_keys(maps: &PolicyMaps, netns_cookie: u64) -> Vec<(u32, CidrKey)> {
    let want = CidrKey::new(netns_cookie, 0, [0; 16]).netns_cookie;
    maps.cidrs
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.data().netns_cookie == want)
        .map(|k| (k.prefix_len(), k.data()))
        .collect()
}

/// Removes every entry of `netns_cookie`. Returns whether the pod was enrolled. Idempotent.
pub fn unenroll_cookie(maps: &mut PolicyMaps, netns_cookie: u64) -> Result<bool, MapsError> {
    let was_enrolled = match maps.pods.remove(&netns_cookie) {
        Ok(()) => true,
        Err(aya::maps::MapError::KeyNotFound) => false,
        // aya reports a missing key on delete as the syscall's ENOENT.
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            false
        }
        Err(e) => return Err(classify(map_names::POD_POLICY, 0, e)),
    };
    crate::sys::failpoint("unenroll:after-pod-entry");
    for key in port_keys(maps, netns_cookie) {
        let _ = maps.ports.remove(&key);
    }
    for (bits, data) in cidr_keys(maps, netns_cookie) {
        let _ = maps.cidrs.remove(&Key::new(bits, data));
    }
    let _ = maps.counters.remove(&netns_cookie);
    remove_addresses(maps, netns_cookie, &[]);
    remove_interfaces(maps, netns_cookie, &[]);
    remove_reroute(maps, netns_cookie, &[]);
    Ok(was_enrolled)
}

/// Unenrols the netns at `netns_path`: its map entries and its tc links.
/// A TPROXY pod also loses its return route; [`unenroll_by_cookie`] cannot reach the netns, and
/// leaves the route to die with it.
pub fn unenroll(pin_root: &Path, netns_path: &Path) -> Result<bool, EnrollError> {
    let netns = Netns::open(netns_path)?;
    let netns_cookie = netns.cookie()?;
    let tproxy_mode = PolicyMaps::open(pin_root)?
        .pods
        .get(&netns_cookie, 0)
        .is_ok_and(|p| p.flags & flags::TPROXY != 0);
    let was = unenroll_by_cookie(pin_root, netns_cookie)?;
    if tproxy_mode {
        tproxy::configure(&netns, false)?;
    }
    Ok(was)
}

/// Unenrols by cookie, for callers whose netns may already be gone.
pub fn unenroll_by_cookie(pin_root: &Path, netns_cookie: u64) -> Result<bool, EnrollError> {
    let mut maps = PolicyMaps::open(pin_root)?;
    let was = unenroll_cookie(&mut maps, netns_cookie)?;
    tc::detach_inbound(&PinLayout::new(pin_root), netns_cookie)?;
    Ok(was)
}
