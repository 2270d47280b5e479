//! The scenarios' manifests: what Istio's and Linkerd's injectors leave on a pod, with HAProxy
//! as the proxy.

use super::{MESH, SERVER_PORT, SERVER_PROXY_UID};
use crate::e2e::install::{APP_IMAGE, PROXY_IMAGE};

pub(super) fn mesh_namespace() -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {MESH}\n---\n{}",
        haproxy_config_map()
    )
}

#[derive(Clone, Copy)]
pub(super) enum ProxyUid {
    /// No runAsUser: the image's 1337, as Istio's proxy image.
    Default,
    Explicit(u32),
}

pub(super) struct App {
    command: Vec<String>,
    port: Option<u16>,
}

pub(super) fn sleep_app() -> App {
    App {
        command: vec!["/bin/sleep".into(), "1000000".into()],
        port: None,
    }
}

pub(super) fn echo_server() -> App {
    App {
        command: vec![
            "/usr/local/bin/probe".into(),
            "origdst-echo".into(),
            format!("0.0.0.0:{SERVER_PORT}"),
        ],
        port: Some(SERVER_PORT),
    }
}

pub(super) fn workloads() -> String {
    [
        injected_pod(
            "server",
            ProxyUid::Explicit(SERVER_PROXY_UID),
            &echo_server(),
        ),
        injected_pod("client", ProxyUid::Default, &sleep_app()),
        plain_pod("plain", &sleep_app()),
    ]
    .join("---\n")
}

/// What Istio's injector writes with the CNI plugin on (istio-validation instead of
/// istio-init) and native sidecars: the status annotation and istio-proxy as an init
/// container with `restartPolicy: Always`.
pub(super) fn injected_pod(name: &str, uid: ProxyUid, app: &App) -> String {
    let run_as = match uid {
        ProxyUid::Default => String::new(),
        ProxyUid::Explicit(uid) => {
            format!("\n      securityContext:\n        runAsUser: {uid}\n        runAsGroup: {uid}")
        }
    };
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {MESH}
  labels:
    app: {name}
    security.istio.io/tlsMode: istio
  annotations:
    sidecar.istio.io/status: '{{"initContainers":["istio-validation","istio-proxy"],"containers":null,"volumes":["istio-envoy"],"imagePullSecrets":null,"revision":"default"}}'
spec:
  terminationGracePeriodSeconds: 2
  initContainers:
    - name: istio-proxy
      image: {PROXY_IMAGE}
      imagePullPolicy: Never
      restartPolicy: Always{run_as}
      volumeMounts:
        - name: haproxy
          mountPath: /etc/haproxy
  containers:
{app}
  volumes:
    - name: haproxy
      configMap:
        name: sidecar-haproxy
"#,
        app = app_container(app),
    )
}

/// What Linkerd's injector leaves with linkerd-cni: the proxy-version annotation and
/// linkerd-proxy (here HAProxy on Linkerd's ports) as UID 2102, first among the containers.
pub(super) fn linkerd_pod(name: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {MESH}
  annotations:
    linkerd.io/inject: enabled
    linkerd.io/proxy-version: e2e
spec:
  terminationGracePeriodSeconds: 2
  containers:
    - name: linkerd-proxy
      image: {PROXY_IMAGE}
      imagePullPolicy: Never
      securityContext:
        runAsUser: 2102
        runAsGroup: 2102
      volumeMounts:
        - name: haproxy
          mountPath: /etc/haproxy
{app}
  volumes:
    - name: haproxy
      configMap:
        name: sidecar-haproxy
        items:
          - key: linkerd.cfg
            path: haproxy.cfg
"#,
        app = app_container(&sleep_app()),
    )
}

pub(super) fn plain_pod(name: &str, app: &App) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {MESH}\n  labels:\n    app: {name}\nspec:\n  terminationGracePeriodSeconds: 2\n  containers:\n{}\n",
        app_container(app)
    )
}

