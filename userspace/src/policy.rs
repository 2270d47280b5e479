//! The per-pod capture policy, its list parsers (shared with the CNI plugin's annotation parsing),
//! and its translation into map entries.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv6Addr},
    str::FromStr,
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use sidestep_abi::{
    CIDR_KEY_FIXED_BITS, CidrKey, PodPolicy, PodSource, PortKey, ambient, cidr_list, defaults,
    flags, port_list,
};

pub use self::budget::{OverBudget, RuleList, too_many_ports};
use crate::limits::{MAX_POD_CIDR_RULES, MAX_POD_PORT_RULES};

/// A port list where `*` means every port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ListInput", into = "String")]
pub enum PortSet {
    All,
    Only(BTreeSet<u16>),
}

/// A CIDR list where `*` means every address of both families.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ListInput", into = "String")]
pub enum CidrSet {
    All,
    Only(Vec<IpNet>),
}

/// Lists arrive as Istio's comma-separated strings or as JSON arrays.
#[derive(Deserialize)]
#[serde(untagged)]
enum ListInput {
    Text(String),
    Items(Vec<String>),
}

impl ListInput {
    fn joined(self) -> String {
        match self {
            Self::Text(s) => s,
            Self::Items(v) => v.join(","),
        }
    }
}

impl TryFrom<ListInput> for PortSet {
    type Error = PolicyError;
    fn try_from(v: ListInput) -> Result<Self, Self::Error> {
        parse_port_set("port list", &v.joined())
    }
}

impl TryFrom<ListInput> for CidrSet {
    type Error = PolicyError;
    fn try_from(v: ListInput) -> Result<Self, Self::Error> {
        parse_cidr_set("CIDR list", &v.joined())
    }
}

impl From<PortSet> for String {
    fn from(p: PortSet) -> String {
        match p {
            PortSet::All => "*".into(),
            PortSet::Only(s) => s.iter().map(u16::to_string).collect::<Vec<_>>().join(","),
        }
    }
}

impl From<CidrSet> for String {
    fn from(c: CidrSet) -> String {
        match c {
            CidrSet::All => "*".into(),
            CidrSet::Only(v) => v.iter().map(IpNet::to_string).collect::<Vec<_>>().join(","),
        }
    }
}

impl PortSet {
    pub fn is_empty(&self) -> bool {
        matches!(self, Self::Only(s) if s.is_empty())
    }
    pub fn none() -> Self {
        Self::Only(BTreeSet::new())
    }
}

impl CidrSet {
    pub fn is_empty(&self) -> bool {
        matches!(self, Self::Only(v) if v.is_empty())
    }
}

