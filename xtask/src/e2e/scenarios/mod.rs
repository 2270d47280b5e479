//! The scenarios of `cargo xtask e2e`, run against the node with sidestep installed through
//! kubectl. Each is a checked line with a figure, as in the demo's report.

mod ambient;
mod gate;
mod helm;

pub use gate::{create_gated_pod, taint_node};
mod lifecycle;
mod manifests;
mod sidecar;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use super::install::PIN_ROOT;
use super::kubectl::Kubectl;
use super::node::Running;
use crate::cmd::Cmd;
use manifests::{ProxyUid, injected_pod, mesh_namespace, sleep_app};

/// The meshed workloads' namespace.
pub(super) const MESH: &str = "mesh";
pub(super) const SERVER_PORT: u16 = 8080;
/// The UID the server's proxy runs as: not Istio's default 1337, so that only the Pod spec's
/// `runAsUser` can tell the plugin which sockets are the proxy's.
pub(super) const SERVER_PROXY_UID: u32 = 1500;
pub(super) const POD_TIMEOUT: Duration = Duration::from_secs(90);

/// The check the negative control must fail: the capture itself.
pub const INJECTED_CALL: &str = "1. injected client -> injected server through both sidecars";

/// Checked lines, printed as they come and again at the end.
#[derive(Default)]
pub struct Report {
    lines: Vec<(bool, String, String, f64)>,
}

impl Report {
    /// Run `check`; its Ok value is the figure shown on the line.
    pub fn check(&mut self, what: &str, check: impl FnOnce() -> Result<String>) -> bool {
        let start = Instant::now();
        let result = check();
        let secs = start.elapsed().as_secs_f64();
        let (ok, detail) = match result {
            Ok(figure) => (true, figure),
            Err(e) => (false, format!("{e:#}")),
        };
        println!(
            "{} {what} ({secs:.1} s): {detail}",
            if ok { "ok  " } else { "FAIL" }
        );
        self.lines.push((ok, what.to_owned(), detail, secs));
        ok
    }

    pub fn failed(&self) -> usize {
        self.lines.iter().filter(|l| !l.0).count()
    }

    /// Whether the check named `what` ran and failed.
    pub fn check_failed(&self, what: &str) -> bool {
        self.lines.iter().any(|l| !l.0 && l.1 == what)
    }

    pub fn print(&self) {
        println!("\ne2e scenarios");
        for (ok, what, detail, secs) in &self.lines {
            let first = detail.lines().next().unwrap_or("");
            println!(
                "  {} {what:<52} {secs:>6.1} s  {first}",
                if *ok { "ok  " } else { "FAIL" }
            );
        }
    }
}

/// Pods made before the DaemonSet is applied: the startup race of scenario 2.
pub fn before_install(node: &Running) -> Result<()> {
    let k = &node.kubectl;
    k.apply(&manifests(node), "mesh", &mesh_namespace())?;
    k.apply(
        &manifests(node),
        "early",
        &injected_pod("early", ProxyUid::Default, &sleep_app()),
    )?;
    k.wait_pod_ready(MESH, "early", POD_TIMEOUT)
}

/// Every scenario after the install, in order; a failure is a FAIL line and the rest still run.
pub fn run_all(node: &Running, report: &mut Report) {
    let k = &node.kubectl;
    report.check(
        "agent installed: plugin chained into the node's conflist",
        || sidecar::installed(node),
    );
    report.check("sidestep check in the agent's pod: no line fails", || {
        sidecar::node_check(node)
    });
    report.check(
        "cgroup programs on the pod cgroup, none on the cgroup2 root",
        || sidecar::cgroup_attachments(node),
    );
    report.check(
        "2. readiness taint: a meshed pod waits for the agent",
        || gate::gated_pod_waited(node),
    );
    let started = report.check("injected server, client and plain pods Running", || {
        k.apply(&manifests(node), "workloads", &manifests::workloads())?;
        for pod in ["server", "client", "plain"] {
            k.wait_pod_ready(MESH, pod, POD_TIMEOUT)?;
        }
        Ok("3 pods".into())
    });
    if started {
        report.check(INJECTED_CALL, || sidecar::injected_call(node));
        report.check("1. a pod without injection is not captured", || {
            sidecar::plain_not_captured(node)
        });
    }
    report.check("2. a pod created before the agent is repaired", || {
        sidecar::repaired_early_pod(node)
    });
    report.check("8. the agent's Events on the pods", || {
        sidecar::events(node)
    });
    report.check(
        "4. pod deletion: DEL leaves nothing in the state dir or maps",
        || sidecar::deletion(node),
    );
    report.check(
        "3. agent restart and image rollout under load: 0 failed",
        || lifecycle::restart_under_load(node),
    );
    report.check(
        "7. ambient: ZDS to the ztunnel stand-in, the pod captured to it",
        || ambient::ambient_pod(node),
    );
    report.check(
        "6. Linkerd preset: a Linkerd-injected pod is captured",
        || lifecycle::linkerd_preset(node),
    );
    let uninstalled = report.check(
        "5. uninstall: a drain keeps running pods captured, then nothing is left",
        || lifecycle::uninstall(node),
    );
    // On the node the uninstall left clean: a failed uninstall would fail this one too.
    if uninstalled {
        report.check(
            "9. helm install: a meshed pod enrolled, helm uninstall leaves nothing",
            || helm::install_and_uninstall(node),
        );
    }
}

