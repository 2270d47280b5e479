use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use sidestep::policy::{CidrSet, InterceptionMode, Policy, PortSet};

use super::*;
use crate::{
    config::PluginConfig,
    pod::{PodInfo, PodSource},
    spec::Command,
};

fn cfg(extra: Value) -> PluginConfig {
    let mut v = json!({"cniVersion": "1.0.0", "name": "n", "type": "sidestep"});
    for (k, val) in extra.as_object().unwrap() {
        v[k] = val.clone();
    }
    PluginConfig::parse(&serde_json::to_vec(&v).unwrap(), Command::Add).unwrap()
}

fn args(s: &str) -> CniArgs {
    CniArgs::parse(s).unwrap()
}

const K8S: &str = "IgnoreUnknown=1;K8S_POD_NAME=web-1;K8S_POD_NAMESPACE=shop";

/// An injected Istio pod as the API serves it.
fn istio_pod() -> Value {
    json!({
        "metadata": {"name": "web-1", "namespace": "shop", "labels": {},
                     "annotations": {"sidecar.istio.io/status":
                        "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"]}"}},
        "spec": {
            "initContainers": [{"name": "istio-validation"}],
            "containers": [{"name": "app"},
                           {"name": "istio-proxy", "args": ["proxy", "sidecar"], "env": []}]
        },
        "status": {"podIPs": [{"ip": "10.0.0.7"}]}
    })
}

pub(crate) fn api(v: &Value) -> PodInfo {
    PodInfo::from_api_json(v).unwrap()
}

fn decide_istio(v: &Value) -> Decision {
    decide_pod(Mesh::Istio, &api(v)).unwrap()
}

pub(crate) fn skipped(d: &Decision) -> &SkipReason {
    match d {
        Decision::Skip(r) => r,
        Decision::Enrol(_) => panic!("enrolled, expected a skip"),
    }
}

pub(crate) fn enrolled(d: Decision) -> Policy {
    match d {
        Decision::Enrol(e) => e.policy,
        Decision::Skip(r) => panic!("skipped: {r}"),
    }
}

// --- Rules before the pod is read -------------------------------------------------------------

#[test]
fn no_identity_without_policy_is_skipped() {
    let c = cfg(json!({}));
    for a in [
        "",
        "IgnoreUnknown=1;K8S_POD_NAME=web",
        "K8S_POD_NAMESPACE=shop",
    ] {
        assert_eq!(
            before_pod_read(&c, &args(a)),
            PreDecision::Skip(SkipReason::NoKubernetesIdentity),
            "{a}"
        );
    }
}

#[test]
fn no_identity_with_policy_uses_it() {
    let c = cfg(json!({"policy": {"proxyUid": 1500}}));
    let PreDecision::ConfigPolicy(p) = before_pod_read(&c, &args("K8S_POD_NAME=web")) else {
        panic!("expected the config policy");
    };
    assert_eq!(p.proxy_uid, 1500);
    // With an identity, the pod's own data decides.
    assert!(matches!(
        before_pod_read(&c, &args(K8S)),
        PreDecision::ReadPod(_)
    ));
}

#[test]
fn excluded_namespace_both_shapes() {
    for extra in [
        json!({"exclude_namespaces": ["shop"]}),
        json!({"kubernetes": {"exclude_namespaces": ["shop"]}}),
    ] {
        assert_eq!(
            before_pod_read(&cfg(extra), &args(K8S)),
            PreDecision::Skip(SkipReason::NamespaceExcluded("shop".into()))
        );
    }
}

#[test]
fn agent_pod_is_skipped() {
    let c = cfg(json!({"pod_namespace": "sidestep-system"}));
    let a = args("K8S_POD_NAME=sidestep-agent-x7;K8S_POD_NAMESPACE=sidestep-system");
    assert_eq!(
        before_pod_read(&c, &a),
        PreDecision::Skip(SkipReason::AgentPod)
    );
    let a = args("K8S_POD_NAME=sidestep-agent-x7;K8S_POD_NAMESPACE=default");
    assert!(matches!(before_pod_read(&c, &a), PreDecision::ReadPod(_)));
}

