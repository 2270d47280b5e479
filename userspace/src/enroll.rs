//! Enrolment: the one code path by which a pod netns enters and leaves the data path. The CLI's
//! `enroll`/`unenroll`, the CNI plugin and the agent's repair all call these functions.
//!
//! Ordering makes every step safe to interrupt: rules are written before the pod entry that makes
//! the programs look at them, and the pod entry is removed before its rules.
//!
//! Unenrolment (the `unenroll` submodule) comes in two kinds: by scanning every per-pod map for
//! the cookie (the safety net, for callers that do not know what was written), and by deleting
//! the keys a recorded enrolment wrote, which costs the same on a full node as on an empty one.

pub mod exclusion;
pub mod facts;
pub mod hook;
mod passthrough;
pub mod plan;
mod reserved_ports;
pub mod source;
mod trim;
mod unenroll;
pub mod verify;

use std::{collections::HashSet, net::IpAddr, path::Path};

use aya::maps::lpm_trie::Key;
pub use facts::{NetnsFacts, NetnsKeys, Route};
pub use plan::{Plan, Removal};
use trim::{exclusion_routes, keep_within};

pub use crate::limits::{
    BUDGETED_PODS, MAX_EXCLUSION_ROUTES, MAX_POD_ADDRESSES, MAX_POD_CIDR_RULES, MAX_POD_PORT_RULES,
};
use sidestep_abi::{
    CidrKey, InterfaceKey, PodSource, PortKey, RerouteIfKey, cidr_list, flags, iface_kind,
    map_names, route_via,
};
pub use unenroll::{
    Recorded, unenroll, unenroll_attachment, unenroll_by_cookie, unenroll_cookie, unenroll_recorded,
};
use unenroll::{
    cidr_keys, interface_entries, port_keys, remove_addresses, remove_interfaces, remove_reroute,
    route_list_keys,
};

use crate::{
    error::EnrollError,
    maps::{MapsError, PolicyMaps, classify},
    netns::Netns,
    pins::PinLayout,
    podlinks,
    policy::{CidrSet, MapEntries, Policy},
    tproxy,
};

