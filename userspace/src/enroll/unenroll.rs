//! Unenrolment: a pod's entries leave the maps, the pod entry first (so the programs stop
//! looking at its rules before they go), then its links.
//!
//! Two ways to find the keys:
//! - [`unenroll_cookie`] scans every per-pod map for the cookie. One bpf(2) call per key of
//!   every pod, so its cost grows with the node; it is the safety net for callers that do not
//!   know what was written (a lost or damaged record, the agent's GC, `sidestep unenroll`).
//! - [`unenroll_recorded`] deletes the keys a recorded enrolment wrote, computed from the
//!   recorded policy by the same [`Policy::to_map_entries`] the enrolment used, so the two
//!   cannot disagree: a constant number of calls per pod.
//!
//! A key already gone is not an error (an interrupted unenrolment removed it, or the enrolment
//! never got that far). Any other failure to delete is reported, after every other key was
//! tried: the entry stays behind, and the caller's retry finds it.

use std::path::Path;

use aya::maps::lpm_trie::Key;
use sidestep_abi::{CidrKey, InterfaceKey, PortKey, RerouteIfKey, cidr_list, map_names};

use super::{NetnsKeys, reroute_names, route_entry, source};
use crate::{
    error::EnrollError,
    maps::{FirstError, MapsError, PolicyMaps, deleted},
    netns::Netns,
    pins::PinLayout,
    podlinks,
    policy::Policy,
    tproxy,
};

/// What a caller recorded of an enrolment: enough to delete exactly its keys.
#[derive(Debug, Clone, Copy)]
pub struct Recorded<'a> {
    /// The policy the enrolment was given.
    pub policy: &'a Policy,
    /// [`super::Enrolled::inbound_ifindexes`]; `None` when the caller does not know them (a
    /// record written before they were recorded), and the interface map is scanned for them.
    pub inbound_ifindexes: Option<&'a [u32]>,
    /// [`super::Enrolled::netns_keys`]; `None` for a record of a version that wrote none.
    pub netns_keys: Option<&'a super::NetnsKeys>,
}

/// Removes the cookie's addresses except `keep` (a scan of the address map).
pub(super) fn remove_addresses(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    keep: &[[u32; 4]],
) -> Result<(), MapsError> {
    let stale: Vec<[u32; 4]> = maps
        .addresses
        .iter()
        .filter_map(Result::ok)
        .filter(|(addr, cookie)| *cookie == netns_cookie && !keep.contains(addr))
        .map(|(addr, _)| addr)
        .collect();
    let mut first = FirstError::default();
    for addr in stale {
        first.note(deleted(
            map_names::POD_ADDRESSES,
            maps.addresses.remove(&addr),
        ));
    }
    first.into_result()
}

/// Removes the cookie's re-routed interfaces except `keep`, and, when it had some and none is
/// kept, the connections they DNATed and their unclaimed hand-overs in `SIDESTEP_PEND` (a SYN
/// refused for want of a listener leaves one). A pod that never had one costs no LRU scan.
pub(super) fn remove_reroute(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    keep: &[RerouteIfKey],
) -> Result<(), MapsError> {
    let stale: Vec<RerouteIfKey> = maps
        .reroute_ifaces
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, v)| v.netns_cookie == netns_cookie && !keep.contains(k))
        .map(|(k, _)| k)
        .collect();
    let had_some = !stale.is_empty() || !keep.is_empty();
    let mut first = FirstError::default();
    for key in stale {
        first.note(deleted(
            map_names::REROUTE_IFACES,
            maps.reroute_ifaces.remove(&key),
        ));
    }
    if had_some && keep.is_empty() {
        let conns: Vec<_> = maps
            .reroute_nat
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.netns_cookie == netns_cookie)
            .collect();
        for key in conns {
            first.note(deleted(
                map_names::REROUTE_NAT,
                maps.reroute_nat.remove(&key),
            ));
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
                first.note(deleted(map_names::PENDING_ORIG_DST, pending.remove(&key)));
            }
        }
    }
    first.into_result()
}

