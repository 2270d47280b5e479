use serde_json::{Value, json};

use super::*;

fn parse(v: Value, cmd: Command) -> Result<PluginConfig, ConfigError> {
    PluginConfig::parse(&serde_json::to_vec(&v).unwrap(), cmd)
}

fn base(version: &str) -> Value {
    json!({"cniVersion": version, "name": "k8s-pod-network", "type": "sidestep"})
}

fn code_of(v: Value, cmd: Command) -> u32 {
    parse(v, cmd).unwrap_err().to_cni().code
}

#[test]
fn defaults_for_every_version() {
    for v in crate::spec::SUPPORTED_VERSIONS {
        let c = parse(base(v.as_str()), Command::Add).unwrap();
        assert_eq!(c.cni_version, v);
        assert_eq!(c.pin_root, Path::new(DEFAULT_PIN_ROOT));
        assert_eq!(c.state_dir, Path::new(DEFAULT_STATE_DIR));
        assert_eq!(c.mesh, Mesh::Istio);
        assert_eq!(c.fail_strategy, FailStrategy::Close);
        assert_eq!(c.inbound_hook, InboundHook::SkLookup);
        assert_eq!(c.kubernetes, KubernetesConfig::default());
        assert!(c.policy.is_none() && c.prev_result.is_none() && c.pod_annotations.is_none());
    }
}

#[test]
fn sidestep_fields() {
    let mut v = base("1.1.0");
    v["pin_root"] = json!("/sys/fs/bpf/x");
    v["state_dir"] = json!("/run/x");
    v["mesh"] = json!("linkerd");
    v["fail_strategy"] = json!("FAIL_OPEN");
    v["inbound_hook"] = json!("tc");
    v["log_level"] = json!("debug");
    v["log_file"] = json!("/var/log/sidestep-cni.log");
    v["kubernetes"] = json!({"kubeconfig": "/etc/cni/net.d/sidestep-kubeconfig",
                             "pod_read_retries": 3, "pod_read_interval_ms": 10,
                             "request_timeout_ms": 200});
    v["policy"] = json!({"proxyUid": 1500, "excludeOutboundPorts": "9000,9001"});
    v["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": {"a": "b"}});
    let c = parse(v, Command::Add).unwrap();
    assert_eq!(c.pin_root, Path::new("/sys/fs/bpf/x"));
    assert_eq!(c.mesh, Mesh::Linkerd);
    assert_eq!(c.fail_strategy, FailStrategy::Open);
    assert_eq!(c.inbound_hook, InboundHook::Tc);
    assert_eq!(c.log_level.as_deref(), Some("debug"));
    assert_eq!(c.kubernetes.pod_read_retries, 3);
    assert_eq!(c.kubernetes.pod_read_interval, Duration::from_millis(10));
    assert_eq!(c.kubernetes.request_timeout, Duration::from_millis(200));
    assert_eq!(c.policy.unwrap().proxy_uid, 1500);
    assert_eq!(c.pod_annotations.unwrap()["a"], "b");
}

#[test]
fn istio_head_flat_shape() {
    // As istio-cni's installer writes it at HEAD.
    let v = json!({
        "cniVersion": "0.3.1", "name": "istio-cni", "type": "sidestep",
        "plugin_log_level": "warn", "cni_agent_run_dir": "/var/run/istio-cni",
        "ambient_enabled": false, "enablement_selectors": [{"podSelector": {}}],
        "exclude_namespaces": ["kube-system", "istio-system"],
        "pod_namespace": "istio-system", "native_nftables": false,
        "dns": {"enabled": false}
    });
    let c = parse(v, Command::Add).unwrap();
    assert_eq!(c.exclude_namespaces, ["istio-system", "kube-system"]);
    assert_eq!(c.agent_namespace.as_deref(), Some("istio-system"));
    assert_eq!(c.log_level.as_deref(), Some("warn"));
}

#[test]
fn istio_1_20_kubernetes_shape() {
    let v = json!({
        "cniVersion": "0.3.1", "name": "istio-cni", "type": "sidestep",
        "log_level": "info", "log_uds_address": "/var/run/istio-cni/log.sock",
        "kubernetes": {"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig",
                       "cni_bin_dir": "/opt/cni/bin",
                       "exclude_namespaces": ["istio-system", "kube-system"]}
    });
    let c = parse(v, Command::Add).unwrap();
    assert_eq!(c.exclude_namespaces, ["istio-system", "kube-system"]);
    assert_eq!(
        c.kubernetes.kubeconfig.as_deref(),
        Some(Path::new("/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"))
    );
    assert_eq!(c.log_level.as_deref(), Some("info"));
}

