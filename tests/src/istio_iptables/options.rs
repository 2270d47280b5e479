//! The option lists of an [`IstioCapture`], checked and resolved as istio-cni does before any
//! rule is written: port and CIDR parsing, the always-excluded inbound ports, the CIDR family
//! split and the DNS capture variant. Kept apart from the rule builder so that its errors (an ADD
//! that istio-cni would fail) are found in one place.

use std::collections::HashSet;
use std::net::IpAddr;

use anyhow::{Context, Result, bail};

use super::{ALWAYS_EXCLUDED_INBOUND_PORTS, Family, IstioCapture};

impl IstioCapture {
    pub(super) fn resolve(&self, dns_servers: Option<&[&str]>) -> Result<Resolved> {
        let inbound_include =
            match self.include_inbound_ports.trim() {
                "" => InboundInclude::Off,
                "*" => InboundInclude::All,
                list => InboundInclude::Ports(ports(list).context(
                    "include_inbound_ports (traffic.sidecar.istio.io/includeInboundPorts)",
                )?),
            };
        // istio-cni: user list, then ",15020,15021,15090", deduplicated in first-seen order.
        let mut inbound_exclude = ports(&self.exclude_inbound_ports)
            .context("exclude_inbound_ports (traffic.sidecar.istio.io/excludeInboundPorts)")?;
        inbound_exclude.extend(ALWAYS_EXCLUDED_INBOUND_PORTS.iter().map(u16::to_string));
        let mut seen = HashSet::new();
        inbound_exclude.retain(|p| seen.insert(p.clone()));

        let outbound_exclude = ports(&self.exclude_outbound_ports)
            .context("exclude_outbound_ports (traffic.sidecar.istio.io/excludeOutboundPorts)")?;
        let outbound_include = ports(&self.include_outbound_ports)
            .context("include_outbound_ports (traffic.sidecar.istio.io/includeOutboundPorts)")?;

        let include = split_ranges(&self.include_outbound_ip_ranges).context(
            "include_outbound_ip_ranges (traffic.sidecar.istio.io/includeOutboundIPRanges)",
        )?;
        let exclude = split_ranges(&self.exclude_outbound_ip_ranges).context(
            "exclude_outbound_ip_ranges (traffic.sidecar.istio.io/excludeOutboundIPRanges)",
        )?;
        if exclude.wildcard {
            bail!("invalid value for OUTBOUND_IP_RANGES_EXCLUDE: \"*\"");
        }

        let dns = if !self.dns_capture {
            None
        } else {
            match dns_servers {
                // istio-cni: REDIRECT_DNS and CAPTURE_ALL_DNS.
                None => Some(Dns {
                    capture_all: true,
                    v4: Vec::new(),
                    v6: Vec::new(),
                }),
                Some(servers) => {
                    let mut d = Dns {
                        capture_all: false,
                        v4: Vec::new(),
                        v6: Vec::new(),
                    };
                    for s in servers {
                        let ip: IpAddr = s
                            .trim()
                            .parse()
                            .with_context(|| format!("DNS server {s:?} is not an IP address"))?;
                        // Istio appends the prefix to the string as written.
                        if ip.is_ipv4() {
                            d.v4.push(format!("{}/32", s.trim()));
                        } else {
                            d.v6.push(format!("{}/128", s.trim()));
                        }
                    }
                    // REDIRECT_DNS without CAPTURE_ALL_DNS and without servers: istio turns DNS
                    // capture off.
                    (!d.v4.is_empty() || !d.v6.is_empty()).then_some(d)
                }
            }
        };

        Ok(Resolved {
            inbound_include,
            inbound_exclude,
            outbound_exclude,
            outbound_include,
            loopback_included: include.v4_loopback || include.v6_loopback,
            include,
            exclude,
            exclude_interfaces: names(&self.exclude_interfaces),
            reroute_interfaces: names(&self.reroute_virtual_interfaces),
            dns,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum InboundInclude {
    Off,
    All,
    Ports(Vec<String>),
}

pub(super) struct Dns {
    pub(super) capture_all: bool,
    pub(super) v4: Vec<String>,
    pub(super) v6: Vec<String>,
}

pub(super) struct Resolved {
    pub(super) inbound_include: InboundInclude,
    pub(super) inbound_exclude: Vec<String>,
    pub(super) outbound_exclude: Vec<String>,
    pub(super) outbound_include: Vec<String>,
    pub(super) include: Ranges,
    pub(super) exclude: Ranges,
    /// A loopback CIDR in the include list of either family drops the "loopback from non-proxy
    /// returns" rules of both families.
    pub(super) loopback_included: bool,
    pub(super) exclude_interfaces: Vec<String>,
    pub(super) reroute_interfaces: Vec<String>,
    pub(super) dns: Option<Dns>,
}

#[derive(Default)]
pub(super) struct Ranges {
    pub(super) wildcard: bool,
    pub(super) v4: Vec<String>,
    pub(super) v6: Vec<String>,
    pub(super) v4_loopback: bool,
    pub(super) v6_loopback: bool,
}

impl Ranges {
    pub(super) fn family(&self, fam: Family) -> &[String] {
        match fam {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }
}

/// Splits a comma list the way istio does (empty items dropped). Items are also trimmed.
fn names(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// A port list. istio-cni rejects items that are not u16 (and iptables would reject `*`).
fn ports(list: &str) -> Result<Vec<String>> {
    names(list)
        .into_iter()
        .map(|p| {
            p.parse::<u16>()
                .map(|n| n.to_string())
                .with_context(|| format!("port {p:?} is not a number in 0..=65535"))
        })
        .collect()
}

/// `SeparateV4V6`: `*` (exactly) is the wildcard for both families. Otherwise each CIDR goes to
/// its family, written as istio's netip.Prefix.String() writes it: canonical address, host bits
/// not masked.
fn split_ranges(list: &str) -> Result<Ranges> {
    let mut r = Ranges::default();
    if list.trim() == "*" {
        r.wildcard = true;
        return Ok(r);
    }
    for item in names(list) {
        let (addr, bits) = item
            .split_once('/')
            .with_context(|| format!("CIDR {item:?} has no prefix length"))?;
        let ip: IpAddr = addr
            .parse()
            .with_context(|| format!("CIDR {item:?}: bad address"))?;
        let bits: u8 = bits
            .parse()
            .with_context(|| format!("CIDR {item:?}: bad prefix length"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if bits > max {
            bail!("CIDR {item:?}: prefix length above {max}");
        }
        match ip {
            IpAddr::V4(a) => {
                r.v4_loopback |= a.is_loopback();
                r.v4.push(format!("{a}/{bits}"));
            }
            IpAddr::V6(a) => {
                r.v6_loopback |= a.is_loopback();
                r.v6.push(format!("{a}/{bits}"));
            }
        }
    }
    Ok(r)
}