pub(super) fn app_container(app: &App) -> String {
    let command = app
        .command
        .iter()
        .map(|a| format!("\"{a}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let ports = app
        .port
        .map(|p| format!("\n      ports:\n        - containerPort: {p}"))
        .unwrap_or_default();
    format!(
        "    - name: app\n      image: {APP_IMAGE}\n      imagePullPolicy: Never\n      command: [{command}]{ports}"
    )
}

/// The sidecar's HAProxy: Istio's ports, forwarding each connection to its original
/// destination (SO_ORIGINAL_DST), inbound from 127.0.0.6 as Envoy's passthrough does; one log
/// line per connection with the addresses the socket API gave.
pub(super) fn haproxy_config_map() -> String {
    let istio = haproxy_config(15001, 15006);
    let linkerd = haproxy_config(4140, 4143);
    let indent = |c: &str| -> String { c.lines().map(|l| format!("    {l}\n")).collect() };
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: sidecar-haproxy\n  namespace: {MESH}\ndata:\n  haproxy.cfg: |\n{}  linkerd.cfg: |\n{}",
        indent(&istio),
        indent(&linkerd)
    )
}

pub(super) fn haproxy_config(outbound: u16, inbound: u16) -> String {
    let config = r#"global
  maxconn 256
  nbthread 1
  log stderr format raw local0 info
defaults
  mode tcp
  log global
  log-format "%ft client=%ci:%cp dst=%fi:%fp be=%b server=%si:%sp term=%ts"
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend outbound
  bind 127.0.0.1:15001
  use_backend loop_guard if { dst_port 15001 }
  default_backend outbound_orig
backend outbound_orig
  server orig 0.0.0.0:0
backend loop_guard
frontend inbound
  bind 0.0.0.0:15006
  use_backend loop_guard if { dst_port 15006 }
  default_backend inbound_orig
backend inbound_orig
  server orig 0.0.0.0:0 source 127.0.0.6
"#;
    config
        .replace("15001", &outbound.to_string())
        .replace("15006", &inbound.to_string())
}

/// A meshed pod made while the node still has the startup taint: it has no toleration.
pub(super) fn gated_pod(name: &str) -> String {
    injected_pod(name, ProxyUid::Default, &sleep_app())
}

/// A namespace that Istio's ambient selectors pick, and one pod in it with no sidecar.
pub(super) fn ambient_pod_manifest(namespace: &str, name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n  labels:\n    istio.io/dataplane-mode: ambient\n---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n  terminationGracePeriodSeconds: 2\n  containers:\n{}\n",
        app_container(&sleep_app())
    )
}

/// The ztunnel stand-in as Istio runs ztunnel: a DaemonSet in istio-system, the container named
/// istio-proxy, the CNI's socket directory from the host, and the capabilities ztunnel's chart
/// grants (SYS_ADMIN to enter pod netns, NET_ADMIN to mark, NET_RAW for IP_TRANSPARENT).
pub(super) fn ztunnel_manifest(socket_dir: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: istio-system
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ztunnel
  namespace: istio-system
spec:
  selector:
    matchLabels:
      app: ztunnel
  template:
    metadata:
      labels:
        app: ztunnel
    spec:
      terminationGracePeriodSeconds: 2
      tolerations:
        - operator: Exists
      containers:
        - name: istio-proxy
          image: {APP_IMAGE}
          imagePullPolicy: Never
          command: ["/usr/local/bin/probe", "ztunnel", "/var/run/ztunnel/ztunnel.sock"]
          securityContext:
            runAsUser: 0
            runAsGroup: 0
            capabilities:
              drop: ["ALL"]
              add: ["SYS_ADMIN", "NET_ADMIN", "NET_RAW"]
          volumeMounts:
            - name: cni-ztunnel-sock-dir
              mountPath: /var/run/ztunnel
      volumes:
        - name: cni-ztunnel-sock-dir
          hostPath:
            path: {socket_dir}
            type: DirectoryOrCreate
"#
    )
}
