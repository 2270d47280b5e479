//! A model of the iptables rules that Istio's `istio-iptables` installs in a sidecar pod's network
//! namespace. The differential tests use it as the oracle that sidestep's eBPF redirection is
//! compared against.
//!
//! The model follows istio/istio at 86c9f01 (1.31 development; the rule text has not changed since
//! 1.25.0). Sources:
//! - `tools/istio-iptables/pkg/capture/run.go`: the rules and the order in which they are added.
//! - `tools/istio-iptables/pkg/builder/iptables_builder_impl.go`: how they become
//!   `iptables-restore` input (`-N` lines, table order).
//! - `tools/common/config/config.go`: IPv6 detection, CIDR family split, loopback detection.
//! - `tools/common/tproxy/run_linux.go`: `ip rule`, `ip route` and the `::6` address.
//! - `cni/pkg/plugin/sidecar_redirect.go` and `sidecar_iptables_linux.go`: annotation defaults and
//!   the CNI-mode settings.
//! - The goldens in `tools/istio-iptables/pkg/capture/testdata/` and `cni/pkg/plugin/testdata/`.
//!
//! The model takes the **istio-cni** (sidecar-mode CNI plugin) view of the options, because that is
//! the component sidestep replaces:
//! - `exclude_inbound_ports` gets `15020,15021,15090` appended, with duplicates removed.
//! - DNS capture means "capture all DNS" (`CAPTURE_ALL_DNS=true`): every port-53 packet from a
//!   non-proxy owner is captured, whatever its destination.
//! - The proxy has exactly one UID and one GID.
//! - `INVALID_DROP`, owner-group filters and `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR` keep their
//!   defaults: no `ISTIO_DROP`, no owner-group rules, loopback `127.0.0.1/32`.
//!
//! The istio-init container's resolv.conf-based DNS capture is available through
//! [`IstioCapture::iptables_restore_with_dns_servers`].
//!
//! Istio feeds the output to `iptables-restore --noflush` (see [`RESTORE_FLAGS`]). It runs the
//! v6 restore only when IPv6 is enabled for the pod. The `ipv6` field stands in for istio's own
//! detection: without `ISTIO_DUAL_STACK`, IPv6 is enabled only when the first non-loopback,
//! non-link-local address in the netns is IPv6; with it, when any such address is IPv6.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use anyhow::{Context, Result, bail};

/// HBONE tunnel port. Istio's REDIRECT rules never capture it (it is not in the TPROXY mangle
/// chain, see [`IstioCapture::iptables_restore_v4`]).
pub const TUNNEL_PORT: u16 = 15008;
/// Ports that istio-cni always adds to `excludeInboundPorts`: status/merged metrics, health,
/// Envoy Prometheus.
pub const ALWAYS_EXCLUDED_INBOUND_PORTS: [u16; 3] = [15020, 15021, 15090];
/// Default of the `excludeInboundPorts` and `excludeOutboundPorts` annotations in istio-cni.
pub const DEFAULT_EXCLUDED_PORT: &str = "15020";
/// The fwmark that TPROXY and `ISTIO_DIVERT` set, and that the policy-routing rule matches.
pub const TPROXY_MARK: u32 = 1337;
/// In TPROXY mode, the mark on packets the proxy sends to the pod over `lo` (mangle OUTPUT), so
/// that `ISTIO_INBOUND` captures them.
pub const OUTBOUND_MARK: u32 = 1338;
/// Routing table for TPROXY'd packets (`local default dev lo`).
pub const TPROXY_ROUTE_TABLE: u32 = 133;
/// Flags that istio passes to `iptables-restore` / `ip6tables-restore`.
pub const RESTORE_FLAGS: [&str; 1] = ["--noflush"];

/// The loopback destination that is never captured (`HostIPv4LoopbackCidr` default).
const LOOPBACK_V4: &str = "127.0.0.1/32";
const LOOPBACK_V6: &str = "::1/128";
/// The source address the proxy uses for inbound passthrough (never captured).
const PASSTHROUGH_V4: &str = "127.0.0.6/32";
const PASSTHROUGH_V6: &str = "::6/128";

const ISTIO_INBOUND: &str = "ISTIO_INBOUND";
const ISTIO_IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
const ISTIO_OUTPUT: &str = "ISTIO_OUTPUT";
const ISTIO_OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
const ISTIO_REDIRECT: &str = "ISTIO_REDIRECT";
const ISTIO_DIVERT: &str = "ISTIO_DIVERT";
const ISTIO_TPROXY: &str = "ISTIO_TPROXY";

/// Chains and targets that are never created with `-N`.
const BUILTIN: [&str; 8] = [
    "INPUT",
    "OUTPUT",
    "FORWARD",
    "PREROUTING",
    "POSTROUTING",
    "ACCEPT",
    "RETURN",
    "DROP",
];

/// Inbound interception mode (`sidecar.istio.io/interceptionMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// nat REDIRECT to the inbound port. The app sees 127.0.0.6 as the client address.
    #[default]
    Redirect,
    /// mangle TPROXY plus policy routing. The original source address is kept.
    Tproxy,
}

