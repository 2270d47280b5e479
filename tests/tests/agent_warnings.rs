//! What the agent warns about, and the plugin's lines in the agent's log: an `istio-cni` entry
//! in the conflist it chains into (a warning and an Event on the Node once per change, the gauge
//! `sidestep_conflist_competing_entries`), a pod the plugin skips for its `istio-init` init
//! container (a warning and an Event on the pod once, `sidestep_cni_skipped_pods_total`), and
//! each plugin invocation's lines re-emitted by the agent with the pod's name. The real agent
//! and plugin, a local API server that records Events. Needs root.

mod agent_support;

use std::time::Duration;

use agent_support::{Agent, Dirs, PodApi, api_pod, base_args, free_port, meshed, wait_until};
use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{PodOptions, TestEnv, skip_unless_root};

/// The node the agent runs on, as the API knows it.
const NODE: &str = "node-1";

const COMPETING: &str = r#"sidestep_conflist_competing_entries{type="istio-cni"}"#;
const SKIPPED_ISTIO_INIT: &str = r#"sidestep_cni_skipped_pods_total{reason="istio-init"}"#;

/// A sample of /metrics, if the agent exposes it.
fn sample(agent: &Agent, key: &str) -> Result<Option<f64>> {
    Ok(agent_support::samples(agent)?.get(key).copied())
}

/// The agent's flags for these tests: Events to `api`, as the agent on [`NODE`]; no repair,
/// whose own ADDs would make lines and Events of their own.
fn args(env: &TestEnv, d: &Dirs, api: &PodApi, port: u16) -> Vec<String> {
    let mut a = base_args(env, d, port);
    a.extend([
        "--node-name".into(),
        NODE.into(),
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
        "--repair".into(),
        "false".into(),
    ]);
    a
}

fn events_with(api: &PodApi, reason: &str) -> Vec<Value> {
    api.events()
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect()
}

#[test]
fn an_istio_cni_entry_in_the_conflist_is_warned_about_once_per_change() -> Result<()> {
    if skip_unless_root("an_istio_cni_entry_in_the_conflist_is_warned_about_once_per_change") {
        return Ok(());
    }
    let env = TestEnv::new("agent-warn-conf")?;
    let d = Dirs::new(&env)?;
    let api = PodApi::start(env.tmp_dir(), Vec::new())?;
    // Istio's CNI node agent chained itself into the primary network before sidestep came.
    let file = d.conf.join("10-test.conflist");
    let with_istio = json!({"cniVersion": "1.0.0", "name": "test-net",
        "plugins": [{"type": "bridge"}, {"type": "istio-cni", "log_level": "info"}]});
    std::fs::write(&file, serde_json::to_vec_pretty(&with_istio)?)?;
    let port = free_port()?;
    let mut agent = Agent::start(&env, &args(&env, &d, &api, port), port)?;
    agent.wait_ready(Duration::from_secs(30))?;

    let warning = "has 1 istio-cni entry besides sidestep's";
    agent.wait_log(warning, Duration::from_secs(10))?;
    wait_until("the gauge at 1", Duration::from_secs(10), || {
        Ok(sample(&agent, COMPETING)? == Some(1.0))
    })
    .with_context(|| agent.log())?;
    wait_until("the Node's Event", Duration::from_secs(10), || {
        Ok(!events_with(&api, "CompetingCniEntry").is_empty())
    })
    .with_context(|| format!("{:?}\n{}", api.events(), agent.log()))?;
    let event = &events_with(&api, "CompetingCniEntry")[0];
    ensure!(
        event["involvedObject"]["kind"] == "Node"
            && event["involvedObject"]["name"] == NODE
            && event["metadata"]["namespace"] == "default"
            && event["type"] == "Warning",
        "{event}"
    );
    ensure!(
        event["message"]
            .as_str()
            .is_some_and(|m| m.contains("istio-cni")),
        "{event}"
    );

    // Every write to the conf directory makes the agent look again; the entry is still there,
    // and nothing more is said.
    let looks = agent_support::samples(&agent)?
        .get("sidestep_cni_config_writes_total")
        .copied();
    for i in 0..4 {
        std::fs::write(d.conf.join(format!("unrelated-{i}.txt")), "x")?;
        std::thread::sleep(Duration::from_millis(300));
    }
    // And the slow tick (5 s) once more.
    std::thread::sleep(Duration::from_secs(6));
    let log = agent.log();
    ensure!(
        log.matches(warning).count() == 1,
        "warned {} times (writes before: {looks:?}):\n{log}",
        log.matches(warning).count()
    );
    ensure!(
        events_with(&api, "CompetingCniEntry").len() == 1,
        "{:?}",
        api.events()
    );
    ensure!(sample(&agent, COMPETING)? == Some(1.0));

    // Istio's CNI goes (its entry with it): the gauge says 0, the log says so once.
    let mut list: Value = serde_json::from_slice(&std::fs::read(&file)?)?;
    list["plugins"]
        .as_array_mut()
        .context("plugins")?
        .retain(|p| p["type"] != "istio-cni");
    std::fs::write(&file, serde_json::to_vec_pretty(&list)?)?;
    wait_until("the gauge at 0", Duration::from_secs(10), || {
        Ok(sample(&agent, COMPETING)? == Some(0.0))
    })
    .with_context(|| agent.log())?;
    agent.wait_log("no longer has a istio-cni entry", Duration::from_secs(5))?;
    ensure!(d.entries_in("10-test.conflist")? == 1);
    ensure!(events_with(&api, "CompetingCniEntry").len() == 1);

    let st = agent.child.terminate(Duration::from_secs(10))?;
    ensure!(st.success(), "agent exited {st}: {}", agent.log());
    agent_support::uninstall(&env, &d)?;
    Ok(())
}

