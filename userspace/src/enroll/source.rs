//! The source a captured connection leaves from. connect4/6 bind a captured socket to the address
//! REDIRECT would have left it, the one the route of the original destination gives: the pod's
//! primary address of the family (`SIDESTEP_SRC`), or, on a multi-homed pod, the address of the
//! interface another route leaves by (`SIDESTEP_SRCR`, a longest-prefix match on the
//! destination).

use std::net::IpAddr;

use aya::maps::lpm_trie::Key;
use sidestep_abi::{CidrKey, PodSource, map_names, pod_source_flags};

use super::facts::NetnsFacts;
pub use super::facts::SourceRoute;
use crate::{
    maps::{FirstError, MapsError, PolicyMaps, classify, deleted},
    policy::{address_words, pod_source, words_address},
};

/// The pod's source addresses, by family: the one an earlier enrolment of the netns chose (a
/// later attachment's ADD names its own interface's IPs), else the policy's (its first pod IP,
/// `MapEntries::source`), else the netns's first usable address.
pub(super) fn primary(
    policy: PodSource,
    facts: &NetnsFacts,
    earlier: Option<PodSource>,
) -> PodSource {
    let netns = pod_source(facts.addresses.iter().map(|(_, ip)| ip));
    let earlier = earlier.unwrap_or_default();
    let first = |words: [[u32; 4]; 3]| words.into_iter().find(|w| *w != [0; 4]).unwrap_or_default();
    PodSource {
        addr4: first([earlier.addr4, policy.addr4, netns.addr4]),
        addr6: first([earlier.addr6, policy.addr6, netns.addr6]),
        flags: 0,
        _reserved: 0,
    }
}

/// [`routes`] as enrolment writes them: at most [`MAX_FOLLOWED_ROUTES`] (a warning counts the rest).
pub(super) fn enrolment_routes(
    facts: &NetnsFacts,
    primary: &PodSource,
    netns_cookie: u64,
) -> Vec<SourceRoute> {
    let mut all = routes(facts, primary);
    if all.len() > MAX_FOLLOWED_ROUTES {
        tracing::warn!(
            netns_cookie,
            left_out = all.len() - MAX_FOLLOWED_ROUTES,
            max = MAX_FOLLOWED_ROUTES,
            "the netns has more routes through its other interfaces than are written for one \
             pod; connections to the rest leave from its primary address"
        );
        all.truncate(MAX_FOLLOWED_ROUTES);
    }
    all
}

/// The routes (facts read them for a pod with addresses on more than one interface) that leave
/// by an interface other than the one holding `primary`'s address of their family, each with
/// that interface's first usable address of the family, which is the source the kernel picks
/// for a destination the route covers (a route's preferred-source attribute is not read).
/// Link-local and multicast prefixes are left out: connect never asks for them.
pub(super) fn routes(facts: &NetnsFacts, primary: &PodSource) -> Vec<SourceRoute> {
    let interface_of = |ip: IpAddr| {
        facts
            .addresses
            .iter()
            .find(|(_, a)| *a == ip)
            .and_then(|(name, _)| facts.ifindex(name))
    };
    let primary_ifindex = |v4: bool| {
        let words = if v4 { primary.addr4 } else { primary.addr6 };
        (words != [0; 4])
            .then(|| interface_of(words_address(&words)))
            .flatten()
    };
    let (home4, home6) = (primary_ifindex(true), primary_ifindex(false));
    let mut out = Vec::new();
    for route in &facts.routes {
        let v4 = route.destination.is_ipv4();
        let skipped = match route.destination {
            IpAddr::V4(a) => a.is_multicast() || a.is_link_local(),
            IpAddr::V6(a) => a.is_multicast() || a.is_unicast_link_local(),
        };
        if skipped || Some(route.ifindex) == (if v4 { home4 } else { home6 }) {
            continue;
        }
        let Some((name, _)) = facts.interfaces.iter().find(|(_, i)| *i == route.ifindex) else {
            continue;
        };
        let own = pod_source(&facts.addresses_of(name));
        let words = if v4 { own.addr4 } else { own.addr6 };
        if words == [0; 4] {
            continue;
        }
        out.push(SourceRoute {
            destination: route.destination,
            prefix_len: route.prefix_len,
            source: words_address(&words),
        });
    }
    out
}

