//! Invariants shared by the fuzz targets. Every check panics (so libFuzzer records a crash) when
//! a parser accepts something it should not, or produces a value that does not survive its own
//! formatting.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde_json::Value;
use sidestep::policy::{self, CidrSet, Policy, PortSet};
use sidestep_abi::CIDR_KEY_FIXED_BITS;
use sidestep_cni::{
    config::Mesh,
    mesh::{self, AnnotationError, Decision, istio, kuma, linkerd},
    pod::{Container, PodInfo, PodSource},
    spec::{code, env::valid_ifname, error::ToCniError},
};

pub const MESHES: [Mesh; 3] = [Mesh::Istio, Mesh::Linkerd, Mesh::Kuma];

/// A parsed CIDR is canonical: its prefix fits its family and no host bits are set.
pub fn check_cidr(net: &IpNet) {
    assert!(
        net.prefix_len() <= net.max_prefix_len(),
        "prefix of {net} past its family"
    );
    assert_eq!(*net, net.trunc(), "{net} has host bits set");
    let text = net.to_string();
    let again = policy::parse_cidr("f", &text).unwrap_or_else(|e| panic!("{text} re-parse: {e}"));
    assert_eq!(again, *net, "{text} re-parses differently");
}

pub fn check_port_set(what: &str, set: &PortSet) {
    if let PortSet::Only(s) = set {
        assert!(!s.contains(&0), "{what}: port 0 in {s:?}");
    }
    let text = String::from(set.clone());
    let again = policy::parse_port_set("f", &text)
        .unwrap_or_else(|e| panic!("{what}: {text:?} does not re-parse: {e}"));
    assert_eq!(&again, set, "{what}: {text:?} re-parses differently");
}

pub fn check_cidr_set(what: &str, set: &CidrSet) {
    if let CidrSet::Only(v) = set {
        v.iter().for_each(check_cidr);
    }
    let text = String::from(set.clone());
    let again = policy::parse_cidr_set("f", &text)
        .unwrap_or_else(|e| panic!("{what}: {text:?} does not re-parse: {e}"));
    assert_eq!(&again, set, "{what}: {text:?} re-parses differently");
}

/// What every policy must satisfy, valid or not: canonical lists, a JSON form that decodes to
/// the same policy, and map entries the programs can use.
pub fn check_policy(p: &Policy) {
    check_cidr_set("includeOutboundIPRanges", &p.include_outbound_ip_ranges);
    check_cidr_set("excludeOutboundIPRanges", &p.exclude_outbound_ip_ranges);
    check_port_set("includeOutboundPorts", &p.include_outbound_ports);
    check_port_set("excludeOutboundPorts", &p.exclude_outbound_ports);
    check_port_set("includeInboundPorts", &p.include_inbound_ports);
    check_port_set("excludeInboundPorts", &p.exclude_inbound_ports);

    let json = serde_json::to_string(p).expect("a policy serialises");
    let back: Policy = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("policy JSON {json} does not decode: {e}"));
    assert_eq!(&back, p, "policy JSON {json} decodes differently");

    let entries = p.to_map_entries(0x0123_4567_89ab_cdef);
    assert_eq!(entries.pod.proxy_uid, p.proxy_uid);
    assert_eq!(entries.pod.outbound_port, p.outbound_port);
    assert_eq!(entries.pod.inbound_port, p.inbound_port);
    assert_eq!(entries.addresses.len(), p.pod_ips.len());
    for k in &entries.ports {
        assert!((1..=65535).contains(&k.port), "port key {k:?}");
    }
    for (bits, key) in &entries.cidrs {
        assert!(
            (CIDR_KEY_FIXED_BITS..=CIDR_KEY_FIXED_BITS + 128).contains(bits),
            "CIDR key length {bits}"
        );
        // LPM keys carry no bits past their prefix.
        let prefix = (bits - CIDR_KEY_FIXED_BITS) as usize;
        let addr = u128::from_be_bytes(key.addr);
        let host = if prefix == 128 {
            0
        } else {
            addr & (u128::MAX >> prefix)
        };
        assert_eq!(host, 0, "CIDR key {key:?}/{prefix} has host bits");
    }
}

/// A policy that goes to the data path.
pub fn check_enrolled_policy(p: &Policy) {
    p.validate()
        .unwrap_or_else(|e| panic!("enrolled policy does not validate: {e}: {p:?}"));
    check_policy(p);
}