/// The options of one istio-cni / istio-iptables run. Lists are comma-separated strings, as in
/// the pod annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IstioCapture {
    /// `-u`: the proxy UID, which is never captured outbound.
    pub proxy_uid: u32,
    /// `-g`: the proxy GID, which is never captured outbound.
    pub proxy_gid: u32,
    /// `-p`: the outbound listener (ISTIO_REDIRECT target).
    pub outbound_port: u16,
    /// `-z`: the inbound listener (ISTIO_IN_REDIRECT and TPROXY target).
    pub inbound_port: u16,
    /// The istio-agent DNS listener. Istio hard-codes 15053.
    pub dns_port: u16,
    /// `-m`.
    pub mode: Mode,
    /// `-i`: `*`, or a list of CIDRs of either family. An empty string captures no outbound
    /// traffic by destination.
    pub include_outbound_ip_ranges: String,
    /// `-x`: CIDRs of either family. `*` is invalid.
    pub exclude_outbound_ip_ranges: String,
    /// `-b`: `*`, a port list, or empty (no inbound capture at all).
    pub include_inbound_ports: String,
    /// `-d`: user list. It applies only when `include_inbound_ports` is `*`.
    /// [`ALWAYS_EXCLUDED_INBOUND_PORTS`] are appended.
    pub exclude_inbound_ports: String,
    /// `-q`: TCP ports captured outbound even when their destination is not in the included
    /// ranges.
    pub include_outbound_ports: String,
    /// `-o`: ports (TCP and UDP) never captured outbound. The istio-cni default is `15020`.
    pub exclude_outbound_ports: String,
    /// `-c`: interfaces on which neither inbound (PREROUTING) nor outbound (OUTPUT) is captured.
    pub exclude_interfaces: String,
    /// `-k`: inbound on these interfaces is treated as outbound (to ISTIO_REDIRECT).
    pub reroute_virtual_interfaces: String,
    /// `ISTIO_META_DNS_CAPTURE=true` on the istio-proxy container. In CNI mode this also sets
    /// capture-all-DNS.
    pub dns_capture: bool,
    /// The pod gets IPv6 rules (istio: `EnableIPv6`, detected from the pod's addresses).
    pub ipv6: bool,
}

impl Default for IstioCapture {
    /// istio-cni defaults for a pod without traffic annotations.
    fn default() -> Self {
        IstioCapture {
            proxy_uid: 1337,
            proxy_gid: 1337,
            outbound_port: 15001,
            inbound_port: 15006,
            dns_port: 15053,
            mode: Mode::Redirect,
            include_outbound_ip_ranges: "*".into(),
            exclude_outbound_ip_ranges: String::new(),
            include_inbound_ports: "*".into(),
            exclude_inbound_ports: DEFAULT_EXCLUDED_PORT.into(),
            include_outbound_ports: String::new(),
            exclude_outbound_ports: DEFAULT_EXCLUDED_PORT.into(),
            exclude_interfaces: String::new(),
            reroute_virtual_interfaces: String::new(),
            dns_capture: false,
            ipv6: false,
        }
    }
}

impl IstioCapture {
    /// `iptables-restore` input for IPv4: the mangle (TPROXY only), nat and raw (DNS only)
    /// tables, in that order, exactly as istio produces it. Panics if the options are invalid
    /// (istio-cni would fail the ADD); use [`Self::try_iptables_restore_v4`] to get the error.
    pub fn iptables_restore_v4(&self) -> String {
        self.try_iptables_restore_v4()
            .expect("invalid IstioCapture options")
    }

    /// `ip6tables-restore` input. It uses `::6` and `::1` and the IPv6 halves of the CIDR lists.
    /// When `ipv6` is false it is empty: istio builds no v6 rules and never runs
    /// `ip6tables-restore`, so IPv6 traffic is not captured at all.
    pub fn iptables_restore_v6(&self) -> String {
        self.try_iptables_restore_v6()
            .expect("invalid IstioCapture options")
    }

    /// Commands that istio runs after iptables (`tproxy.ConfigureRoutes`), as argv vectors:
    /// - with `ipv6`, in either mode: `ip -6 addr add ::6/128 dev lo` (istio ignores "exists");
    /// - with TPROXY and non-empty `include_inbound_ports`: `ip rule add fwmark 1337 lookup 133`
    ///   (and `-6` with `ipv6`), then `ip route add local default dev lo table 133` (and `-6`).
    pub fn route_commands(&self) -> Vec<Vec<String>> {
        let argv = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let mut cmds = Vec::new();
        if self.ipv6 {
            cmds.push(argv("ip -6 addr add ::6/128 dev lo"));
        }
        if self.mode == Mode::Tproxy && !self.include_inbound_ports.trim().is_empty() {
            let rule = format!("rule add fwmark {TPROXY_MARK} lookup {TPROXY_ROUTE_TABLE}");
            cmds.push(argv(&format!("ip {rule}")));
            if self.ipv6 {
                cmds.push(argv(&format!("ip -6 {rule}")));
            }
            let route = format!("route add local default dev lo table {TPROXY_ROUTE_TABLE}");
            cmds.push(argv(&format!("ip {route}")));
            if self.ipv6 {
                cmds.push(argv(&format!("ip -6 {route}")));
            }
        }
        cmds
    }

    /// Like [`Self::iptables_restore_v4`], with the error instead of a panic.
    pub fn try_iptables_restore_v4(&self) -> Result<String> {
        Ok(render(&self.rules(Family::V4, None)?))
    }

    /// Like [`Self::iptables_restore_v6`], with the error instead of a panic.
    pub fn try_iptables_restore_v6(&self) -> Result<String> {
        if !self.ipv6 {
            // Still check the options: istio parses the lists before choosing families.
            self.resolve(None)?;
            return Ok(String::new());
        }
        Ok(render(&self.rules(Family::V6, None)?))
    }

