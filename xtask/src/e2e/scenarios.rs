//! The scenarios of `cargo xtask e2e`, run against the node with sidestep installed through
//! kubectl. Each is a checked line with a figure, as in the demo's report.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use super::install::{self, APP_IMAGE, PIN_ROOT, PROXY_IMAGE};
use super::node::Running;
use crate::cmd::Cmd;

/// The meshed workloads' namespace.
const MESH: &str = "mesh";
const SERVER_PORT: u16 = 8080;
/// The UID the server's proxy runs as: not Istio's default 1337, so that only the Pod spec's
/// `runAsUser` can tell the plugin which sockets are the proxy's.
const SERVER_PROXY_UID: u32 = 1500;
const POD_TIMEOUT: Duration = Duration::from_secs(90);

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
        || installed(node),
    );
    report.check(
        "cgroup programs on the pod cgroup, none on the cgroup2 root",
        || cgroup_attachments(node),
    );
    let started = report.check("injected server, client and plain pods Running", || {
        k.apply(&manifests(node), "workloads", &workloads())?;
        for pod in ["server", "client", "plain"] {
            k.wait_pod_ready(MESH, pod, POD_TIMEOUT)?;
        }
        Ok("3 pods".into())
    });
    if started {
        report.check(
            "1. injected client -> injected server through both sidecars",
            || injected_call(node),
        );
        report.check("1. a pod without injection is not captured", || {
            plain_not_captured(node)
        });
    }
    report.check("2. a pod created before the agent is repaired", || {
        repaired_early_pod(node)
    });
    report.check("8. the agent's Events on the pods", || events(node));
    report.check(
        "4. pod deletion: DEL leaves nothing in the state dir or maps",
        || deletion(node),
    );
    report.check(
        "3. agent restart and image rollout under load: 0 failed",
        || restart_under_load(node),
    );
    report.check(
        "6. Linkerd preset: a Linkerd-injected pod is captured",
        || linkerd_preset(node),
    );
    report.check(
        "5. uninstall: nothing left; old pods delete, new pods start",
        || uninstall(node),
    );
}

fn manifests(node: &Running) -> PathBuf {
    node.layout.at("manifests")
}

fn installed(node: &Running) -> Result<String> {
    let conf_dir = node.layout.cni_conf_dir();
    let mut chained = Vec::new();
    for entry in fs::read_dir(&conf_dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "conflist") {
            let list: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path)?)?;
            let types: Vec<String> = list["plugins"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["type"].as_str().map(str::to_owned))
                .collect();
            chained.push(format!("{}: {}", path.display(), types.join(" + ")));
            ensure!(
                types.last().map(String::as_str) == Some("sidestep"),
                "{} does not end with sidestep: {types:?}",
                path.display()
            );
        }
    }
    ensure!(!chained.is_empty(), "no conflist in {}", conf_dir.display());
    let plugin = node.layout.cni_bin_dir().join("sidestep");
    ensure!(plugin.is_file(), "{} is missing", plugin.display());
    Ok(chained.join("; "))
}

/// sidestep's programs (named sidestep_*) on kubelet's pod cgroup, and none on the machine's
/// cgroup2 root: this node is the machine we work on.
fn cgroup_attachments(node: &Running) -> Result<String> {
    let cgroup2 = super::host::mountinfo()?
        .into_iter()
        .find(|m| m.fstype == "cgroup2")
        .map(|m| m.mount_point)
        .context("no cgroup2 mount")?;
    let attached = |cgroup: &Path| -> Result<usize> {
        let out = Cmd::new("bpftool")
            .args(["cgroup", "show"])
            .arg(cgroup)
            .read()?;
        Ok(out.lines().filter(|l| l.contains("sidestep_")).count())
    };
    let pods = super::host::join_cgroup(&cgroup2, &node.pods_cgroup);
    let on_pods = attached(&pods)?;
    let on_root = attached(&cgroup2)?;
    ensure!(
        on_root == 0,
        "{on_root} sidestep programs on {}",
        cgroup2.display()
    );
    ensure!(on_pods > 0, "no sidestep program on {}", pods.display());
    Ok(format!(
        "{on_pods} on {}, 0 on {}",
        pods.display(),
        cgroup2.display()
    ))
}