fn items(text: &str) -> impl Iterator<Item = &str> {
    text.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// Parses one port (1-65535). `field` names the annotation or flag in the error.
pub fn parse_port(field: &str, text: &str) -> Result<u16, PolicyError> {
    match u16::from_str(text.trim()) {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(PolicyError::Port {
            field: field.into(),
            value: text.into(),
        }),
    }
}

/// Parses a comma-separated port list; `*` alone means all ports. More ports than one pod may
/// put in `SIDESTEP_PORTS` ([`MAX_POD_PORT_RULES`]) is an error.
pub fn parse_port_set(field: &str, text: &str) -> Result<PortSet, PolicyError> {
    if text.trim() == "*" {
        return Ok(PortSet::All);
    }
    let mut ports = BTreeSet::new();
    for item in items(text) {
        ports.insert(parse_port(field, item)?);
        if ports.len() > MAX_POD_PORT_RULES {
            return Err(budget::list_too_long(field, budget::Rules::Ports));
        }
    }
    Ok(PortSet::Only(ports))
}

/// Parses a comma-separated port list that may not be `*`.
pub fn parse_port_list(field: &str, text: &str) -> Result<BTreeSet<u16>, PolicyError> {
    match parse_port_set(field, text)? {
        PortSet::All => Err(PolicyError::Value {
            field: field.into(),
            value: text.into(),
            reason: "`*` is not allowed here".into(),
        }),
        PortSet::Only(s) => Ok(s),
    }
}

/// Parses a comma-separated CIDR list; `*` alone means everything. A bare address is a host route.
/// More distinct CIDRs than one pod may put in `SIDESTEP_CIDRS` ([`MAX_POD_CIDR_RULES`]) is an
/// error.
pub fn parse_cidr_set(field: &str, text: &str) -> Result<CidrSet, PolicyError> {
    if text.trim() == "*" {
        return Ok(CidrSet::All);
    }
    let mut nets = Vec::new();
    // A repeated CIDR is one map entry.
    let mut distinct = BTreeSet::new();
    for item in items(text) {
        let net = parse_cidr(field, item)?;
        if distinct.insert(net) && distinct.len() > MAX_POD_CIDR_RULES {
            return Err(budget::list_too_long(field, budget::Rules::Cidrs));
        }
        nets.push(net);
    }
    Ok(CidrSet::Only(nets))
}

/// The first dotted-quad octet written with a leading zero (`010`), if any. ipnet accepts such
/// octets as decimal, while inet_aton (iptables, Istio's Go tooling before 1.17) reads them as
/// octal, so `010.0.0.0/8` would mean 10/8 here and 8/8 there: refuse it instead of guessing.
pub fn leading_zero_octet(addr: &str) -> Option<&str> {
    // Only the IPv4 part: a plain address, or the tail of an IPv4-embedded IPv6 one.
    let v4 = addr.rsplit(':').next().filter(|s| s.contains('.'))?;
    v4.split('.')
        .find(|o| o.len() > 1 && o.starts_with('0') && o.bytes().all(|b| b.is_ascii_digit()))
}

pub fn parse_cidr(field: &str, text: &str) -> Result<IpNet, PolicyError> {
    let err = |reason: String| PolicyError::Cidr {
        field: field.into(),
        value: text.into(),
        reason,
    };
    let addr = text.split_once('/').map_or(text, |(a, _)| a);
    if let Some(octet) = leading_zero_octet(addr) {
        return Err(err(format!(
            "octet {octet:?} has a leading zero, which other parsers read as octal"
        )));
    }
    if text.contains('/') {
        let net = IpNet::from_str(text).map_err(|e| err(e.to_string()))?;
        Ok(net.trunc())
    } else {
        IpAddr::from_str(text)
            .map(IpNet::from)
            .map_err(|e| err(e.to_string()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum InterceptionMode {
    #[default]
    Redirect,
    Tproxy,
}

impl FromStr for InterceptionMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "REDIRECT" => Ok(Self::Redirect),
            "TPROXY" => Ok(Self::Tproxy),
            other => Err(format!("{other:?} is not REDIRECT or TPROXY")),
        }
    }
}

/// Where inbound capture hooks in. Both hand a captured SYN to the proxy's listener with the
/// original destination as its local address (`bpf_sk_assign`), so the proxy cannot tell them
/// apart; they differ in cost and in what they need (docs/ARCHITECTURE.md, "Inbound hooks").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InboundHook {
    /// A tc ingress program on each captured interface (TCX links, pinned per pod), plus the
    /// per-netns sk_lookup program for SYNs onto a TIME_WAIT 4-tuple.
    Tc,
    /// The default: only the per-netns sk_lookup program: no per-packet program, and no TCX
    /// attach (each of which waits for an RCU grace period) in ADD and DEL. The proxy's listener
    /// must have been opened under the loaded sockops program, which holds for every pod enrolled
    /// before its proxy starts (the plugin and `sidestep enroll` fall back to `tc` otherwise).
    #[default]
    SkLookup,
}

impl InboundHook {
    /// The hook an enrolled pod entry's flags say it has; `None` without inbound capture.
    pub fn of_pod_flags(pod_flags: u32) -> Option<Self> {
        if pod_flags & flags::INBOUND == 0 {
            None
        } else if pod_flags & flags::INBOUND_SK_LOOKUP != 0 {
            Some(Self::SkLookup)
        } else {
            Some(Self::Tc)
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tc => "tc",
            Self::SkLookup => "sk_lookup",
        }
    }
}

impl FromStr for InboundHook {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tc" => Ok(Self::Tc),
            "sk_lookup" => Ok(Self::SkLookup),
            other => Err(format!("{other:?} is not tc or sk_lookup")),
        }
    }
}

