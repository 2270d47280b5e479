//! Kuma: kuma-cni's skip rules and annotations (app/cni/pkg/cni in kumahq/kuma), with its
//! defaults. Kuma's rules descend from Istio's, hairpin included.

use sidestep::policy::Policy;

use super::{
    AnnotationError, Decision, SkipReason, api_sidecar_rules, apply_port_excludes, bad, cidr_set,
    enrol, port_set, proxy_uid_override, single_port, union, value,
};
use crate::pod::PodInfo;

pub const PROXY: &str = "kuma-sidecar";
pub const INIT: &str = "kuma-init";
pub const PROXY_UID: u32 = 5678;

pub const SIDECAR_INJECTED: &str = "kuma.io/sidecar-injected";
pub const SIDECAR_UID: &str = "kuma.io/sidecar-uid";
pub const INBOUND_PORT: &str = "kuma.io/transparent-proxying-inbound-port";
pub const OUTBOUND_PORT: &str = "kuma.io/transparent-proxying-outbound-port";
pub const IP_FAMILY_MODE: &str = "kuma.io/transparent-proxying-ip-family-mode";
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.kuma.io/exclude-inbound-ports";
pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.kuma.io/exclude-outbound-ports";
pub const EXCLUDE_OUTBOUND_IPS: &str = "traffic.kuma.io/exclude-outbound-ips";
pub const EXCLUDE_INBOUND_IPS: &str = "traffic.kuma.io/exclude-inbound-ips";
pub const EXCLUDE_OUTBOUND_PORTS_FOR_UIDS: &str = "traffic.kuma.io/exclude-outbound-ports-for-uids";
pub const BUILTIN_DNS: &str = "kuma.io/builtin-dns";
pub const BUILTIN_DNS_PORT: &str = "kuma.io/builtin-dns-port";
pub const VIRTUAL_PROBES: &str = "kuma.io/virtual-probes";
pub const VIRTUAL_PROBES_PORT: &str = "kuma.io/virtual-probes-port";

/// Envoy's admin port, kuma-cni's default for both exclusion lists.
const DEFAULT_EXCLUDED_PORTS: &str = "9901";

/// Kuma's boolean annotations take enabled/disabled as well as true/false.
fn enabled(key: &str, text: &str) -> Result<bool, AnnotationError> {
    match text {
        "enabled" | "true" => Ok(true),
        "disabled" | "false" => Ok(false),
        _ => Err(bad(key, text, "want enabled, disabled, true or false")),
    }
}

pub fn decide(pod: &PodInfo) -> Result<Decision, AnnotationError> {
    if let Some(skip) = api_sidecar_rules(pod, INIT, PROXY) {
        return Ok(Decision::Skip(skip));
    }
    if pod.annotation(SIDECAR_INJECTED) != Some("true") {
        return Ok(Decision::Skip(SkipReason::NotInjected(SIDECAR_INJECTED)));
    }
    Ok(enrol(policy(pod)?, true))
}

pub fn policy(pod: &PodInfo) -> Result<Policy, AnnotationError> {
    let mut p = Policy {
        proxy_uid: PROXY_UID,
        proxy_gid: PROXY_UID,
        ..Policy::default()
    };
    proxy_uid_override(&mut p, pod, SIDECAR_UID)?;
    p.inbound_port = single_port(INBOUND_PORT, value(pod, INBOUND_PORT, "15006"))?;
    p.outbound_port = single_port(OUTBOUND_PORT, value(pod, OUTBOUND_PORT, "15001"))?;
    let family = value(pod, IP_FAMILY_MODE, "dualstack");
    p.capture_ipv6 = match family {
        "dualstack" | "ipv6" => true,
        "ipv4" => false,
        _ => return Err(bad(IP_FAMILY_MODE, family, "want dualstack, ipv4 or ipv6")),
    };
    let mut inbound_ex = port_set(
        EXCLUDE_INBOUND_PORTS,
        value(pod, EXCLUDE_INBOUND_PORTS, DEFAULT_EXCLUDED_PORTS),
    )?;
    if enabled(VIRTUAL_PROBES, value(pod, VIRTUAL_PROBES, "enabled"))? {
        let port = single_port(VIRTUAL_PROBES_PORT, value(pod, VIRTUAL_PROBES_PORT, "9000"))?;
        inbound_ex = union(inbound_ex, &[port]);
    }
    let outbound_ex = port_set(
        EXCLUDE_OUTBOUND_PORTS,
        value(pod, EXCLUDE_OUTBOUND_PORTS, DEFAULT_EXCLUDED_PORTS),
    )?;
    apply_port_excludes(&mut p, inbound_ex, outbound_ex);
    if let Some(v) = pod.annotation(EXCLUDE_OUTBOUND_IPS) {
        p.exclude_outbound_ip_ranges = cidr_set(EXCLUDE_OUTBOUND_IPS, v)?;
    }
    if enabled(BUILTIN_DNS, value(pod, BUILTIN_DNS, "false"))? {
        p.dns_capture = true;
        p.dns_port = single_port(BUILTIN_DNS_PORT, value(pod, BUILTIN_DNS_PORT, "15053"))?;
    }
    // Not in the policy model yet: capturing more than asked keeps the pod in the mesh.
    for key in [EXCLUDE_INBOUND_IPS, EXCLUDE_OUTBOUND_PORTS_FOR_UIDS] {
        if let Some(v) = pod.annotation(key).filter(|v| !v.trim().is_empty()) {
            tracing::warn!("{key}={v:?} is not supported by sidestep yet and is ignored");
        }
    }
    if p.inbound_port == p.outbound_port {
        return Err(bad(
            INBOUND_PORT,
            &p.inbound_port.to_string(),
            format!("must differ from {OUTBOUND_PORT}"),
        ));
    }
    Ok(p)
}

#[cfg(test)]
mod tests;
