use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use sidestep::policy::{CidrSet, Policy, PortSet};

use crate::{
    config::Mesh,
    mesh::{
        AnnotationError, Decision, SkipReason, decide_pod, linkerd,
        tests::{api, enrolled, skipped},
    },
    pod::PodInfo,
};

fn linkerd_pod() -> Value {
    json!({
        "metadata": {"name": "w", "namespace": "s",
                     "annotations": {"linkerd.io/proxy-version": "stable-2.14.10"}},
        "spec": {"initContainers": [{"name": "linkerd-network-validator"}],
                 "containers": [{"name": "linkerd-proxy"}, {"name": "app"}]}
    })
}

fn linkerd_with(key: &str, value: &str) -> Result<Policy, AnnotationError> {
    let mut v = linkerd_pod();
    v["metadata"]["annotations"][key] = json!(value);
    decide_pod(Mesh::Linkerd, &api(&v)).map(enrolled)
}

#[test]
fn linkerd_rules() {
    let d = decide_pod(Mesh::Linkerd, &api(&linkerd_pod())).unwrap();
    let Decision::Enrol(e) = d else { panic!() };
    assert!(!e.hairpin);
    let p = e.policy;
    assert_eq!(
        (p.outbound_port, p.inbound_port, p.proxy_uid),
        (4140, 4143, 2102)
    );
    assert_eq!(
        p.exclude_inbound_ports,
        PortSet::Only(BTreeSet::from([4190, 4191]))
    );
    assert!(p.exclude_outbound_ports.is_empty() && !p.dns_capture);

    let mut v = linkerd_pod();
    v["spec"]["initContainers"] = json!([{"name": "linkerd-init"}]);
    assert_eq!(
        skipped(&decide_pod(Mesh::Linkerd, &api(&v)).unwrap()),
        &SkipReason::InitContainer("linkerd-init")
    );
    let mut v = linkerd_pod();
    v["spec"]["containers"] = json!([{"name": "app"}]);
    assert!(matches!(
        skipped(&decide_pod(Mesh::Linkerd, &api(&v)).unwrap()),
        SkipReason::NoProxyContainer {
            want: "linkerd-proxy",
            ..
        }
    ));
    // Native sidecar.
    v["spec"]["initContainers"] = json!([{"name": "linkerd-proxy", "restartPolicy": "Always"}]);
    enrolled(decide_pod(Mesh::Linkerd, &api(&v)).unwrap());
    let ann = |m: BTreeMap<String, String>| PodInfo::from_annotations("w", "s", m);
    assert!(matches!(
        skipped(&decide_pod(Mesh::Linkerd, &ann(BTreeMap::new())).unwrap()),
        SkipReason::NotInjected(_)
    ));
    let m = BTreeMap::from([
        ("linkerd.io/proxy-version".to_owned(), "x".to_owned()),
        ("linkerd.io/inject".to_owned(), "disabled".to_owned()),
    ]);
    assert!(matches!(
        skipped(&decide_pod(Mesh::Linkerd, &ann(m)).unwrap()),
        SkipReason::InjectDisabled { .. }
    ));
}

#[test]
fn linkerd_annotations() {
    let p = linkerd_with(linkerd::SKIP_INBOUND_PORTS, "8080,9000-9002").unwrap();
    assert_eq!(
        p.exclude_inbound_ports,
        PortSet::Only(BTreeSet::from([4190, 4191, 8080, 9000, 9001, 9002]))
    );
    let p = linkerd_with(linkerd::SKIP_OUTBOUND_PORTS, "25,587").unwrap();
    assert_eq!(
        p.exclude_outbound_ports,
        PortSet::Only(BTreeSet::from([25, 587]))
    );
    let p = linkerd_with(linkerd::SKIP_SUBNETS, "10.96.0.0/12").unwrap();
    assert_eq!(
        p.exclude_outbound_ip_ranges,
        CidrSet::Only(vec!["10.96.0.0/12".parse().unwrap()])
    );
    let p = linkerd_with(linkerd::PROXY_UID_ANNOTATION, "2103").unwrap();
    assert_eq!((p.proxy_uid, p.proxy_gid), (2103, 2103));
    for (k, bad) in [
        (linkerd::SKIP_INBOUND_PORTS, "70000"),
        (linkerd::SKIP_INBOUND_PORTS, "9002-9000"),
        (linkerd::SKIP_OUTBOUND_PORTS, "1-65535"),
        (linkerd::SKIP_SUBNETS, "10.0.0.0/33"),
        (linkerd::SKIP_SUBNETS, "*"),
        (linkerd::PROXY_UID_ANNOTATION, "-1"),
        (linkerd::PROXY_UID_ANNOTATION, "root"),
    ] {
        let e = linkerd_with(k, bad).unwrap_err();
        assert_eq!((e.key.as_str(), e.value.as_str()), (k, bad));
    }
}