/// What an enrolment wrote, for the caller's state record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolled {
    pub netns_cookie: u64,
    pub entries: MapEntries,
    /// Interfaces that carry the inbound tc program.
    pub interfaces: Vec<String>,
    /// Their ifindexes inside the pod (`interfaces`' order): the keys this enrolment wrote to
    /// `SIDESTEP_IFACES`, which [`unenroll_recorded`] deletes without a scan.
    pub inbound_ifindexes: Vec<u32>,
    /// The keys written from what the netns held.
    pub netns_keys: NetnsKeys,
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
    if policy.sk_msg {
        crate::btf::sock_offsets()?;
    }
    let layout = PinLayout::new(pin_root);
    let netns_cookie = netns.cookie()?;
    let previous_flags = maps.pods.get(&netns_cookie, 0).ok().map(|p| p.flags);
    let was_enrolled = previous_flags.is_some();
    let facts = facts::read(netns, !policy.exclude_interfaces.is_empty())?;
    if interfaces.is_none() && facts.interfaces.len() > crate::limits::MAX_UNNAMED_INTERFACES {
        return Err(EnrollError::TooManyInterfaces {
            path: netns.path().to_path_buf(),
            count: facts.interfaces.len(),
            max: crate::limits::MAX_UNNAMED_INTERFACES,
        });
    }
    // The proxy's IDs as the kernel sees them: a user-namespaced pod's UID 1337 is another UID
    // on the host, and the programs compare with `bpf_get_current_uid_gid`.
    // Ambient mode knows ztunnel by its socket mark, which no user namespace translates.
    let host_ids = if policy.ambient {
        None
    } else {
        crate::userns::proxy_ids_on_host(netns, policy.proxy_uid, policy.proxy_gid)?
    };
    let mut entries = policy.to_map_entries(netns_cookie);
    let earlier_source = maps
        .sources
        .get(&netns_cookie, 0)
        .ok()
        .filter(|_| was_enrolled);
    let primary_source = source::primary(entries.source, &facts, earlier_source);
    let mut netns_keys = netns_keys(
        &maps,
        netns_cookie,
        policy,
        &facts,
        &entries,
        interfaces,
        earlier_source,
    );
    netns_keys.source_routes = source::enrolment_routes(&facts, &primary_source, netns_cookie);
    entries.source = source::entry(primary_source, &netns_keys.source_routes);
    netns_keys.proxy_host_ids = host_ids;
    entries.pod = netns_keys.adjust(entries.pod);
    entries
        .addresses
        .extend(netns_keys.addresses.iter().map(address_words));
    // Before the pod entry: the proxy may bind to ::6 as soon as its pod is captured.
    passthrough::add_ipv6(netns)?;
    // Before the pod entry too: from then on sidestep steers the pod's traffic to these ports.
    // Left in place if a later step fails: reserving takes nothing an explicit bind needs.
    if policy.ambient {
        reserved_ports::reserve(
            netns,
            &[
                policy.outbound_port,
                policy.inbound_port,
                policy.dns_port,
                sidestep_abi::defaults::TUNNEL_PORT,
            ],
        )?;
    }
    // The return route (TPROXY, ambient) goes in before the pod entry that starts marking
    // connections.
    let return_route = tproxy::ReturnRoute::of_pod_flags(entries.pod.flags);
    // Another mode's route goes first: removing it clears tcp_fwmark_accept, which the new
    // route needs set.
    if let Some(previous) = previous_flags.and_then(tproxy::ReturnRoute::of_pod_flags)
        && return_route != Some(previous)
        && let Err(e) = tproxy::configure(netns, previous, false)
    {
        // Harmless if left: only packets with that mark take that route.
        tracing::warn!("re-enrolled in another mode, but the previous return route stays: {e}");
    }
    if let Some(route) = return_route {
        tproxy::configure(netns, route, true)?;
    }
    let written = write_netns_keys(&mut maps, netns_cookie, &netns_keys, was_enrolled)
        .and_then(|()| write_entries(&mut maps, netns_cookie, &entries));
    if let Err(e) = written {
        if !was_enrolled {
            let _ = unenroll_cookie(&mut maps, netns_cookie);
        }
        if let Some(route) = return_route.filter(|_| !was_enrolled) {
            let _ = tproxy::configure(netns, route, false);
        }
        return Err(e.into());
    }
    crate::sys::failpoint("enroll:after-maps");
    let undo_tproxy = || {
        if let Some(route) = return_route.filter(|_| !was_enrolled) {
            let _ = tproxy::configure(netns, route, false);
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
        match podlinks::attach_inbound(
            &layout,
            netns,
            netns_cookie,
            interfaces,
            &not_inbound,
            policy.inbound_hook,
        ) {
            Ok(a) => {
                crate::sys::failpoint("enroll:after-links");
                let tc_links: Vec<u32> = podlinks::attached_interfaces(&layout, netns_cookie)
                    .iter()
                    .filter_map(|n| facts.ifindex(n))
                    .collect();
                if let Err(e) = set_interfaces(
                    &mut maps,
                    netns_cookie,
                    &a,
                    &tc_links,
                    &netns_keys,
                    was_enrolled,
                ) {
                    if !was_enrolled {
                        let _ = unenroll_cookie(&mut maps, netns_cookie);
                        let _ = podlinks::detach_inbound(&layout, netns_cookie);
                    }
                    undo_tproxy();
                    return Err(e.into());
                }
                a
            }
            Err(e) => {
                if !was_enrolled {
                    let _ = unenroll_cookie(&mut maps, netns_cookie);
                    let _ = podlinks::detach_inbound(&layout, netns_cookie);
                }
                undo_tproxy();
                return Err(e);
            }
        }
    } else {
        podlinks::detach_inbound(&layout, netns_cookie)?;
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
            let _ = podlinks::detach_inbound(&layout, netns_cookie);
        }
        undo_tproxy();
        return Err(e);
    }
    let (interfaces, inbound_ifindexes) = attached.into_iter().unzip();
    Ok(Enrolled {
        netns_cookie,
        entries,
        interfaces,
        inbound_ifindexes,
        netns_keys,
    })
}