/// The injected client calls the injected server by its pod IP: the client's sidecar takes
/// it (outbound, SO_ORIGINAL_DST = the server), the server's sidecar takes it inbound (its
/// original destination is the server's address too) and hands it to the app, and the client
/// app's getpeername is the server, as under iptables REDIRECT.
fn injected_call(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let server_ip = pod_ip(node, "server")?;
    let client_ip = pod_ip(node, "client")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    let answer = probe_json(node, "client", &["connect-sock", &target, "--read"])?;
    ensure!(
        answer["peer"] == target.as_str(),
        "client's getpeername is {} (not the server {target}): {answer}",
        answer["peer"]
    );
    ensure!(
        answer["reply"].as_str().is_some_and(|r| !r.is_empty()),
        "no reply from the server: {answer}"
    );
    let outbound = format!("client={client_ip}:");
    let dst = format!("dst={target}");
    let client_log = wait_log_line(
        k,
        "client",
        &["outbound ", &outbound, &dst, "be=outbound_orig"],
    )?;
    let server_log = wait_log_line(
        k,
        "server",
        &["inbound ", &outbound, &dst, "be=inbound_orig"],
    )?;
    Ok(format!(
        "getpeername {target}; client sidecar: {}; server sidecar (UID {SERVER_PROXY_UID}): {}",
        client_log.trim(),
        server_log.trim()
    ))
}

/// The pod without injection calls the server: its connect is not redirected (it has no
/// sidecar, so a capture would refuse it), it has no record, and the server's sidecar sees
/// the plain pod's own address.
fn plain_not_captured(node: &Running) -> Result<String> {
    let server_ip = pod_ip(node, "server")?;
    let plain_ip = pod_ip(node, "plain")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    let answer = probe_json(node, "plain", &["connect-sock", &target, "--read"])?;
    ensure!(
        answer["peer"] == target.as_str() && answer["reply"].as_str().is_some(),
        "the plain pod's call failed: {answer}"
    );
    let records = records_of(node, "plain")?;
    ensure!(records.is_empty(), "the plain pod has records: {records:?}");
    let seen = format!("client={plain_ip}:");
    wait_log_line(
        &node.kubectl,
        "server",
        &["inbound ", &seen, "be=inbound_orig"],
    )?;
    Ok(format!(
        "direct to {target}, no record; the server's sidecar saw {plain_ip}"
    ))
}

/// `early` ran before the DaemonSet existed, so no plugin enrolled it; the agent's repair
/// (the default mode) enrols it in place, and then its calls go through its sidecar.
fn repaired_early_pod(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    k.poll("SidestepRepaired Event on mesh/early", POD_TIMEOUT, |k| {
        Ok(event_reasons(k, "early")?.contains("SidestepRepaired"))
    })?;
    ensure!(
        !records_of(node, "early")?.is_empty(),
        "repaired but no record names mesh/early"
    );
    let server_ip = pod_ip(node, "server")?;
    let early_ip = pod_ip(node, "early")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    let answer = probe_json(node, "early", &["connect-sock", &target, "--read"])?;
    ensure!(answer["peer"] == target.as_str(), "early's call: {answer}");
    let from = format!("client={early_ip}:");
    let dst = format!("dst={target}");
    let line = wait_log_line(k, "early", &["outbound ", &from, &dst, "be=outbound_orig"])?;
    Ok(format!(
        "repaired, then through its sidecar: {}",
        line.trim()
    ))
}

fn events(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let mut seen = Vec::new();
    for (pod, reason) in [
        ("server", "SidestepEnrolled"),
        ("client", "SidestepEnrolled"),
        ("early", "SidestepRepaired"),
    ] {
        k.poll(
            &format!("Event {reason} on {MESH}/{pod}"),
            POD_TIMEOUT,
            |k| Ok(event_reasons(k, pod)?.contains(reason)),
        )?;
        seen.push(format!("{pod}: {reason}"));
    }
    let plain = event_reasons(k, "plain")?;
    ensure!(
        !plain.iter().any(|r| r.starts_with("Sidestep")),
        "the plain pod has sidestep Events: {plain:?}"
    );
    Ok(seen.join(", "))
}

/// containerd runs DEL when the sandbox stops and again when it is removed (then with no
/// netns): the record goes, and the pod map has one entry fewer.
fn deletion(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let before = pod_map_entries()?;
    ensure!(
        !records_of(node, "client")?.is_empty(),
        "no record of mesh/client before the deletion"
    );
    k.run(&[
        "delete",
        "pod",
        "-n",
        MESH,
        "client",
        "--wait=true",
        "--timeout=60s",
    ])?;
    let records = records_of(node, "client")?;
    ensure!(records.is_empty(), "records left: {records:?}");
    let after = pod_map_entries()?;
    ensure!(
        after + 1 == before,
        "pod map entries {before} before, {after} after (expected one fewer)"
    );
    Ok(format!("records 0; pod map {before} -> {after} entries"))
}