#[test]
fn bad_json_and_shapes() {
    let bad = |bytes: &[u8]| {
        PluginConfig::parse(bytes, Command::Add)
            .unwrap_err()
            .to_cni()
            .code
    };
    assert_eq!(bad(b"{"), code::DECODING_FAILURE);
    assert_eq!(bad(b""), code::DECODING_FAILURE);
    assert_eq!(bad(b"[1]"), code::DECODING_FAILURE);
    assert_eq!(bad(b"\"x\""), code::DECODING_FAILURE);
    assert_eq!(bad(b"{\"cniVersion\":\"1.0.0\",}"), code::DECODING_FAILURE);
}

#[test]
fn versions() {
    assert_eq!(
        code_of(json!({"name": "n", "type": "sidestep"}), Command::Add),
        1
    );
    assert_eq!(code_of(base("0.2.0"), Command::Add), 1);
    assert_eq!(code_of(base("2.0.0"), Command::Add), 1);
    let mut v = base("1.0.0");
    v["cniVersion"] = json!(1);
    assert_eq!(code_of(v, Command::Add), code::INVALID_CONFIG);
    assert_eq!(code_of(base("0.3.1"), Command::Check), 1);
    assert_eq!(code_of(base("1.0.0"), Command::Status), 1);
    assert_eq!(code_of(base("1.0.0"), Command::Gc), 1);
    parse(base("0.4.0"), Command::Check).unwrap();
    parse(base("1.1.0"), Command::Status).unwrap();
}

#[test]
fn missing_and_invalid_fields() {
    let cases: Vec<(Value, &str)> = vec![
        (json!({"cniVersion": "1.0.0", "type": "sidestep"}), "name"),
        (
            json!({"cniVersion": "1.0.0", "name": "", "type": "sidestep"}),
            "name",
        ),
        (
            json!({"cniVersion": "1.0.0", "name": "bad name", "type": "sidestep"}),
            "name",
        ),
        (json!({"cniVersion": "1.0.0", "name": "n"}), "type"),
        (
            json!({"cniVersion": "1.0.0", "name": "n", "type": 3}),
            "type",
        ),
    ];
    for (v, f) in cases {
        let e = parse(v.clone(), Command::Add).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Field { field, .. } if field == f),
            "{v}: {e}"
        );
        assert_eq!(e.to_cni().code, code::INVALID_CONFIG);
    }
    let with = |k: &str, val: Value| {
        let mut v = base("1.0.0");
        v[k] = val;
        parse(v, Command::Add).unwrap_err()
    };
    for (k, val) in [
        ("pin_root", json!("relative/path")),
        ("pin_root", json!(7)),
        ("pin_root", json!("/sys/fs/bpf/a\u{0}b")),
        ("state_dir", json!("/run/\u{0}")),
        ("kubernetes", json!({"kubeconfig": "/etc/k\u{0}"})),
        ("state_dir", json!("run/x")),
        ("log_file", json!("x.log")),
        ("mesh", json!("consul")),
        ("mesh", json!("Istio")),
        ("fail_strategy", json!("fail_open")),
        ("inbound_hook", json!("tcx")),
        ("inbound_hook", json!(true)),
        ("exclude_namespaces", json!("kube-system")),
        ("kubernetes", json!({"pod_read_retries": 0})),
        ("kubernetes", json!({"pod_read_retries": -1})),
        ("kubernetes", json!([])),
        ("policy", json!({"proxyUid": -1})),
        ("policy", json!({"outboundPort": 70000})),
        ("policy", json!({"inboundPort": 15001})),
        ("policy", json!({"excludeOutboundIPRanges": "10.0.0.0/33"})),
        ("policy", json!({"noSuchField": 1})),
        (
            "runtimeConfig",
            json!({"io.kubernetes.cri.pod-annotations": {"a": 1}}),
        ),
        ("cni.dev/valid-attachments", json!([{"containerID": "x"}])),
    ] {
        let e = with(k, val.clone());
        assert_eq!(e.to_cni().code, code::INVALID_CONFIG, "{k}={val}: {e}");
        let root = k.split('.').next().unwrap();
        assert!(e.to_string().contains(root), "{k}: {e}");
    }
}