    /// The restore input when istio-iptables runs in the istio-init container instead of
    /// istio-cni. There, `ISTIO_META_DNS_CAPTURE` sets only `REDIRECT_DNS`, so DNS is captured
    /// only to the resolv.conf `dns_servers` of that family (`-d <server>/32`, or `/128`). If there
    /// are no servers at all, DNS capture is turned off, and the hairpin and loopback rules lose
    /// their port-53 exceptions. Everything else is as in [`Self::iptables_restore_v4`]. It has
    /// an effect only when `dns_capture` is set. The port lists keep their CNI merging here; the
    /// injector passes `-d 15090,15021,<statusPort>[,<user excludes>]` instead.
    pub fn iptables_restore_with_dns_servers(
        &self,
        ipv6: bool,
        dns_servers: &[&str],
    ) -> Result<String> {
        if ipv6 && !self.ipv6 {
            return Ok(String::new());
        }
        let fam = if ipv6 { Family::V6 } else { Family::V4 };
        Ok(render(&self.rules(fam, Some(dns_servers))?))
    }

    /// The rules of one chain in the order the kernel holds them once the restore has run
    /// (`-I` applied). Each is the rule text after `-A CHAIN`, in istio's spelling, not in
    /// iptables-save's canonical form (save adds `-m tcp` and so on).
    pub fn effective_chain(&self, ipv6: bool, table: &str, chain: &str) -> Vec<String> {
        if ipv6 && !self.ipv6 {
            return Vec::new();
        }
        let fam = if ipv6 { Family::V6 } else { Family::V4 };
        let rules = self.rules(fam, None).expect("invalid IstioCapture options");
        let mut out: Vec<String> = Vec::new();
        for r in rules
            .iter()
            .filter(|r| r.table == table && r.chain == chain)
        {
            let text = r.args.join(" ");
            match r.insert_at {
                Some(pos) => out.insert((pos as usize - 1).min(out.len()), text),
                None => out.push(text),
            }
        }
        out
    }

    /// Checks the options as istio-cni / istio-iptables would. Ports must parse as u16. CIDRs
    /// must parse. `exclude_outbound_ip_ranges` must not be `*`.
    pub fn validate(&self) -> Result<()> {
        self.resolve(None).map(|_| ())
    }

