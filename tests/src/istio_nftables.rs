//! Istio's native nftables ruleset for a sidecar pod (`global.nativeNftables`, sidecar mode since
//! 1.27: istio/istio `tools/istio-nftables`, whose goldens under `pkg/capture/testdata` give the
//! rule text), with istio-cni's default annotations and REDIRECT interception, as `nft -f` input.
//! One `inet` table, `istio-proxy-nat`, with the same chains and order as the iptables ruleset
//! (`crate::istio_iptables`): the benchmark's ADD lane installs it beside the iptables ruleset,
//! and the parity test checks that it captures as that ruleset does.

use std::fmt::Write as _;

/// The table every rule lives in.
pub const TABLE: &str = "inet istio-proxy-nat";

/// The defaults istio-cni gives a sidecar pod: every outbound destination to 15001, every
/// inbound port but 15008, 15020, 15021 and 15090 to 15006, outbound port 15020 excluded, the
/// proxy's UID and GID 1337 exempt and hairpinned; IPv6 rules too when `ipv6`.
pub fn default_sidecar(ipv6: bool) -> String {
    let mut o = String::new();
    let mut rule = |text: &str| {
        let _ = writeln!(o, "add rule {TABLE} {text}");
    };
    let mut head = format!("add table {TABLE}\nflush table {TABLE}\n");
    for chain in [
        "prerouting { type nat hook prerouting priority -100 ; }",
        "output { type nat hook output priority -100 ; }",
        "istio-inbound",
        "istio-redirect",
        "istio-in-redirect",
        "istio-output",
    ] {
        let _ = writeln!(head, "add chain {TABLE} {chain}");
    }
    rule("istio-inbound meta l4proto tcp tcp dport 15008 return");
    rule("istio-redirect meta l4proto tcp redirect to :15001");
    rule("istio-in-redirect meta l4proto tcp redirect to :15006");
    rule("prerouting meta l4proto tcp jump istio-inbound");
    for port in [15020, 15021, 15090] {
        rule(&format!(
            "istio-inbound meta l4proto tcp tcp dport {port} return"
        ));
    }
    rule("istio-inbound meta l4proto tcp jump istio-in-redirect");
    rule("output jump istio-output");
    rule("istio-output meta l4proto tcp tcp dport 15020 return");
    rule("istio-output meta l4proto udp udp dport 15020 return");
    let families: &[(&str, &str, &str)] = if ipv6 {
        &[
            ("ip", "127.0.0.6/32", "127.0.0.1/32"),
            ("ip6", "::6/128", "::1/128"),
        ]
    } else {
        &[("ip", "127.0.0.6/32", "127.0.0.1/32")]
    };
    for (fam, passthrough, _) in families {
        rule(&format!(
            "istio-output oifname lo {fam} saddr {passthrough} return"
        ));
    }
    for owner in ["skuid", "skgid"] {
        for (fam, _, lo) in families {
            rule(&format!(
                "istio-output oifname lo meta l4proto tcp {fam} daddr != {lo} tcp dport != 15008 \
                 {owner} 1337 jump istio-in-redirect"
            ));
        }
        rule(&format!("istio-output oifname lo {owner} != 1337 return"));
        rule(&format!("istio-output {owner} 1337 return"));
    }
    for (fam, _, lo) in families {
        rule(&format!("istio-output {fam} daddr {lo} return"));
    }
    rule("istio-output jump istio-redirect");
    head + &o
}

/// `nft` input that removes the table again.
pub fn delete() -> String {
    format!("delete table {TABLE}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_ruleset_has_istios_chains_in_order() {
        let text = default_sidecar(true);
        let first = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("{needle}"));
        assert!(first("dport 15008 return") < first("jump istio-in-redirect"));
        assert!(first("ip saddr 127.0.0.6/32 return") < first("skuid 1337 jump"));
        assert!(first("ip6 daddr != ::1/128") < first("skuid != 1337 return"));
        assert!(
            text.trim_end()
                .ends_with("istio-output jump istio-redirect")
        );
        assert!(!default_sidecar(false).contains("ip6"));
    }
}
