//! The kube client against a local HTTP server that answers as the API server does, with the
//! Pod objects Istio's and Linkerd's injectors produce.

use std::{
    io::{BufRead, BufReader, Write},
    net::TcpListener,
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use super::*;
use crate::{
    config::{KubernetesConfig, Mesh},
    mesh::{Decision, decide_pod},
    podsource::read_with_retries,
};

#[derive(Clone)]
struct Reply {
    delay: Duration,
    status: u16,
    body: Value,
}

/// `SIDESTEP_TEST_TIME_SCALE` (set by `cargo xtask test --kernel` for emulated VMs) times `d`:
/// the bounds here are about a real CPU.
fn scaled(d: Duration) -> Duration {
    d * std::env::var("SIDESTEP_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|s| *s >= 1)
        .unwrap_or(1)
}

fn ok(body: Value) -> Reply {
    Reply {
        delay: Duration::ZERO,
        status: 200,
        body,
    }
}

fn not_found() -> Reply {
    Reply {
        delay: Duration::ZERO,
        status: 404,
        body: json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                     "reason": "NotFound", "code": 404, "message": "pods \"web\" not found"}),
    }
}

/// Serves `script` in order (the last reply repeats), one connection per request, for at most
/// ten seconds. Returns the kubeconfig and the request lines seen.
fn serve(script: Vec<Reply>, dir: &Path) -> (PathBuf, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut n = 0;
        while Instant::now() < deadline {
            let Ok((stream, _)) = listener.accept() else {
                thread::sleep(Duration::from_millis(5));
                continue;
            };
            stream.set_nonblocking(false).unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut head = Vec::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                head.push(line.trim_end().to_owned());
            }
            let reply = script[n.min(script.len() - 1)].clone();
            n += 1;
            log.lock().unwrap().push(head.join(" | "));
            thread::sleep(reply.delay);
            let body = reply.body.to_string();
            let mut s = stream;
            let _ = write!(
                s,
                "HTTP/1.1 {} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                reply.status,
                body.len()
            );
        }
    });
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\n\
             clusters: [{{name: t, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n\
             contexts: [{{name: t, context: {{cluster: t, user: t}}}}]\n\
             users: [{{name: t, user: {{token: sidestep-test-token}}}}]\n"
        ),
    )
    .unwrap();
    (kubeconfig, seen)
}

fn id() -> Identity {
    Identity {
        name: "web".into(),
        namespace: "shop".into(),
    }
}

fn kube_cfg(kubeconfig: &Path, retries: u32, timeout_ms: u64) -> KubernetesConfig {
    KubernetesConfig {
        kubeconfig: Some(kubeconfig.to_path_buf()),
        pod_read_retries: retries,
        pod_read_interval: Duration::from_millis(20),
        request_timeout: scaled(Duration::from_millis(timeout_ms)),
    }
}

/// A pod as Istio's injector leaves it (trimmed to what matters).
fn istio_injected() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "web", "namespace": "shop",
            "labels": {"app": "web", "security.istio.io/tlsMode": "istio",
                       "service.istio.io/canonical-name": "web"},
            "annotations": {
                "sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"],\"volumes\":[\"istio-envoy\"],\"imagePullSecrets\":null,\"revision\":\"default\"}",
                "traffic.sidecar.istio.io/excludeOutboundPorts": "5432",
                "kubectl.kubernetes.io/default-container": "web"
            }
        },
        "spec": {
            "initContainers": [{"name": "istio-validation", "image": "docker.io/istio/proxyv2:1.22.0",
                "args": ["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "--run-validation", "--skip-rule-apply"]}],
            "containers": [
                {"name": "web", "image": "nginx", "ports": [{"containerPort": 80, "protocol": "TCP"}]},
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0",
                 "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local"],
                 "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"},
                         {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}],
                 "securityContext": {"runAsUser": 1337, "runAsGroup": 1337, "runAsNonRoot": true}}
            ]
        },
        "status": {"phase": "Pending", "podIP": "10.244.1.7",
                   "podIPs": [{"ip": "10.244.1.7"}, {"ip": "fd00:10:244:1::7"}]}
    })
}