#[test]
fn an_istio_init_pod_is_warned_about_and_the_plugins_lines_reach_the_agents_log() -> Result<()> {
    if skip_unless_root(
        "an_istio_init_pod_is_warned_about_and_the_plugins_lines_reach_the_agents_log",
    ) {
        return Ok(());
    }
    let env = TestEnv::new("agent-warn-init")?;
    let d = Dirs::new(&env)?;
    // The API knows the pod (the Event names its UID).
    let mut api_json = api_pod(NODE, "shop", "legacy", &[], true);
    api_json["spec"]["initContainers"] = json!([{"name": "istio-init"}]);
    let api = PodApi::start(env.tmp_dir(), vec![api_json])?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut agent = Agent::start(&env, &args(&env, &d, &api, port), port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let node = d.node(&env, "10-test.conflist")?;
    ensure!(sample(&agent, SKIPPED_ISTIO_INIT)?.is_none());

    // Injected by an Istio that does not know a CNI captures: istio-init, which the plugin
    // leaves to Istio's iptables. The runtime passes the pod's UID, as kubelet's CRI does.
    let status = r#"{"initContainers":["istio-init"],"containers":["istio-proxy"]}"#;
    let legacy = node.add_pod_with(
        "legacy",
        PodOptions {
            namespace: "shop".into(),
            extra_cni_args: vec![("K8S_POD_UID".into(), "uid-shop-legacy".into())],
            runtime_config: Some(json!({
                "io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": status}
            })),
            ..Default::default()
        },
    )?;
    ensure!(agent_support::enrolled_cookies(&env)?.is_empty());
    wait_until("the pod's Event", Duration::from_secs(10), || {
        Ok(!events_with(&api, "IstioInitPresent").is_empty())
    })
    .with_context(|| format!("{:?}\n{}", api.events(), agent.log()))?;
    let events = events_with(&api, "IstioInitPresent");
    ensure!(events.len() == 1, "{events:?}");
    let o = &events[0]["involvedObject"];
    ensure!(
        o["kind"] == "Pod"
            && o["namespace"] == "shop"
            && o["name"] == "legacy"
            && o["uid"] == "uid-shop-legacy"
            && events[0]["type"] == "Warning",
        "{}",
        events[0]
    );
    wait_until("the skip counter", Duration::from_secs(5), || {
        Ok(sample(&agent, SKIPPED_ISTIO_INIT)? == Some(1.0))
    })
    .with_context(|| agent.log())?;
    agent.wait_log(
        "the pod has Istio's istio-init init container",
        Duration::from_secs(5),
    )?;

    // The plugin's own line for that ADD, re-emitted by the agent with the pod's name and the
    // command, at the plugin's level (info).
    let line = |log: &str, needle: &str| {
        log.lines()
            .find(|l| l.contains("sidestep::cni") && l.contains(needle))
            .map(str::to_owned)
    };
    agent.wait_log(
        "not captured: it has a istio-init init container",
        Duration::from_secs(5),
    )?;
    let log = agent.log();
    let skip = line(&log, "not captured: it has a istio-init init container")
        .with_context(|| format!("no plugin line in:\n{log}"))?;
    ensure!(
        skip.contains("INFO") && skip.contains("pod=shop/legacy") && skip.contains("command=ADD"),
        "{skip}"
    );

    // A meshed pod's ADD: its line is there too, under its own name.
    let web = node.add_pod_with("web", meshed())?;
    ensure!(agent_support::enrolled_cookies(&env)? == [web.netns_cookie()?]);
    agent.wait_log("pod=shop/web", Duration::from_secs(5))?;
    let log = agent.log();
    ensure!(
        log.lines().any(|l| l.contains("sidestep::cni")
            && l.contains("pod=shop/web")
            && l.contains("captured, decided from")),
        "{log}"
    );
    // Once per pod: the meshed pod and the other ADDs made no more Events or counts.
    ensure!(events_with(&api, "IstioInitPresent").len() == 1);
    ensure!(sample(&agent, SKIPPED_ISTIO_INIT)? == Some(1.0));

    // The socket goes with the agent, so that an uninstall finds the state directory empty.
    let st = agent.child.terminate(Duration::from_secs(10))?;
    ensure!(st.success(), "agent exited {st}: {}", agent.log());
    ensure!(
        !d.state.join("log.sock").exists(),
        "the socket outlived the agent"
    );
    node.remove_pod(&web)?;
    node.remove_pod(&legacy)?;
    agent_support::uninstall(&env, &d)?;
    Ok(())
}
