//! A model of the in-pod iptables rules that istio-cni's node agent installs in an **ambient**
//! pod's network namespace (istio/istio `cni/pkg/iptables/iptables.go`, `AppendInpodRules`, and
//! its goldens `cni/pkg/iptables/testdata/*.golden`, at 86c9f01; docs/research/ambient.md has
//! the reading). The ambient parity test applies it as the oracle.
//!
//! ztunnel is not a UID: it enters the pod netns, opens 15001 (outbound), 15006 (inbound
//! plaintext), 15008 (HBONE) and 15053 (DNS) there, and marks every socket it makes with 0x539.
//! Packets from ztunnel's sockets that loop back through lo have their mark turned into the
//! connmark 0x111 in mangle PREROUTING, restored on the app's replies in mangle OUTPUT, and the
//! policy route `fwmark 0x111/0xfff lookup 100` (`local default dev lo`) sends them back to
//! ztunnel's transparent socket.

/// ztunnel's socket mark and its mask (Istio's InpodMark / InpodMask).
pub const MARK: &str = "0x539/0xfff";
/// The connmark of connections ztunnel opened inside the pod (InpodTProxyMark / Mask).
pub const CONN_MARK: &str = "0x111/0xfff";
/// RouteTableInbound.
pub const ROUTE_TABLE: u32 = 100;
/// Where kubelet's probes are SNATed to on the node.
pub const PROBE_SNAT_V4: &str = "169.254.7.127";
pub const PROBE_SNAT_V6: &str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff";

/// The per-pod settings istio-cni reads (chart values and pod annotations).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmbientCapture {
    /// `ambient.dnsCapture` (default true), overridden by `ambient.istio.io/dns-capture`.
    pub dns: bool,
    /// `ambient.istio.io/bypass-inbound-capture: "true"` (ingress mode): no inbound REDIRECT.
    pub bypass_inbound: bool,
    /// IPv6 enabled: the same rules again through ip6tables.
    pub ipv6: bool,
}

impl Default for AmbientCapture {
    fn default() -> Self {
        Self {
            dns: true,
            bypass_inbound: false,
            ipv6: true,
        }
    }
}