/// A policy built from annotations: also only interface names the kernel could have.
/// (The JSON policy does not check names; they only ever filter the netns's own interfaces.)
fn check_mesh_policy(p: &Policy) {
    check_enrolled_policy(p);
    for name in p
        .exclude_interfaces
        .iter()
        .chain(&p.reroute_virtual_interfaces)
    {
        valid_ifname(name).unwrap_or_else(|e| panic!("interface in policy: {e}"));
    }
}

/// An annotation error names an annotation the pod carries and quotes (part of) its value:
/// every default parses, so nothing else can be at fault.
fn check_annotation_error(mesh: Mesh, pod: &PodInfo, e: &AnnotationError) {
    assert_eq!(e.to_cni().code, code::BAD_ANNOTATION);
    match pod.annotations.get(&e.key) {
        Some(v) => assert!(
            v.contains(&e.value),
            "{mesh:?}: error quotes {:?}, annotation {}={v:?}",
            e.value,
            e.key
        ),
        None => {
            let from_proxy_spec =
                mesh == Mesh::Istio && e.key.starts_with("istio-proxy securityContext.");
            // Kuma's inbound port clashes with an outbound port set by annotation.
            let kuma_clash = mesh == Mesh::Kuma
                && e.key == kuma::INBOUND_PORT
                && pod.annotations.contains_key(kuma::OUTBOUND_PORT);
            assert!(
                from_proxy_spec || kuma_clash,
                "{mesh:?}: error names {} which the pod does not carry: {e}",
                e.key
            );
        }
    }
}

/// Decides for `mesh` and checks the outcome. Returns the decision for cross-checks.
pub fn check_decision(mesh: Mesh, pod: &PodInfo) -> Result<Decision, AnnotationError> {
    let d = mesh::decide_pod(mesh, pod);
    assert_eq!(
        mesh::decide_pod(mesh, pod),
        d,
        "decision is not deterministic"
    );
    match &d {
        Ok(Decision::Enrol(e)) => {
            check_mesh_policy(&e.policy);
            assert_eq!(e.hairpin, mesh != Mesh::Linkerd, "{mesh:?} hairpin");
            if mesh == Mesh::Linkerd {
                assert!(
                    !matches!(e.policy.exclude_outbound_ip_ranges, CidrSet::All),
                    "linkerd skips every subnet"
                );
                let PortSet::Only(s) = &e.policy.exclude_inbound_ports else {
                    panic!("linkerd inbound excludes are `*`");
                };
                assert!(
                    s.contains(&4190) && s.contains(&4191),
                    "linkerd admin ports"
                );
            }
            if mesh == Mesh::Kuma {
                assert_ne!(e.policy.inbound_port, e.policy.outbound_port);
            }
        }
        Ok(Decision::Skip(r)) => {
            let _ = r.to_string();
        }
        Err(e) => check_annotation_error(mesh, pod, e),
    }
    d
}

/// Linkerd's and Kuma's policies read annotations only, so the pod's source must not matter.
pub fn check_source_independence(runtime: &PodInfo, api: &PodInfo) {
    assert_eq!(runtime.annotations, api.annotations);
    assert_eq!(
        linkerd::policy(runtime),
        linkerd::policy(api),
        "linkerd policy depends on the pod source"
    );
    assert_eq!(
        kuma::policy(runtime),
        kuma::policy(api),
        "kuma policy depends on the pod source"
    );
    // Istio reads the proxy's UID, GID and DNS env from the container when there is one; with
    // none of those set, only DNS capture may differ (the runtime path reads proxy.istio.io/config).
    let bare = api
        .container(istio::PROXY)
        .filter(|c| c.run_as_user.is_none() && c.run_as_group.is_none() && c.env.is_empty());
    if bare.is_some() {
        let a = istio::policy(runtime, None);
        let b = istio::policy(api, bare);
        match (a, b) {
            (Ok(mut a), Ok(b)) => {
                a.dns_capture = b.dns_capture;
                assert_eq!(a, b, "istio policy depends on the pod source");
            }
            (Err(a), Err(b)) => assert_eq!(a, b),
            (a, b) => panic!("istio policy: runtime {a:?}, api {b:?}"),
        }
    }
}

/// A pod with the same annotations as `runtime`, as the API would show it, with the proxy and
/// init containers of `mesh` as `containers` names them.
pub fn api_pod(
    runtime: &PodInfo,
    containers: Vec<Container>,
    labels: BTreeMap<String, String>,
) -> PodInfo {
    PodInfo {
        source: PodSource::Api,
        labels,
        containers,
        ..runtime.clone()
    }
}

/// Strips `cniVersion`, which a chained plugin rewrites and nothing else.
pub fn without_version(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("cniVersion");
    }
    v
}
