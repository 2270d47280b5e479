//! The agent's lifecycle with real pods: `sidestep uninstall` drains (running pods keep their
//! capture and the plugin stays for their DEL, then nothing is left), by hand or by the agent,
//! and `--force` removes everything at once; pods that started before the agent are reported, repaired in place
//! with `--repair` (found through a local API server serving real Pod JSON, and skipped exactly
//! when their ADD would skip them), and garbage-collected once their netns is gone. Needs root.

mod agent_support;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::Duration,
};

use agent_support::{
    APP_UID, Agent, Dirs, PodApi, api_pod, base_args, free_port, meshed, wait_until,
};
use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{Node, NodeOptions, TestEnv, haproxy, http_get, nginx, skip_unless_root, url};

/// The node the test's pods run on, as the API knows it.
const NODE: &str = "node-1";

use sidestep_tests::faults::bpftool;

/// IDs of the links pinned under the env's pin root.
fn pinned_links(env: &TestEnv) -> Result<BTreeSet<u64>> {
    let root = env.pin_root().display().to_string();
    Ok(bpftool(&["-f", "link", "show"])?
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| {
            l["pinned"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p.as_str().is_some_and(|p| p.starts_with(&root)))
        })
        .filter_map(|l| l["id"].as_u64())
        .collect())
}

fn all_links() -> Result<BTreeSet<u64>> {
    Ok(bpftool(&["link", "show"])?
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["id"].as_u64())
        .collect())
}

/// Nothing of sidestep is left: pins, links, programs on the cgroup, the binary, the kubeconfig,
/// the records; and the conflist is the one the agent found.
fn ensure_nothing_left(
    env: &TestEnv,
    d: &Dirs,
    primary: &Path,
    original: &Value,
    links: &BTreeSet<u64>,
) -> Result<()> {
    ensure!(!env.pin_root().exists(), "pin root left");
    let left: Vec<u64> = all_links()?.intersection(links).copied().collect();
    ensure!(left.is_empty(), "links still exist: {left:?}");
    let cg = bpftool(&["cgroup", "show", &env.cgroup_path().display().to_string()])?;
    ensure!(
        cg.as_array().is_none_or(Vec::is_empty),
        "programs still attached to the cgroup: {cg}"
    );
    let now: Value = serde_json::from_slice(&std::fs::read(primary)?)?;
    ensure!(now == *original, "conflist not restored: {now}");
    ensure!(!d.bin.join("sidestep").exists(), "plugin binary left");
    ensure!(!d.kubeconfig().exists(), "kubeconfig left");
    let records = std::fs::read_dir(&d.state).map(|r| r.count()).unwrap_or(0);
    ensure!(records == 0, "{records} state entries left");
    let conf_files: Vec<_> = std::fs::read_dir(&d.conf)?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    ensure!(conf_files.len() == 1, "conf dir: {conf_files:?}");
    Ok(())
}

/// A node whose runtime runs the chain it cached at ADD (sidestep in it) and finds plugins only
/// in the directory the agent installs into: no fallback copy of the plugin.
fn node_without_fallback(env: &TestEnv, d: &Dirs) -> Result<Node> {
    Node::new(
        env,
        NodeOptions {
            dual_stack: false,
            chain: vec![d.entry("10-test.conflist")?],
            plugin_dirs: vec![d.bin.clone()],
        },
    )
}