/// Calls from `early` to the server for LOAD_SECONDS while the agent pod is deleted (the
/// DaemonSet recreates it) and then rolled to a new image: every call must succeed through
/// both sidecars, the programs and pins staying across both.
fn restart_under_load(node: &Running) -> Result<String> {
    const LOAD_SECONDS: u64 = 40;
    let k = node.kubectl.clone();
    let server_ip = pod_ip(node, "server")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    let deadline = format!("{}", LOAD_SECONDS * 1000);
    let load = std::thread::spawn(move || {
        k.run_unbounded(&[
            "exec",
            "-n",
            MESH,
            "early",
            "-c",
            "app",
            "--",
            "/usr/local/bin/probe",
            "connect-many",
            &target,
            "100000000",
            "--threads",
            "2",
            "--deadline-ms",
            &deadline,
        ])
    });
    let started = Instant::now();
    let k = &node.kubectl;
    std::thread::sleep(Duration::from_secs(3));
    let first = k
        .run(&[
            "get",
            "pods",
            "-n",
            install::NAMESPACE,
            "-l",
            "app.kubernetes.io/name=sidestep-agent",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])?
        .trim()
        .to_owned();
    k.run(&[
        "delete",
        "pod",
        "-n",
        install::NAMESPACE,
        &first,
        "--wait=true",
    ])?;
    install::wait_agent_ready(node, Duration::from_secs(60))?;
    let restarted = started.elapsed().as_secs_f64();
    // A new image: the same build under another tag, as a release would be.
    install::import_agent_as(node, install::AGENT_IMAGE_NEXT)?;
    k.run(&[
        "set",
        "image",
        "-n",
        install::NAMESPACE,
        "daemonset/sidestep-agent",
        &format!("agent={}", install::AGENT_IMAGE_NEXT),
    ])?;
    install::wait_agent_ready(node, Duration::from_secs(60))?;
    let rolled = started.elapsed().as_secs_f64();
    ensure!(
        rolled < LOAD_SECONDS as f64,
        "the restart and rollout took {rolled:.0} s, longer than the load ({LOAD_SECONDS} s)"
    );
    let out = load
        .join()
        .map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
    let line = out.lines().last().unwrap_or("");
    let result: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("probe printed {out:?}"))?;
    // A call fails when it cannot connect or the server's answer does not arrive. The answer
    // itself is the server app's SO_ORIGINAL_DST on its accepted socket, which connect-many
    // compares with the address it called; behind the server's sidecar that socket was not
    // redirected, so its answer differs ("mismatch") and only says the call went through.
    let count = |key: &str| result[key].as_u64().unwrap_or(0);
    let (done, errors) = (count("done"), count("errors"));
    ensure!(
        done > 0 && errors == 0,
        "{errors} of {done} calls failed: {result}"
    );
    Ok(format!(
        "{done} calls, 0 failed; agent pod restarted by {restarted:.0} s, image {} rolled out by {rolled:.0} s",
        install::AGENT_IMAGE_NEXT
    ))
}

