//! More of the bad-input corpus (run by `corpus::corpus` with the same checks): every config
//! field with a wrong type or value, JSON a parser can choke on (duplicate keys, deep nesting,
//! a huge document, NUL bytes, invalid UTF-8), prevResults that contradict themselves or the
//! config's version, hostile CNI_* values, each mesh's annotations with a bad value, and DEL of
//! the enrolled pod with a bad config, which must leave it enrolled.

use serde_json::{Value, json};

use super::corpus::{Case, add, annotated, b, env_for, env_with, with};
use super::sandbox::Sandbox;

/// The conf's bytes with `"key":raw,` inserted right after the opening brace: for values built
/// as text, and for a key that the conf has too (Go's encoding/json and serde_json both keep the
/// last one, so the conf's own value is the one that counts).
fn prepend(conf: &Value, key: &str, first: &str) -> Vec<u8> {
    let text = serde_json::to_string(conf).unwrap();
    format!("{{\"{key}\":{first},{}", &text[1..]).into_bytes()
}

/// `conf` with `raw` spliced in as the value of `name`, for bytes JSON cannot express.
fn raw_name(conf: &Value, raw: &[u8]) -> Vec<u8> {
    let text = b(&with(conf.clone(), &["name"], json!("@@NAME@@")));
    let at = text.windows(8).position(|w| w == b"@@NAME@@").unwrap();
    [&text[..at], raw, &text[at + 8..]].concat()
}

