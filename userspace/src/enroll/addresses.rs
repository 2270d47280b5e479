//! How many of a pod netns's addresses go into `SIDESTEP_ADDRS`, and which.

use std::{collections::HashSet, net::IpAddr};

/// The most addresses one pod holds in `SIDESTEP_ADDRS` (enrolment's and the address follower's
/// together). The addresses come from the pod netns, where an app with CAP_NET_ADMIN can add
/// thousands, and the map is shared by every pod of the node: a full map would fail other pods'
/// ADDs. An address left out fails closed: the app calling it is captured to the outbound port
/// (Istio would leave that call to the pod itself), and a SYN to it is steered by the pod's own
/// sk_lookup program, which names its pod without the map.
pub const MAX_POD_ADDRESSES: usize = 64;

/// Keeps at most `room` of `addresses`, the attachment's own (`first`) before the rest, in their
/// order otherwise; returns how many it left out.
pub(crate) fn keep_within(addresses: &mut Vec<IpAddr>, first: &[IpAddr], room: usize) -> usize {
    // A set: a flooded interface lists thousands of addresses.
    let first: HashSet<&IpAddr> = first.iter().collect();
    let (mut kept, rest): (Vec<IpAddr>, Vec<IpAddr>) =
        addresses.iter().partition(|ip| first.contains(ip));
    kept.extend(rest);
    let left_out = kept.len().saturating_sub(room);
    kept.truncate(room);
    *addresses = kept;
    left_out
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(keep_within(&mut addresses, &own, 3), 1);
        assert_eq!(addresses, [ip("10.0.0.5"), ip("fd00::5"), ip("10.9.0.1")]);
        assert_eq!(keep_within(&mut addresses, &own, 0), 3);
        assert!(addresses.is_empty());
    }
}
