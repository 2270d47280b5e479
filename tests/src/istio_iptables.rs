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

// The model is split along the stages of an istio-iptables run: `options` checks and resolves
// the annotation lists, `rules` adds the rules in istio's order, `restore` holds the rule list
// and writes it as `iptables-restore` input.
mod options;
mod restore;
mod rules;
#[cfg(test)]
mod tests;

use anyhow::Result;

use restore::render;

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}
