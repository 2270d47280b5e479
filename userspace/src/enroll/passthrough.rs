//! The proxy's IPv6 inbound passthrough source. istio-iptables adds `::6/128` to the pod's `lo`
//! (the IPv6 twin of 127.0.0.6, which needs nothing: all of 127/8 is local) so that the proxy can
//! bind to it when it hands an inbound connection to the app, and the rules let traffic from it
//! pass. Enrolment adds it to every netns with IPv6 on `lo`, whatever addresses the pod has at
//! ADD: an address SLAAC gives it later needs the passthrough as much.

use std::{fs, io, net::IpAddr};

use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
};

use crate::{
    netns::{Netns, NetnsError},
    rtnl::Rtnl,
};

/// `lo` is always interface 1 of a network namespace.
const LOOPBACK_IFINDEX: u32 = 1;
const LO_DISABLE_IPV6: &str = "/proc/sys/net/ipv6/conf/lo/disable_ipv6";

/// Adds `::6/128` to the netns's `lo` unless IPv6 is off there; an address already present is
/// fine (a re-enrolment, or a proxy that added it itself).
pub fn add_ipv6(netns: &Netns) -> Result<(), NetnsError> {
    netns.run(|| {
        match fs::read_to_string(LO_DISABLE_IPV6) {
            Ok(v) if v.trim() == "0" => {}
            // Disabled, or a kernel without IPv6.
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
        let mut msg = AddressMessage::default();
        msg.header.family = AddressFamily::Inet6;
        msg.header.prefix_len = 128;
        msg.header.index = LOOPBACK_IFINDEX;
        msg.attributes = vec![AddressAttribute::Address(IpAddr::V6(
            sidestep_abi::defaults::PASSTHROUGH_V6.into(),
        ))];
        Rtnl::open()?.request(RouteNetlinkMessage::NewAddress(msg), true)
    })
}
