//! Linkerd: linkerd-cni's skip rules and `config.linkerd.io/*` overrides. Linkerd's rules ignore
//! loopback wholesale, so there is no hairpin and no DNS capture.

use std::collections::BTreeSet;

use sidestep::{
    enroll::MAX_POD_PORT_RULES,
    policy::{CidrSet, Policy, PortSet, too_many_ports},
};

use super::{
    AnnotationError, Decision, SkipReason, api_sidecar_rules, bad, cidr_set, enrol,
    from_policy_error, proxy_uid_override, single_port, union,
};
use crate::pod::{PodInfo, PodSource};

pub const PROXY: &str = "linkerd-proxy";
pub const INIT: &str = "linkerd-init";
pub const PROXY_UID: u32 = 2102;
pub const INBOUND_PORT: u16 = 4143;
pub const OUTBOUND_PORT: u16 = 4140;
/// The proxy's control (4190) and admin (4191) ports, which linkerd-cni never redirects.
pub const ALWAYS_SKIPPED_INBOUND: [u16; 2] = [4190, 4191];

pub const INJECT: &str = "linkerd.io/inject";
/// The injector stamps it on every pod it gives a proxy.
pub const PROXY_VERSION: &str = "linkerd.io/proxy-version";
pub const SKIP_INBOUND_PORTS: &str = "config.linkerd.io/skip-inbound-ports";
pub const SKIP_OUTBOUND_PORTS: &str = "config.linkerd.io/skip-outbound-ports";
pub const SKIP_SUBNETS: &str = "config.linkerd.io/skip-subnets";
pub const PROXY_UID_ANNOTATION: &str = "config.linkerd.io/proxy-uid";

/// Linkerd's port lists allow ranges: `25,587,4000-4100`. Each port of a range is an entry of
/// the node-wide `SIDESTEP_PORTS`, so a list of more ports than one pod may put there
/// ([`MAX_POD_PORT_RULES`]) is refused as soon as it passes that.
pub fn port_ranges(key: &str, text: &str) -> Result<BTreeSet<u16>, AnnotationError> {
    let mut ports = BTreeSet::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (single_port(key, lo)?, single_port(key, hi)?);
                if lo > hi {
                    return Err(bad(key, text, format!("range {item} is reversed")));
                }
                ports.extend(lo..=hi);
            }
            None => {
                ports.insert(single_port(key, item)?);
            }
        }
        if ports.len() > MAX_POD_PORT_RULES {
            return Err(from_policy_error(key, text, too_many_ports(key)));
        }
    }
    Ok(ports)
}

pub fn decide(pod: &PodInfo) -> Result<Decision, AnnotationError> {
    match pod.source {
        PodSource::Api => {
            if let Some(skip) = api_sidecar_rules(pod, INIT, PROXY) {
                return Ok(Decision::Skip(skip));
            }
        }
        PodSource::RuntimeAnnotations => {
            if let Some(v) = pod.annotation(INJECT)
                && v == "disabled"
            {
                return Ok(Decision::Skip(SkipReason::InjectDisabled {
                    key: INJECT,
                    value: v.into(),
                    from_label: false,
                }));
            }
            if pod.annotation(PROXY_VERSION).is_none() {
                return Ok(Decision::Skip(SkipReason::NotInjected(PROXY_VERSION)));
            }
        }
    }
    Ok(enrol(policy(pod)?, false))
}

pub fn policy(pod: &PodInfo) -> Result<Policy, AnnotationError> {
    let mut p = Policy {
        proxy_uid: PROXY_UID,
        // Linkerd matches the proxy by UID alone; the same value keeps the GID rule inert.
        proxy_gid: PROXY_UID,
        inbound_port: INBOUND_PORT,
        outbound_port: OUTBOUND_PORT,
        dns_capture: false,
        ..Policy::default()
    };
    proxy_uid_override(&mut p, pod, PROXY_UID_ANNOTATION)?;
    let inbound = match pod.annotation(SKIP_INBOUND_PORTS) {
        Some(v) => port_ranges(SKIP_INBOUND_PORTS, v)?,
        None => BTreeSet::new(),
    };
    p.exclude_inbound_ports = union(PortSet::Only(inbound), &ALWAYS_SKIPPED_INBOUND);
    if let Some(v) = pod.annotation(SKIP_OUTBOUND_PORTS) {
        p.exclude_outbound_ports = PortSet::Only(port_ranges(SKIP_OUTBOUND_PORTS, v)?);
    }
    if let Some(v) = pod.annotation(SKIP_SUBNETS) {
        p.exclude_outbound_ip_ranges = cidr_set(SKIP_SUBNETS, v)?;
        if p.exclude_outbound_ip_ranges == CidrSet::All {
            return Err(bad(SKIP_SUBNETS, v, "`*` is not a subnet"));
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests;
