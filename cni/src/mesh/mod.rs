//! The enrolment decision, in Istio's order: first the rules that need only CNI_ARGS and the
//! config ([`before_pod_read`]), then the mesh's own rules and annotations on the pod
//! ([`decide_pod`]). Both are pure; reading the pod and touching the data path happen elsewhere.

pub mod istio;
pub mod kuma;
pub mod linkerd;

use std::fmt;

use sidestep::{
    error::PolicyError,
    policy::{self, CidrSet, Policy, PortSet, RuleList},
};

use crate::{
    config::{Mesh, PluginConfig},
    pod::{PodInfo, PodSource},
    spec::{CniError, code, env::CniArgs, env::valid_ifname, error::ToCniError},
};

/// The pod's Kubernetes identity from CNI_ARGS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub namespace: String,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    NoKubernetesIdentity,
    AgentPod,
    NamespaceExcluded(String),
    InitContainer(&'static str),
    ProxyDisabled(&'static str),
    NoProxyContainer {
        want: &'static str,
        have: Vec<String>,
    },
    ProxyType(String),
    InjectDisabled {
        key: &'static str,
        value: String,
        from_label: bool,
    },
    NotInjected(&'static str),
    /// Istio ambient's ztunnel itself.
    ZtunnelPod,
}

impl SkipReason {
    /// A short fixed name for the reason, which the agent counts pods by (a metric label: never
    /// a pod's own text).
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoKubernetesIdentity => "no-kubernetes-identity",
            Self::AgentPod => "agent-pod",
            Self::NamespaceExcluded(_) => "namespace-excluded",
            // istio-init, linkerd-init, kuma-init: the mesh's own iptables init captures.
            Self::InitContainer(n) => n,
            Self::ProxyDisabled(_) => "proxy-disabled",
            Self::NoProxyContainer { .. } => "no-proxy-container",
            Self::ProxyType(_) => "proxy-type",
            Self::InjectDisabled { .. } => "inject-disabled",
            Self::NotInjected(_) => "not-injected",
            Self::ZtunnelPod => "ztunnel-pod",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoKubernetesIdentity => f.write_str(
                "CNI_ARGS has no K8S_POD_NAME/K8S_POD_NAMESPACE and the config has no policy",
            ),
            Self::AgentPod => f.write_str("it is the node agent's own pod"),
            Self::NamespaceExcluded(ns) => write!(f, "namespace {ns} is in exclude_namespaces"),
            Self::InitContainer(n) => write!(f, "it has a {n} init container (it captures itself)"),
            Self::ProxyDisabled(v) => write!(f, "{v}=true on the proxy container"),
            Self::NoProxyContainer { want, have } => {
                write!(f, "it has no {want} container (has [{}])", have.join(", "))
            }
            Self::ProxyType(t) => write!(f, "its proxy type is {t}, not sidecar"),
            Self::InjectDisabled {
                key,
                value,
                from_label,
            } => write!(
                f,
                "{} {key}={value}",
                if *from_label { "label" } else { "annotation" }
            ),
            Self::NotInjected(key) => write!(f, "it has no {key} annotation (not injected)"),
            Self::ZtunnelPod => f.write_str("it is ztunnel's own pod (istio-system, app=ztunnel)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolment {
    pub policy: Policy,
    /// Whether the pod's own IPs go into the policy, which turns on Istio's hairpin (the proxy
    /// calling its own pod IP goes inbound). Linkerd ignores loopback wholesale and has none.
    pub hairpin: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Skip(SkipReason),
    Enrol(Box<Enrolment>),
}

/// What to do before any pod data is fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreDecision {
    Skip(SkipReason),
    /// A workload without Kubernetes identity, enrolled with the config's `policy`.
    ConfigPolicy(Box<Policy>),
    ReadPod(Identity),
}

/// A pod field that does not parse. The message names the annotation and its value (the start
/// of it, when long: a list of thousands would make an error too big for the runtime's event).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pod annotation {key}={}: {reason}", shortened(value))]
pub struct AnnotationError {
    pub key: String,
    pub value: String,
    pub reason: String,
}

impl ToCniError for AnnotationError {
    fn to_cni(&self) -> CniError {
        CniError::new(code::BAD_ANNOTATION, self.to_string())
            .details("fix the pod's annotation (or the injected field) and recreate the pod")
    }
}

/// Values up to this many characters are quoted whole in an error.
const QUOTED_CHARS: usize = 120;

fn shortened(value: &str) -> String {
    match value.char_indices().nth(QUOTED_CHARS) {
        None => format!("{value:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes)", &value[..end], value.len()),
    }
}

fn bad(key: &str, value: &str, reason: impl Into<String>) -> AnnotationError {
    AnnotationError {
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

fn from_policy_error(key: &str, value: &str, e: PolicyError) -> AnnotationError {
    let reason = match e {
        PolicyError::Port { value, .. } => format!("{value:?} is not a port (1-65535)"),
        PolicyError::Cidr { value, reason, .. } => format!("{value:?} is not a CIDR ({reason})"),
        PolicyError::Value { value, reason, .. } => format!("{value:?}: {reason}"),
        PolicyError::TooLong {
            what, limit, map, ..
        } => format!(
            "more than {limit} {what}, the most one pod's lists may put in {map}, which every \
             pod of the node shares (docs/REFERENCE.md, \"Per-pod map budgets\")"
        ),
        PolicyError::OverBudget(over) => over.to_string(),
    };
    bad(key, value, reason)
}

/// The annotation a mesh fills a policy list from; `None` for lists it has no annotation for.
pub fn list_annotation(mesh: Mesh, list: RuleList) -> Option<&'static str> {
    use RuleList::*;
    match (mesh, list) {
        (Mesh::Istio, IncludeInboundPorts) => Some(istio::INCLUDE_INBOUND_PORTS),
        (Mesh::Istio, ExcludeInboundPorts) => Some(istio::EXCLUDE_INBOUND_PORTS),
        (Mesh::Istio, IncludeOutboundPorts) => Some(istio::INCLUDE_OUTBOUND_PORTS),
        (Mesh::Istio, ExcludeOutboundPorts) => Some(istio::EXCLUDE_OUTBOUND_PORTS),
        (Mesh::Istio, IncludeOutboundIpRanges) => Some(istio::INCLUDE_OUTBOUND_IP_RANGES),
        (Mesh::Istio, ExcludeOutboundIpRanges) => Some(istio::EXCLUDE_OUTBOUND_IP_RANGES),
        (Mesh::Linkerd, ExcludeInboundPorts) => Some(linkerd::SKIP_INBOUND_PORTS),
        (Mesh::Linkerd, ExcludeOutboundPorts) => Some(linkerd::SKIP_OUTBOUND_PORTS),
        (Mesh::Linkerd, ExcludeOutboundIpRanges) => Some(linkerd::SKIP_SUBNETS),
        (Mesh::Kuma, ExcludeInboundPorts) => Some(kuma::EXCLUDE_INBOUND_PORTS),
        (Mesh::Kuma, ExcludeOutboundPorts) => Some(kuma::EXCLUDE_OUTBOUND_PORTS),
        (Mesh::Kuma, ExcludeOutboundIpRanges) => Some(kuma::EXCLUDE_OUTBOUND_IPS),
        _ => None,
    }
}

/// The pod's lists together within its share of the node-wide rule maps (each list alone was
/// held to it while parsing). The error names the largest list the pod sets by annotation, and
/// every list with its count: the mesh's defaults write a few entries, so it is the pod's own.
fn within_budget(mesh: Mesh, pod: &PodInfo, p: &Policy) -> Result<(), AnnotationError> {
    let Err(over) = p.check_budget() else {
        return Ok(());
    };
    let name = |list| list_annotation(mesh, list).unwrap_or(list.field());
    let (key, value) = over
        .lists
        .iter()
        .find_map(|(list, _)| {
            let key = list_annotation(mesh, *list)?;
            Some((key, pod.annotation(key)?))
        })
        .unwrap_or((name(over.lists[0].0), ""));
    Err(bad(
        key,
        value,
        format!(
            "the pod's lists would put {} entries in {}, more than the {} one pod may hold in \
             this map every pod of the node shares: {} (docs/REFERENCE.md, \"Per-pod map \
             budgets\")",
            over.entries,
            over.map,
            over.limit,
            over.listing(name)
        ),
    ))
}

/// An annotation's value, or `default` when the pod does not carry it.
fn value<'a>(pod: &'a PodInfo, key: &str, default: &'a str) -> &'a str {
    pod.annotation(key).unwrap_or(default)
}

pub(crate) fn port_set(key: &str, text: &str) -> Result<PortSet, AnnotationError> {
    policy::parse_port_set(key, text).map_err(|e| from_policy_error(key, text, e))
}

pub(crate) fn cidr_set(key: &str, text: &str) -> Result<CidrSet, AnnotationError> {
    policy::parse_cidr_set(key, text).map_err(|e| from_policy_error(key, text, e))
}

pub(crate) fn single_port(key: &str, text: &str) -> Result<u16, AnnotationError> {
    policy::parse_port(key, text).map_err(|e| from_policy_error(key, text, e))
}

pub(crate) fn id(key: &str, text: &str) -> Result<u32, AnnotationError> {
    text.trim()
        .parse::<u32>()
        .map_err(|_| bad(key, text, "not a user/group ID (0-4294967295)"))
}

pub(crate) fn interfaces(key: &str, text: &str) -> Result<Vec<String>, AnnotationError> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|name| {
            valid_ifname(name)
                .map(|()| name.to_owned())
                .map_err(|e| bad(key, text, e))
        })
        .collect()
}

/// linkerd-cni's and kuma-cni's rule for a pod read from the API: one with the mesh's init
/// container captures itself, and one without the proxy container is not in the mesh. (With
/// runtime annotations only, there are no containers to look at.)
fn api_sidecar_rules(pod: &PodInfo, init: &'static str, proxy: &'static str) -> Option<SkipReason> {
    if pod.source != PodSource::Api {
        return None;
    }
    if pod.has_init_container(init) {
        return Some(SkipReason::InitContainer(init));
    }
    if pod.container(proxy).is_none() {
        return Some(SkipReason::NoProxyContainer {
            want: proxy,
            have: pod
                .container_names()
                .into_iter()
                .map(str::to_owned)
                .collect(),
        });
    }
    None
}

/// A proxy UID annotation (Linkerd's and Kuma's). Both meshes match the proxy by UID alone, so
/// the GID takes the same value, which keeps the GID rule inert.
fn proxy_uid_override(p: &mut Policy, pod: &PodInfo, key: &str) -> Result<(), AnnotationError> {
    if let Some(v) = pod.annotation(key) {
        p.proxy_uid = id(key, v)?;
        p.proxy_gid = p.proxy_uid;
    }
    Ok(())
}

/// Go's strconv.ParseBool, which Istio uses for its boolean annotations and env.
pub(crate) fn go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Pod names the node agent's DaemonSet gives its pods (sidestep's, and istio-cni's for a
/// drop-in install).
const AGENT_POD_PREFIXES: [&str; 2] = ["sidestep-", "istio-cni-node-"];

/// The rules that need no pod data.
pub fn before_pod_read(cfg: &PluginConfig, args: &CniArgs) -> PreDecision {
    let (Some(name), Some(namespace)) = (args.get("K8S_POD_NAME"), args.get("K8S_POD_NAMESPACE"))
    else {
        return match &cfg.policy {
            Some(p) => PreDecision::ConfigPolicy(Box::new(p.clone())),
            None => PreDecision::Skip(SkipReason::NoKubernetesIdentity),
        };
    };
    if cfg.agent_namespace.as_deref() == Some(namespace)
        && AGENT_POD_PREFIXES.iter().any(|p| name.starts_with(p))
    {
        return PreDecision::Skip(SkipReason::AgentPod);
    }
    if cfg.exclude_namespaces.iter().any(|n| n == namespace) {
        return PreDecision::Skip(SkipReason::NamespaceExcluded(namespace.into()));
    }
    PreDecision::ReadPod(Identity {
        name: name.into(),
        namespace: namespace.into(),
    })
}

/// The mesh's rules and annotations on a pod that was read (sidecar mode).
pub fn decide_pod(mesh: Mesh, pod: &PodInfo) -> Result<Decision, AnnotationError> {
    decide_pod_with(mesh, false, pod)
}

/// [`decide_pod`], with Istio's ambient mode on or off (`ambient_enabled`).
pub fn decide_pod_with(
    mesh: Mesh,
    ambient: bool,
    pod: &PodInfo,
) -> Result<Decision, AnnotationError> {
    let mut decision = match mesh {
        Mesh::Istio => istio::decide(pod, ambient),
        Mesh::Linkerd => linkerd::decide(pod),
        Mesh::Kuma => kuma::decide(pod),
    }?;
    if let Decision::Enrol(e) = &mut decision {
        apply_sidestep_annotations(&mut e.policy, pod)?;
        within_budget(mesh, pod, &e.policy)?;
    }
    Ok(decision)
}

/// Opts a pod's app <-> proxy loopback traffic into sk_msg (socket to socket), whatever the mesh.
pub const SK_MSG_ANNOTATION: &str = "sidestep.io/sk-msg";

/// Makes the programs log each of the pod's verdicts, for the agent to forward with its name.
pub const DEBUG_ANNOTATION: &str = "sidestep.io/debug";

/// sidestep's own annotations, which every mesh's pods may carry.
fn apply_sidestep_annotations(p: &mut Policy, pod: &PodInfo) -> Result<(), AnnotationError> {
    for (key, field) in [
        (SK_MSG_ANNOTATION, &mut p.sk_msg),
        (DEBUG_ANNOTATION, &mut p.debug),
    ] {
        if let Some(v) = pod.annotation(key) {
            *field = match v.trim() {
                "true" => true,
                "false" => false,
                _ => return Err(bad(key, v, "expected \"true\" or \"false\"")),
            };
        }
    }
    Ok(())
}

fn enrol(policy: Policy, hairpin: bool) -> Decision {
    Decision::Enrol(Box::new(Enrolment { policy, hairpin }))
}

/// `exclude*Ports: "*"` means nothing of that direction is captured; the policy model spells
/// that as an empty include list.
fn apply_port_excludes(p: &mut Policy, inbound: PortSet, outbound: PortSet) {
    match inbound {
        PortSet::All => p.include_inbound_ports = PortSet::none(),
        set => p.exclude_inbound_ports = set,
    }
    match outbound {
        PortSet::All => {
            p.include_outbound_ip_ranges = CidrSet::Only(Vec::new());
            p.include_outbound_ports = PortSet::none();
            p.exclude_outbound_ports = PortSet::none();
        }
        set => p.exclude_outbound_ports = set,
    }
}

fn union(a: PortSet, extra: &[u16]) -> PortSet {
    match a {
        PortSet::All => PortSet::All,
        PortSet::Only(mut s) => {
            s.extend(extra);
            PortSet::Only(s)
        }
    }
}

#[cfg(test)]
mod tests;
