//! TPROXY interception mode: the pod-side routing that lets the proxy reach its app from the
//! remote client's own address, so that the app sees the real client (Istio's TPROXY mode).
//!
//! Inbound capture is the same `bpf_sk_assign` as in REDIRECT mode. What TPROXY adds is the way
//! back: the proxy's transparent upstream socket is bound to the client's address, so the app's
//! replies to that address would leave through the pod's interface. istio-iptables fixes that with
//! a connmark; sidestep needs no conntrack:
//! - connect4/6 mark the proxy's transparent socket with [`defaults::TPROXY_MARK`];
//! - `net.ipv4.tcp_fwmark_accept` (it covers IPv6 too) makes the app's accepted socket, and so
//!   every reply including the SYN-ACK, carry the mark of the SYN that created it;
//! - `ip rule fwmark 1337 lookup 133` and `ip route add local default dev lo table 133` (both
//!   families, as istio's `tproxy.ConfigureRoutes`) deliver marked packets locally, where the
//!   proxy's transparent socket takes them.
//!
//! Connections from outside the pod never carry a mark (it is scrubbed when a packet changes
//! netns), so `tcp_fwmark_accept` changes nothing for them.
//!
//! Istio's ambient mode needs the same way back for ztunnel's connections to its pod's app from
//! the client's address, with its own numbers ([`ReturnRoute::AMBIENT`]: connection mark
//! 0x111/0xfff, table 100, priority 32764, as istio-cni's in-pod rules).

use std::{fs, io, path::Path};

use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
};
use sidestep_abi::{
    ambient,
    defaults::{TPROXY_MARK, TPROXY_ROUTE_TABLE},
    flags,
};

use crate::{netns::Netns, rtnl::Rtnl};

const FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";
/// Present when the netns has IPv6.
const IPV6_CONF: &str = "/proc/sys/net/ipv6";
/// `lo` is always interface 1 of a network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum TproxyError {
    #[error("TPROXY routing of network namespace {netns}: {step}: {source}")]
    Route {
        netns: String,
        step: String,
        source: io::Error,
    },
}

/// A policy route that delivers a proxy's marked return traffic on `lo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReturnRoute {
    pub mark: u32,
    /// `None`: the whole mark must match.
    pub mask: Option<u32>,
    pub table: u32,
    /// `None`: the kernel picks the priority.
    pub priority: Option<u32>,
}

impl ReturnRoute {
    /// Istio's TPROXY interception mode (`tproxy.ConfigureRoutes`).
    pub const TPROXY: Self = Self {
        mark: TPROXY_MARK,
        mask: None,
        table: TPROXY_ROUTE_TABLE,
        priority: None,
    };
    /// istio-cni's in-pod ambient routing.
    pub const AMBIENT: Self = Self {
        mark: ambient::CONN_MARK,
        mask: Some(ambient::MARK_MASK),
        table: ambient::ROUTE_TABLE,
        priority: Some(ambient::RULE_PRIORITY),
    };

    /// The route a pod entry with these flags needs, if any.
    pub fn of_pod_flags(pod_flags: u32) -> Option<Self> {
        if pod_flags & flags::AMBIENT != 0 {
            Some(Self::AMBIENT)
        } else if pod_flags & flags::TPROXY != 0 {
            Some(Self::TPROXY)
        } else {
            None
        }
    }
}

/// Installs (`on`) or removes the TPROXY routing of the netns. Both are idempotent, so a repeated
/// ADD, or a re-enrolment that switches the pod to REDIRECT, converges.
pub fn configure(netns: &Netns, route: ReturnRoute, on: bool) -> Result<(), TproxyError> {
    let failed = |step: &str, source: io::Error| TproxyError::Route {
        netns: netns.path().display().to_string(),
        step: step.into(),
        source,
    };
    let outcome = netns.run(|| {
        let families = if Path::new(IPV6_CONF).exists() {
            &[AddressFamily::Inet, AddressFamily::Inet6][..]
        } else {
            &[AddressFamily::Inet][..]
        };
        Ok(apply(route, on, families).err())
    });
    match outcome {
        Ok(None) => Ok(()),
        Ok(Some((step, source))) => Err(failed(step, source)),
        Err(e) => Err(failed("enter the netns", io::Error::other(e.to_string()))),
    }
}

/// The steps in order; the first failure names its step. Removal clears the sysctl first so that
/// no new connection is marked for a route that is about to go.
fn apply(
    route: ReturnRoute,
    on: bool,
    families: &[AddressFamily],
) -> Result<(), (&'static str, io::Error)> {
    let at = |step: &'static str| move |e: io::Error| (step, e);
    let mut rtnl = Rtnl::open().map_err(at("open a netlink socket"))?;
    if on {
        for &family in families {
            rtnl.route(route, family, true)
                .map_err(at("add the local route"))?;
            rtnl.rule(route, family, true)
                .map_err(at("add the fwmark rule"))?;
        }
        fs::write(FWMARK_ACCEPT, "1\n").map_err(at("set tcp_fwmark_accept"))?;
    } else {
        fs::write(FWMARK_ACCEPT, "0\n").map_err(at("clear tcp_fwmark_accept"))?;
        for &family in families {
            rtnl.rule(route, family, false)
                .map_err(at("delete the fwmark rule"))?;
            rtnl.route(route, family, false)
                .map_err(at("delete the local route"))?;
        }
    }
    Ok(())
}

impl Rtnl {
    /// `ip rule {add,del} fwmark MARK[/MASK] [pref P] lookup TABLE`.
    fn rule(&mut self, route: ReturnRoute, family: AddressFamily, add: bool) -> io::Result<()> {
        let mut msg = RuleMessage::default();
        msg.header.family = family;
        msg.header.action = RuleAction::ToTable;
        msg.header.table = route.table as u8;
        msg.attributes = vec![
            RuleAttribute::FwMark(route.mark),
            RuleAttribute::Table(route.table),
        ];
        if let Some(mask) = route.mask {
            msg.attributes.push(RuleAttribute::FwMask(mask));
        }
        if let Some(priority) = route.priority {
            msg.attributes.push(RuleAttribute::Priority(priority));
        }
        let request = if add {
            RouteNetlinkMessage::NewRule(msg)
        } else {
            RouteNetlinkMessage::DelRule(msg)
        };
        self.request(request, add)
    }

    /// `ip route {add,del} local default dev lo table TABLE`.
    fn route(&mut self, route: ReturnRoute, family: AddressFamily, add: bool) -> io::Result<()> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = family;
        msg.header.table = route.table as u8;
        msg.header.protocol = RouteProtocol::Boot;
        msg.header.scope = RouteScope::Host;
        msg.header.kind = RouteType::Local;
        msg.attributes = vec![
            RouteAttribute::Table(route.table),
            RouteAttribute::Oif(LOOPBACK_IFINDEX),
        ];
        let request = if add {
            RouteNetlinkMessage::NewRoute(msg)
        } else {
            RouteNetlinkMessage::DelRoute(msg)
        };
        self.request(request, add)
    }
}