/// A primary network, the agent on it (with `extra` arguments) ready; the conflist's path and its
/// content before the agent chained into it.
fn agent_for_uninstall(env: &TestEnv, d: &Dirs, extra: &[&str]) -> Result<(Agent, PathBuf, Value)> {
    let primary = d.write_primary("10-test.conflist")?;
    let original: Value = serde_json::from_slice(&std::fs::read(&primary)?)?;
    let port = free_port()?;
    let mut args = base_args(env, d, port);
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let mut agent = Agent::start(env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    Ok((agent, primary, original))
}

#[test]
fn uninstall_drains_until_the_last_pod_is_gone() -> Result<()> {
    if skip_unless_root("uninstall_drains_until_the_last_pod_is_gone") {
        return Ok(());
    }
    let env = TestEnv::new("agent-drain")?;
    let d = Dirs::new(&env)?;
    let (mut agent, primary, original) = agent_for_uninstall(&env, &d, &[])?;
    let node = node_without_fallback(&env, &d)?;
    let pod = node.add_pod_with("web", meshed())?;
    let cookie = pod.netns_cookie()?;
    ensure!(agent_support::enrolled_cookies(&env)? == [cookie]);
    let links = pinned_links(&env)?;
    let st = agent.child.terminate(Duration::from_secs(10))?;
    ensure!(st.success());

    // The drain: the entry goes, so no new pod is enrolled; the running pod keeps its capture
    // (its pod entry and every link) and the plugin stays for its DEL.
    let out = agent_support::uninstall_with(&env, &d, &[])?;
    eprintln!("{out}");
    ensure!(out.contains("draining: 1 enrolled pods"), "{out}");
    let now: Value = serde_json::from_slice(&std::fs::read(&primary)?)?;
    ensure!(
        now == original,
        "the sidestep entry is still in the conflist: {now}"
    );
    ensure!(
        agent_support::enrolled_cookies(&env)? == [cookie],
        "the pod lost its capture"
    );
    ensure!(
        pinned_links(&env)? == links,
        "links changed during the drain"
    );
    ensure!(
        d.bin.join("sidestep").exists(),
        "plugin binary removed while a pod needs it"
    );
    // Again: nothing changes while the pod runs.
    ensure!(agent_support::uninstall_with(&env, &d, &[])?.contains("draining: 1 enrolled pods"));

    // The runtime deletes the pod with the chain it cached, from the directory the agent
    // installed into: the plugin is still there, and DEL exits 0.
    node.remove_pod(&pod).context("DEL during the drain")?;
    let out = agent_support::uninstall_with(&env, &d, &[])?;
    eprintln!("{out}");
    ensure!(!out.contains("draining"), "{out}");
    ensure_nothing_left(&env, &d, &primary, &original, &links)
}

#[test]
fn uninstall_force_removes_everything_and_counts_the_pods_it_leaves() -> Result<()> {
    if skip_unless_root("uninstall_force_removes_everything_and_counts_the_pods_it_leaves") {
        return Ok(());
    }
    let env = TestEnv::new("agent-uninstall")?;
    let d = Dirs::new(&env)?;
    let (mut agent, primary, original) = agent_for_uninstall(&env, &d, &[])?;
    let node = d.node(&env, "10-test.conflist")?;
    let pod = node.add_pod_with("web", meshed())?;
    ensure!(agent_support::enrolled_cookies(&env)? == [pod.netns_cookie()?]);
    let links = pinned_links(&env)?;
    // Ten cgroup links and the pod's sk_lookup link.
    ensure!(links.len() >= 11, "pinned links: {links:?}");
    ensure!(d.kubeconfig().exists() && d.bin.join("sidestep").exists());
    let st = agent.child.terminate(Duration::from_secs(10))?;
    ensure!(st.success());

    // As a script reads it (the drain's test reads the text).
    let out = agent_support::uninstall_with(&env, &d, &["--force", "-o", "json"])?;
    eprintln!("{out}");
    let removed: Value = serde_json::from_str(&out).context("uninstall -o json")?;
    ensure!(removed["left_uncaptured"] == 1, "{out}");
    ensure!(
        removed["pin_root"].as_str() == Some(&*env.pin_root().display().to_string())
            && removed["draining"].is_null(),
        "{out}"
    );
    ensure_nothing_left(&env, &d, &primary, &original, &links)?;

    // The runtime deletes the pod with the config it cached (sidestep still in the chain; the
    // plugin found in the fallback directory): DEL exits 0 through the whole chain.
    node.remove_pod(&pod).context("DEL after uninstall")?;
    Ok(())
}

#[test]
fn the_agent_finishes_a_drain_once_the_last_pod_is_gone() -> Result<()> {
    if skip_unless_root("the_agent_finishes_a_drain_once_the_last_pod_is_gone") {
        return Ok(());
    }
    let env = TestEnv::new("agent-drain-live")?;
    let d = Dirs::new(&env)?;
    // The ConfigMap, as kubelet mounts it: one file per key.
    let config = env.tmp_dir().join("config");
    std::fs::create_dir_all(&config)?;
    std::fs::write(config.join("uninstall-requested"), "false")?;
    let config_arg = config.display().to_string();
    let (agent, primary, original) = agent_for_uninstall(
        &env,
        &d,
        &["--config", &config_arg, "--reconcile-interval", "1s"],
    )?;
    let node = node_without_fallback(&env, &d)?;
    let pod = node.add_pod_with("web", meshed())?;
    let cookie = pod.netns_cookie()?;
    ensure!(agent_support::enrolled_cookies(&env)? == [cookie]);
    let links = pinned_links(&env)?;

    std::fs::write(config.join("uninstall-requested"), "true")?;
    wait_until(
        "the agent starts the drain",
        Duration::from_secs(20),
        || {
            let (_, body) = agent.get("/readyz")?;
            Ok(
                d.entries_in("10-test.conflist")? == 0
                    && body.contains("draining: 1 enrolled pods"),
            )
        },
    )?;
    ensure!(
        agent_support::enrolled_cookies(&env)? == [cookie],
        "the pod lost its capture"
    );
    ensure!(
        d.bin.join("sidestep").exists(),
        "plugin binary removed while a pod needs it"
    );

    node.remove_pod(&pod).context("DEL during the drain")?;
    wait_until(
        "the agent finishes the drain after the last pod",
        Duration::from_secs(20),
        || Ok(!env.pin_root().exists()),
    )?;
    let (_, body) = agent.get("/readyz")?;
    ensure!(body.contains("uninstalled"), "{body}");
    ensure_nothing_left(&env, &d, &primary, &original, &links)
}

#[test]
fn pods_started_before_the_agent_are_reported_repaired_and_collected() -> Result<()> {
    if skip_unless_root("pods_started_before_the_agent_are_reported_repaired_and_collected") {
        return Ok(());
    }
    let env = TestEnv::new("agent-repair")?;
    let d = Dirs::new(&env)?;
    // Pods made through a chain without sidestep: as if the agent was not ready yet. Two are
    // meshed; `plain` was never injected and `optout` opted out by label, so their ADD would
    // have left them alone and so must repair.
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let plain = node.add_pod("plain")?;
    let optout = node.add_pod("optout")?;
    let ips = |p: &sidestep_tests::Pod| vec![p.ipv4.to_string()];
    let mut optout_json = api_pod(NODE, "shop", "optout", &ips(&optout), true);
    optout_json["metadata"]["labels"]["sidecar.istio.io/inject"] = "false".into();
    let api = PodApi::start(
        env.tmp_dir(),
        vec![
            api_pod(NODE, "shop", "client", &ips(&client), true),
            api_pod(NODE, "shop", "server", &ips(&server), true),
            api_pod(NODE, "shop", "plain", &ips(&plain), false),
            optout_json,
            // Another node's pod, which the node's listing must not return.
            api_pod("node-2", "shop", "elsewhere", &["10.99.0.1".into()], true),
        ],
    )?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let mut client_proxy = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let server_proxy = haproxy::Sidecar::start(&env, &server, Default::default())?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend([
        "--reconcile-interval".into(),
        "1s".into(),
        "--node-name".into(),
        NODE.into(),
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
    ]);

    // Without repair (on by default with a node name, as in a cluster): reported, not touched.
    let mut without = args.clone();
    without.extend(["--repair".into(), "false".into()]);
    let mut agent = Agent::start(&env, &without, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    wait_until("the report", Duration::from_secs(10), || {
        Ok(agent.get("/readyz")?.1.contains("4 not enrolled"))
    })?;
    ensure!(agent.metric("sidestep_pods_unenrolled")? == 4.0);
    for pod in [&client, &server, &plain, &optout] {
        agent.wait_log(
            &pod.netns_path.display().to_string(),
            Duration::from_secs(5),
        )?;
    }
    ensure!(agent.log().contains("running pod netns is not enrolled"));
    ensure!(agent_support::enrolled_cookies(&env)?.is_empty());
    ensure!(api.requests().is_empty(), "{:?}", api.requests());
    agent.child.terminate(Duration::from_secs(10))?;

    // With repair: the meshed pods are enrolled in place through the installed plugin, which
    // read them from the API, and captured both ways; the others are skipped with the plugin's
    // reasons.
    args.extend(["--repair".into(), "true".into()]);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let ready_at = std::time::Instant::now();
    let want: BTreeSet<u64> = [client.netns_cookie()?, server.netns_cookie()?].into();
    wait_until("repair", Duration::from_secs(10), || {
        Ok(agent_support::enrolled_cookies(&env)?
            .into_iter()
            .collect::<BTreeSet<_>>()
            == want)
    })
    .with_context(|| agent.log())?;
    // Pods that started while the agent was down are captured within 2 s of it being ready.
    let took = ready_at.elapsed();
    let bound = sidestep_tests::scaled(Duration::from_secs(2));
    ensure!(
        took <= bound,
        "repaired {took:?} after ready (bound {bound:?})"
    );
    wait_until("the repair and skip counts", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_repaired_pods_total")? == 2.0
            && agent.metric("sidestep_pods_skipped")? == 2.0
            && agent.metric("sidestep_pods_unenrolled")? == 0.0)
    })
    .with_context(|| agent.log())?;
    let log = agent.log();
    ensure!(
        log.contains("shop/plain: it has no istio-proxy container"),
        "{log}"
    );
    ensure!(
        log.contains("shop/optout: label sidecar.istio.io/inject=false"),
        "{log}"
    );
    // Skipped pods are not asked about again on later reconciles.
    let reconciles = agent.metric("sidestep_reconciles_total")?;
    wait_until("two more reconciles", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_reconciles_total")? >= reconciles + 2.0)
    })?;
    let seen = api.requests();
    ensure!(
        seen.iter()
            .all(|r| !r.starts_with("/api/v1/pods") || r.contains("spec.nodeName%3Dnode-1")),
        "{seen:?}"
    );
    for name in ["client", "server", "plain", "optout"] {
        let n = seen
            .iter()
            .filter(|r| r.starts_with(&format!("/api/v1/namespaces/shop/pods/{name}")))
            .count();
        ensure!(n == 1, "{name} read {n} times: {seen:?}");
    }
    let records: Vec<String> = std::fs::read_dir(&d.state)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    ensure!(
        records.len() == 2 && records.iter().all(|n| n.starts_with("sidestep-repair-")),
        "{records:?}"
    );
    // Each repaired pod got a Normal event an operator sees in `kubectl describe pod`.
    let events = api.events();
    for name in ["client", "server"] {
        ensure!(
            events.iter().any(|e| e["involvedObject"]["name"] == name
                && e["reason"] == "SidestepRepaired"
                && e["type"] == "Normal"),
            "no SidestepRepaired event for {name}: {events:?}"
        );
    }
    ensure!(
        !events
            .iter()
            .any(|e| e["involvedObject"]["name"] == "plain"),
        "an event for a pod repair left alone: {events:?}"
    );
    // The plugin recorded the pods under their API names.
    let rec: Value = serde_json::from_slice(&std::fs::read(d.state.join(&records[0]))?)?;
    ensure!(rec["podNamespace"] == "shop", "{rec}");
    let body = http_get(&env, &client, APP_UID, &url(server.ipv4.into(), 80, "/"))?;
    ensure!(body == nginx::body_for("server"));
    client_proxy.wait_log(
        &[&format!("dst={}:80", server.ipv4)],
        Duration::from_secs(5),
    )?;
    server_proxy.wait_log(
        &[&format!("inbound client={}", client.ipv4)],
        Duration::from_secs(5),
    )?;

    // The client pod goes away without a DEL reaching sidestep: GC removes its enrolment.
    let client_cookie = client.netns_cookie()?;
    client_proxy.child().kill()?;
    node.remove_pod(&client)?;
    wait_until("GC", Duration::from_secs(10), || {
        Ok(!agent_support::enrolled_cookies(&env)?.contains(&client_cookie))
    })?;
    ensure!(agent_support::enrolled_cookies(&env)? == [server.netns_cookie()?]);
    wait_until("the GC count", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_gc_attachments_total")? >= 1.0)
    })?;
    let left = std::fs::read_dir(&d.state)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .count();
    ensure!(left == 1, "{left} records after GC");
    agent_support::uninstall(&env, &d)?;
    Ok(())
}

