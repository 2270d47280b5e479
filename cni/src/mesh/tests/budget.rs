//! Each mesh's list annotations are held to the pod's share of the node-wide rule maps: a list
//! past it alone, or the pod's lists together, fail the ADD naming the annotation and the limit.

use serde_json::{Value, json};
use sidestep::enroll::{MAX_POD_CIDR_RULES, MAX_POD_PORT_RULES};

use super::{api, enrolled, istio_pod};
use crate::{
    config::Mesh,
    mesh::{AnnotationError, decide_pod, istio, kuma, linkerd},
    spec::{code, error::ToCniError},
};

fn ports(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn cidrs(n: usize) -> String {
    (0..n)
        .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
        .collect::<Vec<_>>()
        .join(",")
}

fn decide(mesh: Mesh, mut pod: Value, annotations: &[(&str, &str)]) -> Result<(), AnnotationError> {
    for (k, v) in annotations {
        pod["metadata"]["annotations"][*k] = json!(v);
    }
    decide_pod(mesh, &api(&pod)).map(|d| drop(enrolled(d)))
}

fn linkerd_pod() -> Value {
    json!({
        "metadata": {"name": "w", "namespace": "s",
                     "annotations": {"linkerd.io/proxy-version": "stable-2.14.10"}},
        "spec": {"containers": [{"name": "linkerd-proxy"}, {"name": "app"}]}
    })
}

fn kuma_pod() -> Value {
    json!({
        "metadata": {"name": "w", "namespace": "s",
                     "annotations": {"kuma.io/sidecar-injected": "true"}},
        "spec": {"containers": [{"name": "app"}, {"name": "kuma-sidecar"}]}
    })
}

/// The error a runtime shows: names `key` and `limit`, stays short whatever the list's length,
/// and is a bad annotation (101).
fn refused(e: &AnnotationError, key: &str, limit: usize) {
    assert_eq!(e.key, key, "{e}");
    let cni = e.to_cni();
    assert_eq!(cni.code, code::BAD_ANNOTATION);
    assert!(
        cni.msg.contains(key) && cni.msg.contains(&format!("{limit}")),
        "{}",
        cni.msg
    );
    assert!(cni.msg.len() < 1024, "{} bytes: {}", cni.msg.len(), cni.msg);
}

/// The pod of the issue: 30,000 ports in one annotation.
#[test]
fn istio_a_list_of_thousands_is_refused_naming_the_annotation() {
    for key in [
        istio::EXCLUDE_OUTBOUND_PORTS,
        istio::EXCLUDE_INBOUND_PORTS,
        istio::INCLUDE_INBOUND_PORTS,
        istio::INCLUDE_OUTBOUND_PORTS,
    ] {
        let e = decide(Mesh::Istio, istio_pod(), &[(key, &ports(1, 30_000))]).unwrap_err();
        refused(&e, key, MAX_POD_PORT_RULES);
    }
    for key in [
        istio::EXCLUDE_OUTBOUND_IP_RANGES,
        istio::INCLUDE_OUTBOUND_IP_RANGES,
    ] {
        let e = decide(Mesh::Istio, istio_pod(), &[(key, &cidrs(30_000))]).unwrap_err();
        refused(&e, key, MAX_POD_CIDR_RULES);
    }
}

/// Istio's four fixed inbound exclusions count: 508 more ports is the budget exactly.
#[test]
fn istio_at_the_budget_enrols_and_one_past_it_is_refused() {
    let key = istio::EXCLUDE_OUTBOUND_PORTS;
    let at = MAX_POD_PORT_RULES - 4;
    decide(Mesh::Istio, istio_pod(), &[(key, &ports(1, at))]).unwrap();
    let e = decide(Mesh::Istio, istio_pod(), &[(key, &ports(1, at + 1))]).unwrap_err();
    refused(&e, key, MAX_POD_PORT_RULES);
    assert!(
        e.reason.contains(&format!(
            "{key} ({}), {} (4)",
            at + 1,
            istio::EXCLUDE_INBOUND_PORTS
        )),
        "{e}"
    );
    // The include list's `*` is one entry: 255 exclusions fill the CIDR budget.
    let key = istio::EXCLUDE_OUTBOUND_IP_RANGES;
    let at = MAX_POD_CIDR_RULES - 1;
    decide(Mesh::Istio, istio_pod(), &[(key, &cidrs(at))]).unwrap();
    let e = decide(Mesh::Istio, istio_pod(), &[(key, &cidrs(at + 1))]).unwrap_err();
    refused(&e, key, MAX_POD_CIDR_RULES);
}

/// Two lists each within the budget, past it together: the error names the larger and lists
/// both.
#[test]
fn istio_lists_within_the_budget_alone_are_refused_together() {
    let e = decide(
        Mesh::Istio,
        istio_pod(),
        &[
            (istio::EXCLUDE_INBOUND_PORTS, &ports(1, 300)),
            (istio::EXCLUDE_OUTBOUND_PORTS, &ports(1, 250)),
        ],
    )
    .unwrap_err();
    refused(&e, istio::EXCLUDE_INBOUND_PORTS, MAX_POD_PORT_RULES);
    assert!(
        e.reason.contains("554 entries in SIDESTEP_PORTS")
            && e.reason.contains(istio::EXCLUDE_OUTBOUND_PORTS),
        "{e}"
    );
    let e = decide(
        Mesh::Istio,
        istio_pod(),
        &[
            (istio::INCLUDE_OUTBOUND_IP_RANGES, &cidrs(100)),
            (istio::EXCLUDE_OUTBOUND_IP_RANGES, &cidrs(200)),
        ],
    )
    .unwrap_err();
    refused(&e, istio::EXCLUDE_OUTBOUND_IP_RANGES, MAX_POD_CIDR_RULES);
    assert!(e.reason.contains("SIDESTEP_CIDRS"), "{e}");
}

/// Linkerd's ranges count each port: with its two and Istio's four fixed inbound exclusions,
/// `1-506` is the budget exactly.
#[test]
fn linkerd_ranges_count_every_port() {
    let key = linkerd::SKIP_OUTBOUND_PORTS;
    let at = MAX_POD_PORT_RULES - 6;
    decide(Mesh::Linkerd, linkerd_pod(), &[(key, &format!("1-{at}"))]).unwrap();
    let e = decide(
        Mesh::Linkerd,
        linkerd_pod(),
        &[(key, &format!("1-{}", at + 1))],
    )
    .unwrap_err();
    refused(&e, key, MAX_POD_PORT_RULES);
    // One range past the budget alone stops at parsing.
    let e = decide(
        Mesh::Linkerd,
        linkerd_pod(),
        &[(linkerd::SKIP_INBOUND_PORTS, "1-65535")],
    )
    .unwrap_err();
    refused(&e, linkerd::SKIP_INBOUND_PORTS, MAX_POD_PORT_RULES);
    let e = decide(
        Mesh::Linkerd,
        linkerd_pod(),
        &[(linkerd::SKIP_SUBNETS, &cidrs(MAX_POD_CIDR_RULES + 1))],
    )
    .unwrap_err();
    refused(&e, linkerd::SKIP_SUBNETS, MAX_POD_CIDR_RULES);
}

#[test]
fn kuma_lists_are_held_to_the_budget() {
    let key = kuma::EXCLUDE_OUTBOUND_IPS;
    decide(
        Mesh::Kuma,
        kuma_pod(),
        &[(key, &cidrs(MAX_POD_CIDR_RULES - 1))],
    )
    .unwrap();
    let e = decide(Mesh::Kuma, kuma_pod(), &[(key, &cidrs(MAX_POD_CIDR_RULES))]).unwrap_err();
    refused(&e, key, MAX_POD_CIDR_RULES);
    let e = decide(
        Mesh::Kuma,
        kuma_pod(),
        &[
            (kuma::EXCLUDE_INBOUND_PORTS, &ports(1, 300)),
            (kuma::EXCLUDE_OUTBOUND_PORTS, &ports(1, 300)),
        ],
    )
    .unwrap_err();
    // The inbound list also holds the virtual probes' port and Istio's four: the larger.
    refused(&e, kuma::EXCLUDE_INBOUND_PORTS, MAX_POD_PORT_RULES);
    assert!(e.reason.contains("605 entries"), "{e}");
}