#[test]
fn identity_goes_to_the_pod_read() {
    let PreDecision::ReadPod(id) = before_pod_read(&cfg(json!({})), &args(K8S)) else {
        panic!()
    };
    assert_eq!(id.to_string(), "shop/web-1");
}

// --- Istio pod rules, in istio-cni's order ----------------------------------------------------

#[test]
fn istio_injected_pod_is_enrolled_with_defaults() {
    let p = enrolled(decide_istio(&istio_pod()));
    let want = Policy {
        exclude_inbound_ports: PortSet::Only(BTreeSet::from([15020])),
        exclude_outbound_ports: PortSet::Only(BTreeSet::from([15020])),
        ..Policy::default()
    };
    assert_eq!(p, want);
}

#[test]
fn istio_init_container_skips() {
    let mut v = istio_pod();
    v["spec"]["initContainers"] = json!([{"name": "istio-init"}]);
    assert_eq!(
        skipped(&decide_istio(&v)),
        &SkipReason::InitContainer("istio-init")
    );
}

#[test]
fn skip_codes_are_fixed_names() {
    // The agent counts skipped pods by these (a metric label) and warns on istio-init.
    assert_eq!(SkipReason::InitContainer("istio-init").code(), "istio-init");
    assert_eq!(
        SkipReason::NamespaceExcluded("any-namespace".into()).code(),
        "namespace-excluded"
    );
}

#[test]
fn istio_disable_envoy_skips() {
    let mut v = istio_pod();
    v["spec"]["containers"][1]["env"] = json!([{"name": "DISABLE_ENVOY", "value": "true"}]);
    assert_eq!(
        skipped(&decide_istio(&v)),
        &SkipReason::ProxyDisabled("DISABLE_ENVOY")
    );
    v["spec"]["containers"][1]["env"] = json!([{"name": "DISABLE_ENVOY", "value": "false"}]);
    enrolled(decide_istio(&v));
}

#[test]
fn istio_no_proxy_container_skips_and_native_sidecar_counts() {
    let mut v = istio_pod();
    v["spec"]["containers"] = json!([{"name": "app"}]);
    assert!(matches!(
        skipped(&decide_istio(&v)),
        SkipReason::NoProxyContainer {
            want: "istio-proxy",
            ..
        }
    ));
    v["spec"]["initContainers"] =
        json!([{"name": "istio-proxy", "restartPolicy": "Always", "args": ["proxy", "sidecar"]}]);
    enrolled(decide_istio(&v));
}

#[test]
fn istio_gateway_proxy_type_skips() {
    let mut v = istio_pod();
    v["spec"]["containers"][1]["args"] = json!(["proxy", "router"]);
    assert_eq!(
        skipped(&decide_istio(&v)),
        &SkipReason::ProxyType("router".into())
    );
}

#[test]
fn istio_inject_false_label_wins_over_annotation() {
    let mut v = istio_pod();
    v["metadata"]["annotations"]["sidecar.istio.io/inject"] = json!("false");
    assert!(matches!(
        skipped(&decide_istio(&v)),
        SkipReason::InjectDisabled {
            from_label: false,
            ..
        }
    ));
    v["metadata"]["labels"]["sidecar.istio.io/inject"] = json!("true");
    enrolled(decide_istio(&v));
    v["metadata"]["labels"]["sidecar.istio.io/inject"] = json!("false");
    v["metadata"]["annotations"]["sidecar.istio.io/inject"] = json!("true");
    assert!(matches!(
        skipped(&decide_istio(&v)),
        SkipReason::InjectDisabled {
            from_label: true,
            ..
        }
    ));
}

#[test]
fn istio_without_status_skips() {
    let mut v = istio_pod();
    v["metadata"]["annotations"] = json!({});
    assert_eq!(
        skipped(&decide_istio(&v)),
        &SkipReason::NotInjected("sidecar.istio.io/status")
    );
}