/// The agent watches its node's pods: a pod that appears uncaptured while the agent runs (its
/// netns made without sidestep in the chain, as on a node where the chain entry came late) is
/// repaired within seconds of the API listing it, with a reconcile interval far longer than
/// that, so only the watch can explain it. After the API forgets its history (410 Gone on the
/// next watch) the agent lists again and keeps repairing.
#[test]
fn pods_are_repaired_from_the_watch_within_seconds() -> Result<()> {
    if skip_unless_root("pods_are_repaired_from_the_watch_within_seconds") {
        return Ok(());
    }
    let env = TestEnv::new("agent-watch")?;
    let d = Dirs::new(&env)?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let api = PodApi::start(env.tmp_dir(), Vec::new())?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend([
        "--reconcile-interval".into(),
        "10m".into(),
        "--node-name".into(),
        NODE.into(),
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
        "--repair".into(),
        "true".into(),
    ]);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    agent.wait_log(
        "pod watch: listed this node's pods",
        Duration::from_secs(10),
    )?;

    let repaired_within = |name: &str,
                           api_pod_json: &mut dyn FnMut(&sidestep_tests::Pod) -> Value|
     -> Result<Duration> {
        let pod = node.add_pod(name)?;
        let cookie = pod.netns_cookie()?;
        let start = std::time::Instant::now();
        api.add(api_pod_json(&pod));
        wait_until(
            &format!("repair of {name}"),
            Duration::from_secs(10),
            || Ok(agent_support::enrolled_cookies(&env)?.contains(&cookie)),
        )?;
        Ok(start.elapsed())
    };
    let first = repaired_within("first", &mut |p| {
        api_pod(NODE, "shop", "first", &[p.ipv4.to_string()], true)
    })
    .with_context(|| agent.log())?;
    // The claim is 2 s; under emulation (xtask's VMs) it is scaled with the machine's speed.
    let bound = sidestep_tests::scaled(Duration::from_secs(2));
    ensure!(
        first <= bound,
        "repaired {first:?} after the API listed it (bound {bound:?})"
    );
    let watches = |api: &PodApi| {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("/api/v1/pods?") && r.contains("watch=true"))
            .count()
    };
    ensure!(watches(&api) >= 1, "no watch: {:?}", api.requests());

    // History gone: the next watch is answered 410; the watcher lists again, then watches.
    let lists = |api: &PodApi| {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("/api/v1/pods?") && !r.contains("watch=true"))
            .count()
    };
    let lists_before = lists(&api);
    api.compact_and_end_watches();
    wait_until("a relist after 410", Duration::from_secs(15), || {
        Ok(lists(&api) > lists_before)
    })
    .with_context(|| format!("{:?}\n{}", api.requests(), agent.log()))?;
    let second = repaired_within("second", &mut |p| {
        api_pod(NODE, "shop", "second", &[p.ipv4.to_string()], true)
    })
    .with_context(|| agent.log())?;
    ensure!(
        second <= bound,
        "after the relist: repaired {second:?} after the API listed it (bound {bound:?})"
    );
    // A pod on another node never reaches this agent's watch.
    api.add(api_pod(
        "node-2",
        "shop",
        "elsewhere",
        &["10.99.0.1".into()],
        true,
    ));
    agent_support::uninstall(&env, &d)?;
    Ok(())
}