/// The operator switches the plugin to Linkerd's preset (`mesh: linkerd` in plugin-json) and
/// restarts the agent, which rewrites the chain entry; a pod as Linkerd's injector leaves it
/// (linkerd-proxy as UID 2102, `linkerd.io/proxy-version`) is then captured to 4140.
fn linkerd_preset(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let text = k.run(&[
        "get",
        "configmap",
        "-n",
        install::NAMESPACE,
        "sidestep-config",
        "-o",
        "json",
    ])?;
    let mut config: serde_json::Value = serde_json::from_str(&text)?;
    let plugin_json = config["data"]["plugin-json"]
        .as_str()
        .context("no plugin-json in the ConfigMap")?;
    let mut plugin: serde_json::Value =
        serde_json::from_str(plugin_json).context("plugin-json is not JSON")?;
    plugin["mesh"] = "linkerd".into();
    config["data"]["plugin-json"] = serde_json::to_string_pretty(&plugin)?.into();
    k.apply(&manifests(node), "config-linkerd", &config.to_string())?;
    k.run(&[
        "rollout",
        "restart",
        "-n",
        install::NAMESPACE,
        "daemonset/sidestep-agent",
    ])?;
    install::wait_agent_ready(node, Duration::from_secs(60))?;
    k.poll(
        "the chain entry with mesh linkerd",
        Duration::from_secs(30),
        |_| Ok(conflist_text(node)?.contains("\"linkerd\"")),
    )?;
    k.apply(&manifests(node), "linkerd", &linkerd_pod("lkd"))?;
    k.wait_pod_ready(MESH, "lkd", POD_TIMEOUT)?;
    let server_ip = pod_ip(node, "server")?;
    let lkd_ip = pod_ip(node, "lkd")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    let answer = probe_json(node, "lkd", &["connect-sock", &target, "--read"])?;
    ensure!(answer["peer"] == target.as_str(), "lkd's call: {answer}");
    let from = format!("client={lkd_ip}:");
    let dst = format!("dst={target}");
    let line = wait_container_log(
        k,
        "lkd",
        "linkerd-proxy",
        &["outbound ", &from, &dst, "be=outbound_orig"],
    )?;
    Ok(format!(
        "linkerd-proxy (UID 2102, port 4140): {}",
        line.trim()
    ))
}

/// The uninstall of deploy/README.md: `uninstall-requested` in the ConfigMap, then
/// `kubectl delete -k` (the agent's preStop runs `sidestep uninstall --if-requested`).
fn uninstall(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    k.run(&[
        "patch",
        "configmap",
        "-n",
        install::NAMESPACE,
        "sidestep-config",
        "--type",
        "merge",
        "-p",
        r#"{"data":{"uninstall-requested":"true"}}"#,
    ])?;
    // preStop reads the ConfigMap volume: wait for kubelet to refresh it (deploy/README.md
    // tells the operator to wait 90 s), seen from the host in kubelet's pod volume dir.
    let pods_dir = node.layout.kubelet_root().join("pods");
    k.poll(
        "uninstall-requested in the agent's volume",
        Duration::from_secs(120),
        |_| {
            for pod in fs::read_dir(&pods_dir)? {
                let file = pod?
                    .path()
                    .join("volumes/kubernetes.io~configmap/config/uninstall-requested");
                if fs::read_to_string(&file).is_ok_and(|v| v.trim() == "true") {
                    return Ok(true);
                }
            }
            Ok(false)
        },
    )?;
    // What kubelet did with the agent (PreStop failures show here), for the error.
    let events_file = node.layout.at("logs/sidestep-system-events.log");
    let watcher = std::process::Command::new(&k.bin)
        .arg("--kubeconfig")
        .arg(&k.kubeconfig)
        .args([
            "get",
            "events",
            "-n",
            install::NAMESPACE,
            "-w",
            "--watch-only",
        ])
        .stdout(fs::File::create(&events_file)?)
        .stderr(std::process::Stdio::null())
        .spawn();
    let deleting = Instant::now();
    let overlay = node.layout.at("overlay");
    // The token Secret may already be gone with its ServiceAccount (the token controller
    // deletes it), hence --ignore-not-found.
    k.run(&[
        "delete",
        "-k",
        &overlay.display().to_string(),
        "--ignore-not-found",
        "--wait=true",
        "--timeout=90s",
    ])?;
    let mut left = Vec::new();
    // The network itself is named sidestep-e2e: look at the plugin types.
    if conflist_text(node)?.contains("\"type\": \"sidestep\"") {
        left.push("the conflist entry".to_owned());
    }
    for path in [
        node.layout.cni_bin_dir().join("sidestep"),
        PathBuf::from(PIN_ROOT),
    ] {
        if path.exists() {
            left.push(path.display().to_string());
        }
    }
    if cgroup_attachments(node).is_ok() {
        left.push("programs on the pod cgroup".into());
    }
    let deleted_in = deleting.elapsed().as_secs_f64();
    if let Ok(mut w) = watcher {
        let _ = w.kill();
        let _ = w.wait();
    }
    ensure!(
        left.is_empty(),
        "left after uninstall: {} (delete -k took {deleted_in:.0} s); events while deleting:\n{}",
        left.join(", "),
        fs::read_to_string(&events_file).unwrap_or_default()
    );
    // A new pod starts, and the pods that were created while the chain named sidestep delete.
    k.apply(&manifests(node), "after", &plain_pod("after", &sleep_app()))?;
    k.wait_pod_ready(MESH, "after", POD_TIMEOUT)?;
    let old = ["server", "early", "plain", "lkd"];
    let mut args = vec!["delete", "pod", "-n", MESH, "--wait=true", "--timeout=60s"];
    args.extend(old);
    k.run(&args)
        .context("deleting the pods made before the uninstall (stuck Terminating?)")?;
    Ok(format!(
        "no conflist entry, plugin, pins or programs; pod `after` started; {} older pods deleted",
        old.len()
    ))
}

