//! The agent's life on the node: restart and rollout under load, a preset change, uninstall.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use super::manifests::{ProxyUid, injected_pod, linkerd_pod, sleep_app};
use super::*;
use crate::e2e::install;

/// Calls from `early` to the server for LOAD_SECONDS while the agent pod is deleted (the
/// DaemonSet recreates it) and then rolled to a new image: every call must succeed, and every
/// one must pass through early's sidecar (its log gains a line per call), so capture held
/// across both.
pub(super) fn restart_under_load(node: &Running) -> Result<String> {
    const LOAD_SECONDS: u64 = 40;
    let server_ip = pod_ip(node, "server")?;
    let early_ip = pod_ip(node, "early")?;
    let target = format!("{server_ip}:{SERVER_PORT}");
    let through_sidecar = |k: &Kubectl| -> Result<usize> {
        let log = k.run(&["logs", "-n", MESH, "early", "-c", "istio-proxy"])?;
        let from = format!("client={early_ip}:");
        Ok(log
            .lines()
            .filter(|l| l.contains(&from) && l.contains("be=outbound_orig"))
            .count())
    };
    let before = through_sidecar(&node.kubectl)?;
    let k = node.kubectl.clone();
    let deadline = format!("{}", LOAD_SECONDS * 1000);
    let load_target = target.clone();
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
            &load_target,
            "100000000",
            "--threads",
            "1",
            "--deadline-ms",
            &deadline,
        ])
    });
    let started = Instant::now();
    // The load runs to its deadline whatever happens here; it is joined before any error
    // returns, so it never runs into the next scenario.
    let disruptions = restart_and_roll(node, started);
    let out = load
        .join()
        .map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
    let (restarted, rolled) = disruptions?;
    ensure!(
        rolled < LOAD_SECONDS as f64,
        "the restart and rollout took {rolled:.0} s, longer than the load ({LOAD_SECONDS} s)"
    );
    let line = out.lines().last().unwrap_or("");
    let result: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("probe printed {out:?}"))?;
    // A call fails when it cannot connect or the server's answer does not arrive. (The answer is
    // the server app's SO_ORIGINAL_DST on a socket the server's sidecar opened, not one a
    // redirect made, so connect-many's own comparison of it does not apply here.)
    let count = |key: &str| result[key].as_u64().unwrap_or(0);
    let (done, errors) = (count("done"), count("errors"));
    ensure!(
        done > 0 && errors == 0,
        "{errors} of {done} calls failed: {result}"
    );
    let passed = through_sidecar(&node.kubectl)? - before;
    ensure!(
        passed as u64 >= done,
        "only {passed} of {done} calls passed through early's sidecar"
    );
    Ok(format!(
        "{done} calls, 0 failed, all {passed} through the sidecar; agent pod replaced by \
         {restarted:.0} s, image {} rolled out by {rolled:.0} s",
        install::AGENT_IMAGE_NEXT
    ))
}

/// Delete the agent pod and wait for its replacement, then roll the DaemonSet to a new image
/// tag; returns when each was done, in seconds since `started`.
fn restart_and_roll(node: &Running, started: Instant) -> Result<(f64, f64)> {
    let k = &node.kubectl;
    std::thread::sleep(Duration::from_secs(3));
    let first = agent_pod(k)?;
    k.run(&[
        "delete",
        "pod",
        "-n",
        install::NAMESPACE,
        &first,
        "--wait=true",
    ])?;
    wait_new_agent_ready(k, &first)?;
    let restarted = started.elapsed().as_secs_f64();
    // A new image: the same build under another tag, as a release would be.
    install::import_agent_as(node, install::AGENT_IMAGE_NEXT)?;
    let second = agent_pod(k)?;
    k.run(&[
        "set",
        "image",
        "-n",
        install::NAMESPACE,
        "daemonset/sidestep-agent",
        &format!("agent={}", install::AGENT_IMAGE_NEXT),
    ])?;
    wait_new_agent_ready(k, &second)?;
    install::wait_agent_ready(node, Duration::from_secs(60))?;
    Ok((restarted, started.elapsed().as_secs_f64()))
}

