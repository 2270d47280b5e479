//! Istio: the skip rules of istio-cni's CmdAdd and the annotations of its NewRedirect, with the
//! same defaults, so that sidestep is a drop-in replacement.

use std::collections::BTreeSet;

use serde::Deserialize;
use sidestep::policy::{InterceptionMode, Policy};

use super::{
    AnnotationError, Decision, SkipReason, apply_port_excludes, bad, cidr_set, enrol, go_bool,
    interfaces, port_set, value,
};
use crate::pod::{Container, PodInfo, PodSource};

pub const PROXY: &str = "istio-proxy";
pub const INIT: &str = "istio-init";

pub const INJECT: &str = "sidecar.istio.io/inject";
pub const STATUS: &str = "sidecar.istio.io/status";
pub const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
pub const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
pub const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
pub const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
pub const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";
pub const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
pub const DISABLE_ENVOY: &str = "DISABLE_ENVOY";
pub const DNS_CAPTURE: &str = "ISTIO_META_DNS_CAPTURE";
/// Per-pod ProxyConfig; its proxyMetadata becomes the proxy's env, so it is where DNS capture
/// shows when the runtime passes annotations but no containers.
pub const PROXY_CONFIG: &str = "proxy.istio.io/config";

/// Ambient mode: the label istio-cni's default enablement selectors read, on the pod and on its
/// namespace, and its two values.
pub use sidestep::policy::ambient_selectors::{DATAPLANE_AMBIENT, DATAPLANE_MODE, DATAPLANE_NONE};
/// Per-pod override of ambient DNS capture (`ambient.dnsCapture`, on by default).
pub const AMBIENT_DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
/// Ingress mode: no inbound capture.
pub const AMBIENT_BYPASS_INBOUND: &str = "ambient.istio.io/bypass-inbound-capture";
/// Where Istio runs ztunnel (its system namespace).
pub const ZTUNNEL_NAMESPACE: &str = "istio-system";

/// istio-cni's default for both port exclusion annotations: the proxy's status port.
const DEFAULT_EXCLUDED_PORTS: &str = "15020";

/// The part of the injector's status annotation that lists what it injected.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct InjectionStatus {
    containers: Option<Vec<String>>,
    init_containers: Option<Vec<String>>,
}

/// The containers the rules look at: the spec's, or the status annotation's when the runtime
/// gave us annotations only.
struct Containers<'a> {
    names: BTreeSet<String>,
    proxy: Option<&'a Container>,
}

fn containers(pod: &PodInfo) -> Result<Containers<'_>, AnnotationError> {
    match pod.source {
        PodSource::Api => Ok(Containers {
            names: pod
                .container_names()
                .into_iter()
                .map(str::to_owned)
                .collect(),
            proxy: pod.container(PROXY),
        }),
        PodSource::RuntimeAnnotations => {
            let names = match pod.annotation(STATUS) {
                None => BTreeSet::new(),
                Some(text) => {
                    let s: InjectionStatus = serde_json::from_str(text)
                        .map_err(|e| bad(STATUS, text, format!("not the injector's JSON: {e}")))?;
                    s.containers
                        .unwrap_or_default()
                        .into_iter()
                        .chain(s.init_containers.unwrap_or_default())
                        .collect()
                }
            };
            Ok(Containers { names, proxy: None })
        }
    }
}

/// istio-cni's default ambient enablement selectors: the pod labelled ambient, or its namespace
/// labelled ambient and the pod not labelled none; never a sidecar-injected pod. The namespace's
/// labels are known only when the pod was read from the API.
pub fn is_ambient(pod: &PodInfo) -> bool {
    sidestep::policy::ambient_selectors::selected(
        &pod.labels,
        &pod.annotations,
        &pod.namespace_labels,
    )
}

/// istio-cni's in-pod rules for an ambient pod, with its two per-pod overrides.
pub fn ambient_policy(pod: &PodInfo) -> Result<Policy, AnnotationError> {
    let flag = |key: &str, default: bool| match pod.annotation(key) {
        None => Ok(default),
        Some(v) => go_bool(v).ok_or_else(|| bad(key, v, "expected \"true\" or \"false\"")),
    };
    Ok(Policy::istio_ambient(
        flag(AMBIENT_DNS_CAPTURE, true)?,
        flag(AMBIENT_BYPASS_INBOUND, false)?,
    ))
}