/// One pod's capture policy. The JSON form (`--policy FILE`, the CNI `policy` object) uses these
/// camelCase names; lists take Istio's comma-separated strings or arrays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct Policy {
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub dns_port: u16,
    pub interception_mode: InterceptionMode,
    #[serde(rename = "includeOutboundIPRanges")]
    pub include_outbound_ip_ranges: CidrSet,
    #[serde(rename = "excludeOutboundIPRanges")]
    pub exclude_outbound_ip_ranges: CidrSet,
    pub include_outbound_ports: PortSet,
    pub exclude_outbound_ports: PortSet,
    pub include_inbound_ports: PortSet,
    pub exclude_inbound_ports: PortSet,
    pub exclude_interfaces: Vec<String>,
    pub reroute_virtual_interfaces: Vec<String>,
    pub dns_capture: bool,
    /// IPv6 outbound capture. On by default: an IPv6 connect from a v4-only pod then fails at the
    /// proxy instead of leaving the pod uncaptured (istio-iptables installs no ip6tables rules).
    pub capture_ipv6: bool,
    /// The pod's own addresses: how the inbound programs find the pod a connection is for (the
    /// sk_lookup hook has nothing else), and what counts as the pod itself (`-o lo`).
    #[serde(rename = "podIPs")]
    pub pod_ips: Vec<IpAddr>,
    /// Istio's hairpin: the proxy calling its own pod's address goes to the inbound port. Linkerd
    /// has none (its rules skip the proxy and loopback wholesale). Written only when off.
    #[serde(skip_serializing_if = "is_true")]
    pub hairpin: bool,
    /// App <-> proxy bytes on loopback go socket to socket (sk_msg); off by default until the
    /// benchmark shows it wins everywhere.
    pub sk_msg: bool,
    /// The programs log each of this pod's verdicts (`sidestep.io/debug`); written only when on.
    #[serde(skip_serializing_if = "is_false")]
    pub debug: bool,
    /// Set from the plugin's (or the CLI's) configuration, not from annotations.
    /// Read as `tc` when absent: only records of versions before the choice existed lack it,
    /// and those enrolled with tc.
    #[serde(default = "tc_when_unrecorded")]
    pub inbound_hook: InboundHook,
    /// Istio ambient mode: the proxy is ztunnel in its own pod, known by its socket mark, and
    /// the decision is istio-cni's in-pod ruleset ([`Policy::istio_ambient`]). Written only
    /// when on.
    #[serde(skip_serializing_if = "is_false")]
    pub ambient: bool,
}

impl Default for Policy {
    /// Istio's defaults: capture every outbound destination and every inbound port.
    fn default() -> Self {
        Self {
            proxy_uid: defaults::PROXY_UID,
            proxy_gid: defaults::PROXY_GID,
            outbound_port: defaults::OUTBOUND_PORT,
            inbound_port: defaults::INBOUND_PORT,
            dns_port: defaults::DNS_PORT,
            interception_mode: InterceptionMode::Redirect,
            include_outbound_ip_ranges: CidrSet::All,
            exclude_outbound_ip_ranges: CidrSet::Only(Vec::new()),
            include_outbound_ports: PortSet::none(),
            exclude_outbound_ports: PortSet::none(),
            include_inbound_ports: PortSet::All,
            exclude_inbound_ports: PortSet::none(),
            exclude_interfaces: Vec::new(),
            reroute_virtual_interfaces: Vec::new(),
            dns_capture: false,
            capture_ipv6: true,
            pod_ips: Vec::new(),
            hairpin: true,
            sk_msg: false,
            debug: false,
            inbound_hook: InboundHook::SkLookup,
            ambient: false,
        }
    }
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn tc_when_unrecorded() -> InboundHook {
    InboundHook::Tc
}

/// Everything one pod puts in the maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntries {
    pub pod: PodPolicy,
    pub ports: Vec<PortKey>,
    /// (prefix length in bits, key data)
    pub cidrs: Vec<(u32, CidrKey)>,
    /// The pod's addresses as IPv6 words in network byte order (IPv4 mapped), for tc ingress.
    pub addresses: Vec<[u32; 4]>,
    /// The source a captured app socket is bound to (`SIDESTEP_SRC`).
    pub source: PodSource,
}