/// The agent's pods, each as `jsonpath` (a `{range .items[*]}` body) prints it, one a line.
pub(super) fn agent_pods(k: &Kubectl, jsonpath: &str) -> Result<String> {
    k.run(&[
        "get",
        "pods",
        "-n",
        install::NAMESPACE,
        "-l",
        install::AGENT_SELECTOR,
        "-o",
        &format!("jsonpath={{range .items[*]}}{jsonpath}{{\"\\n\"}}{{end}}"),
    ])
}

/// The name of the agent's pod on the node.
pub(super) fn agent_pod(k: &Kubectl) -> Result<String> {
    let names = agent_pods(k, "{.metadata.name}")?;
    Ok(names.lines().next().unwrap_or("").trim().to_owned())
}

/// Wait for an agent pod other than `old` to be Ready (the DaemonSet's status can still show
/// the old pod's readiness right after a deletion).
fn wait_new_agent_ready(k: &Kubectl, old: &str) -> Result<()> {
    k.poll(
        &format!("an agent pod other than {old} Ready"),
        Duration::from_secs(60),
        |k| {
            let out = agent_pods(
                k,
                "{.metadata.name} {.status.conditions[?(@.type==\"Ready\")].status}",
            )?;
            Ok(out.lines().any(|l| {
                let mut parts = l.split_whitespace();
                parts.next().is_some_and(|name| name != old) && parts.next() == Some("True")
            }))
        },
    )
}

/// The operator switches the plugin to Linkerd's preset (`mesh: linkerd` in plugin-json, ambient
/// off) and restarts the agent, which rewrites the chain entry; a pod as Linkerd's injector leaves it
/// (linkerd-proxy as UID 2102, `linkerd.io/proxy-version`) is then captured to 4140.
pub(super) fn linkerd_preset(node: &Running) -> Result<String> {
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
    // Ambient mode is Istio's: the agent refuses it beside another mesh's preset.
    config["data"]["ambient"] = "false".into();
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
        MESH,
        "lkd",
        "linkerd-proxy",
        &["outbound ", &from, &dst, "be=outbound_orig"],
    )?;
    Ok(format!(
        "linkerd-proxy (UID 2102, port 4140): {}",
        line.trim()
    ))
}

