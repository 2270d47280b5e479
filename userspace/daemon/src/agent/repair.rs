//! Repair: enrolling running pods that were never enrolled, in place, deciding exactly as their
//! ADD would have.
//!
//! In a cluster (`api-kubeconfig`, else the agent's service account) the agent lists the pods on
//! its node once per reconcile, finds each unenrolled netns's pod by its addresses, and runs the
//! installed plugin's ADD with that pod's `K8S_POD_NAMESPACE` and `K8S_POD_NAME` and the
//! plugin's kubeconfig (`api-kubeconfig`, else the one the agent writes for the plugin). The plugin then applies its
//! own rules (namespace exclusions, the agent's own pod, the mesh's annotations, labels and
//! containers), reading the pod from the API, so repair skips exactly what ADD skips: the
//! decision code is the plugin's, not a copy. A pod it skips is remembered with the plugin's
//! reason and not asked about again while its netns lives.
//!
//! Outside a cluster there is no pod to ask about: every netns in scope is enrolled with
//! `repair-policy`, as before.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Mutex,
    time::Duration,
};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, api::ListParams};
use serde_json::{Value, json};

use super::{
    apiclient::ApiAccess,
    plugin,
    podapi::NodePod,
    pods::{self, LiveNetns},
    report::{Network, ReconcileError, Report},
    settings::RepairMode,
    settings::Settings,
};

/// Each API request of a reconcile gets this long.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// What a repair did with one netns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Repaired,
    /// `repair-mode: delete`: the pod was deleted, to be recreated through the chain.
    Deleted,
    /// `repair-mode: label`: the pod was labelled and left as it is.
    Labelled,
    /// The plugin's ADD ran and left the pod uncaptured, for this reason.
    Skipped(String),
}

/// Pods skipped by an earlier reconcile, by netns cookie (cookies are never reused while the
/// machine runs, so a process-wide memory is exact). Cleared for netns that are gone.
static SKIPPED: Mutex<BTreeMap<u64, String>> = Mutex::new(BTreeMap::new());

fn skipped() -> std::sync::MutexGuard<'static, BTreeMap<u64, String>> {
    SKIPPED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forgets every remembered skip, so the next reconcile asks the plugin again about each pod it
/// left uncaptured: a namespace's labels changed, and with them the plugin's answer may have
/// (ambient mode's `istio.io/dataplane-mode`).
pub fn forget_skips() {
    skipped().clear();
}

/// The credentials of the agent's own API requests: `api-kubeconfig`, else its service account
/// in a cluster; `None` outside one.
pub fn api_access(s: &Settings) -> Option<ApiAccess> {
    if let Some(kc) = &s.api_kubeconfig {
        return Some(ApiAccess::Kubeconfig(kc.clone()));
    }
    super::install::api_server_from_env().map(|server| ApiAccess::ServiceAccount {
        server,
        dir: s.service_account_dir.clone(),
    })
}

/// The kubeconfig repair's ADD reads the pod with: `api-kubeconfig`, else the one written for
/// the plugin, so that the ADD asks with the plugin's rights, as the runtime's ADD does.
pub fn plugin_kubeconfig(s: &Settings) -> PathBuf {
    s.api_kubeconfig
        .clone()
        .unwrap_or_else(|| s.kubeconfig_path())
}

async fn list_async(api: &ApiAccess, node: &str) -> Result<Vec<Pod>, String> {
    let client = super::apiclient::client(api, Some(API_TIMEOUT)).await?;
    let list = Api::<Pod>::all(client)
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|e| format!("listing the pods on node {node}: {e}"))?;
    Ok(list.items)
}