pub fn cases(sb: &Sandbox, conf: &Value, f: &str, g: &str) -> Vec<Case> {
    let set = |path: &[&str], val: Value| b(&with(conf.clone(), path, val));
    let ips = |val: Value| set(&["prevResult", "ips"], val);
    let ann = |extra: Value| b(&annotated(conf, extra));
    let mesh = |name: &str, extra: Value| b(&with(annotated(conf, extra), &["mesh"], json!(name)));
    let linkerd = |k: &str, v: &str| {
        let mut a = json!({"linkerd.io/proxy-version": "stable-2.14"});
        a[k] = json!(v);
        mesh("linkerd", a)
    };
    let kuma = |k: &str, v: &str| {
        let mut a = json!({"kuma.io/sidecar-injected": "true"});
        a[k] = json!(v);
        mesh("kuma", a)
    };
    let gc = |val: Value| {
        let mut c = with(sb.conf("1.1.0"), &["prevResult"], Value::Null);
        if !val.is_null() {
            c["cni.dev/valid-attachments"] = val;
        }
        b(&c)
    };
    let gc_env = || env_with("GC", g, "X", "");
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let mut huge = br#"{"cniVersion":"1.0.0","name":""#.to_vec();
    huge.resize(huge.len() + (8 << 20), b'a');

    vec![
        // Each config field with the wrong type or a value that cannot work.
        ("name not a string", add(f), set(&["name"], json!(1)), 7),
        ("type not a string", add(f), set(&["type"], json!(["x"])), 7),
        (
            "pin_root not a string",
            add(f),
            set(&["pin_root"], json!(5)),
            7,
        ),
        (
            "relative state_dir",
            add(f),
            set(&["state_dir"], json!("run/cni")),
            7,
        ),
        ("mesh not a string", add(f), set(&["mesh"], json!(true)), 7),
        (
            "mesh capitalised",
            add(f),
            set(&["mesh"], json!("Istio")),
            7,
        ),
        (
            "fail_strategy FAIL_CLOSED",
            add(f),
            set(&["fail_strategy"], json!("FAIL_CLOSED")),
            7,
        ),
        (
            "fail_strategy lower-case",
            add(f),
            set(&["fail_strategy"], json!("fail_open")),
            7,
        ),
        (
            "fail_strategy not a string",
            add(f),
            set(&["fail_strategy"], json!(1)),
            7,
        ),
        (
            "exclude_namespaces a string",
            add(f),
            set(&["exclude_namespaces"], json!("kube-system")),
            7,
        ),
        (
            "kubernetes not an object",
            add(f),
            set(&["kubernetes"], json!("/etc/kubeconfig")),
            7,
        ),
        (
            "pod_read_retries 0",
            add(f),
            set(&["kubernetes"], json!({"pod_read_retries": 0})),
            7,
        ),
        (
            "pod_read_retries -1",
            add(f),
            set(&["kubernetes"], json!({"pod_read_retries": -1})),
            7,
        ),
        (
            "inbound_hook unknown",
            add(f),
            set(&["inbound_hook"], json!("tcx")),
            7,
        ),
        (
            "relative log_file",
            add(f),
            set(&["log_file"], json!("sidestep.log")),
            7,
        ),
        (
            "runtimeConfig an array",
            add(f),
            set(&["runtimeConfig"], json!([])),
            7,
        ),
        (
            "pod annotations an array",
            add(f),
            set(
                &["runtimeConfig"],
                json!({"io.kubernetes.cri.pod-annotations": ["a=b"]}),
            ),
            7,
        ),
        (
            "policy a string",
            add(f),
            set(&["policy"], json!("istio")),
            7,
        ),
        (
            "policy unknown field",
            add(f),
            set(&["policy"], json!({"proxyUID": 1337})),
            7,
        ),
        (
            "policy inbound = outbound",
            add(f),
            set(&["policy"], json!({"inboundPort": 15001})),
            7,
        ),
        (
            "policy port word",
            add(f),
            set(&["policy"], json!({"excludeInboundPorts": "ssh"})),
            7,
        ),
        (
            "policy CIDR leading zero",
            add(f),
            set(
                &["policy"],
                json!({"excludeOutboundIPRanges": "010.0.0.0/8"}),
            ),
            7,
        ),
        // GC must not remove anything when it cannot tell what to keep.
        ("GC without valid-attachments", gc_env(), gc(Value::Null), 7),
        (
            "GC valid-attachments a string",
            gc_env(),
            gc(json!("good")),
            7,
        ),
        (
            "GC attachment without ifname",
            gc_env(),
            gc(json!([{"containerID": "good"}])),
            7,
        ),
        // JSON a parser can choke on.
        (
            "duplicate key, last bad",
            add(f),
            prepend(
                &with(conf.clone(), &["mesh"], json!("consul")),
                "mesh",
                "\"istio\"",
            ),
            7,
        ),
        ("nested 100000 deep", add(f), prepend(conf, "x", &deep), 6),
        ("8 MiB unterminated string", add(f), huge, 6),
        ("raw NUL in a string", add(f), raw_name(conf, b"a\0b"), 6),
        (
            "escaped NUL in name",
            add(f),
            set(&["name"], json!("a\u{0}b")),
            7,
        ),
        (
            "invalid UTF-8 in a string",
            add(f),
            raw_name(conf, b"a\xff\xfeb"),
            6,
        ),
        (
            "UTF-8 byte order mark",
            add(f),
            [b"\xef\xbb\xbf".as_slice(), &b(conf)].concat(),
            6,
        ),
        (
            "NUL in pin_root",
            add(f),
            set(&["pin_root"], json!("/sys/fs/bpf/x\u{0}y")),
            7,
        ),
        // prevResults that contradict themselves or the config.
        (
            "gateway not an IP",
            add(f),
            ips(json!([{"address": "10.1.1.1/24", "gateway": "10.1.1.256"}])),
            6,
        ),
        (
            "prevResult address with a leading-zero octet",
            add(f),
            ips(json!([{"address": "10.1.1.010/24"}])),
            6,
        ),
        (
            "IPv6 address malformed",
            add(f),
            ips(json!([{"address": "fd00::zz/64"}])),
            6,
        ),
        (
            "interface index -1",
            add(f),
            ips(json!([{"address": "10.1.1.1/24", "interface": -1}])),
            6,
        ),
        (
            "interface index a string",
            add(f),
            ips(json!([{"address": "10.1.1.1/24", "interface": "0"}])),
            6,
        ),
        (
            "interface index with no interfaces",
            add(f),
            b(&with(
                with(conf.clone(), &["prevResult", "interfaces"], json!([])),
                &["prevResult", "ips"],
                json!([{"address": "10.1.1.1/24", "interface": 0}]),
            )),
            6,
        ),
        (
            "prevResult 1.0.0 under 0.4.0",
            add(f),
            b(&with(
                sb.conf("0.4.0"),
                &["prevResult", "cniVersion"],
                json!("1.0.0"),
            )),
            1,
        ),
        (
            "prevResult version 0.1.0",
            add(f),
            set(&["prevResult", "cniVersion"], json!("0.1.0")),
            1,
        ),
        (
            "0.4.0 ip version tag wrong",
            add(f),
            b(&with(
                sb.conf("0.4.0"),
                &["prevResult", "ips"],
                json!([{"version": "6", "address": "10.1.1.1/24", "interface": 0}]),
            )),
            6,
        ),
        // Hostile CNI_* values.
        (
            "ifname with '/'",
            env_with("ADD", f, "CNI_IFNAME", "eth/0"),
            b(conf),
            4,
        ),
        (
            "ifname ..",
            env_with("ADD", f, "CNI_IFNAME", ".."),
            b(conf),
            4,
        ),
        (
            "ifname with a space",
            env_with("ADD", f, "CNI_IFNAME", "eth 0"),
            b(conf),
            4,
        ),
        (
            "container id ../good",
            env_with("ADD", f, "CNI_CONTAINERID", "../good"),
            b(conf),
            4,
        ),
        (
            "container id with '/'",
            env_with("ADD", f, "CNI_CONTAINERID", "a/b"),
            b(conf),
            4,
        ),
        (
            "container id with ';'",
            env_with("ADD", f, "CNI_CONTAINERID", "abc;rm"),
            b(conf),
            4,
        ),
        (
            "DEL container id ../good",
            env_with("DEL", g, "CNI_CONTAINERID", "../good"),
            b(conf),
            4,
        ),
        ("netns is a directory", add("/tmp"), b(conf), 8),
        (
            "netns is a mount namespace",
            add("/proc/self/ns/mnt"),
            b(conf),
            8,
        ),
        ("netns is /dev/null", add("/dev/null"), b(conf), 8),
        ("relative netns", add("sidestep-test-relative"), b(conf), 8),
        (
            "CNI_ARGS namespace without '='",
            env_with("ADD", f, "CNI_ARGS", "K8S_POD_NAME=web;K8S_POD_NAMESPACE"),
            b(conf),
            4,
        ),
        // Istio annotations.
        (
            "Istio CIDR leading zero",
            add(f),
            ann(json!({"traffic.sidecar.istio.io/excludeOutboundIPRanges": "010.0.0.0/8"})),
            101,
        ),
        (
            "Istio interceptionMode lower-case",
            add(f),
            ann(json!({"sidecar.istio.io/interceptionMode": "tproxy"})),
            101,
        ),
        (
            "Istio '*' inside a port list",
            add(f),
            ann(json!({"traffic.sidecar.istio.io/includeInboundPorts": "80,*"})),
            101,
        ),
        (
            "Istio outbound port -1",
            add(f),
            ann(json!({"traffic.sidecar.istio.io/includeOutboundPorts": "-1"})),
            101,
        ),
        (
            "Istio reroute interfaces space",
            add(f),
            ann(json!({"istio.io/reroute-virtual-interfaces": "eth0 eth1"})),
            101,
        ),
        (
            "Istio kubevirtInterfaces too long",
            add(f),
            ann(json!({"traffic.sidecar.istio.io/kubevirtInterfaces": "net1,abcdefghijklmnop"})),
            101,
        ),
        (
            "Istio includeOutboundIPRanges IPv6 /129",
            add(f),
            ann(json!({"traffic.sidecar.istio.io/includeOutboundIPRanges": "fd00::/129"})),
            101,
        ),
        // Linkerd annotations.
        (
            "Linkerd reversed range",
            add(f),
            linkerd("config.linkerd.io/skip-inbound-ports", "4000-3000"),
            101,
        ),
        (
            "Linkerd range too wide",
            add(f),
            linkerd("config.linkerd.io/skip-outbound-ports", "1-2000"),
            101,
        ),
        (
            "Linkerd open range",
            add(f),
            linkerd("config.linkerd.io/skip-outbound-ports", "25-"),
            101,
        ),
        (
            "Linkerd skip-subnets *",
            add(f),
            linkerd("config.linkerd.io/skip-subnets", "*"),
            101,
        ),
        (
            "Linkerd subnet leading zero",
            add(f),
            linkerd("config.linkerd.io/skip-subnets", "10.0.0.0/8,010.1.0.0/16"),
            101,
        ),
        (
            "Linkerd proxy-uid word",
            add(f),
            linkerd("config.linkerd.io/proxy-uid", "linkerd"),
            101,
        ),
        // Kuma annotations.
        (
            "Kuma ip family ipv5",
            add(f),
            kuma("kuma.io/transparent-proxying-ip-family-mode", "ipv5"),
            101,
        ),
        (
            "Kuma builtin-dns yes",
            add(f),
            kuma("kuma.io/builtin-dns", "yes"),
            101,
        ),
        (
            "Kuma inbound = outbound",
            add(f),
            kuma("kuma.io/transparent-proxying-inbound-port", "15001"),
            101,
        ),
        (
            "Kuma outbound port 70000",
            add(f),
            kuma("kuma.io/transparent-proxying-outbound-port", "70000"),
            101,
        ),
        (
            "Kuma exclude-outbound-ips /33",
            add(f),
            kuma("traffic.kuma.io/exclude-outbound-ips", "10.0.0.0/33"),
            101,
        ),
        (
            "Kuma virtual-probes-port 0",
            add(f),
            kuma("kuma.io/virtual-probes-port", "0"),
            101,
        ),
        (
            "Kuma exclude-inbound-ports word",
            add(f),
            kuma("traffic.kuma.io/exclude-inbound-ports", "admin"),
            101,
        ),
        // DEL of the enrolled pod with a config it cannot trust: the pod stays enrolled.
        (
            "DEL good, relative pin_root",
            env_for("DEL", "good", g),
            set(&["pin_root"], json!("bpf/x")),
            7,
        ),
        (
            "DEL good, broken JSON",
            env_for("DEL", "good", g),
            b"{\"cniVersion\":".to_vec(),
            6,
        ),
        (
            "DEL good, version 0.2.0",
            env_for("DEL", "good", g),
            set(&["cniVersion"], json!("0.2.0")),
            1,
        ),
    ]
}
