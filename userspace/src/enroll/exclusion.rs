//! Excluded interfaces (`excludeInterfaces`) kept in step with the pod netns after the ADD.
//!
//! istio-iptables' `-i <nic> -j RETURN` and `-o <nic> -j RETURN` match whatever interfaces and
//! routes the netns has when a packet passes. Enrolment writes what it saw: the excluded
//! interfaces present (`SIDESTEP_IFACES`, `EXCLUDED`) and the pod's routes (the `ROUTE` list of
//! `SIDESTEP_CIDRS`). Multus attaches its networks after the default network's chain, this plugin
//! included, has run, so the interface an operator excludes is usually not there yet. The agent's
//! address follower calls [`follow`] on each address or route change of such a pod.
//!
//! The entries are the pod's: `follow` reads them from the maps at every call (a re-enrolment may
//! have rewritten them) and makes them what the netns asks for, whoever wrote them. DEL scans
//! both maps for a pod whose policy excludes interfaces (no record names what the follower
//! wrote), and a call that finds its pod unenrolled after writing removes what it wrote.

use aya::maps::lpm_trie::Key;
use sidestep_abi::{CidrKey, InterfaceKey, iface_kind, map_names, route_via};

use super::{
    NetnsFacts, Route, route_entry,
    trim::exclusion_routes,
    unenroll::{interface_entries, route_list_keys},
};
use crate::maps::{MapsError, PolicyMaps, classify};

/// A `ROUTE` list entry: (prefix bits, key, `route_via` value).
pub(crate) type RouteEntry = (u32, CidrKey, u8);

/// What [`follow`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExclusionChanges {
    /// Excluded interfaces (ifindexes) that appeared, now left out of capture.
    pub interfaces_added: Vec<u32>,
    /// Entries of excluded interfaces that are gone (or renamed), removed.
    pub interfaces_removed: usize,
    /// Route entries written (new, or now through another kind of interface).
    pub routes_written: usize,
    /// Route entries of routes that are gone, removed.
    pub routes_removed: usize,
    /// The netns has more routes than [`crate::limits::MAX_EXCLUSION_ROUTES`]: none is written,
    /// so every connection is captured whatever interface its route takes. Not a change.
    pub routes_over_cap: Option<usize>,
}

impl ExclusionChanges {
    pub fn changed(&self) -> bool {
        !self.interfaces_added.is_empty()
            || self.interfaces_removed > 0
            || self.routes_written > 0
            || self.routes_removed > 0
    }
}

/// The `ROUTE` list entries for `routes`, one per prefix. Of several routes to one prefix (eth0's
/// and a Multus network's default route, `fe80::/64` on every interface) the kernel takes the
/// lowest metric; where that ties, the entry says "other", so the connection is captured.
pub(crate) fn route_entries(
    netns_cookie: u64,
    routes: &[Route],
    excluded_ifindexes: &[u32],
) -> Vec<RouteEntry> {
    // (metric, entry), one per prefix; at most MAX_EXCLUSION_ROUTES of them.
    let mut best: Vec<(u32, RouteEntry)> = Vec::new();
    for route in exclusion_routes(routes) {
        let Some(entry @ (bits, data, via)) = route_entry(netns_cookie, route, excluded_ifindexes)
        else {
            continue;
        };
        match best
            .iter_mut()
            .find(|(_, (b, d, _))| (*b, *d) == (bits, data))
        {
            Some((metric, kept)) => {
                if route.metric < *metric || (route.metric == *metric && via == route_via::OTHER) {
                    *metric = route.metric;
                    *kept = entry;
                }
            }
            None => best.push((route.metric, entry)),
        }
    }
    best.into_iter().map(|(_, entry)| entry).collect()
}

