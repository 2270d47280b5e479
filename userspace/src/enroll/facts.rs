//! What an enrolment reads from the pod netns itself, in one visit: every address of every
//! interface (the capture boundary is the netns, not the addresses a runtime reported), the
//! interfaces' indexes, and, for a pod with excluded interfaces, its routes (istio-iptables'
//! `-o <nic>` is decided by the route of the destination).

use std::{io, net::IpAddr};

use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteType},
};
use serde::{Deserialize, Serialize};

use ipnet::IpNet;
use sidestep_abi::{CidrKey, cidr_list};

use crate::{
    netns::{Netns, NetnsError},
    policy::cidr_entry,
    rtnl::Rtnl,
};

/// The main routing table, the one `ip route` shows and pods route by.
const RT_TABLE_MAIN: u32 = 254;

/// One route of the pod: destination prefix and the interface it leaves by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    pub destination: IpAddr,
    pub prefix_len: u8,
    pub ifindex: u32,
    /// Its metric (`RTA_PRIORITY`): of routes to one prefix the kernel takes the lowest. Absent
    /// in records of older versions.
    #[serde(default)]
    pub metric: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetnsFacts {
    /// (interface, address) for every address of every interface but lo.
    pub addresses: Vec<(String, IpAddr)>,
    /// (interface, ifindex) for every interface but lo.
    pub interfaces: Vec<(String, u32)>,
    /// The main table's unicast routes; read only when asked for.
    pub routes: Vec<Route>,
    /// IPv4 `route_localnet` is on for the netns (`conf/all`, `conf/default`, or an interface).
    pub route_localnet: bool,
}

impl NetnsFacts {
    pub fn ifindex(&self, name: &str) -> Option<u32> {
        self.interfaces
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, i)| *i)
    }

    pub fn addresses_of(&self, name: &str) -> Vec<IpAddr> {
        self.addresses
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, a)| *a)
            .collect()
    }
}

/// Reads the netns's interfaces and addresses, and its routes when `with_routes` or when
/// addresses sit on more than one interface (the source of a captured connection then depends
/// on the route: enroll/source.rs).
pub fn read(netns: &Netns, with_routes: bool) -> Result<NetnsFacts, NetnsError> {
    netns.run(move || {
        let mut facts = NetnsFacts::default();
        for i in nix::net::if_::if_nameindex()?.iter() {
            let name = i.name().to_string_lossy().into_owned();
            if name != "lo" {
                facts.interfaces.push((name, i.index()));
            }
        }
        for a in nix::ifaddrs::getifaddrs().map_err(io::Error::from)? {
            if a.interface_name == "lo" {
                continue;
            }
            let Some(addr) = a.address.as_ref() else {
                continue;
            };
            let ip = if let Some(v4) = addr.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else if let Some(v6) = addr.as_sockaddr_in6() {
                IpAddr::V6(v6.ip())
            } else {
                continue;
            };
            facts.addresses.push((a.interface_name.clone(), ip));
        }
        let mut homes: Vec<&str> = facts
            .addresses
            .iter()
            .filter(|(_, ip)| !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
            .map(|(n, _)| n.as_str())
            .collect();
        homes.sort_unstable();
        homes.dedup();
        if with_routes || homes.len() > 1 {
            facts.routes = dump_routes()?;
        }
        facts.route_localnet = ["all", "default"]
            .into_iter()
            .chain(facts.interfaces.iter().map(|(name, _)| name.as_str()))
            .any(route_localnet_on);
        Ok(facts)
    })
}

/// Whether IPv4 `route_localnet` is on for `conf` (`all`, `default` or an interface) of the
/// calling thread's netns. The kernel honours the interface's value or `all`'s; `default` is what
/// an interface made later starts with. A netns without IPv4 has none.
fn route_localnet_on(conf: &str) -> bool {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{conf}/route_localnet"))
        .is_ok_and(|v| v.trim() != "0")
}

/// The main table's unicast routes of both families (an IPv6-less netns has none of its own).
fn dump_routes() -> io::Result<Vec<Route>> {
    let mut rtnl = Rtnl::open()?;
    let mut routes = Vec::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut msg = RouteMessage::default();
        msg.header.address_family = family;
        let replies = match rtnl.dump(RouteNetlinkMessage::GetRoute(msg)) {
            Ok(replies) => replies,
            // An IPv6-less kernel refuses the family: no routes of it.
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => continue,
            Err(e) => return Err(e),
        };
        routes.extend(replies.iter().filter_map(|reply| match reply {
            RouteNetlinkMessage::NewRoute(r) => unicast_route(r),
            _ => None,
        }));
    }
    Ok(routes)
}