/// `uninstall-requested: "true"` in the ConfigMap, waited for until the agent's own volume
/// shows it (kubelet syncs ConfigMap volumes with a delay).
pub(super) fn request_uninstall(node: &Running) -> Result<()> {
    node.kubectl.run(&[
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
    uninstall_requested_seen(node)
}

/// The uninstall of deploy/README.md: `uninstall-requested` in the ConfigMap, then
/// `kubectl delete -k` (the agent's preStop runs `sidestep uninstall --if-requested`).
pub(super) fn uninstall(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    request_uninstall(node)?;
    // The agent drains: its entry leaves the conflist, the meshed pods keep their capture and
    // the plugin stays for their DEL.
    k.poll(
        "the drain removes the conflist entry",
        Duration::from_secs(60),
        |_| {
            Ok(!super::sidecar::chained_types(node)?
                .iter()
                .any(|(_, types)| types.iter().any(|t| t == "sidestep")))
        },
    )?;
    ensure!(
        !records_of(node, "server")?.is_empty()
            && PathBuf::from(PIN_ROOT).exists()
            && node.layout.cni_bin_dir().join("sidestep").exists(),
        "the drain took the capture of a running pod away (its record, the pins or the plugin)"
    );
    // A meshed pod made now is not enrolled.
    k.apply(
        &manifests(node),
        "after",
        &injected_pod("after", ProxyUid::Default, &sleep_app()),
    )?;
    k.wait_pod_ready(MESH, "after", POD_TIMEOUT)?;
    ensure!(
        records_of(node, "after")?.is_empty(),
        "a pod made during the drain was enrolled"
    );
    // Every pod from before the drain is deleted (they delete: the plugin is still there), and
    // the drain then removes everything by itself.
    let old = pods_with_netns(node)?
        .into_iter()
        .filter(|(ns, name)| !(ns == MESH && name == "after"))
        .collect::<Vec<_>>();
    for (ns, name) in &old {
        k.run(&[
            "delete",
            "pod",
            "-n",
            ns,
            name,
            "--wait=true",
            "--timeout=60s",
        ])
        .with_context(|| format!("deleting {ns}/{name}, made before the drain (stuck?)"))?;
    }
    let draining = Instant::now();
    k.poll(
        "the drain finishes after the last old pod",
        Duration::from_secs(90),
        |_| {
            Ok(!PathBuf::from(PIN_ROOT).exists()
                && !node.layout.cni_bin_dir().join("sidestep").exists())
        },
    )
    .with_context(|| {
        format!(
            "the agent's drain did not finish: {}",
            k.run(&["get", "pods", "-A", "-o", "wide"])
                .unwrap_or_default()
        )
    })?;
    let drained_in = draining.elapsed().as_secs_f64();
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
    let left = leftovers(node)?;
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
    k.run(&[
        "delete",
        "pod",
        "-n",
        MESH,
        "after",
        "--wait=true",
        "--timeout=60s",
    ])
    .context("deleting the pod made during the drain")?;
    Ok(format!(
        "drain: entry removed, `server` still captured, meshed `after` not enrolled; {} older \
         pods deleted, then everything removed by the agent in {drained_in:.0} s; nothing left \
         after delete -k",
        old.len()
    ))
}

/// Wait until the agent's ConfigMap volume has uninstall-requested=true: preStop and the agent
/// read the volume, which kubelet refreshes at a pod's sync (deploy/README.md tells the
/// operator to wait 90 s), seen from the host in kubelet's pod volume dir.
pub(super) fn uninstall_requested_seen(node: &Running) -> Result<()> {
    let k = &node.kubectl;
    // The running agents' own pod directories: those of agents already gone may still be there.
    let uids = agent_pods(k, "{.metadata.uid}")?;
    let pods_dir = node.layout.kubelet_root().join("pods");
    k.poll(
        "uninstall-requested in the agent's volume",
        Duration::from_secs(120),
        |_| {
            Ok(uids.split_whitespace().any(|uid| {
                let file = pods_dir
                    .join(uid)
                    .join("volumes/kubernetes.io~configmap/config/uninstall-requested");
                fs::read_to_string(&file).is_ok_and(|v| v.trim() == "true")
            }))
        },
    )
}

/// What sidestep left on the node: its conflist entry, plugin, kubeconfig, pins, programs on
/// the pod cgroup or the cgroup2 root, and records. Empty after a complete uninstall.
pub(super) fn leftovers(node: &Running) -> Result<Vec<String>> {
    let mut left: Vec<String> = Vec::new();
    if super::sidecar::chained_types(node)?
        .iter()
        .any(|(_, types)| types.iter().any(|t| t == "sidestep"))
    {
        left.push("the conflist entry".to_owned());
    }
    for path in [
        node.layout.cni_bin_dir().join("sidestep"),
        node.layout.cni_conf_dir().join("ZZZ-sidestep-kubeconfig"),
        PathBuf::from(PIN_ROOT),
    ] {
        if path.exists() {
            left.push(path.display().to_string());
        }
    }
    let (on_pods, on_root) = super::sidecar::sidestep_programs(node)?;
    if on_pods + on_root > 0 {
        left.push(format!(
            "{on_pods} programs on the pod cgroup, {on_root} on the cgroup2 root"
        ));
    }
    let records: Vec<_> = fs::read_dir(node.layout.at("sidestep/cni"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .map(|e| e.path().display().to_string())
        .collect();
    left.extend(records);
    Ok(left)
}

/// Pods with a network namespace of their own (not hostNetwork), outside sidestep's namespace:
/// (namespace, name).
pub(super) fn pods_with_netns(node: &Running) -> Result<Vec<(String, String)>> {
    let text = node.kubectl.run(&["get", "pods", "-A", "-o", "json"])?;
    let list: serde_json::Value = serde_json::from_str(&text)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["spec"]["hostNetwork"] != true)
        .filter_map(|p| {
            let m = &p["metadata"];
            Some((
                m["namespace"].as_str()?.to_owned(),
                m["name"].as_str()?.to_owned(),
            ))
        })
        .filter(|(ns, _)| ns != install::NAMESPACE)
        .collect())
}

pub(super) fn conflist_text(node: &Running) -> Result<String> {
    let mut text = String::new();
    for entry in fs::read_dir(node.layout.cni_conf_dir())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "conflist") {
            text += &fs::read_to_string(&path)?;
        }
    }
    Ok(text)
}