/// The first address of each family in `candidates` that can be a pod's source for any
/// destination: not loopback, unspecified, link-local or multicast. All-zero words for a family
/// with none.
pub fn pod_source<'a>(candidates: impl IntoIterator<Item = &'a IpAddr>) -> PodSource {
    let mut source = PodSource::default();
    for ip in candidates {
        let usable = match ip {
            IpAddr::V4(v4) => {
                !(v4.is_loopback()
                    || v4.is_unspecified()
                    || v4.is_link_local()
                    || v4.is_multicast())
            }
            IpAddr::V6(v6) => {
                !(v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_unicast_link_local()
                    || v6.is_multicast()
                    || v6.to_ipv4_mapped().is_some())
            }
        };
        let slot = if ip.is_ipv4() {
            &mut source.addr4
        } else {
            &mut source.addr6
        };
        if usable && *slot == [0; 4] {
            *slot = address_words(ip);
        }
    }
    source
}

/// The address an entry of `SIDESTEP_ADDRS` names ([`address_words`] reversed).
pub fn words_address(words: &[u32; 4]) -> IpAddr {
    let mut o = [0u8; 16];
    for (i, w) in words.iter().enumerate() {
        o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
    }
    let v6 = Ipv6Addr::from(o);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

/// An address as the programs see it: IPv6 words in network byte order, IPv4 mapped.
pub fn address_words(ip: &IpAddr) -> [u32; 4] {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => *v6,
    };
    let o = v6.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

pub(crate) fn cidr_entry(netns_cookie: u64, list: u32, net: &IpNet) -> (u32, CidrKey) {
    let (addr, bits) = match net {
        IpNet::V4(n) => (n.network().to_ipv6_mapped(), 96 + u32::from(n.prefix_len())),
        IpNet::V6(n) => (n.network(), u32::from(n.prefix_len())),
    };
    (
        CIDR_KEY_FIXED_BITS + bits,
        CidrKey::new(netns_cookie, list, addr.octets()),
    )
}

fn all_addresses() -> IpNet {
    IpNet::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0).expect("/0 is a valid prefix")
}

impl Policy {
    /// istio-cni's in-pod rules for an ambient pod: every outbound TCP destination off the pod
    /// to ztunnel's 15001, every inbound TCP port but HBONE's 15008 to its 15006, DNS to its
    /// 15053 when `dns_capture` (Istio's `ambient.dnsCapture`, on by default), ztunnel's own
    /// sockets by their mark. `bypass_inbound` is `ambient.istio.io/bypass-inbound-capture`.
    pub fn istio_ambient(dns_capture: bool, bypass_inbound: bool) -> Self {
        Self {
            include_inbound_ports: if bypass_inbound {
                PortSet::none()
            } else {
                PortSet::All
            },
            dns_capture,
            hairpin: false,
            ambient: true,
            ..Self::default()
        }
    }

    /// Checks what serde cannot: values that parse but make no sense together, and lists that
    /// together take more than the pod's share of the node-wide rule maps.
    pub fn validate(&self) -> Result<(), PolicyError> {
        for (field, port) in [
            ("outboundPort", self.outbound_port),
            ("inboundPort", self.inbound_port),
            ("dnsPort", self.dns_port),
        ] {
            if port == 0 {
                return Err(PolicyError::Port {
                    field: field.into(),
                    value: "0".into(),
                });
            }
        }
        if self.ambient {
            self.validate_ambient()?;
        }
        if self.outbound_port == self.inbound_port {
            return Err(PolicyError::Value {
                field: "inboundPort".into(),
                value: self.inbound_port.to_string(),
                reason: "must differ from outboundPort".into(),
            });
        }
        self.check_budget()?;
        Ok(())
    }