pub(super) fn manifests(node: &Running) -> PathBuf {
    node.layout.at("manifests")
}

// --- helpers ------------------------------------------------------------------------------

pub(super) fn pod_ip(node: &Running, pod: &str) -> Result<String> {
    pod_ip_in(node, MESH, pod)
}

pub(super) fn pod_ip_in(node: &Running, namespace: &str, pod: &str) -> Result<String> {
    let ip = node
        .kubectl
        .field(&format!("pod/{pod}"), namespace, "{.status.podIP}")?;
    ensure!(!ip.is_empty(), "pod {namespace}/{pod} has no IP");
    Ok(ip)
}

/// Run the probe in the pod's app container and parse its one JSON line.
pub(super) fn probe_json(node: &Running, pod: &str, args: &[&str]) -> Result<serde_json::Value> {
    probe_json_in(node, MESH, pod, args)
}

pub(super) fn probe_json_in(
    node: &Running,
    namespace: &str,
    pod: &str,
    args: &[&str],
) -> Result<serde_json::Value> {
    let mut argv = vec![
        "exec",
        "-n",
        namespace,
        pod,
        "-c",
        "app",
        "--",
        "/usr/local/bin/probe",
    ];
    argv.extend_from_slice(args);
    let out = node.kubectl.run(&argv)?;
    let line = out.lines().last().unwrap_or("");
    serde_json::from_str(line).with_context(|| format!("probe printed {out:?}"))
}

/// Wait for a line of the pod's istio-proxy log (HAProxy's) with every one of `parts`.
pub(super) fn wait_log_line(k: &Kubectl, pod: &str, parts: &[&str]) -> Result<String> {
    wait_container_log(k, MESH, pod, "istio-proxy", parts)
}

pub(super) fn wait_container_log(
    k: &Kubectl,
    namespace: &str,
    pod: &str,
    container: &str,
    parts: &[&str],
) -> Result<String> {
    let mut found = String::new();
    let mut last = String::new();
    let waited = k.poll(
        &format!("a line with {parts:?} in {namespace}/{pod} {container}'s log"),
        Duration::from_secs(20),
        |k| {
            last = k.run(&["logs", "-n", namespace, pod, "-c", container])?;
            if let Some(line) = last.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
                found = line.to_owned();
                return Ok(true);
            }
            Ok(false)
        },
    );
    if let Err(e) = waited {
        let lines: Vec<&str> = last.lines().collect();
        let tail = lines[lines.len().saturating_sub(5)..].join("\n    ");
        anyhow::bail!(
            "{e:#}; its last lines ({} in all):\n    {tail}",
            lines.len()
        );
    }
    Ok(found)
}

pub(super) fn event_reasons(k: &Kubectl, pod: &str) -> Result<BTreeSet<String>> {
    let out = k.run(&[
        "get",
        "events",
        "-n",
        MESH,
        "--field-selector",
        &format!("involvedObject.name={pod}"),
        "-o",
        "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}",
    ])?;
    Ok(out.lines().map(str::to_owned).collect())
}

/// The plugin's records (`<state>/<container>@<ifname>.json`) that name `mesh/<pod>`.
pub(super) fn records_of(node: &Running, pod: &str) -> Result<Vec<PathBuf>> {
    let dir = node.layout.at("sidestep/cni");
    let mut found = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Ok(record) = serde_json::from_str::<serde_json::Value>(&fs::read_to_string(&path)?)
        else {
            continue;
        };
        let field = |snake: &str, camel: &str| {
            record[snake]
                .as_str()
                .or_else(|| record[camel].as_str())
                .map(str::to_owned)
        };
        if field("pod_name", "podName").as_deref() == Some(pod)
            && field("pod_namespace", "podNamespace").as_deref() == Some(MESH)
        {
            found.push(path);
        }
    }
    Ok(found)
}

/// Entries of the pinned pod map (one per enrolled netns).
pub(super) fn pod_map_entries() -> Result<usize> {
    let map = Path::new(PIN_ROOT).join("maps/SIDESTEP_POD");
    let out = Cmd::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&map)
        .read()?;
    let entries: serde_json::Value = serde_json::from_str(&out)?;
    Ok(entries.as_array().map_or(0, Vec::len))
}