/// A pod as Linkerd's injector leaves it with the CNI plugin (network validator, no init).
fn linkerd_injected() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web", "namespace": "shop",
            "labels": {"linkerd.io/control-plane-ns": "linkerd", "linkerd.io/proxy-deployment": "web"},
            "annotations": {"linkerd.io/proxy-version": "stable-2.14.10", "linkerd.io/inject": "enabled",
                            "config.linkerd.io/skip-outbound-ports": "4567,4568",
                            "config.linkerd.io/proxy-uid": "2102"}},
        "spec": {
            "initContainers": [{"name": "linkerd-network-validator", "image": "cr.l5d.io/linkerd/proxy-init:v2.2.4"}],
            "containers": [
                {"name": "linkerd-proxy", "image": "cr.l5d.io/linkerd/proxy:stable-2.14.10",
                 "securityContext": {"runAsUser": 2102}},
                {"name": "web", "image": "nginx"}
            ]
        },
        "status": {"podIP": "10.244.1.8"}
    })
}

#[test]
fn reads_the_pod_through_the_kubeconfig() {
    let tmp = tempfile::tempdir().unwrap();
    let (kc, seen) = serve(vec![ok(istio_injected())], tmp.path());
    let reader = KubeReader::new(&kc, scaled(Duration::from_secs(2)));
    let pod = read_with_retries(&reader, &id(), &kube_cfg(&kc, 1, 2000)).unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen[0].starts_with("GET /api/v1/namespaces/shop/pods/web "),
        "{seen:?}"
    );
    assert!(seen[0].contains("Bearer sidestep-test-token"), "{seen:?}");
    let Decision::Enrol(e) = decide_pod(Mesh::Istio, &pod).unwrap() else {
        panic!("the injected pod is not enrolled");
    };
    assert!(e.policy.dns_capture);
    assert_eq!(pod.pod_ips.len(), 2);
    assert_eq!(
        e.policy.exclude_outbound_ports,
        sidestep::policy::PortSet::Only([5432].into())
    );
}

#[test]
fn linkerd_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let (kc, _) = serve(vec![ok(linkerd_injected())], tmp.path());
    let reader = KubeReader::new(&kc, scaled(Duration::from_secs(2)));
    let pod = read_with_retries(&reader, &id(), &kube_cfg(&kc, 1, 2000)).unwrap();
    let Decision::Enrol(e) = decide_pod(Mesh::Linkerd, &pod).unwrap() else {
        panic!("the injected pod is not enrolled");
    };
    assert_eq!((e.policy.proxy_uid, e.policy.inbound_port), (2102, 4143));
    assert!(!e.hairpin);
}

#[test]
fn retries_while_the_pod_is_not_there_yet() {
    let tmp = tempfile::tempdir().unwrap();
    let (kc, seen) = serve(
        vec![not_found(), not_found(), ok(istio_injected())],
        tmp.path(),
    );
    let reader = KubeReader::new(&kc, scaled(Duration::from_secs(2)));
    let pod = read_with_retries(&reader, &id(), &kube_cfg(&kc, 5, 2000)).unwrap();
    assert_eq!(pod.name, "web");
    assert_eq!(seen.lock().unwrap().len(), 3);
}

#[test]
fn a_slow_server_times_out_within_the_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let slow = Reply {
        delay: scaled(Duration::from_millis(1500)),
        ..ok(istio_injected())
    };
    let (kc, _) = serve(vec![slow], tmp.path());
    let reader = KubeReader::new(&kc, scaled(Duration::from_millis(200)));
    let start = Instant::now();
    let e = read_with_retries(&reader, &id(), &kube_cfg(&kc, 2, 200)).unwrap_err();
    assert!(
        start.elapsed() < scaled(Duration::from_millis(1200)),
        "{:?}",
        start.elapsed()
    );
    assert!(e.to_string().contains("after 2 tries"), "{e}");
}

#[test]
fn a_server_that_is_down_or_a_missing_kubeconfig_fails_after_the_retries() {
    let tmp = tempfile::tempdir().unwrap();
    let dead = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let kc = tmp.path().join("kc");
    std::fs::write(
        &kc,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\nclusters: [{{name: t, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\ncontexts: [{{name: t, context: {{cluster: t, user: t}}}}]\nusers: [{{name: t, user: {{}}}}]\n"
        ),
    )
    .unwrap();
    let reader = KubeReader::new(&kc, Duration::from_millis(500));
    let e = read_with_retries(&reader, &id(), &kube_cfg(&kc, 3, 500)).unwrap_err();
    assert!(e.to_string().contains("after 3 tries"), "{e}");

    let missing = tmp.path().join("not-written-yet");
    let reader = KubeReader::new(&missing, Duration::from_millis(500));
    let e = read_with_retries(&reader, &id(), &kube_cfg(&missing, 2, 500)).unwrap_err();
    assert!(e.to_string().contains("not-written-yet"), "{e}");
}
