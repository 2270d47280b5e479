//! One pod's share of the node-wide rule maps. `SIDESTEP_PORTS` and `SIDESTEP_CIDRS` hold the
//! lists of every pod of the node, so a pod whose annotations list thousands of ports or CIDRs
//! would fail every later ADD on the node. The budgets and their arithmetic are with the other
//! per-pod caps, in `limits.rs`.

use std::fmt::Write as _;

use sidestep_abi::{cidr_list, map_names, port_list};

use super::{Policy, PolicyError};
use crate::limits::{MAX_POD_CIDR_RULES, MAX_POD_PORT_RULES};

/// A list of a pod's policy as it lands in a node-wide map, named by the policy field that
/// fills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleList {
    IncludeInboundPorts,
    ExcludeInboundPorts,
    IncludeOutboundPorts,
    ExcludeOutboundPorts,
    /// Also holds the `::/0` that `includeOutboundPorts: "*"` writes.
    IncludeOutboundIpRanges,
    ExcludeOutboundIpRanges,
}

impl RuleList {
    /// The policy's JSON name, which is also the last part of Istio's annotation.
    pub fn field(self) -> &'static str {
        match self {
            Self::IncludeInboundPorts => "includeInboundPorts",
            Self::ExcludeInboundPorts => "excludeInboundPorts",
            Self::IncludeOutboundPorts => "includeOutboundPorts",
            Self::ExcludeOutboundPorts => "excludeOutboundPorts",
            Self::IncludeOutboundIpRanges => "includeOutboundIPRanges",
            Self::ExcludeOutboundIpRanges => "excludeOutboundIPRanges",
        }
    }

    fn of_port_list(list: u32) -> Self {
        match list {
            port_list::INBOUND_INCLUDE => Self::IncludeInboundPorts,
            port_list::INBOUND_EXCLUDE => Self::ExcludeInboundPorts,
            port_list::OUTBOUND_INCLUDE => Self::IncludeOutboundPorts,
            _ => Self::ExcludeOutboundPorts,
        }
    }

    fn of_cidr_list(list: u32) -> Self {
        if list == cidr_list::OUTBOUND_INCLUDE {
            Self::IncludeOutboundIpRanges
        } else {
            Self::ExcludeOutboundIpRanges
        }
    }
}

/// The kind of entry a list is made of, for [`PolicyError::TooLong`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Rules {
    Ports,
    Cidrs,
}

pub(super) fn list_too_long(field: &str, rules: Rules) -> PolicyError {
    let (what, limit, map) = match rules {
        Rules::Ports => ("ports", MAX_POD_PORT_RULES, map_names::PORT_RULES),
        Rules::Cidrs => ("CIDRs", MAX_POD_CIDR_RULES, map_names::CIDR_RULES),
    };
    PolicyError::TooLong {
        field: field.into(),
        what,
        limit,
        map,
    }
}

/// The error for a list of more ports than one pod may put in `SIDESTEP_PORTS`, for parsers of
/// other list forms (Linkerd's ranges).
pub fn too_many_ports(field: &str) -> PolicyError {
    list_too_long(field, Rules::Ports)
}

/// A pod whose lists together would take more than its share of a node-wide map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{} would put {entries} entries in {map}, more than the {limit} one pod may hold \
     (docs/REFERENCE.md, \"Per-pod map budgets\")",
    self.listing(RuleList::field)
)]
pub struct OverBudget {
    pub map: &'static str,
    pub entries: usize,
    pub limit: usize,
    /// The lists that have entries in the map, with their counts, largest first.
    pub lists: Vec<(RuleList, usize)>,
}

impl OverBudget {
    /// `name (count), ...` with each list named by `name`: the policy field, or the annotation
    /// a mesh reads it from.
    pub fn listing(&self, name: impl Fn(RuleList) -> &'static str) -> String {
        let mut out = String::new();
        for (i, (list, count)) in self.lists.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let _ = write!(out, "{sep}{} ({count})", name(*list));
        }
        out
    }
}

/// Counts per list, largest first (ties in the order of `lists`).
fn tally(lists: impl Iterator<Item = RuleList>) -> Vec<(RuleList, usize)> {
    let mut counts: Vec<(RuleList, usize)> = Vec::new();
    for list in lists {
        match counts.iter_mut().find(|(l, _)| *l == list) {
            Some((_, n)) => *n += 1,
            None => counts.push((list, 1)),
        }
    }
    counts.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    counts
}

fn within(
    map: &'static str,
    limit: usize,
    lists: impl Iterator<Item = RuleList>,
) -> Result<(), OverBudget> {
    let lists = tally(lists);
    let entries = lists.iter().map(|(_, n)| n).sum();
    if entries <= limit {
        return Ok(());
    }
    Err(OverBudget {
        map,
        entries,
        limit,
        lists,
    })
}

