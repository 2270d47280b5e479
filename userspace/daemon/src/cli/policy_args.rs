//! `sidestep enroll`'s policy flags: each overrides the same field of `--policy FILE`, and both
//! default to Istio's.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use sidestep::policy::{self, InterceptionMode, Policy};

#[derive(Args, Default)]
pub struct PolicyArgs {
    /// JSON policy file (camelCase fields, Istio-style lists).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// The proxy's UID: its outbound traffic is never captured [default: 1337].
    #[arg(long)]
    proxy_uid: Option<u32>,
    /// The proxy's GID: its outbound traffic is never captured [default: 1337].
    #[arg(long)]
    proxy_gid: Option<u32>,
    /// The proxy's outbound listener (loopback) [default: 15001].
    #[arg(long)]
    outbound_port: Option<u16>,
    /// The proxy's inbound listener [default: 15006].
    #[arg(long)]
    inbound_port: Option<u16>,
    /// The DNS listener captured DNS goes to, with --dns-capture [default: 15053].
    #[arg(long)]
    dns_port: Option<u16>,
    /// REDIRECT or TPROXY.
    #[arg(long)]
    interception_mode: Option<InterceptionMode>,
    /// Comma-separated CIDRs, or `*`.
    #[arg(long)]
    include_outbound_ip_ranges: Option<String>,
    /// Comma-separated CIDRs never captured outbound.
    #[arg(long)]
    exclude_outbound_ip_ranges: Option<String>,
    /// Comma-separated ports captured outbound even to excluded ranges.
    #[arg(long)]
    include_outbound_ports: Option<String>,
    /// Comma-separated ports never captured outbound.
    #[arg(long)]
    exclude_outbound_ports: Option<String>,
    /// Comma-separated ports, or `*`.
    #[arg(long)]
    include_inbound_ports: Option<String>,
    /// Comma-separated ports never captured inbound.
    #[arg(long)]
    exclude_inbound_ports: Option<String>,
    /// Capture the pod's DNS (port 53) to the DNS listener, as Istio's DNS capture does.
    #[arg(long)]
    dns_capture: bool,
    /// Leave IPv6 outbound uncaptured (istio-iptables' behaviour for pods without IPv6).
    #[arg(long)]
    no_ipv6: bool,
    /// App <-> proxy data on loopback goes socket to socket (sk_msg).
    #[arg(long)]
    sk_msg: bool,
    /// Log each verdict for this pod (read them with `sidestep debug --follow`).
    #[arg(long)]
    debug: bool,
    /// Where inbound capture hooks in: `sk_lookup` (the per-netns listener lookup only) or `tc`
    /// (tc ingress per interface). Default: `sk_lookup`, or `tc` where the proxy listens already
    /// or the netns is enrolled with `tc`, as the CNI plugin decides.
    #[arg(long)]
    inbound_hook: Option<policy::InboundHook>,
    /// Istio ambient mode: istio-cni's in-pod rules, to an unmodified ztunnel that opens its
    /// listeners in the pod's netns and marks its own sockets (`--dns-capture` for its DNS
    /// proxy, `--include-inbound-ports ""` for `ambient.istio.io/bypass-inbound-capture`).
    #[arg(long)]
    ambient: bool,
    /// The pod's own address (repeatable), for hairpin detection.
    #[arg(long = "pod-ip")]
    pod_ips: Vec<std::net::IpAddr>,
}

impl PolicyArgs {
    /// The policy, and whether the operator chose its inbound hook (the flag or the file's
    /// `inboundHook`); without a choice the enrolment picks one ([`sidestep::enroll::hook`]).
    pub fn resolve(self) -> anyhow::Result<(Policy, bool)> {
        let mut hook_chosen = self.inbound_hook.is_some();
        let mut p = match &self.policy {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading policy file {}", path.display()))?;
                let value: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("parsing policy file {}", path.display()))?;
                hook_chosen |= value.get("inboundHook").is_some();
                serde_json::from_value(value)
                    .with_context(|| format!("parsing policy file {}", path.display()))?
            }
            None if self.ambient => Policy::istio_ambient(false, false),
            None => Policy::default(),
        };
        if self.ambient {
            p.ambient = true;
            p.hairpin = false;
        }
        p.proxy_uid = self.proxy_uid.unwrap_or(p.proxy_uid);
        p.proxy_gid = self.proxy_gid.unwrap_or(p.proxy_gid);
        p.outbound_port = self.outbound_port.unwrap_or(p.outbound_port);
        p.inbound_port = self.inbound_port.unwrap_or(p.inbound_port);
        p.dns_port = self.dns_port.unwrap_or(p.dns_port);
        p.interception_mode = self.interception_mode.unwrap_or(p.interception_mode);
        if let Some(v) = &self.include_outbound_ip_ranges {
            p.include_outbound_ip_ranges =
                policy::parse_cidr_set("--include-outbound-ip-ranges", v)?;
        }
        if let Some(v) = &self.exclude_outbound_ip_ranges {
            p.exclude_outbound_ip_ranges =
                policy::parse_cidr_set("--exclude-outbound-ip-ranges", v)?;
        }
        if let Some(v) = &self.include_outbound_ports {
            p.include_outbound_ports = policy::parse_port_set("--include-outbound-ports", v)?;
        }
        if let Some(v) = &self.exclude_outbound_ports {
            p.exclude_outbound_ports = policy::parse_port_set("--exclude-outbound-ports", v)?;
        }
        if let Some(v) = &self.include_inbound_ports {
            p.include_inbound_ports = policy::parse_port_set("--include-inbound-ports", v)?;
        }
        if let Some(v) = &self.exclude_inbound_ports {
            p.exclude_inbound_ports = policy::parse_port_set("--exclude-inbound-ports", v)?;
        }
        p.dns_capture |= self.dns_capture;
        p.sk_msg |= self.sk_msg;
        p.debug |= self.debug;
        p.inbound_hook = self.inbound_hook.unwrap_or(p.inbound_hook);
        if self.no_ipv6 {
            p.capture_ipv6 = false;
        }
        p.pod_ips.extend(self.pod_ips);
        p.validate()?;
        Ok((p, hook_chosen))
    }
}
