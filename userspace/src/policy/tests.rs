use super::*;

#[test]
fn defaults_capture_everything_like_istio() {
    let e = Policy::default().to_map_entries(7);
    let f = e.pod.flags;
    assert_ne!(f & flags::OUTBOUND, 0);
    assert_ne!(f & flags::INBOUND_ALL_PORTS, 0);
    assert_ne!(f & flags::HAIRPIN, 0);
    assert_eq!(f & flags::DNS_CAPTURE, 0);
    assert_eq!(e.pod.outbound_port, 15001);
    assert_eq!(e.pod.inbound_port, 15006);
    // "*" is one ::/0 entry, which also covers IPv4-mapped addresses.
    assert_eq!(e.cidrs.len(), 1);
    assert_eq!(e.cidrs[0].0, CIDR_KEY_FIXED_BITS);
    let excluded: Vec<u32> = e
        .ports
        .iter()
        .filter(|k| k.list == port_list::INBOUND_EXCLUDE)
        .map(|k| k.port)
        .collect();
    assert_eq!(excluded, vec![15008, 15020, 15021, 15090]);
}

#[test]
fn ipv4_ranges_become_mapped_prefixes() {
    let p = Policy {
        include_outbound_ip_ranges: parse_cidr_set("f", "10.0.0.0/8").unwrap(),
        exclude_outbound_ip_ranges: parse_cidr_set("f", "10.1.0.0/16, 2001:db8::/32").unwrap(),
        ..Policy::default()
    };
    let e = p.to_map_entries(1);
    let include = e
        .cidrs
        .iter()
        .find(|(_, k)| k.list_be == cidr_list::OUTBOUND_INCLUDE.to_be())
        .unwrap();
    assert_eq!(include.0, CIDR_KEY_FIXED_BITS + 96 + 8);
    assert_eq!(&include.1.addr[10..13], &[0xff, 0xff, 10]);
    assert_ne!(e.pod.flags & flags::HAS_OUT_CIDR_EXCLUDES, 0);
    assert_eq!(
        e.cidrs
            .iter()
            .filter(|(_, k)| k.list_be == cidr_list::OUTBOUND_EXCLUDE.to_be())
            .count(),
        2
    );
}

#[test]
fn empty_includes_turn_capture_off() {
    let p = Policy {
        include_outbound_ip_ranges: parse_cidr_set("f", "").unwrap(),
        include_inbound_ports: parse_port_set("f", "").unwrap(),
        ..Policy::default()
    };
    let f = p.to_map_entries(1).pod.flags;
    assert_eq!(f & (flags::OUTBOUND | flags::INBOUND), 0);
    // istio-iptables keeps the hairpin without inbound capture (istio-validation needs it).
    assert_ne!(f & flags::HAIRPIN, 0);
}

#[test]
fn bad_values_name_the_field() {
    let e = parse_port_set("traffic.sidecar.istio.io/excludeInboundPorts", "80,70000").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("excludeInboundPorts") && msg.contains("70000"),
        "{msg}"
    );
    let e = parse_cidr_set("includeOutboundIPRanges", "10.0.0.0/33").unwrap_err();
    assert!(e.to_string().contains("10.0.0.0/33"));
    assert!(parse_port("p", "0").is_err());
    assert!(parse_port("p", "-1").is_err());
    assert!(parse_port_list("p", "*").is_err());
}