/// The interface of a route whose next hops leave by more than one (a multipath route), or
/// which names none the netns can resolve (a nexthop object, `nhid`, dumped without its hops
/// when `net.ipv4.nexthop_compat_mode` is 0). No interface has ifindex 0, so such a route never
/// counts as leaving by an excluded interface: its connections are captured (fail closed), where
/// Istio's `-o <nic>` would decide per connection by the hop the kernel picks.
pub const SEVERAL_OR_UNKNOWN_INTERFACES: u32 = 0;

fn unicast_route(r: &RouteMessage) -> Option<Route> {
    if r.header.kind != RouteType::Unicast {
        return None;
    }
    let mut table = u32::from(r.header.table);
    let mut destination = None;
    let mut ifindex = None;
    let mut metric = 0;
    for a in &r.attributes {
        match a {
            RouteAttribute::Priority(p) => metric = *p,
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => {
                destination = Some(IpAddr::V4(*v4));
            }
            RouteAttribute::Destination(RouteAddress::Inet6(v6)) => {
                destination = Some(IpAddr::V6(*v6));
            }
            RouteAttribute::Oif(i) => ifindex = Some(*i),
            RouteAttribute::MultiPath(hops) if ifindex.is_none() => {
                let first = hops.first().map(|h| h.interface_index);
                ifindex = if hops.iter().all(|h| Some(h.interface_index) == first) {
                    first
                } else {
                    Some(SEVERAL_OR_UNKNOWN_INTERFACES)
                };
            }
            _ => {}
        }
    }
    if table != RT_TABLE_MAIN {
        return None;
    }
    let destination = destination.unwrap_or(match r.header.address_family {
        AddressFamily::Inet6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
    });
    // Kept even without an interface: dropped, its destinations would fall to a shorter prefix,
    // which may be an excluded interface's.
    Some(Route {
        destination,
        prefix_len: r.header.destination_prefix_length,
        ifindex: ifindex.unwrap_or(SEVERAL_OR_UNKNOWN_INTERFACES),
        metric,
    })
}

/// A route of a multi-homed pod through an interface other than its source address's, with the
/// address connections it carries leave from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceRoute {
    pub destination: IpAddr,
    pub prefix_len: u8,
    pub source: IpAddr,
}

impl SourceRoute {
    /// Its `SIDESTEP_SRCR` key: (prefix bits, key data).
    pub(super) fn key(&self, netns_cookie: u64) -> Option<(u32, CidrKey)> {
        let net = IpNet::new(self.destination, self.prefix_len).ok()?;
        Some(cidr_entry(netns_cookie, cidr_list::SOURCE, &net.trunc()))
    }
}