fn conflist_text(node: &Running) -> Result<String> {
    let mut text = String::new();
    for entry in fs::read_dir(node.layout.cni_conf_dir())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "conflist") {
            text += &fs::read_to_string(&path)?;
        }
    }
    Ok(text)
}

// --- helpers ------------------------------------------------------------------------------

fn pod_ip(node: &Running, pod: &str) -> Result<String> {
    let ip = node
        .kubectl
        .field(&format!("pod/{pod}"), MESH, "{.status.podIP}")?;
    ensure!(!ip.is_empty(), "pod {MESH}/{pod} has no IP");
    Ok(ip)
}

/// Run the probe in the pod's app container and parse its one JSON line.
fn probe_json(node: &Running, pod: &str, args: &[&str]) -> Result<serde_json::Value> {
    let mut argv = vec![
        "exec",
        "-n",
        MESH,
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
fn wait_log_line(k: &super::kubectl::Kubectl, pod: &str, parts: &[&str]) -> Result<String> {
    wait_container_log(k, pod, "istio-proxy", parts)
}

fn wait_container_log(
    k: &super::kubectl::Kubectl,
    pod: &str,
    container: &str,
    parts: &[&str],
) -> Result<String> {
    let mut found = String::new();
    let mut last = String::new();
    let waited = k.poll(
        &format!("a line with {parts:?} in {MESH}/{pod} {container}'s log"),
        Duration::from_secs(20),
        |k| {
            last = k.run(&["logs", "-n", MESH, pod, "-c", container])?;
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

fn event_reasons(k: &super::kubectl::Kubectl, pod: &str) -> Result<BTreeSet<String>> {
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
fn records_of(node: &Running, pod: &str) -> Result<Vec<PathBuf>> {
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
fn pod_map_entries() -> Result<usize> {
    let map = Path::new(PIN_ROOT).join("maps/SIDESTEP_POD");
    let out = Cmd::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&map)
        .read()?;
    let entries: serde_json::Value = serde_json::from_str(&out)?;
    Ok(entries.as_array().map_or(0, Vec::len))
}

// --- manifests ----------------------------------------------------------------------------

fn mesh_namespace() -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {MESH}\n---\n{}",
        haproxy_config_map()
    )
}

#[derive(Clone, Copy)]
enum ProxyUid {
    /// No runAsUser: the image's 1337, as Istio's proxy image.
    Default,
    Explicit(u32),
}

struct App {
    command: Vec<String>,
    port: Option<u16>,
}

fn sleep_app() -> App {
    App {
        command: vec!["/bin/sleep".into(), "1000000".into()],
        port: None,
    }
}

fn echo_server() -> App {
    App {
        command: vec![
            "/usr/local/bin/probe".into(),
            "origdst-echo".into(),
            format!("0.0.0.0:{SERVER_PORT}"),
        ],
        port: Some(SERVER_PORT),
    }
}

fn workloads() -> String {
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
fn injected_pod(name: &str, uid: ProxyUid, app: &App) -> String {
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
fn linkerd_pod(name: &str) -> String {
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

fn plain_pod(name: &str, app: &App) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {MESH}\n  labels:\n    app: {name}\nspec:\n  terminationGracePeriodSeconds: 2\n  containers:\n{}\n",
        app_container(app)
    )
}

fn app_container(app: &App) -> String {
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
fn haproxy_config_map() -> String {
    let istio = haproxy_config(15001, 15006);
    let linkerd = haproxy_config(4140, 4143);
    let indent = |c: &str| -> String { c.lines().map(|l| format!("    {l}\n")).collect() };
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: sidecar-haproxy\n  namespace: {MESH}\ndata:\n  haproxy.cfg: |\n{}  linkerd.cfg: |\n{}",
        indent(&istio),
        indent(&linkerd)
    )
}

fn haproxy_config(outbound: u16, inbound: u16) -> String {
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
