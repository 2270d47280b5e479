//! Unit tests of the Istio ruleset model: the restore text, effective chains and route commands
//! it gives for each option. A file of their own so that the model's files hold only the model.

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
    let lo_ret = "-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN";
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