#[test]
fn prev_result_is_checked_in_the_config_version() {
    let mut v = base("0.4.0");
    v["prevResult"] = json!({"cniVersion": "0.4.0",
        "ips": [{"version": "4", "address": "10.1.0.4/24", "interface": 0}],
        "interfaces": [{"name": "eth0", "sandbox": "/run/netns/x"}]});
    let c = parse(v.clone(), Command::Add).unwrap();
    assert_eq!(c.prev_result.unwrap().ips[0].to_string(), "10.1.0.4");
    v["cniVersion"] = json!("1.0.0");
    assert_eq!(code_of(v.clone(), Command::Add), code::INCOMPATIBLE_VERSION);
    v["prevResult"]["cniVersion"] = json!("1.0.0");
    assert_eq!(code_of(v.clone(), Command::Add), code::DECODING_FAILURE);
    // DEL must go through even so.
    assert!(parse(v, Command::Del).unwrap().prev_result.is_none());
}

#[test]
fn gc_needs_its_attachment_list() {
    assert_eq!(code_of(base("1.1.0"), Command::Gc), code::INVALID_CONFIG);
    let mut v = base("1.1.0");
    v["cni.dev/valid-attachments"] = json!([{"containerID": "a", "ifname": "eth0"}]);
    let c = parse(v, Command::Gc).unwrap();
    assert_eq!(c.valid_attachments.unwrap()[0].container_id, "a");
}

#[test]
fn peek_version_only_when_usable() {
    assert_eq!(
        peek_version(br#"{"cniVersion":"0.4.0"}"#),
        Some(CniVersion::V0_4_0)
    );
    assert_eq!(peek_version(br#"{"cniVersion":"9"}"#), None);
    assert_eq!(peek_version(b"{"), None);
}

/// The config's policy writes the same shared maps as annotations: a list past one pod's
/// budget, or lists past it together, are refused with code 7 naming the field and the limit.
#[test]
fn the_configs_policy_is_held_to_the_pods_map_budget() {
    let ports = |from: u16, n: u16| -> String {
        (from..from + n)
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut v = base("1.0.0");
    v["policy"] = json!({"excludeOutboundPorts": ports(1, 508)});
    parse(v.clone(), Command::Add).unwrap();
    for policy in [
        json!({"excludeOutboundPorts": ports(1, 509)}),
        json!({"excludeOutboundPorts": ports(1, 300), "includeInboundPorts": ports(1, 300)}),
        json!({"excludeOutboundPorts": ports(1, 30_000)}),
    ] {
        v["policy"] = policy;
        let e = parse(v.clone(), Command::Add).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.to_cni().code, code::INVALID_CONFIG);
        assert!(
            msg.contains("policy") && msg.contains("512") && msg.contains("SIDESTEP_PORTS"),
            "{msg}"
        );
    }
}

#[test]
fn a_level_that_is_no_level_is_refused_by_name() {
    for (key, bad) in [("log_level", "verbose"), ("plugin_log_level", "debgu")] {
        let mut v = base("1.0.0");
        v[key] = json!(bad);
        let e = parse(v, Command::Add).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(bad), "{e}");
    }
    for good in ["debug", "warning", "none", "sidestep_cni=trace,info"] {
        let mut v = base("1.0.0");
        v["log_level"] = json!(good);
        assert_eq!(
            parse(v, Command::Add).unwrap().log_level.as_deref(),
            Some(good)
        );
    }
}

#[test]
fn unknown_fields_are_named_and_known_ones_are_not() {
    let mut v = base("1.0.0");
    v["fail_stratgy"] = json!("FAIL_OPEN");
    v["native_nftables"] = json!(true);
    v["ipam"] = json!({});
    let obj = v.as_object().unwrap();
    assert_eq!(unknown_fields(obj), ["fail_stratgy"]);
    // Tolerated: the misspelled field keeps the default, and the warning says so.
    assert_eq!(
        parse(v, Command::Add).unwrap().fail_strategy,
        FailStrategy::Close
    );
}