fn address_words(ip: &IpAddr) -> [u32; 4] {
    crate::policy::address_words(ip)
}

/// Whether `addr` belongs to an enrolled pod other than `netns_cookie`.
fn owned_by_other_pod(maps: &PolicyMaps, addr: &[u32; 4], netns_cookie: u64) -> Option<u64> {
    let owner = maps.addresses.get(addr, 0).ok()?;
    other_live_pod(maps, owner, netns_cookie)
}

/// `owner`, when it is an enrolled pod other than `netns_cookie`.
fn other_live_pod(maps: &PolicyMaps, owner: u64, netns_cookie: u64) -> Option<u64> {
    (owner != netns_cookie && maps.pods.get(&owner, 0).is_ok()).then_some(owner)
}

/// The keys this enrolment derives from the netns: every address of every interface (an
/// address another live pod owns is left to it: the identity program still names this pod for
/// its connections), the excluded and re-routed interfaces present, and the routes of a pod with
/// excluded interfaces.
///
/// Past [`MAX_POD_ADDRESSES`], the addresses kept are, in order: the pod's primary addresses
/// (`earlier_source`, which a re-enrolment keeps), the addresses the pod holds already (what
/// earlier attachments registered: their pod IPs were theirs to keep first), this attachment's
/// interface addresses, then the rest. Root in the pod can flood a second attachment's
/// interface before its ADD runs; that must not push the first attachment's pod IP out of the
/// map.
fn netns_keys(
    maps: &PolicyMaps,
    netns_cookie: u64,
    policy: &Policy,
    facts: &NetnsFacts,
    entries: &MapEntries,
    interfaces: Option<&[String]>,
    earlier_source: Option<PodSource>,
) -> NetnsKeys {
    // Sets: root in the pod can put thousands of addresses on one interface.
    let mut seen: HashSet<IpAddr> = HashSet::new();
    let mut addresses: Vec<IpAddr> = Vec::new();
    let mut held: Vec<IpAddr> = Vec::new();
    for (_, ip) in &facts.addresses {
        let words = address_words(ip);
        if !seen.insert(*ip) || entries.addresses.contains(&words) {
            continue;
        }
        let owner = maps.addresses.get(&words, 0).ok();
        if let Some(other) = owner.and_then(|o| other_live_pod(maps, o, netns_cookie)) {
            tracing::warn!(
                netns_cookie,
                "address {ip} of the netns is already registered to netns cookie {other}; it \
                 stays with that pod"
            );
            continue;
        }
        if owner == Some(netns_cookie) {
            held.push(*ip);
        }
        addresses.push(*ip);
    }
    let primary: Vec<IpAddr> = earlier_source
        .into_iter()
        .flat_map(|s| [s.addr4, s.addr6])
        .filter(|w| *w != [0; 4])
        .map(|w| crate::policy::words_address(&w))
        .collect();
    let mut interface_addresses: Vec<IpAddr> = policy.pod_ips.clone();
    let mut listed: HashSet<IpAddr> = interface_addresses.iter().copied().collect();
    for name in interfaces.unwrap_or_default() {
        for ip in facts.addresses_of(name) {
            if listed.insert(ip) {
                interface_addresses.push(ip);
            }
        }
    }
    let room = MAX_POD_ADDRESSES.saturating_sub(entries.addresses.len());
    let left_out = keep_within(
        &mut addresses,
        &[&primary, &held, &interface_addresses],
        room,
    );
    if !left_out.is_empty() {
        // The record names what this attachment registered: CHECK verifies each, and a flooded
        // interface would otherwise put thousands into it.
        let left_out: HashSet<&IpAddr> = left_out.iter().collect();
        interface_addresses.retain(|ip| !left_out.contains(ip));
        tracing::warn!(
            netns_cookie,
            left_out = left_out.len(),
            max = MAX_POD_ADDRESSES,
            "the netns has more addresses than are registered for one pod; connections to the \
             rest are captured as outbound"
        );
    }
    let ifindexes =
        |names: &[String]| -> Vec<u32> { names.iter().filter_map(|n| facts.ifindex(n)).collect() };
    let excluded_ifindexes = ifindexes(&policy.exclude_interfaces);
    let rerouted_ifindexes: Vec<u32> = ifindexes(&policy.reroute_virtual_interfaces)
        .into_iter()
        .filter(|i| !excluded_ifindexes.contains(i))
        .collect();
    NetnsKeys {
        addresses,
        interface_addresses,
        excluded_ifindexes,
        rerouted_ifindexes,
        // Read for a multi-homed pod too (its source routes); the ROUTE list is for `-o <nic>`.
        routes: if policy.exclude_interfaces.is_empty() {
            Vec::new()
        } else {
            let routes = exclusion_routes(&facts.routes);
            if routes.len() < facts.routes.len() {
                tracing::warn!(
                    netns_cookie,
                    routes = facts.routes.len(),
                    max = crate::limits::MAX_EXCLUSION_ROUTES,
                    "the netns has more routes than are written for one pod's excluded \
                     interfaces; none is written, so connections are captured whatever \
                     interface their route takes (sockets bound to an excluded device excepted)"
                );
            }
            routes.to_vec()
        },
        proxy_host_ids: None,
        source_routes: Vec::new(),
        route_localnet: facts.route_localnet,
    }
}