    fn resolve(&self, dns_servers: Option<&[&str]>) -> Result<Resolved> {
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

    /// The rules of one family, in the order istio-iptables adds them.
    fn rules(&self, fam: Family, dns_servers: Option<&[&str]>) -> Result<Vec<Rule>> {
        let c = self.resolve(dns_servers)?;
        let v6 = fam == Family::V6;
        let tproxy = self.mode == Mode::Tproxy;
        let lo_dst = if v6 { LOOPBACK_V6 } else { LOOPBACK_V4 };
        let passthrough = if v6 { PASSTHROUGH_V6 } else { PASSTHROUGH_V4 };
        let (uid, gid) = (self.proxy_uid, self.proxy_gid);
        let (out_port, in_port, dns_port) = (self.outbound_port, self.inbound_port, self.dns_port);
        let mut r = Rules::default();

        // Interfaces that are never captured: nat, plus mangle for TPROXY.
        for nic in &c.exclude_interfaces {
            r.add(NAT, "PREROUTING", format!("-i {nic} -j RETURN"));
            r.add(NAT, "OUTPUT", format!("-o {nic} -j RETURN"));
        }
        if tproxy {
            for nic in &c.exclude_interfaces {
                r.add(MANGLE, "PREROUTING", format!("-i {nic} -j RETURN"));
                r.add(MANGLE, "OUTPUT", format!("-o {nic} -j RETURN"));
            }
        }
        // Rerouted virtual interfaces skip inbound capture. Each is inserted at the top, so the
        // last one listed ends up first.
        for nic in &c.reroute_interfaces {
            r.insert(NAT, "PREROUTING", 1, format!("-i {nic} -j RETURN"));
        }

        // Shared chains. The tunnel-port RETURN is created even when nothing jumps to
        // ISTIO_INBOUND in nat.
        r.add(
            NAT,
            ISTIO_INBOUND,
            format!("-p tcp --dport {TUNNEL_PORT} -j RETURN"),
        );
        r.add(
            NAT,
            ISTIO_REDIRECT,
            format!("-p tcp -j REDIRECT --to-ports {out_port}"),
        );
        r.add(
            NAT,
            ISTIO_IN_REDIRECT,
            format!("-p tcp -j REDIRECT --to-ports {in_port}"),
        );

        // Inbound.
        if c.inbound_include != InboundInclude::Off {
            let table = if tproxy {
                r.add(
                    MANGLE,
                    ISTIO_DIVERT,
                    format!("-j MARK --set-mark {TPROXY_MARK}"),
                );
                r.add(MANGLE, ISTIO_DIVERT, "-j ACCEPT".into());
                r.add(
                    MANGLE,
                    ISTIO_TPROXY,
                    format!(
                        "! -d {lo_dst} -p tcp -j TPROXY --tproxy-mark {TPROXY_MARK}/0xffffffff \
                         --on-port {in_port}"
                    ),
                );
                MANGLE
            } else {
                NAT
            };
            r.add(table, "PREROUTING", format!("-p tcp -j {ISTIO_INBOUND}"));
            match &c.inbound_include {
                InboundInclude::All => {
                    for p in &c.inbound_exclude {
                        r.add(
                            table,
                            ISTIO_INBOUND,
                            format!("-p tcp --dport {p} -j RETURN"),
                        );
                    }
                    if tproxy {
                        r.add(
                            MANGLE,
                            ISTIO_INBOUND,
                            format!(
                                "-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j {ISTIO_DIVERT}"
                            ),
                        );
                        r.add(MANGLE, ISTIO_INBOUND, format!("-p tcp -j {ISTIO_TPROXY}"));
                    } else {
                        r.add(NAT, ISTIO_INBOUND, format!("-p tcp -j {ISTIO_IN_REDIRECT}"));
                    }
                }
                InboundInclude::Ports(list) => {
                    for p in list {
                        if tproxy {
                            r.add(
                                MANGLE,
                                ISTIO_INBOUND,
                                format!(
                                    "-p tcp --dport {p} -m conntrack --ctstate RELATED,ESTABLISHED \
                                     -j {ISTIO_DIVERT}"
                                ),
                            );
                            r.add(
                                MANGLE,
                                ISTIO_INBOUND,
                                format!("-p tcp --dport {p} -j {ISTIO_TPROXY}"),
                            );
                        } else {
                            r.add(
                                NAT,
                                ISTIO_INBOUND,
                                format!("-p tcp --dport {p} -j {ISTIO_IN_REDIRECT}"),
                            );
                        }
                    }
                }
                InboundInclude::Off => unreachable!(),
            }
        }

        // Outbound. All protocols jump; only TCP is redirected, except DNS.
        r.add(NAT, "OUTPUT", format!("-j {ISTIO_OUTPUT}"));
        for p in &c.outbound_exclude {
            r.add(NAT, ISTIO_OUTPUT, format!("-p tcp --dport {p} -j RETURN"));
            r.add(NAT, ISTIO_OUTPUT, format!("-p udp --dport {p} -j RETURN"));
        }
        r.add(
            NAT,
            ISTIO_OUTPUT,
            format!("-o lo -s {passthrough} -j RETURN"),
        );

        let dns = c.dns.as_ref();
        // Proxy UID: hairpin (proxy -> own pod IP over lo goes to inbound), then loopback from
        // anyone else returns, then everything else of the proxy returns. With DNS, the hairpin
        // also skips port 53 (UID only; the GID variant below does not).
        let uid_hairpin_ports = if dns.is_some() {
            format!("-m multiport ! --dports 53,{TUNNEL_PORT}")
        } else {
            format!("! --dport {TUNNEL_PORT}")
        };
        let lo_not_53 = if dns.is_some() {
            "-p tcp ! --dport 53 "
        } else {
            ""
        };
        r.add(
            NAT,
            ISTIO_OUTPUT,
            format!(
                "-o lo ! -d {lo_dst} -p tcp {uid_hairpin_ports} -m owner --uid-owner {uid} -j {ISTIO_IN_REDIRECT}"
            ),
        );
        if !c.loopback_included {
            r.add(
                NAT,
                ISTIO_OUTPUT,
                format!("-o lo {lo_not_53}-m owner ! --uid-owner {uid} -j RETURN"),
            );
        }
        r.add(
            NAT,
            ISTIO_OUTPUT,
            format!("-m owner --uid-owner {uid} -j RETURN"),
        );
        // The same for the proxy GID.
        r.add(
            NAT,
            ISTIO_OUTPUT,
            format!(
                "-o lo ! -d {lo_dst} -p tcp ! --dport {TUNNEL_PORT} -m owner --gid-owner {gid} -j {ISTIO_IN_REDIRECT}"
            ),
        );
        if !c.loopback_included {
            r.add(
                NAT,
                ISTIO_OUTPUT,
                format!("-o lo {lo_not_53}-m owner ! --gid-owner {gid} -j RETURN"),
            );
        }
        r.add(
            NAT,
            ISTIO_OUTPUT,
            format!("-m owner --gid-owner {gid} -j RETURN"),
        );

        if let Some(d) = dns {
            dns_rules(&mut r, d, fam, uid, gid, dns_port);
        }

        r.add(NAT, ISTIO_OUTPUT, format!("-d {lo_dst} -j RETURN"));
        for cidr in c.exclude.family(fam) {
            r.add(NAT, ISTIO_OUTPUT, format!("-d {cidr} -j RETURN"));
        }
        for p in &c.outbound_include {
            r.add(
                NAT,
                ISTIO_OUTPUT,
                format!("-p tcp --dport {p} -j {ISTIO_REDIRECT}"),
            );
        }
        if c.include.wildcard {
            r.add(NAT, ISTIO_OUTPUT, format!("-j {ISTIO_REDIRECT}"));
            for nic in &c.reroute_interfaces {
                r.insert(
                    NAT,
                    "PREROUTING",
                    1,
                    format!("-i {nic} -j {ISTIO_REDIRECT}"),
                );
            }
        } else {
            for cidr in c.include.family(fam) {
                for nic in &c.reroute_interfaces {
                    r.insert(
                        NAT,
                        "PREROUTING",
                        1,
                        format!("-i {nic} -d {cidr} -j {ISTIO_REDIRECT}"),
                    );
                }
                r.add(NAT, ISTIO_OUTPUT, format!("-d {cidr} -j {ISTIO_REDIRECT}"));
            }
        }

        // TPROXY: connmark bookkeeping, proxy-to-pod marking, and the ISTIO_INBOUND head. These
        // come even when inbound capture is off.
        if tproxy {
            r.add(
                MANGLE,
                "PREROUTING",
                format!("-p tcp -m mark --mark {TPROXY_MARK} -j CONNMARK --save-mark"),
            );
            r.add(
                MANGLE,
                "OUTPUT",
                format!("-p tcp -o lo -m mark --mark {TPROXY_MARK} -j RETURN"),
            );
            r.add(
                MANGLE,
                "OUTPUT",
                format!(
                    "! -d {lo_dst} -p tcp -o lo -m owner --uid-owner {uid} -j MARK --set-mark {OUTBOUND_MARK}"
                ),
            );
            r.add(
                MANGLE,
                "OUTPUT",
                format!(
                    "! -d {lo_dst} -p tcp -o lo -m owner --gid-owner {gid} -j MARK --set-mark {OUTBOUND_MARK}"
                ),
            );
            r.add(
                MANGLE,
                "OUTPUT",
                format!("-p tcp -m connmark --mark {TPROXY_MARK} -j CONNMARK --restore-mark"),
            );
            r.insert(
                MANGLE,
                ISTIO_INBOUND,
                1,
                format!("-p tcp -m mark --mark {TPROXY_MARK} -j RETURN"),
            );
            r.insert(
                MANGLE,
                ISTIO_INBOUND,
                2,
                format!("-p tcp -s {passthrough} -i lo -j RETURN"),
            );
            r.insert(
                MANGLE,
                ISTIO_INBOUND,
                3,
                format!("-p tcp -i lo -m mark ! --mark {OUTBOUND_MARK} -j RETURN"),
            );
        }
        Ok(r.0)
    }
}

/// DNS: nat redirect to the agent, raw conntrack zones (1 = proxy <-> upstream resolvers,
/// 2 = apps <-> proxy).
fn dns_rules(r: &mut Rules, d: &Dns, fam: Family, uid: u32, gid: u32, dns_port: u16) {
    let servers = if fam == Family::V6 { &d.v6 } else { &d.v4 };
    r.add(RAW, "OUTPUT", format!("-j {ISTIO_OUTPUT_DNS}"));
    if d.capture_all || !servers.is_empty() {
        r.add(NAT, ISTIO_OUTPUT, format!("-j {ISTIO_OUTPUT_DNS}"));
    }
    // Note istio's spelling: `--to-ports` for TCP, `--to-port` for UDP.
    if d.capture_all {
        r.add(
            NAT,
            ISTIO_OUTPUT_DNS,
            format!("-p tcp --dport 53 -j REDIRECT --to-ports {dns_port}"),
        );
    } else {
        for s in servers {
            r.add(
                NAT,
                ISTIO_OUTPUT_DNS,
                format!("-p tcp --dport 53 -d {s} -j REDIRECT --to-ports {dns_port}"),
            );
        }
    }
    if d.capture_all {
        r.add(
            NAT,
            ISTIO_OUTPUT_DNS,
            format!("-p udp --dport 53 -j REDIRECT --to-port {dns_port}"),
        );
    } else {
        for s in servers {
            r.add(
                NAT,
                ISTIO_OUTPUT_DNS,
                format!("-p udp --dport 53 -d {s} -j REDIRECT --to-port {dns_port}"),
            );
        }
    }
    for owner in [format!("--uid-owner {uid}"), format!("--gid-owner {gid}")] {
        r.add(
            RAW,
            ISTIO_OUTPUT_DNS,
            format!("-p udp --dport 53 -m owner {owner} -j CT --zone 1"),
        );
        r.add(
            RAW,
            ISTIO_OUTPUT_DNS,
            format!("-p udp --sport {dns_port} -m owner {owner} -j CT --zone 2"),
        );
    }
    if d.capture_all {
        r.add(RAW, "PREROUTING", format!("-j {ISTIO_INBOUND}"));
        r.add(
            RAW,
            ISTIO_OUTPUT_DNS,
            "-p udp --dport 53 -j CT --zone 2".into(),
        );
        r.add(
            RAW,
            ISTIO_INBOUND,
            "-p udp --sport 53 -j CT --zone 1".into(),
        );
    } else {
        if !servers.is_empty() {
            r.add(RAW, "PREROUTING", format!("-j {ISTIO_INBOUND}"));
        }
        for s in servers {
            r.add(
                RAW,
                ISTIO_OUTPUT_DNS,
                format!("-p udp --dport 53 -d {s} -j CT --zone 2"),
            );
            r.add(
                RAW,
                ISTIO_INBOUND,
                format!("-p udp --sport 53 -s {s} -j CT --zone 1"),
            );
        }
    }
}

const MANGLE: &str = "mangle";
const NAT: &str = "nat";
const RAW: &str = "raw";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum InboundInclude {
    Off,
    All,
    Ports(Vec<String>),
}

struct Dns {
    capture_all: bool,
    v4: Vec<String>,
    v6: Vec<String>,
}

struct Resolved {
    inbound_include: InboundInclude,
    inbound_exclude: Vec<String>,
    outbound_exclude: Vec<String>,
    outbound_include: Vec<String>,
    include: Ranges,
    exclude: Ranges,
    /// A loopback CIDR in the include list of either family drops the "loopback from non-proxy
    /// returns" rules of both families.
    loopback_included: bool,
    exclude_interfaces: Vec<String>,
    reroute_interfaces: Vec<String>,
    dns: Option<Dns>,
}

#[derive(Default)]
struct Ranges {
    wildcard: bool,
    v4: Vec<String>,
    v6: Vec<String>,
    v4_loopback: bool,
    v6_loopback: bool,
}

impl Ranges {
    fn family(&self, fam: Family) -> &[String] {
        match fam {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }
}

struct Rule {
    table: &'static str,
    chain: String,
    insert_at: Option<u32>,
    args: Vec<String>,
}

#[derive(Default)]
struct Rules(Vec<Rule>);

impl Rules {
    fn add(&mut self, table: &'static str, chain: &str, args: String) {
        self.push(table, chain, None, args);
    }