#[test]
fn leading_zero_octets_are_refused_with_the_value() {
    for bad in [
        "010.0.0.0/8",
        "10.00.0.0/16",
        "10.0.0.01",
        "::ffff:010.0.0.1/128",
    ] {
        let e = parse_cidr_set("excludeOutboundIPRanges", &format!("192.168.0.0/16,{bad}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(bad) && e.contains("leading zero") && e.contains("excludeOutboundIPRanges"),
            "{bad}: {e}"
        );
    }
    // Zero itself and zeros inside an octet are ordinary decimal.
    for good in [
        "0.0.0.0/0",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "10.20.0.100",
        "fd00::10/64",
    ] {
        parse_cidr("f", good).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
}

#[test]
fn json_accepts_strings_and_arrays() {
    let p: Policy = serde_json::from_str(
        r#"{"proxyUid":2102,"includeOutboundIPRanges":["10.0.0.0/8","fd00::/8"],
            "excludeOutboundPorts":"22, 443","podIPs":["10.1.2.3"]}"#,
    )
    .unwrap();
    assert_eq!(p.proxy_uid, 2102);
    assert_eq!(p.proxy_gid, 1337);
    assert!(matches!(&p.include_outbound_ip_ranges, CidrSet::Only(v) if v.len() == 2));
    assert_eq!(p.exclude_outbound_ports, PortSet::Only([22, 443].into()));
    let back: Policy = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
    assert!(serde_json::from_str::<Policy>(r#"{"bogus":1}"#).is_err());
}

#[test]
fn pod_ips_become_address_entries() {
    let p = Policy {
        pod_ips: vec!["10.9.8.7".parse().unwrap(), "fd00::7".parse().unwrap()],
        ..Policy::default()
    };
    let e = p.to_map_entries(3);
    assert_eq!(e.addresses.len(), 2);
    assert_eq!(
        e.addresses[0],
        [0, 0, 0xffff_u32.to_be(), u32::from_ne_bytes([10, 9, 8, 7])]
    );
    assert_eq!(e.addresses[1][3], u32::from_ne_bytes([0, 0, 0, 7]));
    assert_ne!(e.pod.flags & flags::OUTBOUND_ALL_RANGES, 0);
}

/// The source a captured socket is bound to: the first usable address of each family, skipping
/// what no route of the pod could give as a source for a foreign destination.
#[test]
fn pod_source_takes_the_first_usable_address_of_each_family() {
    let ips: Vec<IpAddr> = [
        "fe80::1",
        "127.0.0.5",
        "169.254.1.1",
        "::ffff:10.0.0.9",
        "10.1.2.3",
        "fd00::7",
        "10.9.9.9",
        "fd00::8",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let s = pod_source(&ips);
    assert_eq!(s.addr4, address_words(&"10.1.2.3".parse().unwrap()));
    assert_eq!(s.addr6, address_words(&"fd00::7".parse().unwrap()));
    // A family without one stays all-zero: connect then keeps the loopback source.
    let only4 = pod_source(&["10.1.2.3".parse().unwrap()]);
    assert_eq!(only4.addr6, [0; 4]);
    assert_eq!(pod_source(&[]), sidestep_abi::PodSource::default());
    // The policy's pod IPs come first.
    let p = Policy {
        pod_ips: vec!["fd00::9".parse().unwrap(), "10.4.4.4".parse().unwrap()],
        ..Policy::default()
    };
    let e = p.to_map_entries(3);
    assert_eq!(e.source.addr4, address_words(&"10.4.4.4".parse().unwrap()));
    assert_eq!(e.source.addr6, address_words(&"fd00::9".parse().unwrap()));
}

/// DEL deletes the keys a record's policy makes (enroll::unenroll_recorded), so a policy read
/// back from its record must make exactly the keys the enrolment wrote.
#[test]
fn a_recorded_policy_makes_the_same_map_entries() {
    let p: Policy = serde_json::from_str(
        r#"{"includeOutboundIPRanges":"10.0.0.0/8,10.1.0.0/16,fd00::/8",
            "excludeOutboundIPRanges":"192.168.0.0/16","includeOutboundPorts":"80,443",
            "excludeOutboundPorts":"22","includeInboundPorts":"8080,9090",
            "excludeInboundPorts":"9090","podIPs":["10.1.2.3","fd00::3"],"hairpin":false,
            "dnsCapture":true,"interceptionMode":"TPROXY","inboundHook":"sk_lookup",
            "rerouteVirtualInterfaces":["vm0"]}"#,
    )
    .unwrap();
    for p in [p, Policy::default()] {
        let back: Policy = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back.to_map_entries(7), p.to_map_entries(7));
    }
}

#[test]
fn an_ambient_pod_is_ztunnels_by_mark_with_only_hbone_excluded_inbound() {
    let p = Policy::istio_ambient(true, false);
    let e = p.to_map_entries(9);
    assert_ne!(e.pod.flags & flags::AMBIENT, 0);
    assert_ne!(e.pod.flags & flags::DNS_CAPTURE, 0);
    assert_eq!(e.pod.flags & flags::HAIRPIN, 0);
    assert_ne!(e.pod.flags & flags::OUTBOUND_ALL_RANGES, 0);
    assert_eq!(
        (e.pod.proxy_uid, e.pod.proxy_gid),
        (ambient::MARK, ambient::MARK_MASK)
    );
    let excluded: Vec<u32> = e
        .ports
        .iter()
        .filter(|k| k.list == port_list::INBOUND_EXCLUDE)
        .map(|k| k.port)
        .collect();
    assert_eq!(excluded, vec![15008]);
    // Ingress mode: no inbound capture at all.
    let bypass = Policy::istio_ambient(false, true).to_map_entries(9);
    assert_eq!(bypass.pod.flags & (flags::INBOUND | flags::DNS_CAPTURE), 0);
    // Survives its record, and refuses TPROXY.
    let back: Policy = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
    let tproxy = Policy {
        interception_mode: InterceptionMode::Tproxy,
        ..p.clone()
    };
    assert!(tproxy.validate().is_err());
    // The sidecar's traffic options do not exist there; setting one is refused, not ignored.
    let excluded: Policy = serde_json::from_str(
        r#"{"ambient": true, "hairpin": false, "excludeOutboundPorts": "22"}"#,
    )
    .unwrap();
    let e = excluded.validate().unwrap_err().to_string();
    assert!(e.contains("excludeOutboundPorts"), "{e}");
    assert!(Policy::istio_ambient(true, true).validate().is_ok());
}