/// The startup gate: with `readiness-taint`, the agent removes that taint (and only it) from its
/// node once /readyz is true, never before.
#[test]
fn the_readiness_taint_goes_once_ready_and_only_then() -> Result<()> {
    if skip_unless_root("the_readiness_taint_goes_once_ready_and_only_then") {
        return Ok(());
    }
    const TAINT: &str = "sidestep.io/agent-not-ready";
    let env = TestEnv::new("agent-taint")?;
    let d = Dirs::new(&env)?;
    let api = PodApi::start(env.tmp_dir(), Vec::new())?;
    api.add_node(serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "spec": {"taints": [
            {"key": TAINT, "effect": "NoSchedule"},
            {"key": "example.com/other", "value": "x", "effect": "NoSchedule"},
        ]},
    }));
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend([
        "--node-name".into(),
        NODE.into(),
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
        "--readiness-taint".into(),
        "true".into(),
    ]);
    // No primary CNI configuration yet: the agent runs, but is not ready.
    let agent = Agent::start(&env, &args, port)?;
    wait_until("the agent answers", Duration::from_secs(30), || {
        Ok(agent.get("/healthz").is_ok_and(|(code, _)| code == 200))
    })?;
    std::thread::sleep(Duration::from_secs(3));
    ensure!(
        agent.get("/readyz")?.0 != 200,
        "ready without a CNI configuration"
    );
    let taints = |api: &PodApi| -> Vec<String> {
        api.node(NODE)
            .and_then(|n| n["spec"]["taints"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|t| t["key"].as_str().map(str::to_owned))
            .collect()
    };
    ensure!(
        taints(&api).contains(&TAINT.to_owned()),
        "the taint went before the agent was ready: {:?}",
        api.requests()
    );
    ensure!(agent.metric("sidestep_readiness_taint_removed")? == 0.0);

    d.write_primary("10-test.conflist")?;
    let mut agent = agent;
    agent.wait_ready(Duration::from_secs(30))?;
    wait_until("the taint's removal", Duration::from_secs(10), || {
        Ok(!taints(&api).contains(&TAINT.to_owned()))
    })
    .with_context(|| agent.log())?;
    ensure!(
        taints(&api) == ["example.com/other"],
        "other taints must stay: {:?}",
        taints(&api)
    );
    // Set after the API confirmed the patch, so a moment after the taint is gone.
    wait_until("the taint metric", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_readiness_taint_removed")? == 1.0)
    })?;
    agent_support::uninstall(&env, &d)?;
    Ok(())
}