#[test]
fn istio_runtime_annotations_use_the_status_container_lists() {
    let pod = |status: &str| {
        PodInfo::from_annotations(
            "web-1",
            "shop",
            BTreeMap::from([("sidecar.istio.io/status".to_owned(), status.to_owned())]),
        )
    };
    let ok = pod(r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#);
    assert_eq!(ok.source, PodSource::RuntimeAnnotations);
    enrolled(decide_pod(Mesh::Istio, &ok).unwrap());
    let native = pod(r#"{"initContainers":["istio-proxy"],"containers":[]}"#);
    enrolled(decide_pod(Mesh::Istio, &native).unwrap());
    let old = pod(r#"{"initContainers":["istio-init"],"containers":["istio-proxy"]}"#);
    assert_eq!(
        skipped(&decide_pod(Mesh::Istio, &old).unwrap()),
        &SkipReason::InitContainer("istio-init")
    );
    let none = pod(r#"{"containers":["app"]}"#);
    assert!(matches!(
        skipped(&decide_pod(Mesh::Istio, &none).unwrap()),
        SkipReason::NoProxyContainer { .. }
    ));
    let e = decide_pod(Mesh::Istio, &pod("not json")).unwrap_err();
    assert_eq!(e.key, "sidecar.istio.io/status");
    let empty = PodInfo::from_annotations("web-1", "shop", BTreeMap::new());
    assert!(matches!(
        skipped(&decide_pod(Mesh::Istio, &empty).unwrap()),
        SkipReason::NoProxyContainer { .. }
    ));
}

// --- Istio annotations: each with its default and a bad value ---------------------------------

fn istio_with(key: &str, value: &str) -> Result<Policy, AnnotationError> {
    let mut v = istio_pod();
    v["metadata"]["annotations"][key] = json!(value);
    decide_pod(Mesh::Istio, &api(&v)).map(enrolled)
}

fn istio_bad(key: &str, value: &str) {
    let e = istio_with(key, value).unwrap_err();
    assert_eq!(e.key, key);
    assert_eq!(e.value, value);
    let msg = e.to_string();
    assert!(msg.contains(key) && msg.contains(value), "{msg}");
}

#[test]
fn interception_mode() {
    assert_eq!(
        enrolled(decide_istio(&istio_pod())).interception_mode,
        InterceptionMode::Redirect
    );
    assert_eq!(
        istio_with(istio::INTERCEPTION_MODE, "TPROXY")
            .unwrap()
            .interception_mode,
        InterceptionMode::Tproxy
    );
    istio_bad(istio::INTERCEPTION_MODE, "NONE");
    istio_bad(istio::INTERCEPTION_MODE, "redirect");
}

#[test]
fn outbound_ip_ranges() {
    let d = enrolled(decide_istio(&istio_pod()));
    assert_eq!(d.include_outbound_ip_ranges, CidrSet::All);
    assert!(d.exclude_outbound_ip_ranges.is_empty());
    let p = istio_with(istio::INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8, fd00::/8").unwrap();
    assert_eq!(
        p.include_outbound_ip_ranges,
        CidrSet::Only(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00::/8".parse().unwrap()
        ])
    );
    assert!(
        istio_with(istio::INCLUDE_OUTBOUND_IP_RANGES, "")
            .unwrap()
            .include_outbound_ip_ranges
            .is_empty()
    );
    let p = istio_with(istio::EXCLUDE_OUTBOUND_IP_RANGES, "169.254.169.254/32").unwrap();
    assert_eq!(
        p.exclude_outbound_ip_ranges,
        CidrSet::Only(vec!["169.254.169.254/32".parse().unwrap()])
    );
    istio_bad(istio::INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/33");
    istio_bad(istio::EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8,banana");
}

#[test]
fn inbound_ports() {
    let d = enrolled(decide_istio(&istio_pod()));
    assert_eq!(d.include_inbound_ports, PortSet::All);
    let p = istio_with(istio::INCLUDE_INBOUND_PORTS, "80,8080").unwrap();
    assert_eq!(
        p.include_inbound_ports,
        PortSet::Only(BTreeSet::from([80, 8080]))
    );
    let p = istio_with(istio::EXCLUDE_INBOUND_PORTS, "9090").unwrap();
    assert_eq!(
        p.exclude_inbound_ports,
        PortSet::Only(BTreeSet::from([9090]))
    );
    assert!(
        p.effective_inbound_excludes()
            .is_superset(&BTreeSet::from([15008, 15020, 15021, 15090, 9090]))
    );
    let p = istio_with(istio::EXCLUDE_INBOUND_PORTS, "*").unwrap();
    assert!(p.include_inbound_ports.is_empty());
    istio_bad(istio::INCLUDE_INBOUND_PORTS, "70000");
    istio_bad(istio::EXCLUDE_INBOUND_PORTS, "80,0");
}

#[test]
fn outbound_ports() {
    let d = enrolled(decide_istio(&istio_pod()));
    assert!(d.include_outbound_ports.is_empty());
    assert_eq!(
        d.exclude_outbound_ports,
        PortSet::Only(BTreeSet::from([15020]))
    );
    let p = istio_with(istio::INCLUDE_OUTBOUND_PORTS, "5432").unwrap();
    assert_eq!(
        p.include_outbound_ports,
        PortSet::Only(BTreeSet::from([5432]))
    );
    let p = istio_with(istio::EXCLUDE_OUTBOUND_PORTS, "3306, 6379").unwrap();
    assert_eq!(
        p.exclude_outbound_ports,
        PortSet::Only(BTreeSet::from([3306, 6379]))
    );
    let p = istio_with(istio::EXCLUDE_OUTBOUND_PORTS, "").unwrap();
    assert!(p.exclude_outbound_ports.is_empty());
    let p = istio_with(istio::EXCLUDE_OUTBOUND_PORTS, "*").unwrap();
    assert!(p.include_outbound_ip_ranges.is_empty() && p.include_outbound_ports.is_empty());
    istio_bad(istio::INCLUDE_OUTBOUND_PORTS, "http");
    istio_bad(istio::EXCLUDE_OUTBOUND_PORTS, "-1");
}

#[test]
fn interfaces_and_virtual_interfaces() {
    let d = enrolled(decide_istio(&istio_pod()));
    assert!(d.exclude_interfaces.is_empty() && d.reroute_virtual_interfaces.is_empty());
    let p = istio_with(istio::EXCLUDE_INTERFACES, "net1, net2").unwrap();
    assert_eq!(p.exclude_interfaces, ["net1", "net2"]);
    istio_bad(istio::EXCLUDE_INTERFACES, "a-very-long-interface-name");
    let p = istio_with(istio::REROUTE_VIRTUAL_INTERFACES, "tap0").unwrap();
    assert_eq!(p.reroute_virtual_interfaces, ["tap0"]);
    let p = istio_with(istio::KUBEVIRT_INTERFACES, "k6t-eth0").unwrap();
    assert_eq!(p.reroute_virtual_interfaces, ["k6t-eth0"]);
    istio_bad(istio::REROUTE_VIRTUAL_INTERFACES, "bad/name");
    // The new spelling wins over the deprecated one.
    let mut v = istio_pod();
    v["metadata"]["annotations"][istio::REROUTE_VIRTUAL_INTERFACES] = json!("tap0");
    v["metadata"]["annotations"][istio::KUBEVIRT_INTERFACES] = json!("k6t-eth0");
    assert_eq!(
        enrolled(decide_istio(&v)).reroute_virtual_interfaces,
        ["tap0"]
    );
}

#[test]
fn proxy_uid_gid_from_security_context() {
    let mut v = istio_pod();
    v["spec"]["containers"][1]["securityContext"] = json!({"runAsUser": 1500, "runAsGroup": 1600});
    let p = enrolled(decide_istio(&v));
    assert_eq!((p.proxy_uid, p.proxy_gid), (1500, 1600));
    v["spec"]["containers"][1]["securityContext"] = json!({"runAsUser": 0, "runAsGroup": 0});
    let p = enrolled(decide_istio(&v));
    assert_eq!((p.proxy_uid, p.proxy_gid), (1337, 1337));
    v["spec"]["containers"][1]["securityContext"] = json!({"runAsUser": -1});
    let e = decide_pod(Mesh::Istio, &api(&v)).unwrap_err();
    assert!(e.key.contains("runAsUser") && e.value == "-1", "{e}");
}

#[test]
fn dns_capture_from_proxy_env() {
    assert!(!enrolled(decide_istio(&istio_pod())).dns_capture);
    let mut v = istio_pod();
    v["spec"]["containers"][1]["env"] =
        json!([{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}]);
    assert!(enrolled(decide_istio(&v)).dns_capture);
    // A value istio-cni cannot parse leaves DNS capture off, with a warning, as istio-cni does.
    v["spec"]["containers"][1]["env"] = json!([{"name": "ISTIO_META_DNS_CAPTURE", "value": "yes"}]);
    assert!(!enrolled(decide_istio(&v)).dns_capture);
    let ann = PodInfo::from_annotations(
        "w",
        "s",
        BTreeMap::from([
            (
                "sidecar.istio.io/status".to_owned(),
                r#"{"containers":["istio-proxy"]}"#.to_owned(),
            ),
            (
                istio::PROXY_CONFIG.to_owned(),
                r#"{"proxyMetadata":{"ISTIO_META_DNS_CAPTURE":"true"}}"#.to_owned(),
            ),
        ]),
    );
    assert!(enrolled(decide_pod(Mesh::Istio, &ann).unwrap()).dns_capture);
}

#[test]
fn sk_msg_annotation_opts_a_pod_in_for_every_mesh() {
    assert!(
        !istio_with("traffic.sidecar.istio.io/excludeInboundPorts", "")
            .unwrap()
            .sk_msg
    );
    assert!(istio_with(SK_MSG_ANNOTATION, "true").unwrap().sk_msg);
    assert!(!istio_with(SK_MSG_ANNOTATION, "false").unwrap().sk_msg);
    let e = istio_with(SK_MSG_ANNOTATION, "yes").unwrap_err();
    assert!(e.key == SK_MSG_ANNOTATION && e.value == "yes", "{e}");
    let linkerd = PodInfo::from_annotations(
        "web-1",
        "shop",
        BTreeMap::from([
            (
                "linkerd.io/proxy-version".to_owned(),
                "edge-26.8.1".to_owned(),
            ),
            (SK_MSG_ANNOTATION.to_owned(), "true".to_owned()),
        ]),
    );
    assert!(enrolled(decide_pod(Mesh::Linkerd, &linkerd).unwrap()).sk_msg);
}

#[test]
fn the_debug_annotation_turns_on_the_verdict_log() {
    assert!(!istio_with(SK_MSG_ANNOTATION, "true").unwrap().debug);
    assert!(istio_with(DEBUG_ANNOTATION, "true").unwrap().debug);
    assert!(!istio_with(DEBUG_ANNOTATION, "false").unwrap().debug);
    let e = istio_with(DEBUG_ANNOTATION, "1").unwrap_err();
    assert!(e.key == DEBUG_ANNOTATION && e.value == "1", "{e}");
}

/// A plain app pod (no sidecar) with these pod labels, annotations and namespace labels.
fn plain_pod(labels: Value, annotations: Value, ns_labels: Value) -> Value {
    json!({
        "metadata": {"name": "web-1", "namespace": "shop", "labels": labels,
                     "annotations": annotations},
        "spec": {"containers": [{"name": "app"}]},
        "status": {"podIPs": [{"ip": "10.0.0.7"}]},
        crate::pod::NAMESPACE_LABELS_KEY: ns_labels,
    })
}

fn decide_ambient(v: &Value) -> Result<Decision, AnnotationError> {
    decide_pod_with(Mesh::Istio, true, &api(v))
}

#[test]
fn ambient_follows_istio_cnis_default_enablement_selectors() {
    let ambient = json!({"istio.io/dataplane-mode": "ambient"});
    let none = json!({"istio.io/dataplane-mode": "none"});
    // The pod's label, in any namespace.
    let p = enrolled(decide_ambient(&plain_pod(ambient.clone(), json!({}), json!({}))).unwrap());
    assert!(p.ambient && p.dns_capture);
    assert_eq!(p.include_inbound_ports, PortSet::All);
    // The namespace's label, unless the pod opts out.
    let p = enrolled(decide_ambient(&plain_pod(json!({}), json!({}), ambient.clone())).unwrap());
    assert!(p.ambient);
    let opted_out = decide_ambient(&plain_pod(none, json!({}), ambient.clone())).unwrap();
    assert!(matches!(
        skipped(&opted_out),
        SkipReason::NotInjected(_) | SkipReason::NoProxyContainer { .. }
    ));
    // A sidecar-injected pod in an ambient namespace keeps its sidecar.
    let mut sidecar = istio_pod();
    sidecar[crate::pod::NAMESPACE_LABELS_KEY] = ambient.clone();
    assert!(!enrolled(decide_ambient(&sidecar).unwrap()).ambient);
    // Ambient off in the plugin: the sidecar rules alone.
    let off = decide_pod(
        Mesh::Istio,
        &api(&plain_pod(ambient.clone(), json!({}), json!({}))),
    );
    assert!(matches!(off, Ok(Decision::Skip(_))));
}

#[test]
fn ambient_overrides_per_pod() {
    let ambient = json!({"istio.io/dataplane-mode": "ambient"});
    let p = enrolled(
        decide_ambient(&plain_pod(
            ambient.clone(),
            json!({"ambient.istio.io/dns-capture": "false",
                   "ambient.istio.io/bypass-inbound-capture": "true"}),
            json!({}),
        ))
        .unwrap(),
    );
    assert!(!p.dns_capture);
    assert_eq!(p.include_inbound_ports, PortSet::none());
    let e = decide_ambient(&plain_pod(
        ambient,
        json!({"ambient.istio.io/dns-capture": "maybe"}),
        json!({}),
    ))
    .unwrap_err();
    assert_eq!(e.key, "ambient.istio.io/dns-capture");
}

#[test]
fn ambient_enabled_is_istios() {
    let bad = PluginConfig::parse(
        &serde_json::to_vec(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "sidestep",
                                    "mesh": "linkerd", "ambient_enabled": true}),
        )
        .unwrap(),
        Command::Add,
    );
    assert!(bad.unwrap_err().to_string().contains("ambient_enabled"));
    assert!(cfg(json!({"ambient_enabled": true})).ambient_enabled);
}

#[test]
fn ambient_needs_the_api_and_skips_ztunnel() {
    for source in ["annotations", "prefer-annotations"] {
        let bad = PluginConfig::parse(
            &serde_json::to_vec(
                &json!({"cniVersion": "1.0.0", "name": "n", "type": "sidestep",
                "ambient_enabled": true, "pod_source": source,
                "kubernetes": {"kubeconfig": "/k"}}),
            )
            .unwrap(),
            Command::Add,
        );
        assert!(
            bad.unwrap_err().to_string().contains("pod_source"),
            "{source}"
        );
    }
    let mut z = plain_pod(
        json!({"app": "ztunnel"}),
        json!({}),
        json!({"istio.io/dataplane-mode": "ambient"}),
    );
    z["metadata"]["namespace"] = json!("istio-system");
    assert_eq!(
        skipped(&decide_ambient(&z).unwrap()),
        &SkipReason::ZtunnelPod
    );
}

mod budget;