/// The pod's `SIDESTEP_SRC` entry, with the routes flag when it has any.
pub(super) fn entry(primary: PodSource, routes: &[SourceRoute]) -> PodSource {
    PodSource {
        flags: if routes.is_empty() {
            0
        } else {
            pod_source_flags::ROUTES
        },
        ..primary
    }
}

/// Writes the pod's source routes; a re-enrolment's stale ones (found by a scan of the pod's
/// keys, which only multi-homed pods have) go.
pub(super) fn write_routes(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    routes: &[SourceRoute],
    was_enrolled: bool,
) -> Result<(), MapsError> {
    let existing = if was_enrolled {
        scan_entries(maps, netns_cookie)
    } else {
        Vec::new()
    };
    // A stale route left behind only costs a lookup that the pod's other routes would answer.
    sync_routes(maps, netns_cookie, routes, &existing).map(drop)
}

/// What [`sync_routes`] did: the routes written, and each stale key's removal.
struct RoutesSynced {
    written: Vec<SourceRoute>,
    removals: Vec<Result<bool, MapsError>>,
}

/// Makes the pod's `SIDESTEP_SRCR` entries `wanted`, given the `existing` ones: writes the routes
/// that are new or have another source, then removes the keys no longer wanted.
fn sync_routes(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    wanted: &[SourceRoute],
    existing: &[((u32, CidrKey), [u32; 4])],
) -> Result<RoutesSynced, MapsError> {
    let mut wanted_keys = Vec::with_capacity(wanted.len());
    let mut written = Vec::new();
    for route in wanted {
        let Some(key) = route.key(netns_cookie) else {
            continue;
        };
        wanted_keys.push(key);
        let source = address_words(&route.source);
        if existing.contains(&(key, source)) {
            continue;
        }
        maps.source_routes
            .insert(&Key::new(key.0, key.1), source, 0)
            .map_err(|e| classify(map_names::SOURCE_ROUTES, 0, e))?;
        written.push(route.clone());
    }
    let removals = existing
        .iter()
        .filter(|(key, _)| !wanted_keys.contains(key))
        .map(|(key, _)| {
            deleted(
                map_names::SOURCE_ROUTES,
                maps.source_routes.remove(&Key::new(key.0, key.1)),
            )
        })
        .collect();
    Ok(RoutesSynced { written, removals })
}

/// The pod's `SIDESTEP_SRCR` keys whose source `keep` accepts.
pub(super) fn scan(
    maps: &PolicyMaps,
    netns_cookie: u64,
    keep: impl Fn(IpAddr) -> bool,
) -> Vec<(u32, CidrKey)> {
    scan_entries(maps, netns_cookie)
        .into_iter()
        .filter(|(_, source)| keep(words_address(source)))
        .map(|(key, _)| key)
        .collect()
}

/// The pod's `SIDESTEP_SRCR` entries: ((prefix bits, key data), source).
fn scan_entries(maps: &PolicyMaps, netns_cookie: u64) -> Vec<((u32, CidrKey), [u32; 4])> {
    let cookie_words = CidrKey::new(netns_cookie, 0, [0; 16]).netns_cookie;
    maps.source_routes
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.data().netns_cookie == cookie_words)
        .map(|(k, source)| ((k.prefix_len(), k.data()), source))
        .collect()
}

/// The most source routes enrolment or [`follow`] writes for one pod. The routes come from the pod netns, where
/// an app with CAP_NET_ADMIN can add thousands, and `SIDESTEP_SRCR` is shared by every pod of the
/// node: a full trie would fail other pods' ADDs. A route left out only costs its destinations
/// REDIRECT's source (they leave from the primary address); capture does not depend on it.
pub const MAX_FOLLOWED_ROUTES: usize = 64;