impl AmbientCapture {
    /// `iptables-restore --noflush` input for one family, in istio-cni's rule order.
    pub fn iptables_restore(&self, v6: bool) -> String {
        let (lo, probe) = if v6 {
            ("::1/128", PROBE_SNAT_V6)
        } else {
            ("127.0.0.1/32", PROBE_SNAT_V4)
        };
        let mut out = String::new();
        let mut table = |name: &str, rules: &[String]| {
            out.push_str(&format!(
                "* {name}\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n"
            ));
            for r in rules {
                out.push_str(r);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
        };
        table(
            "mangle",
            &[
                "-A PREROUTING -j ISTIO_PRERT".into(),
                "-A OUTPUT -j ISTIO_OUTPUT".into(),
                format!("-A ISTIO_PRERT -m mark --mark {MARK} -j CONNMARK --set-xmark {CONN_MARK}"),
                format!(
                    "-A ISTIO_OUTPUT -m connmark --mark {CONN_MARK} -j CONNMARK --restore-mark \
                     --nfmask 0xffffffff --ctmask 0xffffffff"
                ),
            ],
        );
        let mut nat = vec![
            "-A OUTPUT -j ISTIO_OUTPUT".to_owned(),
            "-A PREROUTING -j ISTIO_PRERT".to_owned(),
        ];
        if !self.bypass_inbound {
            nat.push(format!("-A ISTIO_PRERT -s {probe} -p tcp -m tcp -j ACCEPT"));
            nat.push(format!(
                "-A ISTIO_PRERT ! -d {lo} -p tcp -m tcp ! --dport 15008 -m mark ! --mark {MARK} \
                 -j REDIRECT --to-ports 15006"
            ));
        }
        nat.push(format!(
            "-A ISTIO_OUTPUT -d {probe} -p tcp -m tcp -j ACCEPT"
        ));
        if self.dns {
            nat.push(format!(
                "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark {MARK} -m udp --dport 53 \
                 -j REDIRECT --to-ports 15053"
            ));
            nat.push(format!(
                "-A ISTIO_OUTPUT ! -d {lo} -p tcp -m tcp --dport 53 -m mark ! --mark {MARK} \
                 -j REDIRECT --to-ports 15053"
            ));
        }
        nat.push(format!(
            "-A ISTIO_OUTPUT -p tcp -m mark --mark {CONN_MARK} -j ACCEPT"
        ));
        nat.push(format!("-A ISTIO_OUTPUT ! -d {lo} -o lo -j ACCEPT"));
        nat.push(format!(
            "-A ISTIO_OUTPUT ! -d {lo} -p tcp -m mark ! --mark {MARK} -j REDIRECT --to-ports 15001"
        ));
        table("nat", &nat);
        if self.dns {
            table(
                "raw",
                &[
                    "-A PREROUTING -j ISTIO_PRERT".into(),
                    "-A OUTPUT -j ISTIO_OUTPUT".into(),
                    format!(
                        "-A ISTIO_OUTPUT -p udp -m mark --mark {MARK} -m udp --dport 53 \
                         -j CT --zone 1"
                    ),
                    format!(
                        "-A ISTIO_PRERT -p udp -m mark ! --mark {MARK} -m udp --sport 53 \
                         -j CT --zone 1"
                    ),
                ],
            );
        }
        out
    }

    /// The policy routing istio-cni adds beside the rules (`addInpodMarkIPRule`,
    /// `addLoopbackRoute`), as `ip` argument vectors.
    pub fn route_commands(&self) -> Vec<Vec<String>> {
        let argv = |s: String| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let mut families = vec![""];
        if self.ipv6 {
            families.push("-6 ");
        }
        let mut cmds = Vec::new();
        for f in families {
            cmds.push(argv(format!(
                "ip {f}rule add fwmark {CONN_MARK} pref 32764 lookup {ROUTE_TABLE}"
            )));
            cmds.push(argv(format!(
                "ip {f}route add local default dev lo table {ROUTE_TABLE}"
            )));
        }
        cmds
    }
}

/// ztunnel's local xDS (`LOCAL_XDS_PATH`): each `(name, service account, address)` as an HBONE
/// workload of `namespace` on `node`, in the cluster.local trust domain (what a test or a
/// benchmark runs an unmodified ztunnel with, instead of istiod).
pub fn ztunnel_local_xds(
    namespace: &str,
    node: &str,
    pods: &[(&str, &str, std::net::Ipv4Addr)],
) -> String {
    let mut out = String::from("workloads:\n");
    for (name, sa, ip) in pods {
        out.push_str(&format!(
            "- uid: Kubernetes//v1/Pod/{namespace}/{name}\n  name: {name}\n  namespace: \
             {namespace}\n  serviceAccount: {sa}\n  trustDomain: cluster.local\n  \
             workloadIps: [\"{ip}\"]\n  protocol: HBONE\n  node: {node}\n  network: \"\"\n  \
             services: {{}}\n"
        ));
    }
    out.push_str("policies: []\nservices: []\n");
    out
}

/// The policy istiod sends ztunnel for a STRICT PeerAuthentication in `namespace`: deny every
/// connection without a peer identity (plaintext), to go in place of the empty `policies` of
/// `ztunnel_local_xds`.
pub fn ztunnel_strict_mtls(xds: &str, namespace: &str) -> String {
    xds.replace(
        "policies: []\n",
        &format!(
            "policies:\n- name: converted_peer_authentication_strict\n  namespace: {namespace}\n  \
             scope: Namespace\n  action: Deny\n  dryRun: false\n  rules:\n  - - - \
             notPrincipals:\n        - !Presence []\n"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_rules_only_with_dns() {
        let on = AmbientCapture::default().iptables_restore(false);
        assert!(on.contains("--dport 53 -j REDIRECT --to-ports 15053"));
        assert!(on.contains("* raw"));
        let off = AmbientCapture {
            dns: false,
            ..AmbientCapture::default()
        }
        .iptables_restore(false);
        assert!(!off.contains("15053") && !off.contains("* raw"));
    }

    #[test]
    fn bypass_inbound_keeps_the_connmark_rules() {
        let text = AmbientCapture {
            bypass_inbound: true,
            ..AmbientCapture::default()
        }
        .iptables_restore(true);
        assert!(!text.contains("15006"));
        assert!(text.contains("CONNMARK --set-xmark 0x111/0xfff"));
        assert!(text.contains("! -d ::1/128 -p tcp -m mark ! --mark 0x539/0xfff"));
    }
}