    /// istio-cni's in-pod rules have none of the sidecar's traffic options: a policy that sets
    /// one with `ambient` would be silently ignored, so it is refused.
    fn validate_ambient(&self) -> Result<(), PolicyError> {
        let refuse = |field: &str, value: String| {
            Err(PolicyError::Value {
                field: field.into(),
                value,
                reason: "ambient mode applies istio-cni's in-pod rules, which have no such option"
                    .into(),
            })
        };
        if self.interception_mode == InterceptionMode::Tproxy {
            return refuse("interceptionMode", "TPROXY".into());
        }
        if self.include_outbound_ip_ranges != CidrSet::All {
            return refuse(
                "includeOutboundIPRanges",
                format!("{:?}", self.include_outbound_ip_ranges),
            );
        }
        let unset_cidrs = |c: &CidrSet| matches!(c, CidrSet::Only(v) if v.is_empty());
        let unset_ports = |p: &PortSet| matches!(p, PortSet::Only(v) if v.is_empty());
        if !unset_cidrs(&self.exclude_outbound_ip_ranges) {
            return refuse(
                "excludeOutboundIPRanges",
                format!("{:?}", self.exclude_outbound_ip_ranges),
            );
        }
        for (field, ports) in [
            ("includeOutboundPorts", &self.include_outbound_ports),
            ("excludeOutboundPorts", &self.exclude_outbound_ports),
            ("excludeInboundPorts", &self.exclude_inbound_ports),
        ] {
            if !unset_ports(ports) {
                return refuse(field, format!("{ports:?}"));
            }
        }
        if !matches!(self.include_inbound_ports, PortSet::All)
            && !unset_ports(&self.include_inbound_ports)
        {
            return refuse(
                "includeInboundPorts",
                format!("{:?}", self.include_inbound_ports),
            );
        }
        if !self.exclude_interfaces.is_empty() {
            return refuse("excludeInterfaces", self.exclude_interfaces.join(","));
        }
        Ok(())
    }

    /// Inbound ports that are never captured: Istio's fixed four plus the pod's own (ambient:
    /// HBONE's 15008 alone).
    pub fn effective_inbound_excludes(&self) -> BTreeSet<u16> {
        let fixed: &[u16] = if self.ambient {
            &ambient::EXCLUDED_INBOUND
        } else {
            &defaults::ALWAYS_EXCLUDED_INBOUND
        };
        let mut ports: BTreeSet<u16> = fixed.iter().copied().collect();
        if let PortSet::Only(own) = &self.exclude_inbound_ports {
            ports.extend(own);
        }
        ports
    }