    fn insert(&mut self, table: &'static str, chain: &str, pos: u32, args: String) {
        self.push(table, chain, Some(pos), args);
    }

    fn push(&mut self, table: &'static str, chain: &str, insert_at: Option<u32>, args: String) {
        let args = args.split_whitespace().map(String::from).collect();
        self.0.push(Rule {
            table,
            chain: chain.to_string(),
            insert_at,
            args,
        });
    }
}

/// Turns the rule list into restore input. Tables come in name order, each with its `-N` lines
/// first. The `-N` lines follow the order in which chains first appear: as a rule's chain, then
/// as a jump target at the end of a rule. Then come the rules as `-A CHAIN ...` or
/// `-I CHAIN pos ...`, then COMMIT.
fn render(rules: &[Rule]) -> String {
    let mut tables: Vec<&'static str> = rules.iter().map(|r| r.table).collect();
    tables.sort_unstable();
    tables.dedup();

    let mut created: HashSet<(&str, &str)> = HashSet::new();
    let mut new_chains: Vec<(&str, &str)> = Vec::new();
    let builtin = |c: &str| BUILTIN.contains(&c);
    for r in rules {
        if !builtin(&r.chain) && created.insert((r.table, r.chain.as_str())) {
            new_chains.push((r.table, r.chain.as_str()));
        }
    }
    for r in rules {
        if let [.., j, target] = r.args.as_slice()
            && j == "-j"
            && !builtin(target)
            && created.insert((r.table, target.as_str()))
        {
            new_chains.push((r.table, target.as_str()));
        }
    }

    let mut out = String::new();
    for table in tables {
        // istio writes the header as "* <table>" (with a space); iptables-restore accepts it.
        let _ = writeln!(out, "* {table}");
        for (_, chain) in new_chains.iter().filter(|(t, _)| *t == table) {
            let _ = writeln!(out, "-N {chain}");
        }
        for r in rules.iter().filter(|r| r.table == table) {
            match r.insert_at {
                Some(pos) => {
                    let _ = writeln!(out, "-I {} {} {}", r.chain, pos, r.args.join(" "));
                }
                None => {
                    let _ = writeln!(out, "-A {} {}", r.chain, r.args.join(" "));
                }
            }
        }
        out.push_str("COMMIT\n");
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<&str> {
        s.lines().collect()
    }

    /// The lines of one table's section (between "* table" and COMMIT).
    fn table<'a>(restore: &'a str, name: &str) -> Vec<&'a str> {
        let header = format!("* {name}");
        let mut it = restore.lines().skip_while(|l| *l != header);
        assert!(it.next().is_some(), "no {name} table in:\n{restore}");
        it.take_while(|l| *l != "COMMIT").collect()
    }

