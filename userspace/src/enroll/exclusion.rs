//! Excluded interfaces (`excludeInterfaces`) kept in step with the pod netns after the ADD.
//!
//! istio-iptables' `-i <nic> -j RETURN` and `-o <nic> -j RETURN` match whatever interfaces and
//! routes the netns has when a packet passes. Enrolment writes what it saw: the excluded
//! interfaces present (`SIDESTEP_IFACES`, `EXCLUDED`) and the pod's routes (the `ROUTE` list of
//! `SIDESTEP_CIDRS`). Multus attaches its networks after the default network's chain, this plugin
//! included, has run, so the interface an operator excludes is usually not there yet. The agent's
//! address follower calls [`follow`] on each address or route change of such a pod.
//!
//! The entries are the pod's: `follow` writes what the netns asks for and removes route entries
//! the netns no longer has, whoever wrote them; it removes only the interface entries it wrote.
//! DEL scans both maps for a pod whose policy excludes interfaces (no record names what the
//! follower wrote), and a sync that finds its pod unenrolled after writing removes what it wrote.

use aya::maps::lpm_trie::Key;
use sidestep_abi::{CidrKey, InterfaceKey, cidr_list, iface_kind, map_names};

use super::{NetnsFacts, limits::exclusion_routes, route_entry, unenroll::cidr_keys};
use crate::{
    error::MapsError,
    maps::{PolicyMaps, classify},
};

/// A `ROUTE` list entry: (prefix bits, key, `route_via` value).
type RouteEntry = (u32, CidrKey, u8);

/// What one follower knows of a pod's exclusion entries between its syncs.
#[derive(Debug, Default)]
pub struct Followed {
    /// Interface entries this follower wrote.
    interfaces: Vec<u32>,
    /// The pod's `ROUTE` list entries: read by a scan at the first sync, kept since.
    routes: Option<Vec<RouteEntry>>,
}

/// What [`follow`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExclusionChanges {
    /// Excluded interfaces (ifindexes) that appeared, now left out of capture.
    pub interfaces_added: Vec<u32>,
    /// Entries of excluded interfaces that are gone, removed.
    pub interfaces_removed: usize,
    /// Route entries written (new, or now through another kind of interface).
    pub routes_written: usize,
    /// Route entries of routes that are gone, removed.
    pub routes_removed: usize,
}

impl ExclusionChanges {
    pub fn changed(&self) -> bool {
        !self.interfaces_added.is_empty()
            || self.interfaces_removed > 0
            || self.routes_written > 0
            || self.routes_removed > 0
    }
}

/// Makes the pod's excluded-interface entries match `facts` for the interfaces `excluded` names.
pub(crate) fn follow(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    facts: &NetnsFacts,
    excluded: &[String],
    followed: &mut Followed,
) -> Result<ExclusionChanges, MapsError> {
    let mut changes = ExclusionChanges::default();
    let present: Vec<u32> = excluded.iter().filter_map(|n| facts.ifindex(n)).collect();
    let key = |ifindex: u32| InterfaceKey {
        netns_cookie,
        ifindex,
        _reserved: 0,
    };
    for &ifindex in &present {
        if maps.interfaces.get(&key(ifindex), 0).ok() == Some(iface_kind::EXCLUDED) {
            continue;
        }
        maps.interfaces
            .insert(key(ifindex), iface_kind::EXCLUDED, 0)
            .map_err(|e| classify(map_names::INTERFACES, 0, e))?;
        followed.interfaces.push(ifindex);
        changes.interfaces_added.push(ifindex);
    }
    let gone: Vec<u32> = followed
        .interfaces
        .iter()
        .copied()
        .filter(|i| !present.contains(i))
        .collect();
    for ifindex in gone {
        followed.interfaces.retain(|i| *i != ifindex);
        if maps.interfaces.get(&key(ifindex), 0).ok() == Some(iface_kind::EXCLUDED)
            && maps.interfaces.remove(&key(ifindex)).is_ok()
        {
            changes.interfaces_removed += 1;
        }
    }

    let wanted: Vec<RouteEntry> = exclusion_routes(&facts.routes)
        .iter()
        .filter_map(|r| route_entry(netns_cookie, r, &present))
        .collect();
    let known = followed
        .routes
        .get_or_insert_with(|| route_entries(maps, netns_cookie));
    for entry @ (bits, data, via) in &wanted {
        if known.contains(entry) {
            continue;
        }
        maps.cidrs
            .insert(&Key::new(*bits, *data), *via, 0)
            .map_err(|e| classify(map_names::CIDR_RULES, 0, e))?;
        changes.routes_written += 1;
    }
    for (bits, data, _) in known.iter() {
        if !wanted.iter().any(|(b, d, _)| (b, d) == (bits, data))
            && maps.cidrs.remove(&Key::new(*bits, *data)).is_ok()
        {
            changes.routes_removed += 1;
        }
    }
    *known = wanted;
    if changes.changed() && !maps.is_enrolled(netns_cookie)? {
        // The pod's DEL ran meanwhile; its scan may have come before these writes.
        undo(maps, netns_cookie, followed);
        return Ok(ExclusionChanges::default());
    }
    Ok(changes)
}

/// The pod's `ROUTE` list entries, by a scan of the trie.
fn route_entries(maps: &PolicyMaps, netns_cookie: u64) -> Vec<RouteEntry> {
    let route_list = cidr_list::ROUTE.to_be();
    cidr_keys(maps, netns_cookie)
        .into_iter()
        .filter(|(_, data)| data.list_be == route_list)
        .filter_map(|(bits, data)| {
            let via = maps.cidrs.get(&Key::new(bits, data), 0).ok()?;
            Some((bits, data, via))
        })
        .collect()
}

/// Removes what the follower wrote and the route entries it knows of.
fn undo(maps: &mut PolicyMaps, netns_cookie: u64, followed: &mut Followed) {
    for ifindex in std::mem::take(&mut followed.interfaces) {
        let _ = maps.interfaces.remove(&InterfaceKey {
            netns_cookie,
            ifindex,
            _reserved: 0,
        });
    }
    for (bits, data, _) in followed.routes.take().unwrap_or_default() {
        let _ = maps.cidrs.remove(&Key::new(bits, data));
    }
}
