use std::collections::BTreeSet;

use serde_json::{Value, json};
use sidestep::policy::{Policy, PortSet};

use crate::{
    config::Mesh,
    mesh::{
        AnnotationError, SkipReason, decide_pod, kuma,
        tests::{api, enrolled, skipped},
    },
};

fn kuma_pod() -> Value {
    json!({
        "metadata": {"name": "w", "namespace": "s",
                     "annotations": {"kuma.io/sidecar-injected": "true"}},
        "spec": {"containers": [{"name": "app"}, {"name": "kuma-sidecar"}]}
    })
}

fn kuma_with(key: &str, value: &str) -> Result<Policy, AnnotationError> {
    let mut v = kuma_pod();
    v["metadata"]["annotations"][key] = json!(value);
    decide_pod(Mesh::Kuma, &api(&v)).map(enrolled)
}

#[test]
fn kuma_rules() {
    let p = enrolled(decide_pod(Mesh::Kuma, &api(&kuma_pod())).unwrap());
    assert_eq!(
        (p.outbound_port, p.inbound_port, p.proxy_uid),
        (15001, 15006, 5678)
    );
    assert_eq!(
        p.exclude_inbound_ports,
        PortSet::Only(BTreeSet::from([9000, 9901]))
    );
    assert_eq!(
        p.exclude_outbound_ports,
        PortSet::Only(BTreeSet::from([9901]))
    );
    assert!(!p.dns_capture && p.capture_ipv6);

    let mut v = kuma_pod();
    v["spec"]["initContainers"] = json!([{"name": "kuma-init"}]);
    assert_eq!(
        skipped(&decide_pod(Mesh::Kuma, &api(&v)).unwrap()),
        &SkipReason::InitContainer("kuma-init")
    );
    let mut v = kuma_pod();
    v["spec"]["containers"] = json!([{"name": "app"}]);
    assert!(matches!(
        skipped(&decide_pod(Mesh::Kuma, &api(&v)).unwrap()),
        SkipReason::NoProxyContainer { .. }
    ));
    let mut v = kuma_pod();
    v["metadata"]["annotations"]["kuma.io/sidecar-injected"] = json!("false");
    assert!(matches!(
        skipped(&decide_pod(Mesh::Kuma, &api(&v)).unwrap()),
        SkipReason::NotInjected(_)
    ));
}

#[test]
fn kuma_annotations() {
    assert_eq!(
        kuma_with(kuma::SIDECAR_UID, "5679").unwrap().proxy_uid,
        5679
    );
    assert_eq!(
        kuma_with(kuma::INBOUND_PORT, "16006").unwrap().inbound_port,
        16006
    );
    assert_eq!(
        kuma_with(kuma::OUTBOUND_PORT, "16001")
            .unwrap()
            .outbound_port,
        16001
    );
    assert!(
        !kuma_with(kuma::IP_FAMILY_MODE, "ipv4")
            .unwrap()
            .capture_ipv6
    );
    let p = kuma_with(kuma::EXCLUDE_INBOUND_PORTS, "8443").unwrap();
    assert_eq!(
        p.exclude_inbound_ports,
        PortSet::Only(BTreeSet::from([8443, 9000]))
    );
    let p = kuma_with(kuma::VIRTUAL_PROBES, "disabled").unwrap();
    assert_eq!(
        p.exclude_inbound_ports,
        PortSet::Only(BTreeSet::from([9901]))
    );
    let p = kuma_with(kuma::EXCLUDE_OUTBOUND_PORTS, "53").unwrap();
    assert_eq!(
        p.exclude_outbound_ports,
        PortSet::Only(BTreeSet::from([53]))
    );
    let p = kuma_with(kuma::EXCLUDE_OUTBOUND_IPS, "10.0.0.1,172.16.0.0/12").unwrap();
    assert!(!p.exclude_outbound_ip_ranges.is_empty());
    let p = kuma_with(kuma::BUILTIN_DNS, "enabled").unwrap();
    assert!(p.dns_capture && p.dns_port == 15053);
    for (k, bad) in [
        (kuma::SIDECAR_UID, "-1"),
        (kuma::INBOUND_PORT, "70000"),
        (kuma::INBOUND_PORT, "15001"),
        (kuma::OUTBOUND_PORT, "x"),
        (kuma::IP_FAMILY_MODE, "ipv5"),
        (kuma::EXCLUDE_INBOUND_PORTS, "65536"),
        (kuma::EXCLUDE_OUTBOUND_IPS, "10.0.0.0/33"),
        (kuma::BUILTIN_DNS, "yes"),
        (kuma::BUILTIN_DNS_PORT, "0"),
        (kuma::VIRTUAL_PROBES_PORT, "99999"),
    ] {
        let mut v = kuma_pod();
        v["metadata"]["annotations"][k] = json!(bad);
        if k == kuma::BUILTIN_DNS_PORT {
            v["metadata"]["annotations"][kuma::BUILTIN_DNS] = json!("true");
        }
        let e = decide_pod(Mesh::Kuma, &api(&v)).unwrap_err();
        assert_eq!(e.key, k, "{k}={bad}: {e}");
    }
}