    fn pos(haystack: &[&str], needle: &str) -> usize {
        haystack
            .iter()
            .position(|l| *l == needle)
            .unwrap_or_else(|| panic!("missing line {needle:?} in:\n{}", haystack.join("\n")))
    }

    #[test]
    fn default_redirect_v4() {
        let c = IstioCapture::default();
        let out = c.iptables_restore_v4();
        assert!(out.starts_with(
            "* nat\n-N ISTIO_INBOUND\n-N ISTIO_REDIRECT\n-N ISTIO_IN_REDIRECT\n-N ISTIO_OUTPUT\n"
        ));
        assert!(out.ends_with("COMMIT\n"));
        assert_eq!(out.matches("COMMIT").count(), 1, "only nat by default");
        let nat = table(&out, "nat");
        let inbound = [
            "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN",
            "-A PREROUTING -p tcp -j ISTIO_INBOUND",
            "-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN",
            "-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN",
            "-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN",
            "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT",
        ];
        let idx: Vec<usize> = inbound.iter().map(|l| pos(&nat, l)).collect();
        assert!(
            idx.windows(2).all(|w| w[0] < w[1]),
            "inbound order: {idx:?}"
        );

        assert_eq!(
            c.effective_chain(false, "nat", "ISTIO_OUTPUT"),
            vec![
                "-p tcp --dport 15020 -j RETURN",
                "-p udp --dport 15020 -j RETURN",
                "-o lo -s 127.0.0.6/32 -j RETURN",
                "-o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT",
                "-o lo -m owner ! --uid-owner 1337 -j RETURN",
                "-m owner --uid-owner 1337 -j RETURN",
                "-o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT",
                "-o lo -m owner ! --gid-owner 1337 -j RETURN",
                "-m owner --gid-owner 1337 -j RETURN",
                "-d 127.0.0.1/32 -j RETURN",
                "-j ISTIO_REDIRECT",
            ]
        );
        assert!(nat.contains(&"-A OUTPUT -j ISTIO_OUTPUT"));
        assert!(nat.contains(&"-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001"));
        assert!(nat.contains(&"-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006"));
        // No IPv6 unless the pod has it: istio runs no ip6tables-restore then.
        assert_eq!(c.iptables_restore_v6(), "");
        assert!(c.route_commands().is_empty());
    }