/// Istio's other repair modes: `label` marks a pod that should be captured and is not, and
/// leaves it; `delete` deletes it (its UID as precondition) so that its controller recreates it
/// through the CNI chain. Either acts only on pods the plugin's ADD would capture (it is asked
/// with `decide_only`), never enrols, and records a Warning event on the pod.
#[test]
fn repair_modes_label_and_delete_act_on_uncaptured_pods_only() -> Result<()> {
    if skip_unless_root("repair_modes_label_and_delete_act_on_uncaptured_pods_only") {
        return Ok(());
    }
    let env = TestEnv::new("agent-repair-modes")?;
    let d = Dirs::new(&env)?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let meshed = node.add_pod("meshed")?;
    let plain = node.add_pod("plain")?;
    let api = PodApi::start(
        env.tmp_dir(),
        vec![
            api_pod(NODE, "shop", "meshed", &[meshed.ipv4.to_string()], true),
            api_pod(NODE, "shop", "plain", &[plain.ipv4.to_string()], false),
        ],
    )?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend([
        "--node-name".into(),
        NODE.into(),
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
    ]);
    let with_mode = |mode: &str| {
        let mut a = args.clone();
        a.extend(["--repair-mode".into(), mode.into()]);
        a
    };
    let label = |name: &str| -> Option<String> {
        api.pod("shop", name).and_then(|p| {
            p["metadata"]["labels"]["sidestep.io/uninitialized"]
                .as_str()
                .map(str::to_owned)
        })
    };

    // label: repair is on by default with a node name; the meshed pod is labelled, not enrolled.
    let bound = sidestep_tests::scaled(Duration::from_secs(2));
    let mut agent = Agent::start(&env, &with_mode("label"), port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let ready_at = std::time::Instant::now();
    wait_until("the label", Duration::from_secs(10), || {
        Ok(label("meshed").as_deref() == Some("true"))
    })
    .with_context(|| agent.log())?;
    ensure!(
        ready_at.elapsed() <= bound,
        "labelled {:?} after ready",
        ready_at.elapsed()
    );
    ensure!(label("plain").is_none(), "an unmeshed pod was labelled");
    ensure!(
        agent_support::enrolled_cookies(&env)?.is_empty(),
        "label mode enrolled"
    );
    wait_until("the label count", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_repair_labelled_pods_total")? == 1.0)
    })?;
    let events = api.events();
    ensure!(
        events
            .iter()
            .any(|e| e["involvedObject"]["name"] == "meshed"
                && e["reason"] == "SidestepLabelledUncaptured"
                && e["type"] == "Warning"),
        "{events:?}"
    );
    agent.child.terminate(Duration::from_secs(10))?;

    // delete: the meshed pod is deleted from the API; the unmeshed one stays.
    let mut agent = Agent::start(&env, &with_mode("delete"), port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let ready_at = std::time::Instant::now();
    wait_until("the deletion", Duration::from_secs(10), || {
        Ok(api.pod("shop", "meshed").is_none())
    })
    .with_context(|| agent.log())?;
    ensure!(
        ready_at.elapsed() <= bound,
        "deleted {:?} after ready",
        ready_at.elapsed()
    );
    ensure!(
        api.pod("shop", "plain").is_some(),
        "an unmeshed pod was deleted"
    );
    ensure!(
        agent_support::enrolled_cookies(&env)?.is_empty(),
        "delete mode enrolled"
    );
    wait_until("the delete count", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_repair_deleted_pods_total")? == 1.0)
    })?;
    let events = api.events();
    ensure!(
        events
            .iter()
            .any(|e| e["involvedObject"]["name"] == "meshed"
                && e["reason"] == "SidestepDeletedUncaptured"),
        "{events:?}"
    );
    ensure!(
        api.requests().iter().any(
            |r| r.starts_with("DELETE /api/v1/namespaces/shop/pods/meshed")
                && r.contains("uid-shop-meshed")
        ),
        "the delete carries no UID precondition: {:?}",
        api.requests()
    );
    agent_support::uninstall(&env, &d)?;
    Ok(())
}