/// Removes the cookie's inbound interfaces except `keep` (a scan of the interface map).
pub(super) fn remove_interfaces(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    keep: &[InterfaceKey],
) -> Result<(), MapsError> {
    let stale: Vec<InterfaceKey> = maps
        .interfaces
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.netns_cookie == netns_cookie && !keep.contains(k))
        .collect();
    let mut first = FirstError::default();
    for key in stale {
        first.note(deleted(map_names::INTERFACES, maps.interfaces.remove(&key)));
    }
    first.into_result()
}

pub(super) fn port_keys(maps: &PolicyMaps, netns_cookie: u64) -> Vec<PortKey> {
    maps.ports
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.netns_cookie == netns_cookie)
        .collect()
}

/// The pod's keys of the `ROUTE` list (`-o <nic>` for excluded interfaces).
pub(super) fn route_list_keys(maps: &PolicyMaps, netns_cookie: u64) -> Vec<(u32, CidrKey)> {
    let route_list = cidr_list::ROUTE.to_be();
    cidr_keys(maps, netns_cookie)
        .into_iter()
        .filter(|(_, data)| data.list_be == route_list)
        .collect()
}

/// The pod's `SIDESTEP_IFACES` entries: (key, kind).
pub(super) fn interface_entries(maps: &PolicyMaps, netns_cookie: u64) -> Vec<(InterfaceKey, u8)> {
    maps.interfaces
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.netns_cookie == netns_cookie)
        .collect()
}

pub(super) fn cidr_keys(maps: &PolicyMaps, netns_cookie: u64) -> Vec<(u32, CidrKey)> {
    let want = CidrKey::new(netns_cookie, 0, [0; 16]).netns_cookie;
    maps.cidrs
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.data().netns_cookie == want)
        .map(|k| (k.prefix_len(), k.data()))
        .collect()
}

/// Deletes the pod's port and CIDR rules (scanned or recorded, as the caller found them), its
/// counters and its source addresses.
fn remove_rules(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    ports: &[PortKey],
    cidrs: &[(u32, CidrKey)],
    first: &mut FirstError,
) {
    for key in ports {
        first.note(deleted(map_names::PORT_RULES, maps.ports.remove(key)));
    }
    for (bits, data) in cidrs {
        first.note(deleted(
            map_names::CIDR_RULES,
            maps.cidrs.remove(&Key::new(*bits, *data)),
        ));
    }
    first.note(deleted(
        map_names::COUNTERS,
        maps.counters.remove(&netns_cookie),
    ));
    first.note(deleted(
        map_names::SOURCE_ADDRESSES,
        maps.sources.remove(&netns_cookie),
    ));
}

/// The pod entry goes first: from then on the programs ignore the pod's rules.
fn remove_pod_entry(maps: &mut PolicyMaps, netns_cookie: u64) -> Result<bool, MapsError> {
    let was_enrolled = deleted(map_names::POD_POLICY, maps.pods.remove(&netns_cookie))?;
    crate::sys::failpoint("unenroll:after-pod-entry");
    Ok(was_enrolled)
}

/// Removes every entry of `netns_cookie`, found by scanning the maps. Returns whether the pod
/// was enrolled. Idempotent.
pub fn unenroll_cookie(maps: &mut PolicyMaps, netns_cookie: u64) -> Result<bool, MapsError> {
    let was_enrolled = remove_pod_entry(maps, netns_cookie)?;
    let mut first = FirstError::default();
    let (ports, cidrs) = (port_keys(maps, netns_cookie), cidr_keys(maps, netns_cookie));
    remove_rules(maps, netns_cookie, &ports, &cidrs, &mut first);
    first.note(remove_addresses(maps, netns_cookie, &[]));
    first.note(remove_interfaces(maps, netns_cookie, &[]));
    first.note(remove_reroute(maps, netns_cookie, &[]));
    remove_source_routes(maps, netns_cookie, |_| true, &mut first);
    first.into_result().map(|()| was_enrolled)
}