    #[test]
    fn exclude_inbound_ports_merge_and_dedup() {
        let c = IstioCapture {
            exclude_inbound_ports: "8080,15021,9090".into(),
            ..Default::default()
        };
        assert_eq!(
            c.effective_chain(false, "nat", "ISTIO_INBOUND"),
            vec![
                "-p tcp --dport 15008 -j RETURN",
                "-p tcp --dport 8080 -j RETURN",
                "-p tcp --dport 15021 -j RETURN",
                "-p tcp --dport 9090 -j RETURN",
                "-p tcp --dport 15020 -j RETURN",
                "-p tcp --dport 15090 -j RETURN",
                "-p tcp -j ISTIO_IN_REDIRECT",
            ]
        );
    }

    #[test]
    fn inbound_port_list_ignores_excludes() {
        let c = IstioCapture {
            include_inbound_ports: "1111,2222".into(),
            exclude_inbound_ports: "3333".into(),
            ..Default::default()
        };
        assert_eq!(
            c.effective_chain(false, "nat", "ISTIO_INBOUND"),
            vec![
                "-p tcp --dport 15008 -j RETURN",
                "-p tcp --dport 1111 -j ISTIO_IN_REDIRECT",
                "-p tcp --dport 2222 -j ISTIO_IN_REDIRECT",
            ]
        );
        // Empty include list: no PREROUTING jump, but the hairpin stays.
        let off = IstioCapture {
            include_inbound_ports: String::new(),
            ..Default::default()
        };
        let out = off.iptables_restore_v4();
        assert!(!out.contains("-A PREROUTING"));
        assert!(out.contains("--uid-owner 1337 -j ISTIO_IN_REDIRECT"));
    }

    #[test]
    fn dns_capture_all() {
        let c = IstioCapture {
            dns_capture: true,
            ..Default::default()
        };
        let out = c.iptables_restore_v4();
        let nat = table(&out, "nat");
        assert!(nat.contains(&"-N ISTIO_OUTPUT_DNS"));
        let hairpin = "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT";
        let gid_hairpin = "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT";
        let lo_ret =
            "-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN";
        let gid_ret = "-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN";
        let jump = "-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS";
        let tcp = "-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -j REDIRECT --to-ports 15053";
        let udp = "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j REDIRECT --to-port 15053";
        let lo = "-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN";
        let order: Vec<usize> = [hairpin, lo_ret, gid_hairpin, gid_ret, jump, tcp, udp, lo]
            .iter()
            .map(|l| pos(&nat, l))
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");

        let raw = table(&out, "raw");
        assert_eq!(
            raw,
            vec![
                "-N ISTIO_OUTPUT_DNS",
                "-N ISTIO_INBOUND",
                "-A OUTPUT -j ISTIO_OUTPUT_DNS",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 1337 -j CT --zone 1",
                "-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 1337 -j CT --zone 2",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1337 -j CT --zone 1",
                "-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 1337 -j CT --zone 2",
                "-A PREROUTING -j ISTIO_INBOUND",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j CT --zone 2",
                "-A ISTIO_INBOUND -p udp --sport 53 -j CT --zone 1",
            ]
        );
        // nat before raw (table name order).
        assert!(out.find("* nat").unwrap() < out.find("* raw").unwrap());
    }

    #[test]
    fn dns_istio_init_servers() {
        let c = IstioCapture {
            dns_capture: true,
            ipv6: true,
            ..Default::default()
        };
        let v4 = c
            .iptables_restore_with_dns_servers(false, &["10.96.0.10"])
            .unwrap();
        assert!(v4.contains(
            "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.96.0.10/32 -j REDIRECT --to-port 15053"
        ));
        assert!(v4.contains("-A ISTIO_INBOUND -p udp --sport 53 -s 10.96.0.10/32 -j CT --zone 1"));
        // No v6 server: v6 nat has no DNS jump, raw keeps only the owner zones.
        let v6 = c
            .iptables_restore_with_dns_servers(true, &["10.96.0.10"])
            .unwrap();
        assert!(!v6.contains("-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS"));
        assert!(v6.contains("-A OUTPUT -j ISTIO_OUTPUT_DNS"));
        assert!(!v6.contains("-A PREROUTING -j ISTIO_INBOUND"));
        assert!(v6.contains("--dports 53,15008"));
        // No servers at all: DNS capture is off.
        let none = c.iptables_restore_with_dns_servers(false, &[]).unwrap();
        assert_eq!(
            none,
            IstioCapture {
                ipv6: true,
                ..Default::default()
            }
            .iptables_restore_v4()
        );
    }

