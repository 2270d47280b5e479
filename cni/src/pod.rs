//! What the decision needs to know about a pod, from either source: the Pod object of the
//! Kubernetes API, or the annotations a CRI runtime passes in runtimeConfig (which show no
//! containers, so the injector's `sidecar.istio.io/status` stands in for the container list).

use std::{collections::BTreeMap, net::IpAddr, str::FromStr};

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Container {
    pub name: String,
    pub env: BTreeMap<String, String>,
    pub args: Vec<String>,
    pub run_as_user: Option<i64>,
    pub run_as_group: Option<i64>,
}

/// Where the pod data came from; rules that need the container spec only apply to `Api`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodSource {
    Api,
    RuntimeAnnotations,
}

/// Where the pod reader puts the labels of the pod's namespace in the Pod JSON it returns (a key
/// the API never serves; the JSON stays inside the plugin).
pub const NAMESPACE_LABELS_KEY: &str = "sidestep.io/namespaceLabels";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub name: String,
    pub namespace: String,
    pub source: PodSource,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub containers: Vec<Container>,
    /// Every init container, native sidecars (restartPolicy Always) included, as Istio counts them.
    pub init_containers: Vec<Container>,
    /// status.podIPs, else status.podIP.
    pub pod_ips: Vec<IpAddr>,
    /// The namespace's labels, when the reader fetched them (ambient); empty otherwise.
    pub namespace_labels: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PodError {
    #[error("the Pod object does not decode: {0}")]
    Decode(String),
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct RawPod {
    metadata: RawMeta,
    spec: RawSpec,
    status: RawStatus,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawMeta {
    name: String,
    namespace: String,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct RawSpec {
    containers: Option<Vec<RawContainer>>,
    init_containers: Option<Vec<RawContainer>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct RawContainer {
    name: String,
    env: Option<Vec<RawEnv>>,
    args: Option<Vec<String>>,
    security_context: Option<RawSecurityContext>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawEnv {
    name: String,
    value: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct RawSecurityContext {
    run_as_user: Option<i64>,
    run_as_group: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct RawStatus {
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pod_ips: Option<Vec<RawPodIp>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawPodIp {
    ip: String,
}

impl From<RawContainer> for Container {
    fn from(c: RawContainer) -> Self {
        let sc = c.security_context.unwrap_or_default();
        Self {
            name: c.name,
            env: c
                .env
                .unwrap_or_default()
                .into_iter()
                .map(|e| (e.name, e.value.unwrap_or_default()))
                .collect(),
            args: c.args.unwrap_or_default(),
            run_as_user: sc.run_as_user,
            run_as_group: sc.run_as_group,
        }
    }
}

fn parse_ips(status: RawStatus) -> Vec<IpAddr> {
    let listed: Vec<IpAddr> = status
        .pod_ips
        .unwrap_or_default()
        .iter()
        .filter_map(|p| IpAddr::from_str(&p.ip).ok())
        .collect();
    if !listed.is_empty() {
        return listed;
    }
    status
        .pod_ip
        .and_then(|ip| IpAddr::from_str(&ip).ok())
        .into_iter()
        .collect()
}

impl PodInfo {
    /// From a Pod object as the API serves it (core/v1 JSON).
    pub fn from_api_json(pod: &Value) -> Result<Self, PodError> {
        let raw = RawPod::deserialize(pod).map_err(|e| PodError::Decode(e.to_string()))?;
        Ok(Self {
            name: raw.metadata.name,
            namespace: raw.metadata.namespace,
            source: PodSource::Api,
            labels: raw.metadata.labels.unwrap_or_default(),
            annotations: raw.metadata.annotations.unwrap_or_default(),
            containers: raw
                .spec
                .containers
                .unwrap_or_default()
                .into_iter()
                .map(Container::from)
                .collect(),
            init_containers: raw
                .spec
                .init_containers
                .unwrap_or_default()
                .into_iter()
                .map(Container::from)
                .collect(),
            pod_ips: parse_ips(raw.status),
            namespace_labels: pod
                .get(NAMESPACE_LABELS_KEY)
                .and_then(|v| BTreeMap::<String, String>::deserialize(v).ok())
                .unwrap_or_default(),
        })
    }

    /// From runtimeConfig: annotations only; no labels, containers or IPs.
    pub fn from_annotations(
        name: &str,
        namespace: &str,
        annotations: BTreeMap<String, String>,
    ) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            source: PodSource::RuntimeAnnotations,
            labels: BTreeMap::new(),
            annotations,
            containers: Vec::new(),
            init_containers: Vec::new(),
            pod_ips: Vec::new(),
            namespace_labels: BTreeMap::new(),
        }
    }

    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }

    /// The container named `name`, regular or init.
    pub fn container(&self, name: &str) -> Option<&Container> {
        self.containers
            .iter()
            .chain(&self.init_containers)
            .find(|c| c.name == name)
    }

    pub fn has_init_container(&self, name: &str) -> bool {
        self.init_containers.iter().any(|c| c.name == name)
    }

    pub fn container_names(&self) -> Vec<&str> {
        self.init_containers
            .iter()
            .chain(&self.containers)
            .map(|c| c.name.as_str())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn api_pod_with_native_sidecar() {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "shop",
                         "labels": {"app": "web"},
                         "annotations": {"sidecar.istio.io/status": "{}"}},
            "spec": {
                "initContainers": [{"name": "istio-proxy", "restartPolicy": "Always",
                                    "args": ["proxy", "sidecar"],
                                    "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"},
                                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {}}}],
                                    "securityContext": {"runAsUser": 1500, "runAsGroup": 1501}}],
                "containers": [{"name": "app", "image": "nginx"}]
            },
            "status": {"podIP": "10.0.0.9", "podIPs": [{"ip": "10.0.0.9"}, {"ip": "fd00::9"}]}
        });
        let p = PodInfo::from_api_json(&pod).unwrap();
        assert_eq!(p.name, "web");
        assert_eq!(p.source, PodSource::Api);
        let proxy = p.container("istio-proxy").unwrap();
        assert_eq!(proxy.run_as_user, Some(1500));
        assert_eq!(proxy.env["ISTIO_META_DNS_CAPTURE"], "true");
        assert_eq!(proxy.env["POD_NAME"], "");
        assert_eq!(p.pod_ips.len(), 2);
        assert_eq!(p.container_names(), ["istio-proxy", "app"]);
    }

    #[test]
    fn pod_ip_fallback_and_bad_shapes() {
        let p = PodInfo::from_api_json(&json!({"status": {"podIP": "10.1.1.1"}})).unwrap();
        assert_eq!(p.pod_ips, [IpAddr::from([10, 1, 1, 1])]);
        let p = PodInfo::from_api_json(&json!({"metadata": {"name": "x"}})).unwrap();
        assert!(p.pod_ips.is_empty() && p.containers.is_empty());
        assert!(PodInfo::from_api_json(&json!({"metadata": {"annotations": {"a": 1}}})).is_err());
        assert!(PodInfo::from_api_json(&json!("pod")).is_err());
    }
}