/// What [`follow`] changed of an enrolled pod's source entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceChanges {
    /// Source addresses of a family the pod had none of (an address SLAAC gave it later).
    pub gained: Vec<IpAddr>,
    /// Routes through another interface written (new, or with another source).
    pub routes_written: Vec<SourceRoute>,
    /// Routes that no longer exist, removed.
    pub routes_removed: usize,
    /// Routes of the netns beyond [`MAX_FOLLOWED_ROUTES`], not written.
    pub routes_left_out: usize,
}

impl SourceChanges {
    pub fn changed(&self) -> bool {
        !self.gained.is_empty()
            || !self.routes_written.is_empty()
            || self.routes_removed > 0
            || self.routes_left_out > 0
    }
}

/// Brings an enrolled pod's source entries in step with its netns as `facts` read it now: an
/// interface attached after the ADD (Multus runs the default network's chain, this plugin
/// included, before it adds `net1`), a route added or gone, a family the pod had no address of.
/// The primary addresses enrolment chose stay. No record names the routes written here: the
/// routes flag is set before any is written and cleared only once all are gone, and DEL scans
/// for the routes of a flagged pod ([`flagged_routes`]). A pod unenrolled meanwhile (its DEL
/// ran while the netns was read) gets what this wrote removed again.
pub fn follow(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    facts: &NetnsFacts,
) -> Result<SourceChanges, MapsError> {
    let current = match maps.sources.get(&netns_cookie, 0) {
        Ok(entry) => Some(entry),
        Err(aya::maps::MapError::KeyNotFound) => None,
        Err(e) => return Err(classify(map_names::SOURCE_ADDRESSES, 0, e)),
    };
    let had = current.unwrap_or_default();
    let primary = primary(PodSource::default(), facts, current);
    let mut wanted = routes(facts, &primary);
    let mut changes = SourceChanges {
        routes_left_out: wanted.len().saturating_sub(MAX_FOLLOWED_ROUTES),
        ..SourceChanges::default()
    };
    wanted.truncate(MAX_FOLLOWED_ROUTES);
    for (was, now) in [(had.addr4, primary.addr4), (had.addr6, primary.addr6)] {
        if was == [0; 4] && now != [0; 4] {
            changes.gained.push(words_address(&now));
        }
    }
    // Only a flagged pod has routes: an unflagged one costs no scan of the trie.
    let existing = if had.flags & pod_source_flags::ROUTES != 0 {
        scan_entries(maps, netns_cookie)
    } else {
        Vec::new()
    };
    // A flagged pod whose lookup misses leaves from its primary address, as an unflagged one,
    // so the flag stays on until the routes are gone.
    let flagged = entry(primary, &wanted);
    let during = PodSource {
        flags: flagged.flags | had.flags & pod_source_flags::ROUTES,
        ..flagged
    };
    let write_entry = |maps: &mut PolicyMaps, entry: PodSource| {
        if current == Some(entry) || entry == PodSource::default() {
            return Ok(());
        }
        maps.sources
            .insert(netns_cookie, entry, 0)
            .map_err(|e| classify(map_names::SOURCE_ADDRESSES, 0, e))
    };
    write_entry(maps, during)?;
    let synced = sync_routes(maps, netns_cookie, &wanted, &existing)?;
    changes.routes_written = synced.written;
    let mut first = FirstError::default();
    for removed in synced.removals {
        if let Ok(true) = removed {
            changes.routes_removed += 1;
        }
        first.note(removed);
    }
    first.into_result()?;
    if during != flagged {
        write_entry(maps, flagged)?;
    }
    if !maps.is_enrolled(netns_cookie)? {
        undo(maps, netns_cookie);
        return Ok(SourceChanges::default());
    }
    Ok(changes)
}

/// The source entry and routes of a pod whose DEL ran while [`follow`] wrote them.
fn undo(maps: &mut PolicyMaps, netns_cookie: u64) {
    let _ = maps.sources.remove(&netns_cookie);
    for (bits, data) in scan(maps, netns_cookie, |_| true) {
        let _ = maps.source_routes.remove(&Key::new(bits, data));
    }
}