/// Makes the pod's excluded-interface entries match `facts` for the interfaces `excluded` names.
pub fn follow(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    facts: &NetnsFacts,
    excluded: &[String],
) -> Result<ExclusionChanges, MapsError> {
    let mut changes = ExclusionChanges::default();
    let present: Vec<u32> = excluded.iter().filter_map(|n| facts.ifindex(n)).collect();
    let key = |ifindex: u32| InterfaceKey {
        netns_cookie,
        ifindex,
        _reserved: 0,
    };
    // Routes first: an interface entry without its routes only leaves inbound out.
    let wanted = route_entries(netns_cookie, &facts.routes, &present);
    if exclusion_routes(&facts.routes).len() < facts.routes.len() {
        changes.routes_over_cap = Some(facts.routes.len());
    }
    let have = pod_route_entries(maps, netns_cookie);
    let mut written: Vec<RouteEntry> = Vec::new();
    for entry @ (bits, data, via) in &wanted {
        if have.contains(entry) {
            continue;
        }
        maps.cidrs
            .insert(&Key::new(*bits, *data), *via, 0)
            .map_err(|e| classify(map_names::CIDR_RULES, 0, e))?;
        written.push(*entry);
    }
    changes.routes_written = written.len();
    for (bits, data, _) in &have {
        if !wanted.iter().any(|(b, d, _)| (b, d) == (bits, data))
            && maps.cidrs.remove(&Key::new(*bits, *data)).is_ok()
        {
            changes.routes_removed += 1;
        }
    }
    for &ifindex in &present {
        if maps.interfaces.get(&key(ifindex), 0).ok() == Some(iface_kind::EXCLUDED) {
            continue;
        }
        maps.interfaces
            .insert(key(ifindex), iface_kind::EXCLUDED, 0)
            .map_err(|e| classify(map_names::INTERFACES, 0, e))?;
        changes.interfaces_added.push(ifindex);
    }
    // An excluded interface deleted or renamed: its ifindex no longer names it.
    let stale = interface_entries(maps, netns_cookie)
        .into_iter()
        .filter(|(k, kind)| *kind == iface_kind::EXCLUDED && !present.contains(&k.ifindex));
    for (k, _) in stale {
        if maps.interfaces.remove(&k).is_ok() {
            changes.interfaces_removed += 1;
        }
    }
    if changes.changed() && !maps.is_enrolled(netns_cookie)? {
        // The pod's DEL ran meanwhile; its scan may have come before these writes.
        for ifindex in &changes.interfaces_added {
            let _ = maps.interfaces.remove(&key(*ifindex));
        }
        for (bits, data, _) in &written {
            let _ = maps.cidrs.remove(&Key::new(*bits, *data));
        }
        return Ok(ExclusionChanges {
            routes_over_cap: changes.routes_over_cap,
            ..ExclusionChanges::default()
        });
    }
    Ok(changes)
}

/// The pod's `ROUTE` list entries, by a scan of the trie.
fn pod_route_entries(maps: &PolicyMaps, netns_cookie: u64) -> Vec<RouteEntry> {
    route_list_keys(maps, netns_cookie)
        .into_iter()
        .filter_map(|(bits, data)| {
            let via = maps.cidrs.get(&Key::new(bits, data), 0).ok()?;
            Some((bits, data, via))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn route(destination: &str, prefix_len: u8, ifindex: u32, metric: u32) -> Route {
        Route {
            destination: destination.parse::<IpAddr>().unwrap(),
            prefix_len,
            ifindex,
            metric,
        }
    }

    #[test]
    fn of_routes_to_one_prefix_the_lowest_metric_decides_and_a_tie_captures() {
        let (eth0, net1) = (2, 3);
        let via = |routes: &[Route]| -> Vec<u8> {
            route_entries(7, routes, &[net1])
                .iter()
                .map(|(_, _, via)| *via)
                .collect()
        };
        // Multus's default route through net1 behind eth0's.
        let defaults = [route("0.0.0.0", 0, eth0, 0), route("0.0.0.0", 0, net1, 100)];
        assert_eq!(via(&defaults), [route_via::OTHER]);
        let reversed = [route("0.0.0.0", 0, net1, 100), route("0.0.0.0", 0, eth0, 0)];
        assert_eq!(via(&reversed), [route_via::OTHER]);
        // net1's in front.
        let net1_first = [
            route("0.0.0.0", 0, eth0, 200),
            route("0.0.0.0", 0, net1, 100),
        ];
        assert_eq!(via(&net1_first), [route_via::EXCLUDED]);
        // fe80::/64 on both at one metric: captured.
        let link_local = [
            route("fe80::", 64, net1, 256),
            route("fe80::", 64, eth0, 256),
        ];
        assert_eq!(via(&link_local), [route_via::OTHER]);
        // Distinct prefixes stay distinct.
        let two = [
            route("10.77.0.0", 24, net1, 0),
            route("10.0.0.0", 8, eth0, 0),
        ];
        assert_eq!(via(&two), [route_via::EXCLUDED, route_via::OTHER]);
    }
}
