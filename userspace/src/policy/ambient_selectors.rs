//! istio-cni's default ambient enablement selectors. The plugin's ADD enrols the pods they pick;
//! the agent takes a running pod out of the mesh when they stop picking it (a label removed from
//! the pod or its namespace), as istio-cni's node agent does.

use std::collections::BTreeMap;

/// The label the selectors read, on the pod and on its namespace, and its two values.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
pub const DATAPLANE_AMBIENT: &str = "ambient";
pub const DATAPLANE_NONE: &str = "none";
/// The annotation Istio's injector writes on a sidecar-injected pod.
pub const SIDECAR_STATUS: &str = "sidecar.istio.io/status";

/// The pod labelled ambient, or its namespace labelled ambient and the pod not labelled none;
/// never a sidecar-injected pod.
pub fn selected(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    namespace_labels: &BTreeMap<String, String>,
) -> bool {
    if annotations.contains_key(SIDECAR_STATUS) {
        return false;
    }
    match labels.get(DATAPLANE_MODE).map(String::as_str) {
        Some(DATAPLANE_AMBIENT) => true,
        Some(DATAPLANE_NONE) => false,
        _ => namespace_labels.get(DATAPLANE_MODE).map(String::as_str) == Some(DATAPLANE_AMBIENT),
    }
}