    #[test]
    fn tproxy_mangle() {
        let c = IstioCapture {
            mode: Mode::Tproxy,
            ..Default::default()
        };
        let out = c.iptables_restore_v4();
        assert!(out.starts_with("* mangle\n-N ISTIO_DIVERT\n-N ISTIO_TPROXY\n-N ISTIO_INBOUND\n"));
        let mangle = table(&out, "mangle");
        assert!(mangle.contains(
            &"-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006"
        ));
        assert_eq!(
            c.effective_chain(false, "mangle", "ISTIO_INBOUND"),
            vec![
                "-p tcp -m mark --mark 1337 -j RETURN",
                "-p tcp -s 127.0.0.6/32 -i lo -j RETURN",
                "-p tcp -i lo -m mark ! --mark 1338 -j RETURN",
                "-p tcp --dport 15020 -j RETURN",
                "-p tcp --dport 15021 -j RETURN",
                "-p tcp --dport 15090 -j RETURN",
                "-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT",
                "-p tcp -j ISTIO_TPROXY",
            ]
        );
        assert_eq!(
            c.effective_chain(false, "mangle", "OUTPUT"),
            vec![
                "-p tcp -o lo -m mark --mark 1337 -j RETURN",
                "! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338",
                "! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338",
                "-p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark",
            ]
        );
        // nat keeps its ISTIO_INBOUND chain but nothing jumps to it.
        let nat = table(&out, "nat");
        assert!(!nat.iter().any(|l| l.starts_with("-A PREROUTING")));
        assert!(nat.contains(&"-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN"));
        assert_eq!(
            c.route_commands(),
            vec![
                vec!["ip", "rule", "add", "fwmark", "1337", "lookup", "133"],
                vec![
                    "ip", "route", "add", "local", "default", "dev", "lo", "table", "133"
                ],
            ]
        );
        let v6 = IstioCapture { ipv6: true, ..c };
        assert_eq!(v6.route_commands().len(), 5);
        assert!(
            v6.iptables_restore_v6()
                .contains("-I ISTIO_INBOUND 2 -p tcp -s ::6/128 -i lo -j RETURN")
        );
    }

    #[test]
    fn ipv6_split_ranges() {
        let c = IstioCapture {
            ipv6: true,
            include_outbound_ip_ranges: "10.0.0.0/8,2001:DB8::/32".into(),
            exclude_outbound_ip_ranges: "10.1.0.0/16,2001:db8:1::/48".into(),
            reroute_virtual_interfaces: "eth1,eth2".into(),
            ..Default::default()
        };
        let v6 = c.iptables_restore_v6();
        assert!(v6.contains("-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN"));
        assert!(v6.contains("-A ISTIO_OUTPUT -d ::1/128 -j RETURN"));
        assert!(v6.contains("-A ISTIO_OUTPUT -d 2001:db8:1::/48 -j RETURN"));
        assert!(v6.contains("-A ISTIO_OUTPUT -d 2001:db8::/32 -j ISTIO_REDIRECT"));
        assert!(!v6.contains("10.0.0.0/8"));
        let v4 = c.iptables_restore_v4();
        assert!(v4.contains("-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT"));
        assert!(!v4.contains("2001:db8"));
        assert_eq!(
            c.effective_chain(false, "nat", "PREROUTING"),
            vec![
                "-i eth2 -d 10.0.0.0/8 -j ISTIO_REDIRECT",
                "-i eth1 -d 10.0.0.0/8 -j ISTIO_REDIRECT",
                "-i eth2 -j RETURN",
                "-i eth1 -j RETURN",
                "-p tcp -j ISTIO_INBOUND",
            ]
        );
        assert_eq!(
            c.route_commands(),
            vec![vec!["ip", "-6", "addr", "add", "::6/128", "dev", "lo"]]
        );
    }

    #[test]
    fn loopback_include_drops_lo_return() {
        let c = IstioCapture {
            include_outbound_ip_ranges: "127.0.0.0/8".into(),
            ..Default::default()
        };
        let chain = c.effective_chain(false, "nat", "ISTIO_OUTPUT");
        assert!(
            !chain
                .iter()
                .any(|l| l.contains("! --uid-owner") || l.contains("! --gid-owner"))
        );
        assert_eq!(chain.last().unwrap(), "-d 127.0.0.0/8 -j ISTIO_REDIRECT");
    }

    #[test]
    fn outbound_ports_and_interfaces() {
        let c = IstioCapture {
            exclude_outbound_ports: "5555,6666".into(),
            include_outbound_ports: "32000".into(),
            include_outbound_ip_ranges: String::new(),
            exclude_interfaces: "eth9".into(),
            ..Default::default()
        };
        let chain = c.effective_chain(false, "nat", "ISTIO_OUTPUT");
        assert_eq!(
            &chain[..4],
            [
                "-p tcp --dport 5555 -j RETURN",
                "-p udp --dport 5555 -j RETURN",
                "-p tcp --dport 6666 -j RETURN",
                "-p udp --dport 6666 -j RETURN",
            ]
        );
        assert_eq!(
            chain.last().unwrap(),
            "-p tcp --dport 32000 -j ISTIO_REDIRECT"
        );
        assert_eq!(
            c.effective_chain(false, "nat", "OUTPUT"),
            vec!["-o eth9 -j RETURN", "-j ISTIO_OUTPUT"]
        );
        let nat = lines(&c.iptables_restore_v4()).len();
        assert!(nat > 10);
    }

    #[test]
    fn invalid_options() {
        let bad = |c: IstioCapture| c.validate().is_err();
        assert!(bad(IstioCapture {
            exclude_outbound_ip_ranges: "*".into(),
            ..Default::default()
        }));
        assert!(bad(IstioCapture {
            include_outbound_ip_ranges: "10.0.0.0".into(),
            ..Default::default()
        }));
        assert!(bad(IstioCapture {
            include_inbound_ports: "http".into(),
            ..Default::default()
        }));
        assert!(bad(IstioCapture {
            exclude_outbound_ports: "70000".into(),
            ..Default::default()
        }));
        assert!(IstioCapture::default().validate().is_ok());
    }
}