/// Removes the entries `recorded` wrote for `netns_cookie`, without scanning a map except where
/// the record cannot say (see [`Recorded::inbound_ifindexes`], and re-routed interfaces, whose
/// keys are the interfaces' ifindex and MAC as found in the netns at enrolment). Returns whether
/// the pod was enrolled. Idempotent.
///
/// A pod entry that is not the one the recorded policy makes means the pod was enrolled since
/// with something else (by hand, or a re-enrolment the record did not follow), whose keys the
/// record does not name: then every map is scanned, as [`unenroll_cookie`] does.
pub fn unenroll_recorded(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    recorded: &Recorded<'_>,
) -> Result<bool, MapsError> {
    let entries = recorded.policy.to_map_entries(netns_cookie);
    let pod = recorded
        .netns_keys
        .map_or(entries.pod, |k| k.adjust(entries.pod));
    // Absent is fine: an unenrolment interrupted after the pod entry left the rest.
    if maps
        .pods
        .get(&netns_cookie, 0)
        .is_ok_and(|have| have != pod)
    {
        tracing::info!(
            netns_cookie,
            "the pod entry differs from the recorded policy; unenrolling by scanning the maps"
        );
        return unenroll_cookie(maps, netns_cookie);
    }
    let was_enrolled = remove_pod_entry(maps, netns_cookie)?;
    // After the pod entry (a follower that sets the flag later sees the pod gone and undoes its
    // writes itself), before remove_rules drops the source entry that holds it.
    let followed_routes = source::flagged_routes(maps, netns_cookie);
    let mut first = FirstError::default();
    remove_rules(
        maps,
        netns_cookie,
        &entries.ports,
        &entries.cidrs,
        &mut first,
    );
    let netns_addresses: Vec<[u32; 4]> = recorded
        .netns_keys
        .map(|k| {
            k.addresses
                .iter()
                .map(crate::policy::address_words)
                .collect()
        })
        .unwrap_or_default();
    remove_own_addresses(
        maps,
        netns_cookie,
        entries.addresses.iter().chain(&netns_addresses),
        &mut first,
    );
    if let Some(keys) = recorded.netns_keys {
        remove_netns_keys(maps, netns_cookie, keys, &mut first);
    }
    // The follower writes routes of interfaces attached after the ADD, which no record names;
    // only a pod flagged as having routes pays for the scan.
    if followed_routes {
        remove_source_routes(maps, netns_cookie, |_| true, &mut first);
    }
    // The agent's follower writes the entries of excluded interfaces that appear after the ADD
    // (Multus attaches them after this chain ran) and of their routes; no record names them.
    let follower_wrote = !recorded.policy.exclude_interfaces.is_empty();
    if follower_wrote {
        for (bits, data) in route_list_keys(maps, netns_cookie) {
            first.note(deleted(
                map_names::CIDR_RULES,
                maps.cidrs.remove(&Key::new(bits, data)),
            ));
        }
    }
    match recorded.inbound_ifindexes.filter(|_| !follower_wrote) {
        Some(ifindexes) => {
            for &ifindex in ifindexes {
                let key = InterfaceKey {
                    netns_cookie,
                    ifindex,
                    _reserved: 0,
                };
                first.note(deleted(map_names::INTERFACES, maps.interfaces.remove(&key)));
            }
        }
        None => first.note(remove_interfaces(maps, netns_cookie, &[])),
    }
    // Only pods with re-routed interfaces (VMs) have these; for them the scan stays, since the
    // keys depend on what the netns held at enrolment, and no record says it.
    if !reroute_names(recorded.policy).is_empty() {
        first.note(remove_reroute(maps, netns_cookie, &[]));
    }
    first.into_result().map(|()| was_enrolled)
}

/// An address is the key, and a later pod given the same IP owns it now: delete only ours.
fn remove_own_addresses<'a>(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    addresses: impl Iterator<Item = &'a [u32; 4]>,
    first: &mut FirstError,
) {
    for addr in addresses {
        if maps.addresses.get(addr, 0).is_ok_and(|c| c == netns_cookie) {
            first.note(deleted(
                map_names::POD_ADDRESSES,
                maps.addresses.remove(addr),
            ));
        }
    }
}