/// The `SIDESTEP_CIDRS` entry of one route: (prefix bits, key data, `route_via` value).
pub(crate) fn route_entry(
    netns_cookie: u64,
    route: &Route,
    excluded: &[u32],
) -> Option<(u32, CidrKey, u8)> {
    let net = ipnet::IpNet::new(route.destination, route.prefix_len).ok()?;
    let (bits, data) = crate::policy::cidr_entry(netns_cookie, cidr_list::ROUTE, &net.trunc());
    let via = if excluded.contains(&route.ifindex) {
        route_via::EXCLUDED
    } else {
        route_via::OTHER
    };
    Some((bits, data, via))
}

/// Writes the excluded and re-routed interface keys and the route entries, replacing what an
/// earlier enrolment of the cookie derived (found by a scan, which a first enrolment skips).
fn write_netns_keys(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    keys: &NetnsKeys,
    was_enrolled: bool,
) -> Result<(), MapsError> {
    let iface = |ifindex: u32| InterfaceKey {
        netns_cookie,
        ifindex,
        _reserved: 0,
    };
    for (list, kind) in [
        (&keys.excluded_ifindexes, iface_kind::EXCLUDED),
        (&keys.rerouted_ifindexes, iface_kind::REROUTED),
    ] {
        for &ifindex in list {
            maps.interfaces
                .insert(iface(ifindex), kind, 0)
                .map_err(|e| classify(map_names::INTERFACES, 0, e))?;
        }
    }
    source::write_routes(maps, netns_cookie, &keys.source_routes, was_enrolled)?;
    let routes = exclusion::route_entries(netns_cookie, &keys.routes, &keys.excluded_ifindexes);
    for (bits, data, via) in &routes {
        maps.cidrs
            .insert(&Key::new(*bits, *data), *via, 0)
            .map_err(|e| classify(map_names::CIDR_RULES, 0, e))?;
    }
    if was_enrolled {
        for (bits, data) in route_list_keys(maps, netns_cookie) {
            if !routes.iter().any(|r| (r.0, r.1) == (bits, data)) {
                let _ = maps.cidrs.remove(&Key::new(bits, data));
            }
        }
        let wanted: Vec<u32> = keys
            .excluded_ifindexes
            .iter()
            .chain(&keys.rerouted_ifindexes)
            .copied()
            .collect();
        let stale = interface_entries(maps, netns_cookie)
            .into_iter()
            .filter(|(k, kind)| *kind != iface_kind::TC && !wanted.contains(&k.ifindex));
        for (key, _) in stale {
            let _ = maps.interfaces.remove(&key);
        }
    }
    Ok(())
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
            // The route list is the netns's, written by `write_netns_keys`.
            cidr_keys(maps, netns_cookie)
                .into_iter()
                .filter(|(_, k)| k.list_be != cidr_list::ROUTE.to_be())
                .collect(),
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
            // Taking over a live pod's address would send its inbound SYNs here, and this
            // enrolment's rollback would then delete its entry.
            if let Some(owner) = owned_by_other_pod(maps, addr, netns_cookie) {
                return Err(MapsError::AddressOwned {
                    address: crate::policy::words_address(addr),
                    owner,
                });
            }
            maps.addresses
                .insert(addr, netns_cookie, 0)
                .map_err(|e| classify(map_names::POD_ADDRESSES, 0, e))?;
        }
        // The counter and source maps hold as many pods as the pod map: full means it is.
        let capacity = maps.pod_capacity;
        let pod_map_full = |e: MapsError| match e {
            MapsError::Full { .. } => MapsError::Full {
                map: map_names::POD_POLICY,
                capacity,
            },
            other => other,
        };
        if previous.is_none() {
            maps.zero_counters(netns_cookie).map_err(pod_map_full)?;
        }
        if entries.source != PodSource::default() {
            maps.sources
                .insert(netns_cookie, entries.source, 0)
                .map_err(|e| pod_map_full(classify(map_names::SOURCE_ADDRESSES, 0, e)))?;
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
            let _ = maps.sources.remove(&netns_cookie);
            let _ = remove_addresses(maps, netns_cookie, &[]);
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
        let _ = remove_addresses(maps, netns_cookie, &entries.addresses);
    }
    Ok(())
}

