//! The rules istio-iptables adds for one address family, in the order it adds them
//! (`tools/istio-iptables/pkg/capture/run.go`). The order matters: `-I` positions and the
//! first-seen order of the `-N` lines both come from it, so this follows run.go step by step.

use anyhow::Result;

use super::options::{Dns, InboundInclude};
use super::restore::{Rule, Rules};
use super::{Family, IstioCapture, Mode, OUTBOUND_MARK, TPROXY_MARK, TUNNEL_PORT};

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

const MANGLE: &str = "mangle";
const NAT: &str = "nat";
const RAW: &str = "raw";

impl IstioCapture {
    /// The rules of one family, in the order istio-iptables adds them.
    pub(super) fn rules(&self, fam: Family, dns_servers: Option<&[&str]>) -> Result<Vec<Rule>> {
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
