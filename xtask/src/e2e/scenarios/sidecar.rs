//! The sidecar scenarios: install, capture of injected pods, repair, Events, deletion.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};

use super::*;

/// Each conflist of the node's conf dir with its plugin types in chain order.
pub(super) fn chained_types(node: &Running) -> Result<Vec<(PathBuf, Vec<String>)>> {
    let mut lists = Vec::new();
    for entry in fs::read_dir(node.layout.cni_conf_dir())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "conflist") {
            let list: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path)?)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            let types = list["plugins"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["type"].as_str().map(str::to_owned))
                .collect();
            lists.push((path, types));
        }
    }
    Ok(lists)
}

pub(super) fn installed(node: &Running) -> Result<String> {
    let lists = chained_types(node)?;
    ensure!(
        !lists.is_empty(),
        "no conflist in {}",
        node.layout.cni_conf_dir().display()
    );
    for (path, types) in &lists {
        ensure!(
            types.last().map(String::as_str) == Some("sidestep"),
            "{} does not end with sidestep: {types:?}",
            path.display()
        );
    }
    let plugin = node.layout.cni_bin_dir().join("sidestep");
    ensure!(plugin.is_file(), "{} is missing", plugin.display());
    Ok(lists
        .iter()
        .map(|(p, t)| format!("{}: {}", p.display(), t.join(" + ")))
        .collect::<Vec<_>>()
        .join("; "))
}

/// `sidestep check -o json` in the agent's pod, as an operator runs it: no line fails.
pub(super) fn node_check(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let out = std::process::Command::new(&k.bin)
        .arg("--kubeconfig")
        .arg(&k.kubeconfig)
        .args([
            "exec",
            "-n",
            crate::e2e::install::NAMESPACE,
            "ds/sidestep-agent",
            "--",
            "sidestep",
            "check",
            "-o",
            "json",
        ])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "sidestep check printed no JSON: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let items = v["items"].as_array().cloned().unwrap_or_default();
    let verdicts: Vec<String> = items
        .iter()
        .map(|i| {
            format!(
                "{} {}",
                i["id"].as_str().unwrap_or("?"),
                i["verdict"].as_str().unwrap_or("?")
            )
        })
        .collect();
    // Every item must pass on a real node, the warn-only ones too: the runtime's own CNI
    // directories, the build that loaded the programs, the agent's RBAC and its pods by name.
    let all_pass = items.iter().all(|i| i["verdict"] == "pass");
    ensure!(
        out.status.success() && v["passed"] == true && items.len() == 12 && all_pass,
        "sidestep check in the agent's pod: {}",
        serde_json::to_string_pretty(&v).unwrap_or_default()
    );
    Ok(verdicts.join(", "))
}

/// sidestep's programs (named sidestep_*) on kubelet's pod cgroup and on the machine's cgroup2
/// root.
pub(super) fn sidestep_programs(node: &Running) -> Result<(usize, usize)> {
    let cgroup2 = crate::e2e::install::cgroup2_mount()?;
    let attached = |cgroup: &Path| -> Result<usize> {
        let out = Cmd::new("bpftool")
            .args(["cgroup", "show"])
            .arg(cgroup)
            .read()?;
        Ok(out.lines().filter(|l| l.contains("sidestep_")).count())
    };
    let pods = crate::e2e::host::join_cgroup(&cgroup2, &node.pods_cgroup);
    Ok((attached(&pods)?, attached(&cgroup2)?))
}

/// Programs on kubelet's pod cgroup, none on the machine's cgroup2 root: this node is the
/// machine we work on.
pub(super) fn cgroup_attachments(node: &Running) -> Result<String> {
    let (on_pods, on_root) = sidestep_programs(node)?;
    ensure!(
        on_root == 0,
        "{on_root} sidestep programs on the cgroup2 root"
    );
    ensure!(on_pods > 0, "no sidestep program on kubelet's pod cgroup");
    Ok(format!(
        "{on_pods} on {}, 0 on the cgroup2 root",
        crate::e2e::host::join_cgroup(&crate::e2e::install::cgroup2_mount()?, &node.pods_cgroup)
            .display()
    ))
}

/// The injected client calls the injected server by its pod IP: the client's sidecar takes
/// it (outbound, SO_ORIGINAL_DST = the server), the server's sidecar takes it inbound (its
/// original destination is the server's address too) and hands it to the app, and the client
/// app's getpeername is the server, as under iptables REDIRECT.
pub(super) fn injected_call(node: &Running) -> Result<String> {
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
pub(super) fn plain_not_captured(node: &Running) -> Result<String> {
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
pub(super) fn repaired_early_pod(node: &Running) -> Result<String> {
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

pub(super) fn events(node: &Running) -> Result<String> {
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
pub(super) fn deletion(node: &Running) -> Result<String> {
    let k = &node.kubectl;
    let dels_before = plugin_dels(node)?;
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
    // containerd runs DEL at the sandbox's stop and again when kubelet's garbage collection
    // removes it (within about a minute), then with no netns: both must succeed.
    let (mut dels, mut dels_ok) = (0, 0);
    let deleted = std::time::Instant::now();
    k.poll(
        "the plugin's second DEL (sandbox removal)",
        Duration::from_secs(100),
        |_| {
            let (all, ok) = plugin_dels(node)?;
            (dels, dels_ok) = (all - dels_before.0, ok - dels_before.1);
            Ok(dels >= 2)
        },
    )
    .with_context(|| format!("{dels} DEL call(s) seen in the plugin's timing lines"))?;
    ensure!(dels_ok == dels, "{dels} DEL calls, only {dels_ok} ok");
    let records = records_of(node, "client")?;
    ensure!(
        records.is_empty(),
        "records after the second DEL: {records:?}"
    );
    Ok(format!(
        "2 DEL calls (sandbox stop; removal {:.0} s later, when containerd passes no netns), both ok; records 0; pod map \
         {before} -> {after} entries",
        deleted.elapsed().as_secs_f64()
    ))
}

/// The plugin's DEL calls so far, ok or not, from the timing lines it appends to the state
/// directory (one per call; the agent rotates the file only past 1 MiB).
fn plugin_dels(node: &Running) -> Result<(usize, usize)> {
    let dir = node.layout.at("sidestep/cni");
    let (mut all, mut ok) = (0, 0);
    for name in ["timings", "timings.1"] {
        let Ok(text) = fs::read_to_string(dir.join(name)) else {
            continue;
        };
        for line in text.lines().filter(|l| l.starts_with("DEL ")) {
            all += 1;
            ok += usize::from(line.split_whitespace().nth(1) == Some("ok"));
        }
    }
    Ok((all, ok))
}
