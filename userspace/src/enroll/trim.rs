//! Keeping a pod within its caps ([`crate::limits`]): which addresses stay when there are more
//! than a pod may hold, and the exclusion routes written all or none.

use std::{collections::HashSet, net::IpAddr};

use super::Route;
use crate::limits::MAX_EXCLUSION_ROUTES;

/// Keeps at most `room` of `addresses`: those in `tiers[0]` first, then those in `tiers[1]`,
/// and so on, then the rest, each group in the order of `addresses`; returns the ones it left
/// out.
pub(crate) fn keep_within(
    addresses: &mut Vec<IpAddr>,
    tiers: &[&[IpAddr]],
    room: usize,
) -> Vec<IpAddr> {
    // Sets: a flooded interface lists thousands of addresses.
    let tiers: Vec<HashSet<&IpAddr>> = tiers.iter().map(|t| t.iter().collect()).collect();
    let rank = |ip: &IpAddr| {
        tiers
            .iter()
            .position(|t| t.contains(ip))
            .unwrap_or(tiers.len())
    };
    // Stable: each group keeps its order.
    addresses.sort_by_cached_key(rank);
    addresses.split_off(room.min(addresses.len()))
}

/// The routes to write for a pod with excluded interfaces: all of them, or none when there are
/// more than [`MAX_EXCLUSION_ROUTES`]. A part would not do: a route left out sends its
/// destinations to a shorter prefix, which may be an excluded interface's, and the connection
/// would pass uncaptured. Without routes nothing counts as leaving by an excluded interface, so
/// everything is captured (fail closed) but sockets bound to that device.
pub(crate) fn exclusion_routes(routes: &[Route]) -> &[Route] {
    if routes.len() <= MAX_EXCLUSION_ROUTES {
        routes
    } else {
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusion_routes_are_all_written_or_none() {
        let route = |i: u32| Route {
            destination: IpAddr::from([10, 100, (i / 256) as u8, (i % 256) as u8]),
            prefix_len: 32,
            ifindex: 3,
            metric: 0,
        };
        let at_cap: Vec<Route> = (0..MAX_EXCLUSION_ROUTES as u32).map(route).collect();
        assert_eq!(exclusion_routes(&at_cap), at_cap);
        let past: Vec<Route> = (0..=MAX_EXCLUSION_ROUTES as u32).map(route).collect();
        assert!(exclusion_routes(&past).is_empty());
    }

    #[test]
    fn the_cap_keeps_the_attachments_own_addresses_first() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let mut addresses = vec![
            ip("10.9.0.1"),
            ip("10.9.0.2"),
            ip("10.0.0.5"),
            ip("fd00::5"),
        ];
        let own = [ip("fd00::5"), ip("10.0.0.5")];
        assert_eq!(keep_within(&mut addresses, &[&own], 3).len(), 1);
        assert_eq!(addresses, [ip("10.0.0.5"), ip("fd00::5"), ip("10.9.0.1")]);
        assert_eq!(keep_within(&mut addresses, &[&own], 0).len(), 3);
        assert!(addresses.is_empty());
    }

    /// A second attachment's interface flooded before its ADD: the pod's primary address and
    /// what earlier enrolments registered come before the new interface's flood.
    #[test]
    fn earlier_tiers_outrank_a_flooded_interface() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let primary = ip("10.0.0.5");
        let registered = [ip("10.0.0.6"), primary];
        let flood: Vec<IpAddr> = (0..10).map(|i| ip(&format!("10.8.0.{i}"))).collect();
        let mut addresses: Vec<IpAddr> = flood.clone();
        addresses.extend([ip("10.0.0.6"), ip("10.7.0.1"), primary]);
        let left_out = keep_within(&mut addresses, &[&[primary], &registered, &flood], 4);
        assert_eq!(
            addresses,
            [primary, ip("10.0.0.6"), ip("10.8.0.0"), ip("10.8.0.1")]
        );
        assert_eq!(left_out.len(), 9);
        assert!(
            left_out.contains(&ip("10.7.0.1")),
            "the untiered rest is left out before any tier"
        );
    }
}