/// Whether the pod's source entry says it has source routes, which the agent's follower may
/// have written beyond the enrolment's record.
pub(super) fn flagged_routes(maps: &PolicyMaps, netns_cookie: u64) -> bool {
    maps.sources
        .get(&netns_cookie, 0)
        .is_ok_and(|s| s.flags & pod_source_flags::ROUTES != 0)
}

/// Removes the recorded routes' keys.
pub(super) fn remove_recorded(
    maps: &mut PolicyMaps,
    netns_cookie: u64,
    routes: &[SourceRoute],
) -> Vec<Result<(), aya::maps::MapError>> {
    routes
        .iter()
        .filter_map(|r| r.key(netns_cookie))
        .map(|(bits, data)| maps.source_routes.remove(&Key::new(bits, data)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::facts::Route;

    fn facts() -> NetnsFacts {
        NetnsFacts {
            addresses: vec![
                ("eth0".into(), "10.1.0.5".parse().unwrap()),
                ("eth0".into(), "fd00:1::5".parse().unwrap()),
                ("eth0".into(), "fe80::1".parse().unwrap()),
                ("net1".into(), "fe80::2".parse().unwrap()),
                ("net1".into(), "10.2.0.5".parse().unwrap()),
                ("net1".into(), "fd00:2::5".parse().unwrap()),
                ("net2".into(), "fe80::3".parse().unwrap()),
            ],
            interfaces: vec![("eth0".into(), 2), ("net1".into(), 3), ("net2".into(), 4)],
            routes: [
                ("0.0.0.0", 0, 2),
                ("10.1.0.0", 24, 2),
                ("10.2.0.0", 24, 3),
                ("10.3.0.0", 16, 3),
                ("fd00:2::", 64, 3),
                ("fe80::", 64, 3),
                ("10.4.0.0", 16, 4),
            ]
            .iter()
            .map(|(d, l, i)| Route {
                destination: d.parse().unwrap(),
                prefix_len: *l,
                ifindex: *i,
                metric: 0,
            })
            .collect(),
            route_localnet: false,
        }
    }

    #[test]
    fn only_routes_through_other_interfaces_with_an_address_of_the_family() {
        let f = facts();
        let primary = primary(pod_source(&["10.1.0.5".parse().unwrap()]), &f, None);
        assert_eq!(
            words_address(&primary.addr6),
            "fd00:1::5".parse::<IpAddr>().unwrap()
        );
        let got: Vec<(String, u8, String)> = routes(&f, &primary)
            .iter()
            .map(|r| {
                (
                    r.destination.to_string(),
                    r.prefix_len,
                    r.source.to_string(),
                )
            })
            .collect();
        // eth0's own routes stay with the primary; net2 has no usable IPv4 address; the
        // link-local prefix is never asked for.
        assert_eq!(
            got,
            [
                ("10.2.0.0".into(), 24, "10.2.0.5".into()),
                ("10.3.0.0".into(), 16, "10.2.0.5".into()),
                ("fd00:2::".into(), 64, "fd00:2::5".into()),
            ]
        );
        assert_eq!(
            entry(primary, &routes(&f, &primary)).flags,
            pod_source_flags::ROUTES
        );
        assert_eq!(entry(primary, &[]).flags, 0);
    }

    #[test]
    fn a_later_attachment_keeps_the_first_ones_source() {
        let f = facts();
        let first = primary(pod_source(&["10.1.0.5".parse().unwrap()]), &f, None);
        // net1's ADD names net1's IPs; the pod keeps leaving from eth0's.
        let later = primary(pod_source(&["10.2.0.5".parse().unwrap()]), &f, Some(first));
        assert_eq!(later.addr4, first.addr4);
        assert_eq!(later.addr6, first.addr6);
        // A family the first enrolment had none of is filled in.
        let v4_only = PodSource {
            addr6: [0; 4],
            ..first
        };
        let later = primary(PodSource::default(), &f, Some(v4_only));
        assert_eq!(later.addr6, first.addr6);
    }
}