/// The pods on `node` that hold pod addresses now, by address. Pods that finished (their IP may
/// already be another pod's) and host-network pods (the node's own address) are left out.
pub fn node_pods(api: &ApiAccess, node: &str) -> Result<BTreeMap<IpAddr, NodePod>, String> {
    if node.is_empty() {
        return Err(
            "repair needs node-name (NODE_NAME from the downward API) to list this node's pods"
                .into(),
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start an async runtime: {e}"))?;
    let items = rt
        .block_on(async { tokio::time::timeout(API_TIMEOUT, list_async(api, node)).await })
        .map_err(|_| format!("no answer from the API server within {API_TIMEOUT:?}"))??;
    Ok(by_address(&items))
}

pub fn by_address(items: &[Pod]) -> BTreeMap<IpAddr, NodePod> {
    let mut out = BTreeMap::new();
    for p in items {
        let spec = p.spec.as_ref();
        let status = p.status.as_ref();
        if spec.and_then(|s| s.host_network) == Some(true)
            || status
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|ph| ph == "Succeeded" || ph == "Failed")
        {
            continue;
        }
        let pod = NodePod {
            namespace: p.metadata.namespace.clone().unwrap_or_default(),
            name: p.metadata.name.clone().unwrap_or_default(),
            uid: p.metadata.uid.clone().unwrap_or_default(),
        };
        let ips = status
            .and_then(|s| s.pod_ips.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|i| i.ip)
            .chain(status.and_then(|s| s.pod_ip.clone()));
        for ip in ips.filter_map(|i| i.parse::<IpAddr>().ok()) {
            out.insert(ip, pod.clone());
        }
    }
    out
}

/// The pod that holds `ips`: exactly one, or an error saying why not.
pub fn match_pod<'a>(
    pods: &'a BTreeMap<IpAddr, NodePod>,
    ips: &[IpAddr],
) -> Result<&'a NodePod, String> {
    let found: BTreeSet<(&str, &str)> = ips
        .iter()
        .filter_map(|ip| pods.get(ip))
        .map(|p| (p.namespace.as_str(), p.name.as_str()))
        .collect();
    match found.len() {
        1 => Ok(ips.iter().find_map(|ip| pods.get(ip)).expect("found one")),
        0 => Err(format!(
            "no running pod on this node has its address ({})",
            ips.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
        _ => Err(format!(
            "its addresses belong to several pods: {}",
            found
                .iter()
                .map(|(ns, n)| format!("{ns}/{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// The plugin's own words for a skip: the text after "not captured: " in its log.
pub fn skip_reason(stderr: &str) -> Option<String> {
    stderr.lines().find_map(|l| {
        l.split_once(" not captured: ")
            .map(|(_, r)| r.trim().to_owned())
    })
}

/// The ADD's config in a cluster: the runtime's entry, with the plugin's kubeconfig, and no
/// `policy` (the pod's own annotations decide).
pub fn cluster_config(
    entry: &Value,
    network: &Network,
    kubeconfig: &Path,
    netns: &LiveNetns,
    addrs: &pods::PodAddresses,
) -> Value {
    let mut conf = plugin::repair_config(
        entry,
        network,
        &sidestep::policy::Policy::default(),
        netns,
        addrs,
    );
    if let Some(o) = conf.as_object_mut() {
        o.remove("policy");
    }
    if !conf["kubernetes"].is_object() {
        conf["kubernetes"] = json!({});
    }
    conf["kubernetes"]["kubeconfig"] = json!(kubeconfig);
    conf
}

/// Repairs every netns of `report.unenrolled`: repaired ones move to `report.repaired`, skipped
/// ones to `report.skipped`; failures stay unenrolled with an error.
pub fn repair_all(
    s: &Settings,
    entry: &Value,
    network: Option<&Network>,
    report: &mut Report,
    watched: Option<Vec<Pod>>,
) {
    let live: BTreeSet<u64> = report.unenrolled.iter().map(|l| l.cookie).collect();
    skipped().retain(|c, _| live.contains(c));
    let api = api_access(s);
    let plugin_kubeconfig = plugin_kubeconfig(s);
    // The watch's pods when it has listed them; a list of our own before that.
    let mut pods: Option<Result<BTreeMap<IpAddr, NodePod>, String>> =
        watched.map(|w| Ok(by_address(&w)));
    for l in std::mem::take(&mut report.unenrolled) {
        if let Some(why) = skipped().get(&l.cookie).cloned() {
            report.skipped.push((l, why));
            continue;
        }
        let done = match &api {
            None => plugin::repair(s, entry, network, &l).map(|()| Outcome::Repaired),
            Some(api) => {
                let pods = pods.get_or_insert_with(|| node_pods(api, &s.node_name));
                let access = Access {
                    api,
                    plugin_kubeconfig: &plugin_kubeconfig,
                };
                repair_in_cluster(s, entry, network, &access, pods.as_ref(), &l)
            }
        };
        match done {
            Ok(Outcome::Repaired) => report.repaired.push(l),
            Ok(Outcome::Deleted) => report.deleted.push(l),
            Ok(Outcome::Labelled) => {
                // Left uncaptured on purpose: not labelled again while its netns lives.
                skipped().insert(l.cookie, "labelled sidestep.io/uninitialized=true".into());
                report.labelled.push(l);
            }
            Ok(Outcome::Skipped(why)) => {
                tracing::info!(
                    netns = %l.path.display(),
                    netns_cookie = l.cookie,
                    reason = %why,
                    "repair: the plugin leaves this pod uncaptured, as its ADD did"
                );
                skipped().insert(l.cookie, why.clone());
                report.skipped.push((l, why));
            }
            Err(e) => {
                report.errors.push(e.to_string());
                report.unenrolled.push(l);
            }
        }
    }
}

/// Whose rights each of repair's API requests carries.
struct Access<'a> {
    /// The agent's: the node's pods, events, and the repair mode's delete or label.
    api: &'a ApiAccess,
    /// The plugin's, for its ADD.
    plugin_kubeconfig: &'a Path,
}

fn repair_in_cluster(
    s: &Settings,
    entry: &Value,
    network: Option<&Network>,
    access: &Access<'_>,
    pods: Result<&BTreeMap<IpAddr, NodePod>, &String>,
    l: &LiveNetns,
) -> Result<Outcome, ReconcileError> {
    let fail = |reason: String| ReconcileError::Repair {
        netns: l.path.display().to_string(),
        reason,
    };
    let network =
        network.ok_or_else(|| fail("the CNI configuration is not in place yet".into()))?;
    let pods = pods.map_err(|e| fail(e.clone()))?;
    let addrs = pods::pod_addresses(l).map_err(|e| fail(e.to_string()))?;
    let ips: Vec<IpAddr> = addrs.ips.iter().map(|(ip, _)| *ip).collect();
    let pod = match_pod(pods, &ips).map_err(fail)?;
    let mut conf = cluster_config(entry, network, access.plugin_kubeconfig, l, &addrs);
    let who = format!("{}/{}", pod.namespace, pod.name);
    let container_id = format!("sidestep-repair-{}", l.cookie);
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_UID={}",
        pod.namespace, pod.name, pod.uid
    );
    let event = |reason, message: &str| {
        if let Err(e) = super::podapi::event(access.api, &s.node_name, pod, reason, message) {
            tracing::warn!(pod = %who, error = %e, "could not record an event");
        }
    };
    // The installed plugin's ADD for this netns, as the runtime would run it.
    let add = |conf: &Value| {
        plugin::run_plugin_with_args(s, "ADD", &container_id, &l.path, &addrs.ifname, &args, conf)
    };
    if s.repair_mode != RepairMode::Repair {
        // Ask the plugin's rules without enrolling: only a pod its ADD would capture is acted on.
        conf["decide_only"] = json!(true);
        let (stdout, _) = add(&conf).map_err(fail)?;
        let decision: Value = serde_json::from_str(&stdout).unwrap_or_default();
        if decision["sidestepDecision"] != "enrol" {
            let why = decision["reason"]
                .as_str()
                .unwrap_or("not captured by its ADD");
            return Ok(Outcome::Skipped(format!("{who}: {why}")));
        }
        return if s.repair_mode == RepairMode::Delete {
            let message = "the pod runs without traffic capture (it started before sidestep was \
                           ready); deleted so that it is recreated through the CNI chain";
            event(super::podapi::Reason::DeletedUncaptured, message);
            super::podapi::delete(access.api, pod).map_err(fail)?;
            tracing::warn!(pod = %who, netns_cookie = l.cookie, "repair: deleted an uncaptured pod, to be recreated through the CNI chain");
            Ok(Outcome::Deleted)
        } else {
            super::podapi::label(access.api, pod).map_err(fail)?;
            event(
                super::podapi::Reason::LabelledUncaptured,
                "the pod runs without traffic capture; labelled sidestep.io/uninitialized=true (repair-mode: label)",
            );
            tracing::warn!(pod = %who, netns_cookie = l.cookie, "repair: labelled an uncaptured pod");
            Ok(Outcome::Labelled)
        };
    }
    let (_, stderr) = match add(&conf) {
        Ok(out) => out,
        Err(e) => {
            event(
                super::podapi::Reason::RepairFailed,
                &format!("could not enrol the running pod in place: {e}"),
            );
            return Err(fail(e));
        }
    };
    if sidestep::maps::enrolled_cookies(&s.pin_root).contains(&l.cookie) {
        tracing::info!(
            pod = %who,
            netns = %l.path.display(),
            netns_cookie = l.cookie,
            interface = %addrs.ifname,
            "repaired: enrolled a running pod in place"
        );
        event(
            super::podapi::Reason::Repaired,
            "traffic capture was missing (the pod started before sidestep was ready); enrolled in place",
        );
        return Ok(Outcome::Repaired);
    }
    let why = skip_reason(&stderr).unwrap_or_else(|| "the plugin did not enrol it".into());
    Ok(Outcome::Skipped(format!("{who}: {why}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, phase: &str, ips: &[&str], host: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name, "uid": format!("uid-{name}")},
            "spec": {"hostNetwork": host, "containers": [{"name": "app"}]},
            "status": {"phase": phase, "podIP": ips.first(),
                       "podIPs": ips.iter().map(|i| json!({"ip": i})).collect::<Vec<_>>()}
        }))
        .unwrap()
    }

    #[test]
    fn finds_the_running_pod_by_address() {
        let items = [
            pod("shop", "web", "Running", &["10.0.0.7", "fd00::7"], false),
            // Finished: its address is free for the next pod.
            pod("shop", "old", "Succeeded", &["10.0.0.8"], false),
            pod("shop", "new", "Pending", &["10.0.0.8"], false),
            pod("kube-system", "proxy", "Running", &["192.168.1.10"], true),
        ];
        let m = by_address(&items);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(match_pod(&m, &[ip("fd00::7")]).unwrap().name, "web");
        assert_eq!(match_pod(&m, &[ip("10.0.0.8")]).unwrap().name, "new");
        assert!(match_pod(&m, &[ip("192.168.1.10")]).is_err());
        let e = match_pod(&m, &[ip("10.0.0.7"), ip("10.0.0.8")]).unwrap_err();
        assert!(e.contains("shop/new") && e.contains("shop/web"), "{e}");
    }

    #[test]
    fn the_plugins_reason_is_kept() {
        let log = "2026-12-02T18:00:00Z  INFO sidestep_cni::ops::add: shop/plain not captured: \
                   it has no istio-proxy container (has [app])\n";
        assert_eq!(
            skip_reason(log).as_deref(),
            Some("it has no istio-proxy container (has [app])")
        );
        assert_eq!(skip_reason("nothing"), None);
    }

    #[test]
    fn the_cluster_config_names_the_kubeconfig_and_no_policy() {
        let entry = json!({"type": "sidestep", "policy": {"x": 1},
                           "kubernetes": {"pod_read_retries": 2}});
        let addrs = pods::PodAddresses {
            ifname: "eth0".into(),
            ips: vec![("10.1.2.3".parse().unwrap(), 24)],
        };
        let net = ("k8s".to_string(), "1.0.0".to_string());
        let c = cluster_config(
            &entry,
            &net,
            Path::new("/k/config"),
            &LiveNetns {
                path: "/run/netns/x".into(),
                cookie: 7,
                processes: 1,
            },
            &addrs,
        );
        assert_eq!(c["expect_netns_cookie"], 7);
        assert!(c.get("policy").is_none());
        assert_eq!(c["kubernetes"]["kubeconfig"], "/k/config");
        assert_eq!(c["kubernetes"]["pod_read_retries"], 2);
        assert_eq!(c["prevResult"]["ips"][0]["address"], "10.1.2.3/24");
    }
}