/// The excluded and re-routed interface keys and the route entries an enrolment derived from
/// the netns.
fn remove_netns_keys(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    keys: &NetnsKeys,
    first: &mut FirstError,
) {
    for &ifindex in keys
        .excluded_ifindexes
        .iter()
        .chain(&keys.rerouted_ifindexes)
    {
        let key = InterfaceKey {
            netns_cookie,
            ifindex,
            _reserved: 0,
        };
        first.note(deleted(map_names::INTERFACES, maps.interfaces.remove(&key)));
    }
    for route in &keys.routes {
        if let Some((bits, data, _)) = route_entry(netns_cookie, route, &[]) {
            first.note(deleted(
                map_names::CIDR_RULES,
                maps.cidrs.remove(&Key::new(bits, data)),
            ));
        }
    }
    for result in source::remove_recorded(maps, netns_cookie, &keys.source_routes) {
        first.note(deleted(map_names::SOURCE_ROUTES, result));
    }
}

/// Removes the pod's source routes whose source `gone` names (all of them for `|_| true`).
fn remove_source_routes(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    gone: impl Fn(std::net::IpAddr) -> bool,
    first: &mut FirstError,
) {
    for (bits, data) in source::scan(maps, netns_cookie, gone) {
        first.note(deleted(
            map_names::SOURCE_ROUTES,
            maps.source_routes.remove(&Key::new(bits, data)),
        ));
    }
}

/// Removes one attachment of a pod whose other attachments stay enrolled (a Multus network, a
/// `podman network disconnect`): the addresses of its interfaces, its interface keys and its tc
/// link. The pod entry, the sk_lookup links and every other attachment's keys stay.
pub fn unenroll_attachment(
    pin_root: &Path,
    netns_cookie: u64,
    ifname: &str,
    addresses: &[std::net::IpAddr],
    inbound_ifindexes: &[u32],
) -> Result<(), EnrollError> {
    let mut maps = PolicyMaps::open(pin_root)?;
    let mut first = FirstError::default();
    let words: Vec<[u32; 4]> = addresses.iter().map(crate::policy::address_words).collect();
    remove_own_addresses(&mut maps, netns_cookie, words.iter(), &mut first);
    // Routes through the attachment's interface go with it: its address cannot be bound any
    // more, and their destinations now take the pod's other routes.
    remove_source_routes(
        &mut maps,
        netns_cookie,
        |ip| addresses.contains(&ip),
        &mut first,
    );
    for &ifindex in inbound_ifindexes {
        let key = InterfaceKey {
            netns_cookie,
            ifindex,
            _reserved: 0,
        };
        // Only the tc key: an excluded interface's key describes the netns, not the attachment.
        if maps
            .interfaces
            .get(&key, 0)
            .is_ok_and(|k| k == sidestep_abi::iface_kind::TC)
        {
            first.note(deleted(map_names::INTERFACES, maps.interfaces.remove(&key)));
        }
    }
    let layout = PinLayout::new(pin_root);
    let pin = layout.pod_links_dir(netns_cookie).join(ifname);
    if pin.exists() {
        podlinks::detach_link_pin(&layout, netns_cookie, &pin);
    }
    first.into_result().map_err(Into::into)
}

/// Unenrols the netns at `netns_path`: its map entries and its tc links.
/// A TPROXY or ambient pod also loses its return route; [`unenroll_by_cookie`] cannot reach the netns, and
/// leaves the route to die with it.
pub fn unenroll(pin_root: &Path, netns_path: &Path) -> Result<bool, EnrollError> {
    let netns = Netns::open(netns_path)?;
    let netns_cookie = netns.cookie()?;
    let return_route = PolicyMaps::open(pin_root)?
        .pods
        .get(&netns_cookie, 0)
        .ok()
        .and_then(|p| tproxy::ReturnRoute::of_pod_flags(p.flags));
    let was = unenroll_by_cookie(pin_root, netns_cookie)?;
    if let Some(route) = return_route {
        tproxy::configure(&netns, route, false)?;
    }
    Ok(was)
}

/// Unenrols by cookie (scanning the maps), for callers whose netns may already be gone.
pub fn unenroll_by_cookie(pin_root: &Path, netns_cookie: u64) -> Result<bool, EnrollError> {
    let mut maps = PolicyMaps::open(pin_root)?;
    let was = unenroll_cookie(&mut maps, netns_cookie)?;
    podlinks::detach_inbound(&PinLayout::new(pin_root), netns_cookie)?;
    Ok(was)
}