/// What the plugin's ADD did reaches the pod as a Kubernetes Event: a pod captured through the
/// chain gets `SidestepEnrolled`, named by the pod the plugin recorded. Its annotation
/// `sidestep.io/debug` makes its verdicts reach the agent's log, named by the pod.
#[test]
fn adds_through_the_chain_become_events_on_the_pod() -> Result<()> {
    if skip_unless_root("adds_through_the_chain_become_events_on_the_pod") {
        return Ok(());
    }
    let env = TestEnv::new("agent-events")?;
    let d = Dirs::new(&env)?;
    // The Pod as the API holds it once scheduled: no IP yet, so repair has nothing to match.
    let web_uid = "0f0e0d0c-0000-4000-8000-00000000a11d";
    let api = PodApi::start(
        env.tmp_dir(),
        vec![json!({
            "metadata": {"name": "web", "namespace": "shop", "uid": web_uid},
            "spec": {"nodeName": NODE, "containers": [{"name": "web"}]},
            "status": {"phase": "Pending"}
        })],
    )?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend([
        "--node-name".into(),
        NODE.into(),
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
    ]);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let node = d.node(&env, "10-test.conflist")?;
    let mut options = meshed();
    options.runtime_config = Some(json!({
        "io.kubernetes.cri.pod-annotations": {
            "sidecar.istio.io/status": agent_support::STATUS,
            "sidestep.io/debug": "true"
        }
    }));
    let web = node.add_pod_with("web", options)?;
    let event = || {
        api.events().into_iter().find(|e| {
            e["involvedObject"]["name"] == "web" && e["involvedObject"]["namespace"] == "shop"
        })
    };
    wait_until("the event", Duration::from_secs(10), || {
        Ok(event().is_some())
    })
    .with_context(|| agent.log())?;
    let e = event().context("no event")?;
    ensure!(
        e["reason"] == "SidestepEnrolled"
            && e["type"] == "Normal"
            && e["source"]["component"] == "sidestep-agent"
            && e["message"].as_str().is_some_and(|m| m.contains("eth0"))
            && e["involvedObject"]["uid"] == web_uid,
        "{e}"
    );
    // No sidecar runs, so the connect fails; its decision is what the log reports.
    let probe = env!("CARGO_BIN_EXE_probe");
    let _ = web.run(
        &env,
        APP_UID,
        &[probe, "connect", "192.0.2.1:80", "--timeout-ms", "300"],
    );
    let verdict = format!("connect to 192.0.2.1:80 by uid {APP_UID}: redirected");
    agent.wait_log(&verdict, Duration::from_secs(10))?;
    let log = agent.log();
    let line = log
        .lines()
        .find(|l| l.contains(&verdict))
        .unwrap_or_default();
    ensure!(line.contains("pod=shop/web"), "{line}");
    agent_support::uninstall(&env, &d)?;
    Ok(())
}
