//! How much of a pod goes into the maps every pod of the node shares. Root in a pod can add
//! thousands of addresses and routes, and its annotations can list thousands of ports and CIDRs;
//! a full shared map would fail other pods' ADDs. Every per-pod cap of a shared map is here.

use std::{collections::HashSet, net::IpAddr};

use super::Route;

/// The most addresses one pod holds in `SIDESTEP_ADDRS` (enrolment's and the address follower's
/// together). The addresses come from the pod netns, where an app with CAP_NET_ADMIN can add
/// thousands, and the map is shared by every pod of the node: a full map would fail other pods'
/// ADDs. An address left out fails closed: the app calling it is captured to the outbound port
/// (Istio would leave that call to the pod itself), and a SYN to it is steered by the pod's own
/// sk_lookup program, which names its pod without the map.
pub const MAX_POD_ADDRESSES: usize = 64;

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

/// The most interfaces an enrolment captures when not told which (`sidestep enroll` without
/// `--interface`: every interface but lo). Each is a `SIDESTEP_IFACES` entry and, with the tc
/// hook, a TCX link; a netns with more is refused rather than enrolled in part. The plugin
/// always names its attachment's interface.
pub const MAX_UNNAMED_INTERFACES: usize = 32;

/// The most routes of one pod in the `cidr_list::ROUTE` list of `SIDESTEP_CIDRS` (`-o <nic>` for
/// excluded interfaces).
pub const MAX_EXCLUSION_ROUTES: usize = 256;

/// The pods of one node the rule budgets below are sized for: kubelet's default `maxPods`.
pub const BUDGETED_PODS: usize = 110;

/// The most `SIDESTEP_PORTS` entries one pod's policy writes: its four port lists together
/// (inbound include and exclude, outbound include and exclude), each port of an expanded range
/// (Linkerd's `4000-4100`) an entry, the fixed exclusions (Istio's 15008, 15020, 15021, 15090)
/// included. The map holds 65,536 entries for the whole node:
///
/// ```text
/// 65,536 / 110 pods = 595 per pod, rounded down to 512
/// 110 pods x 512    = 56,320, leaving 9,216 spare
/// ```
///
/// A default Istio pod writes 5. Past 128 pods the budget alone no longer guarantees room: a
/// node of 1,000 pods stays within the map while they average at most 65 entries each.
pub const MAX_POD_PORT_RULES: usize = 512;

/// The most `SIDESTEP_CIDRS` entries one pod's policy writes: its outbound include and exclude
/// IP ranges, with the `::/0` a `*` writes. The same map holds the pod's routes for excluded
/// interfaces ([`MAX_EXCLUSION_ROUTES`]), so a pod's share is both:
///
/// ```text
/// 65,536 / 110 pods  = 595 per pod
/// 595 - 256 routes   = 339 for the policy, rounded down to 256
/// 110 pods x (256 + 256) = 56,320, leaving 9,216 spare
/// ```
///
/// A default Istio pod writes 1. A node of 1,000 pods stays within the map while they average
/// at most 65 entries each.
pub const MAX_POD_CIDR_RULES: usize = 256;

const _: () = assert!(
    BUDGETED_PODS * MAX_POD_PORT_RULES <= sidestep_abi::capacity::PORT_RULES as usize,
    "a full node of pods at their port budget overflows SIDESTEP_PORTS"
);
const _: () = assert!(
    BUDGETED_PODS * (MAX_POD_CIDR_RULES + MAX_EXCLUSION_ROUTES)
        <= sidestep_abi::capacity::CIDR_RULES as usize,
    "a full node of pods at their CIDR budget overflows SIDESTEP_CIDRS"
);

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
