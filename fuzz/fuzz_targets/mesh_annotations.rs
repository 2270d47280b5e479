//! Pod annotations (and the proxy container fields Istio reads) to a policy, for Istio, Linkerd
//! and Kuma.
//!
//! Input, either
//! - a Pod object as the Kubernetes API serves it (starts with `{`), or
//! - lines: `KEY=VALUE` is an annotation; `label:KEY=VALUE` a label; `env:KEY=VALUE`,
//!   `arg:VALUE`, `uid:N` and `gid:N` go to the mesh's proxy container; `init` adds the mesh's
//!   init container. The pod is decided both as the runtime passes it (annotations only) and as
//!   the API would show it (with the containers).
//!
//! Checked: an enrolled pod's policy validates and satisfies the policy invariants (ports in
//! 1..=65535, canonical CIDRs, a JSON form that decodes to itself, sane map entries); errors name
//! an annotation the pod carries and quote its value; Linkerd and Kuma decide from annotations
//! alone, whatever the pod source.

#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sidestep_cni::{
    config::Mesh,
    mesh::{istio, kuma, linkerd},
    pod::{Container, PodInfo},
};
use sidestep_fuzz::{MESHES, api_pod, check_decision, check_port_set, check_source_independence};

#[derive(Default)]
struct Lines {
    annotations: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    args: Vec<String>,
    uid: Option<i64>,
    gid: Option<i64>,
    init: bool,
}

fn parse_lines(text: &str) -> Lines {
    let mut l = Lines::default();
    for line in text.lines() {
        if line == "init" {
            l.init = true;
        } else if let Some(a) = line.strip_prefix("arg:") {
            l.args.push(a.to_owned());
        } else if let Some(n) = line.strip_prefix("uid:") {
            l.uid = n.parse().ok();
        } else if let Some(n) = line.strip_prefix("gid:") {
            l.gid = n.parse().ok();
        } else if let Some((k, v)) = line.strip_prefix("label:").and_then(|r| r.split_once('=')) {
            l.labels.insert(k.to_owned(), v.to_owned());
        } else if let Some((k, v)) = line.strip_prefix("env:").and_then(|r| r.split_once('=')) {
            l.env.insert(k.to_owned(), v.to_owned());
        } else if let Some((k, v)) = line.split_once('=') {
            l.annotations.insert(k.to_owned(), v.to_owned());
        }
    }
    l
}

fn names(mesh: Mesh) -> (&'static str, &'static str) {
    match mesh {
        Mesh::Istio => (istio::PROXY, istio::INIT),
        Mesh::Linkerd => (linkerd::PROXY, linkerd::INIT),
        Mesh::Kuma => (kuma::PROXY, kuma::INIT),
    }
}

fn check_linkerd_ranges(pod: &PodInfo) {
    for key in [linkerd::SKIP_INBOUND_PORTS, linkerd::SKIP_OUTBOUND_PORTS] {
        let Some(v) = pod.annotation(key) else {
            continue;
        };
        if let Ok(ports) = linkerd::port_ranges(key, v) {
            assert!(
                ports.len() <= sidestep::enroll::MAX_POD_PORT_RULES,
                "{key}: {} ports",
                ports.len()
            );
            check_port_set(key, &sidestep::policy::PortSet::Only(ports));
        }
    }
}

fn lines(text: &str) {
    let l = parse_lines(text);
    let runtime = PodInfo::from_annotations("web-1", "shop", l.annotations.clone());
    check_linkerd_ranges(&runtime);
    for mesh in MESHES {
        let _ = check_decision(mesh, &runtime);
        let (proxy, init) = names(mesh);
        let app = Container {
            name: "app".into(),
            ..Container::default()
        };
        let proxy = Container {
            name: proxy.into(),
            env: l.env.clone(),
            args: l.args.clone(),
            run_as_user: l.uid,
            run_as_group: l.gid,
        };
        let mut api = api_pod(&runtime, vec![app, proxy], l.labels.clone());
        if l.init {
            api.init_containers.push(Container {
                name: init.into(),
                ..Container::default()
            });
        }
        let _ = check_decision(mesh, &api);
        check_source_independence(&runtime, &api);
    }
}

fn api_object(v: &Value) {
    let Ok(pod) = PodInfo::from_api_json(v) else {
        return;
    };
    check_linkerd_ranges(&pod);
    let runtime = PodInfo::from_annotations(&pod.name, &pod.namespace, pod.annotations.clone());
    for mesh in MESHES {
        let _ = check_decision(mesh, &pod);
        let _ = check_decision(mesh, &runtime);
    }
    check_source_independence(&runtime, &pod);
}

fuzz_target!(|data: &[u8]| {
    if data.first() == Some(&b'{') {
        if let Ok(v) = serde_json::from_slice::<Value>(data) {
            api_object(&v);
        }
        return;
    }
    lines(&String::from_utf8_lossy(data));
});