/// `ambient`: istio-cni's plugin checks the ambient selectors first, and a pod they pick is
/// ztunnel's; every other pod goes through the sidecar rules.
pub fn decide(pod: &PodInfo, ambient: bool) -> Result<Decision, AnnotationError> {
    // ztunnel's own pod is never captured: its connections to istiod carry no mark in its own
    // netns (istio-cni's IsZtunnelPod).
    if ambient
        && pod.namespace == ZTUNNEL_NAMESPACE
        && pod.labels.get("app").is_some_and(|a| a == "ztunnel")
    {
        return Ok(Decision::Skip(SkipReason::ZtunnelPod));
    }
    if ambient && is_ambient(pod) {
        return Ok(enrol(ambient_policy(pod)?, true));
    }
    let c = containers(pod)?;
    if c.names.contains(INIT) {
        return Ok(Decision::Skip(SkipReason::InitContainer(INIT)));
    }
    if let Some(proxy) = c.proxy
        && proxy.env.get(DISABLE_ENVOY).and_then(|v| go_bool(v)) == Some(true)
    {
        return Ok(Decision::Skip(SkipReason::ProxyDisabled(DISABLE_ENVOY)));
    }
    if !c.names.contains(PROXY) {
        return Ok(Decision::Skip(SkipReason::NoProxyContainer {
            want: PROXY,
            have: c.names.into_iter().collect(),
        }));
    }
    if let Some(proxy) = c.proxy
        && proxy.args.first().map(String::as_str) == Some("proxy")
        && let Some(kind) = proxy.args.get(1)
        && kind != "sidecar"
    {
        return Ok(Decision::Skip(SkipReason::ProxyType(kind.clone())));
    }
    // The label is the newer API; when both are set, it wins.
    let inject = match pod.labels.get(INJECT) {
        Some(v) => Some((v.as_str(), true)),
        None => pod.annotation(INJECT).map(|v| (v, false)),
    };
    if let Some((v, from_label)) = inject
        && go_bool(v) == Some(false)
    {
        return Ok(Decision::Skip(SkipReason::InjectDisabled {
            key: INJECT,
            value: v.into(),
            from_label,
        }));
    }
    if pod.annotation(STATUS).is_none() {
        return Ok(Decision::Skip(SkipReason::NotInjected(STATUS)));
    }
    Ok(enrol(policy(pod, c.proxy)?, true))
}

fn proxy_id(
    proxy: Option<&Container>,
    field: &str,
    pick: fn(&Container) -> Option<i64>,
    default: u32,
) -> Result<u32, AnnotationError> {
    match proxy.and_then(pick) {
        None | Some(0) => Ok(default),
        Some(v) => u32::try_from(v).map_err(|_| {
            bad(
                &format!("{PROXY} securityContext.{field}"),
                &v.to_string(),
                "not a user/group ID",
            )
        }),
    }
}

/// The annotations, each with istio-cni's default.
pub fn policy(pod: &PodInfo, proxy: Option<&Container>) -> Result<Policy, AnnotationError> {
    let mut p = Policy::default();
    let mode = value(pod, INTERCEPTION_MODE, "REDIRECT");
    p.interception_mode = mode
        .parse::<InterceptionMode>()
        .map_err(|e| bad(INTERCEPTION_MODE, mode, e))?;
    p.proxy_uid = proxy_id(proxy, "runAsUser", |c| c.run_as_user, p.proxy_uid)?;
    p.proxy_gid = proxy_id(proxy, "runAsGroup", |c| c.run_as_group, p.proxy_gid)?;
    p.include_outbound_ip_ranges = cidr_set(
        INCLUDE_OUTBOUND_IP_RANGES,
        value(pod, INCLUDE_OUTBOUND_IP_RANGES, "*"),
    )?;
    p.exclude_outbound_ip_ranges = cidr_set(
        EXCLUDE_OUTBOUND_IP_RANGES,
        value(pod, EXCLUDE_OUTBOUND_IP_RANGES, ""),
    )?;
    p.include_inbound_ports = port_set(
        INCLUDE_INBOUND_PORTS,
        value(pod, INCLUDE_INBOUND_PORTS, "*"),
    )?;
    p.include_outbound_ports = port_set(
        INCLUDE_OUTBOUND_PORTS,
        value(pod, INCLUDE_OUTBOUND_PORTS, ""),
    )?;
    // 15008, 15020, 15021 and 15090 are always excluded inbound by the policy model itself.
    let inbound_ex = port_set(
        EXCLUDE_INBOUND_PORTS,
        value(pod, EXCLUDE_INBOUND_PORTS, DEFAULT_EXCLUDED_PORTS),
    )?;
    let outbound_ex = port_set(
        EXCLUDE_OUTBOUND_PORTS,
        value(pod, EXCLUDE_OUTBOUND_PORTS, DEFAULT_EXCLUDED_PORTS),
    )?;
    apply_port_excludes(&mut p, inbound_ex, outbound_ex);
    p.exclude_interfaces = interfaces(EXCLUDE_INTERFACES, value(pod, EXCLUDE_INTERFACES, ""))?;
    // The deprecated spelling counts only when the new one is absent, as in istio-cni.
    p.reroute_virtual_interfaces = match pod.annotation(REROUTE_VIRTUAL_INTERFACES) {
        Some(v) => interfaces(REROUTE_VIRTUAL_INTERFACES, v)?,
        None => interfaces(KUBEVIRT_INTERFACES, value(pod, KUBEVIRT_INTERFACES, ""))?,
    };
    let from_annotation = || {
        let text = pod.annotation(PROXY_CONFIG)?;
        let cfg: serde_json::Value = serde_json::from_str(text)
            .map_err(|_| {
                tracing::warn!("{PROXY_CONFIG} is not JSON; its proxyMetadata is not read")
            })
            .ok()?;
        cfg.get("proxyMetadata")?
            .get(DNS_CAPTURE)?
            .as_str()
            .map(str::to_owned)
    };
    let dns = match proxy {
        Some(c) => c.env.get(DNS_CAPTURE).cloned(),
        None => from_annotation(),
    };
    if let Some(v) = dns.as_deref() {
        // istio-cni logs and ignores a value it cannot parse; so do we.
        match go_bool(v) {
            Some(b) => p.dns_capture = b,
            None => tracing::warn!(
                "{PROXY} env {DNS_CAPTURE}={v:?} is not a boolean; DNS capture stays off"
            ),
        }
    }
    Ok(p)
}