/// The keys an enrolment wrote from what the netns held (not from the policy), recorded so that
/// an unenrolment deletes exactly them, and so that one attachment's DEL removes only its own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetnsKeys {
    /// Addresses found on the netns's interfaces beyond the policy's pod IPs (`SIDESTEP_ADDRS`).
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    /// The addresses of the interfaces this enrolment was made for (a CNI attachment's), pod IPs
    /// included: what that attachment's DEL removes while other attachments stay.
    #[serde(default)]
    pub interface_addresses: Vec<IpAddr>,
    /// `excludeInterfaces` present in the netns, by ifindex (`iface_kind::EXCLUDED`).
    #[serde(default)]
    pub excluded_ifindexes: Vec<u32>,
    /// Re-routed interfaces present in the netns (`iface_kind::REROUTED`).
    #[serde(default)]
    pub rerouted_ifindexes: Vec<u32>,
    /// The routes written to the `cidr_list::ROUTE` list (pods with excluded interfaces).
    #[serde(default)]
    pub routes: Vec<Route>,
    /// A multi-homed pod's routes through its other interfaces (`SIDESTEP_SRCR`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_routes: Vec<SourceRoute>,
    /// The proxy's (uid, gid) as the host sees them, when the netns belongs to a user namespace
    /// of its own (`hostUsers: false`): what the pod entry holds instead of the policy's IDs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_host_ids: Option<(u32, u32)>,
    /// IPv4 `route_localnet` was on in the netns (`flags::ROUTE_LOCALNET`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub route_localnet: bool,
}

impl NetnsKeys {
    /// The pod entry an enrolment of `policy` writes into this netns.
    pub fn pod_entry(
        &self,
        policy: &crate::policy::Policy,
        netns_cookie: u64,
    ) -> sidestep_abi::PodPolicy {
        self.adjust(policy.to_map_entries(netns_cookie).pod)
    }

    /// What the netns changes in a policy's pod entry: the proxy's IDs as the host sees them,
    /// and the `route_localnet` flag.
    pub fn adjust(&self, mut pod: sidestep_abi::PodPolicy) -> sidestep_abi::PodPolicy {
        if let Some((uid, gid)) = self.proxy_host_ids {
            pod.proxy_uid = uid;
            pod.proxy_gid = gid;
        }
        if self.route_localnet {
            pod.flags |= sidestep_abi::flags::ROUTE_LOCALNET;
        }
        pod
    }
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::route::{RouteNextHop, RouteProtocol};

    use super::*;

    fn main_table_route(attributes: Vec<RouteAttribute>) -> RouteMessage {
        let mut r = RouteMessage::default();
        r.header.address_family = AddressFamily::Inet;
        r.header.kind = RouteType::Unicast;
        r.header.protocol = RouteProtocol::Boot;
        r.header.table = RT_TABLE_MAIN as u8;
        r.header.destination_prefix_length = 16;
        r.attributes = vec![RouteAttribute::Destination(RouteAddress::Inet(
            [10, 102, 0, 0].into(),
        ))];
        r.attributes.extend(attributes);
        r
    }

    fn hop(ifindex: u32) -> RouteNextHop {
        let mut hop = RouteNextHop::default();
        hop.interface_index = ifindex;
        hop
    }

    #[test]
    fn a_multipath_route_names_its_interface_only_when_every_hop_shares_it() {
        let (eth0, net1) = (2, 3);
        let one_device =
            main_table_route(vec![RouteAttribute::MultiPath(vec![hop(net1), hop(net1)])]);
        assert_eq!(unicast_route(&one_device).unwrap().ifindex, net1);
        // net1 first: taken for the route, every connection through eth0 would pass uncaptured.
        let mixed = main_table_route(vec![RouteAttribute::MultiPath(vec![hop(net1), hop(eth0)])]);
        assert_eq!(
            unicast_route(&mixed).unwrap().ifindex,
            SEVERAL_OR_UNKNOWN_INTERFACES
        );
    }

    #[test]
    fn a_route_without_a_device_is_kept_as_leaving_by_no_excluded_interface() {
        // A nexthop object dumped without its hops (`nexthop_compat_mode` 0): dropped, 10.102/16
        // would fall to a shorter prefix, perhaps net1's.
        let by_object = main_table_route(vec![RouteAttribute::NhId(7)]);
        let route = unicast_route(&by_object).expect("the route was dropped");
        assert_eq!(route.ifindex, SEVERAL_OR_UNKNOWN_INTERFACES);
        assert_eq!(route.prefix_len, 16);
    }
}
