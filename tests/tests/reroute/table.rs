//! The differential table's pieces: one policy in both forms (sidestep's flags and policy file,
//! istio-iptables' options), observing one connection from the VM, and rule G, so the test
//! itself reads as the table.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Result;
use sidestep_tests::{
    TestEnv,
    istio_iptables::IstioCapture,
    parity::{Listeners, Names, Outcome, outcome},
};

use crate::IFACE;
use crate::vm::Vm;

/// A policy file naming the re-routed interface (the CLI has no flag for it).
pub(super) fn reroute_policy(env: &TestEnv, ifaces: &[&str]) -> Result<PathBuf> {
    let path = env
        .tmp_dir()
        .join(format!("reroute-{}.json", ifaces.join("-")));
    std::fs::write(
        &path,
        serde_json::json!({ "rerouteVirtualInterfaces": ifaces }).to_string(),
    )?;
    Ok(path)
}

/// One policy of the table, in both forms.
pub(super) struct Case {
    pub(super) name: &'static str,
    pub(super) include: String,
    pub(super) exclude: String,
    pub(super) exclude_ports: String,
    /// Destinations the VM connects to.
    pub(super) targets: Vec<SocketAddr>,
}

pub(super) fn sidestep_args(c: &Case, policy_file: &Path) -> Vec<String> {
    vec![
        "--policy".into(),
        policy_file.display().to_string(),
        "--include-outbound-ip-ranges".into(),
        c.include.clone(),
        "--exclude-outbound-ip-ranges".into(),
        c.exclude.clone(),
        "--exclude-outbound-ports".into(),
        c.exclude_ports.clone(),
    ]
}

pub(super) fn istio_capture(c: &Case) -> IstioCapture {
    IstioCapture {
        include_outbound_ip_ranges: c.include.clone(),
        exclude_outbound_ip_ranges: c.exclude.clone(),
        exclude_outbound_ports: c.exclude_ports.clone(),
        reroute_virtual_interfaces: IFACE.into(),
        ipv6: true,
        ..Default::default()
    }
}

pub(super) fn observe(
    vm: &Vm,
    names: &Names,
    listeners: &mut Listeners,
    to: SocketAddr,
) -> Result<Outcome> {
    let client = vm.connect(to, false)?;
    let wait = if client.get("errno").is_some() {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(3)
    };
    let accepted = listeners.take(wait)?;
    outcome(names, &client, &accepted)
}

/// tests/tests/parity.rs's rule G: a connection nothing redirected gets its own local address from
/// SO_ORIGINAL_DST under Istio's rules (they turn conntrack on in the pod), ENOENT from sidestep.
pub(super) fn rule_g(istio: &Outcome) -> Outcome {
    let mut o = istio.clone();
    if o.accepted == "15001" {
        return o;
    }
    let local = o.local.clone();
    for v in [&mut o.orig_v4, &mut o.orig_v6] {
        if *v == local {
            *v = "ENOENT".into();
        }
    }
    o
}