    pub fn to_map_entries(&self, netns_cookie: u64) -> MapEntries {
        let mut f = 0;
        let mut ports = Vec::new();
        let port_key = |list, port: u16| PortKey {
            netns_cookie,
            list,
            port: u32::from(port),
        };
        match &self.include_inbound_ports {
            PortSet::All => f |= flags::INBOUND | flags::INBOUND_ALL_PORTS,
            PortSet::Only(s) if !s.is_empty() => {
                f |= flags::INBOUND;
                ports.extend(s.iter().map(|p| port_key(port_list::INBOUND_INCLUDE, *p)));
            }
            PortSet::Only(_) => {}
        }
        // istio-iptables installs the hairpin (the proxy calling its own pod goes to the
        // inbound listener) whether or not any inbound port is captured: with
        // `includeInboundPorts: ""` the validation init container still dials through it.
        if self.hairpin && !self.ambient {
            f |= flags::HAIRPIN;
        }
        if f & flags::INBOUND != 0 {
            ports.extend(
                self.effective_inbound_excludes()
                    .into_iter()
                    .map(|p| port_key(port_list::INBOUND_EXCLUDE, p)),
            );
        }
        if let PortSet::Only(s) = &self.exclude_outbound_ports
            && !s.is_empty()
        {
            f |= flags::HAS_OUT_PORT_EXCLUDES;
            ports.extend(s.iter().map(|p| port_key(port_list::OUTBOUND_EXCLUDE, *p)));
        }
        match &self.include_outbound_ports {
            PortSet::Only(s) if !s.is_empty() => {
                f |= flags::OUTBOUND | flags::HAS_OUT_PORT_INCLUDES;
                ports.extend(s.iter().map(|p| port_key(port_list::OUTBOUND_INCLUDE, *p)));
            }
            // "*" for outbound ports is the same as including every range.
            PortSet::All => f |= flags::OUTBOUND,
            PortSet::Only(_) => {}
        }

        let mut cidrs = Vec::new();
        match &self.include_outbound_ip_ranges {
            CidrSet::All => {
                f |= flags::OUTBOUND | flags::OUTBOUND_ALL_RANGES;
                cidrs.push(cidr_entry(
                    netns_cookie,
                    cidr_list::OUTBOUND_INCLUDE,
                    &all_addresses(),
                ));
            }
            CidrSet::Only(v) => {
                if !v.is_empty() {
                    f |= flags::OUTBOUND;
                }
                cidrs.extend(
                    v.iter()
                        .map(|n| cidr_entry(netns_cookie, cidr_list::OUTBOUND_INCLUDE, n)),
                );
            }
        }
        if matches!(self.include_outbound_ports, PortSet::All) {
            f |= flags::OUTBOUND_ALL_RANGES;
            cidrs.push(cidr_entry(
                netns_cookie,
                cidr_list::OUTBOUND_INCLUDE,
                &all_addresses(),
            ));
        }
        match &self.exclude_outbound_ip_ranges {
            CidrSet::All => {
                // Excluding everything leaves only hairpin and DNS; keep it explicit in the trie.
                f |= flags::HAS_OUT_CIDR_EXCLUDES;
                cidrs.push(cidr_entry(
                    netns_cookie,
                    cidr_list::OUTBOUND_EXCLUDE,
                    &all_addresses(),
                ));
            }
            CidrSet::Only(v) if !v.is_empty() => {
                f |= flags::HAS_OUT_CIDR_EXCLUDES;
                cidrs.extend(
                    v.iter()
                        .map(|n| cidr_entry(netns_cookie, cidr_list::OUTBOUND_EXCLUDE, n)),
                );
            }
            CidrSet::Only(_) => {}
        }
        if self.dns_capture {
            f |= flags::DNS_CAPTURE;
        }
        if self.interception_mode == InterceptionMode::Tproxy {
            f |= flags::TPROXY;
        }
        if self.capture_ipv6 {
            f |= flags::IPV6;
        }
        if self.sk_msg {
            f |= flags::SK_MSG;
        }
        if self.debug {
            f |= flags::DEBUG;
        }
        if self.inbound_hook == InboundHook::SkLookup {
            f |= flags::INBOUND_SK_LOOKUP;
        }
        if self.ambient {
            f |= flags::AMBIENT;
        }
        // Inbound capture is netns-wide, with the excluded interfaces listed apart.
        f |= flags::NETNS_WIDE;
        if !self.exclude_interfaces.is_empty() {
            f |= flags::HAS_EXCLUDED_IFACES;
        }
        cidrs.sort_by_key(|c| (c.0, c.1.list_be, c.1.addr));
        cidrs.dedup();
        ports.sort_by_key(|k| (k.list, k.port));
        ports.dedup();
        MapEntries {
            pod: PodPolicy {
                // Ambient: ztunnel's mark and mask in the identity fields (sidestep_abi::ambient).
                proxy_uid: if self.ambient {
                    ambient::MARK
                } else {
                    self.proxy_uid
                },
                proxy_gid: if self.ambient {
                    ambient::MARK_MASK
                } else {
                    self.proxy_gid
                },
                outbound_port: self.outbound_port,
                inbound_port: self.inbound_port,
                dns_port: self.dns_port,
                _reserved: 0,
                flags: f,
            },
            ports,
            cidrs,
            addresses: self.pod_ips.iter().map(address_words).collect(),
            source: pod_source(&self.pod_ips),
        }
    }
}

pub mod ambient_selectors;
mod budget;

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{field}: invalid port {value:?} (want 1-65535)")]
    Port { field: String, value: String },
    #[error("{field}: invalid CIDR {value:?} ({reason})")]
    Cidr {
        field: String,
        value: String,
        reason: String,
    },
    #[error("{field}: invalid value {value:?} ({reason})")]
    Value {
        field: String,
        value: String,
        reason: String,
    },
    /// One list alone past the pod's share of its node-wide map, found while parsing it (so a
    /// list of thousands is never built).
    #[error(
        "{field}: more than {limit} {what}, the most one pod's lists may put in {map} \
         (docs/REFERENCE.md, \"Per-pod map budgets\")"
    )]
    TooLong {
        field: String,
        what: &'static str,
        limit: usize,
        map: &'static str,
    },
    /// The pod's lists together past its share of a node-wide map.
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
}

#[cfg(test)]
mod tests;