impl Policy {
    /// Whether the entries this policy writes, counted as the maps hold them (ranges expanded,
    /// duplicates once, fixed exclusions included), fit the pod's share of `SIDESTEP_PORTS`
    /// ([`MAX_POD_PORT_RULES`]) and `SIDESTEP_CIDRS` ([`MAX_POD_CIDR_RULES`]).
    pub fn check_budget(&self) -> Result<(), OverBudget> {
        let entries = self.to_map_entries(0);
        within(
            map_names::PORT_RULES,
            MAX_POD_PORT_RULES,
            entries.ports.iter().map(|k| RuleList::of_port_list(k.list)),
        )?;
        within(
            map_names::CIDR_RULES,
            MAX_POD_CIDR_RULES,
            entries
                .cidrs
                .iter()
                .map(|(_, k)| RuleList::of_cidr_list(u32::from_be(k.list_be))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{CidrSet, PortSet, parse_cidr_set, parse_port_set};

    fn ports(n: usize) -> String {
        (1..=n).map(|p| p.to_string()).collect::<Vec<_>>().join(",")
    }

    fn cidrs(n: usize) -> String {
        (0..n)
            .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
            .collect::<Vec<_>>()
            .join(",")
    }

    const ANNOTATION: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";

    #[test]
    fn a_port_list_past_the_budget_is_refused_naming_the_field_and_the_limit() {
        let at = parse_port_set(ANNOTATION, &ports(MAX_POD_PORT_RULES)).unwrap();
        assert!(matches!(at, PortSet::Only(s) if s.len() == MAX_POD_PORT_RULES));
        let e = parse_port_set(ANNOTATION, &ports(MAX_POD_PORT_RULES + 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ANNOTATION)
                && e.contains("more than 512 ports")
                && e.contains("SIDESTEP_PORTS"),
            "{e}"
        );
        // What counts is what the map holds: a port listed twice is one entry.
        let repeated = format!("{},1,2,3", ports(MAX_POD_PORT_RULES));
        assert!(parse_port_set(ANNOTATION, &repeated).is_ok());
        // The annotation of the issue: 30,000 ports.
        assert!(parse_port_set(ANNOTATION, &ports(30_000)).is_err());
    }

    #[test]
    fn a_cidr_list_past_the_budget_is_refused_naming_the_field_and_the_limit() {
        let field = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
        let at = parse_cidr_set(field, &cidrs(MAX_POD_CIDR_RULES)).unwrap();
        assert!(matches!(&at, CidrSet::Only(v) if v.len() == MAX_POD_CIDR_RULES));
        let e = parse_cidr_set(field, &cidrs(MAX_POD_CIDR_RULES + 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(field) && e.contains("more than 256 CIDRs") && e.contains("SIDESTEP_CIDRS"),
            "{e}"
        );
        let repeated = format!("{},10.0.0.0/24", cidrs(MAX_POD_CIDR_RULES));
        assert!(parse_cidr_set(field, &repeated).is_ok());
        assert!(parse_cidr_set(field, &cidrs(30_000)).is_err());
    }

    fn port_set(list: &[u16]) -> PortSet {
        PortSet::Only(list.iter().copied().collect())
    }

    /// Lists each within the budget but together past it; the fixed inbound exclusions count.
    #[test]
    fn the_pods_lists_together_are_held_to_its_budget() {
        // Istio's four fixed inbound exclusions (15008, 15020, 15021, 15090) plus 300 of the
        // pod's own, and the rest outbound: exactly the budget.
        let inbound: Vec<u16> = (1..=300).collect();
        let outbound: Vec<u16> = (1001..=1000 + (MAX_POD_PORT_RULES as u16 - 304)).collect();
        let at = Policy {
            exclude_inbound_ports: port_set(&inbound),
            exclude_outbound_ports: port_set(&outbound),
            ..Policy::default()
        };
        assert_eq!(at.to_map_entries(1).ports.len(), MAX_POD_PORT_RULES);
        at.validate().unwrap();

        let mut past = at.clone();
        past.exclude_inbound_ports = port_set(&(1..=301).collect::<Vec<_>>());
        let e = past.check_budget().unwrap_err();
        assert_eq!(
            (e.map, e.entries, e.limit),
            ("SIDESTEP_PORTS", MAX_POD_PORT_RULES + 1, MAX_POD_PORT_RULES)
        );
        assert_eq!(
            e.lists,
            [
                (RuleList::ExcludeInboundPorts, 305),
                (RuleList::ExcludeOutboundPorts, 208)
            ]
        );
        let msg = past.validate().unwrap_err().to_string();
        assert!(
            msg.starts_with("excludeInboundPorts (305), excludeOutboundPorts (208) would put 513")
                && msg.contains("more than the 512"),
            "{msg}"
        );
    }

    #[test]
    fn include_and_exclude_ranges_share_the_pods_cidr_budget() {
        let half = MAX_POD_CIDR_RULES / 2;
        let at = Policy {
            include_outbound_ip_ranges: parse_cidr_set("f", &cidrs(half)).unwrap(),
            exclude_outbound_ip_ranges: parse_cidr_set("f", &cidrs(2 * half)).unwrap(),
            ..Policy::default()
        };
        let e = at.check_budget().unwrap_err();
        assert_eq!((e.map, e.entries), ("SIDESTEP_CIDRS", 3 * half));
        let fits = Policy {
            exclude_outbound_ip_ranges: parse_cidr_set("f", &cidrs(half)).unwrap(),
            ..at.clone()
        };
        assert_eq!(fits.to_map_entries(1).cidrs.len(), MAX_POD_CIDR_RULES);
        fits.validate().unwrap();
        // includeOutboundPorts "*" adds the ::/0 to the include list: one more.
        let past = Policy {
            include_outbound_ports: PortSet::All,
            ..fits
        };
        assert_eq!(
            past.check_budget().unwrap_err().lists[0],
            (RuleList::IncludeOutboundIpRanges, half + 1)
        );
    }

    #[test]
    fn a_default_pod_is_far_within_both_budgets() {
        let e = Policy::default().to_map_entries(1);
        assert_eq!((e.ports.len(), e.cidrs.len()), (4, 1));
        Policy::default().check_budget().unwrap();
    }
}