/// Records which interfaces carry this enrolment's tc program. Keys of other interfaces stay
/// when they still carry a tc link (another attachment's) or are excluded (`write_netns_keys`
/// owns those); the rest of the pod's earlier set goes. A first enrolment has no earlier set
/// (netns cookies are never reused), so it skips the map scan that would make ADD cost grow
/// with the node's pods.
fn set_interfaces(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    attached: &[(String, u32)],
    tc_links: &[u32],
    netns_keys: &NetnsKeys,
    was_enrolled: bool,
) -> Result<(), MapsError> {
    let key = |ifindex: u32| InterfaceKey {
        netns_cookie,
        ifindex,
        _reserved: 0,
    };
    let keys: Vec<InterfaceKey> = attached.iter().map(|(_, i)| key(*i)).collect();
    for k in &keys {
        maps.interfaces
            .insert(k, iface_kind::TC, 0)
            .map_err(|e| classify(map_names::INTERFACES, 0, e))?;
    }
    if was_enrolled {
        let keep: Vec<InterfaceKey> = keys
            .iter()
            .copied()
            .chain(tc_links.iter().map(|i| key(*i)))
            .chain(netns_keys.excluded_ifindexes.iter().map(|i| key(*i)))
            .chain(netns_keys.rerouted_ifindexes.iter().map(|i| key(*i)))
            .collect();
        let _ = remove_interfaces(maps, netns_cookie, &keep);
    }
    Ok(())
}

/// The virtual interfaces whose traffic `policy` re-routes. istio-iptables adds the re-route
/// rules only when includeOutboundIPRanges is not empty; with none named here, an enrolment
/// writes no `SIDESTEP_REROUTE_IFACES` entry, which lets [`unenroll_recorded`] skip that map.
fn reroute_names(policy: &Policy) -> &[String] {
    if policy.include_outbound_ip_ranges.is_empty() {
        &[]
    } else {
        &policy.reroute_virtual_interfaces
    }
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
    let names = reroute_names(policy);
    let all_ranges = matches!(policy.include_outbound_ip_ranges, CidrSet::All);
    let found = if names.is_empty() {
        Vec::new()
    } else {
        podlinks::reroute_interfaces(netns, netns_cookie, names, all_ranges)?
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
            podlinks::attach_reroute(layout, netns, netns_cookie, names)?;
        } else if was_enrolled {
            podlinks::detach_reroute(layout, netns, netns_cookie);
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
        let _ = remove_reroute(maps, netns_cookie, &keep);
    }
    Ok(())
}
