//! Repair with `scan-proc` finds pods through their processes' netns, and matches a netns to a
//! pod by its addresses. Root in a pod can make a netns of its own (`unshare -Urn`: a new user
//! namespace, and a netns it owns) and put another pod's address on an interface there. The
//! agent must not take that netns for the other pod: `repair-mode: label` or `delete` would
//! label or delete the victim (again at every reconcile), and `repair` would run the plugin's
//! ADD for it, whose enrolment joins the netns's user namespace, the attacker's, to read its ID
//! maps. A netns found only through a process counts when the node's user namespace owns it (or
//! a record names it); a pod that really started before the agent still is repaired. Needs root.

mod agent_support;

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use agent_support::{
    Agent, Dirs, PodApi, api_pod, base_args, enrolled_cookies, free_port, meshed, wait_until,
};
use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv, netns, skip_unless_root};

const NODE: &str = "node-1";

/// Sets `flag`'s value in `args`, or adds it.
fn set(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value.to_owned(),
        None => args.extend([flag.to_owned(), value.to_owned()]),
    }
}

/// The pods of one scenario: `victim`, meshed and enrolled through the chain; `late`, meshed,
/// started before sidestep (never enrolled), with a process, so the scan finds it through
/// /proc; and the attacker, root in a pod of its own, in a user and network namespace it made
/// itself, carrying the victim's address.
/// Fields drop in order: the processes, then the pods, and the env last.
struct Scenario {
    attacker: ChildGuard,
    _late_app: ChildGuard,
    victim: std::sync::Arc<Pod>,
    late: std::sync::Arc<Pod>,
    _nodes: (Node, Node),
    api: PodApi,
    args: Vec<String>,
    port: u16,
    d: Dirs,
    env: TestEnv,
}

impl Scenario {
    fn new(name: &str) -> Result<Self> {
        let env = TestEnv::new(name)?;
        let d = Dirs::new(&env)?;
        d.write_primary("10-test.conflist")?;
        let api = PodApi::start(env.tmp_dir(), Vec::new())?;
        let port = free_port()?;
        let mut args = base_args(&env, &d, port);
        // Every process's netns, and no bind mount: only the scan of /proc finds pods.
        let no_dirs = env.tmp_dir().join("no-netns-dirs");
        std::fs::create_dir_all(&no_dirs)?;
        set(&mut args, "--netns-prefix", "");
        set(&mut args, "--scan-proc", "true");
        for (flag, value) in [
            ("--netns-dirs", no_dirs.display().to_string()),
            ("--reconcile-interval", "1s".into()),
            ("--node-name", NODE.into()),
            ("--api-kubeconfig", api.kubeconfig.display().to_string()),
            ("--repair", "false".into()),
        ] {
            set(&mut args, flag, &value);
        }

        // The victim is enrolled through the chain the agent wrote.
        let mut agent = Agent::start(&env, &args, port)?;
        agent.wait_ready(Duration::from_secs(30))?;
        let chain = d.node(&env, "10-test.conflist")?;
        let victim = chain.add_pod_with("victim", meshed())?;
        ensure!(enrolled_cookies(&env)? == [victim.netns_cookie()?]);
        agent.child.terminate(Duration::from_secs(10))?;

        let plain = Node::new(&env, NodeOptions::ipv4_only())?;
        let late = plain.add_pod("late")?;
        let late_app = late.spawn(&env, Spawn::new(&["sleep", "600"]))?;
        // What root in a pod can do with `unshare -Urn`. The interface is a veth rather than a
        // dummy (some test kernels have no dummy driver): any device root in the namespace can
        // make carries an address as well.
        let attacker_pod = plain.add_pod("attacker")?;
        let script = format!(
            "ip link add eth0 type veth peer name peer0 && ip addr add {}/24 dev eth0 && \
             ip link set eth0 up && ip link set lo up && echo ready && exec sleep 600",
            victim.ipv4
        );
        let attacker =
            attacker_pod.spawn(&env, Spawn::new(&["unshare", "-Urn", "sh", "-c", &script]))?;
        attacker.wait_stdout(&["ready"], Duration::from_secs(10))?;
        let s = Self {
            attacker,
            _late_app: late_app,
            victim,
            late,
            _nodes: (chain, plain),
            api,
            args,
            port,
            d,
            env,
        };
        // It really is a netns of its own, in a user namespace of its own.
        let ns = |pid: &str, kind: &str| -> Result<(u64, u64)> {
            let m = std::fs::metadata(format!("/proc/{pid}/ns/{kind}"))?;
            Ok((m.dev(), m.ino()))
        };
        let pid = s.attacker.pid().to_string();
        ensure!(
            ns(&pid, "user")? != ns("self", "user")?,
            "no new user namespace"
        );
        let pod_netns = std::fs::metadata(attacker_pod.netns_path())?;
        ensure!(ns(&pid, "net")? != (pod_netns.dev(), pod_netns.ino()));
        s.serve_pods();
        Ok(s)
    }

    /// The API's pods, as they were before any repair: both meshed, with their addresses.
    fn serve_pods(&self) {
        for pod in [&self.victim, &self.late] {
            self.api.add(api_pod(
                NODE,
                "shop",
                &pod.name,
                &[pod.ipv4.to_string()],
                true,
            ));
        }
    }

    fn attacker_netns(&self) -> PathBuf {
        Path::new("/proc")
            .join(self.attacker.pid().to_string())
            .join("ns/net")
    }

    fn agent(&self, mode: &str) -> Result<Agent> {
        let mut args = self.args.clone();
        set(&mut args, "--repair", "true");
        set(&mut args, "--repair-mode", mode);
        let mut agent = Agent::start(&self.env, &args, self.port)?;
        agent.wait_ready(Duration::from_secs(30))?;
        Ok(agent)
    }

    /// Waits for two reconciles after now, each of which saw the attacker's netns.
    fn two_more_reconciles(&self, agent: &Agent) -> Result<()> {
        let seen = agent.metric("sidestep_reconciles_total")?;
        wait_until("two more reconciles", Duration::from_secs(10), || {
            Ok(agent.metric("sidestep_reconciles_total")? >= seen + 2.0)
        })
    }

    /// The agent saw the attacker's netns and left it out (so the test is not vacuous).
    fn left_out(&self, agent: &mut Agent) -> Result<()> {
        let path = self.attacker_netns().display().to_string();
        agent
            .wait_log(&path, Duration::from_secs(5))
            .context("the agent never logged the attacker's netns")?;
        let log = agent.log();
        ensure!(
            log.lines()
                .filter(|l| l.contains(&path))
                .all(|l| l.contains("left out")),
            "the attacker's netns was taken for a pod:\n{log}"
        );
        Ok(())
    }

    fn uninstall(self) -> Result<()> {
        agent_support::uninstall(&self.env, &self.d).map(drop)
    }
}

fn label(api: &PodApi, name: &str) -> Option<String> {
    api.pod("shop", name).and_then(|p| {
        p["metadata"]["labels"]["sidestep.io/uninitialized"]
            .as_str()
            .map(str::to_owned)
    })
}

/// The events repair recorded on pod `name` (the chain's ADD records its own).
fn repair_events(api: &PodApi, name: &str) -> Vec<Value> {
    api.events()
        .into_iter()
        .filter(|e| e["involvedObject"]["name"] == name && e["reason"] != "SidestepEnrolled")
        .collect()
}

/// `repair-mode: label` and `delete` act on the pod that really runs uncaptured, found through
/// its process, and never on the victim because of the attacker's netns.
#[test]
fn label_and_delete_leave_a_pod_alone_whose_address_a_nested_user_namespace_carries() -> Result<()>
{
    if skip_unless_root(
        "label_and_delete_leave_a_pod_alone_whose_address_a_nested_user_namespace_carries",
    ) {
        return Ok(());
    }
    let s = Scenario::new("agent-repair-userns-label")?;

    let mut agent = s.agent("label")?;
    wait_until("the late pod's label", Duration::from_secs(10), || {
        Ok(label(&s.api, "late").as_deref() == Some("true"))
    })
    .with_context(|| agent.log())?;
    s.two_more_reconciles(&agent)?;
    ensure!(
        label(&s.api, "victim").is_none(),
        "the victim was labelled because of the attacker's netns: {:?}\n{}",
        s.api.pod("shop", "victim"),
        agent.log()
    );
    ensure!(
        repair_events(&s.api, "victim").is_empty(),
        "{:?}",
        repair_events(&s.api, "victim")
    );
    s.left_out(&mut agent)?;
    agent.child.terminate(Duration::from_secs(10))?;

    s.serve_pods();
    let mut agent = s.agent("delete")?;
    wait_until("the late pod's deletion", Duration::from_secs(10), || {
        Ok(s.api.pod("shop", "late").is_none())
    })
    .with_context(|| agent.log())?;
    s.two_more_reconciles(&agent)?;
    ensure!(
        s.api.pod("shop", "victim").is_some(),
        "the victim was deleted because of the attacker's netns:\n{}",
        agent.log()
    );
    ensure!(
        !s.api
            .requests()
            .iter()
            .any(|r| r.starts_with("DELETE /api/v1/namespaces/shop/pods/victim")),
        "{:?}",
        s.api.requests()
    );
    s.left_out(&mut agent)?;
    ensure!(enrolled_cookies(&s.env)? == [s.victim.netns_cookie()?]);
    agent.child.terminate(Duration::from_secs(10))?;
    s.uninstall()
}

/// `repair-mode: repair` enrols the pod that really runs uncaptured, and never runs the plugin's
/// ADD for the attacker's netns: that enrolment would fork a child into the attacker's user
/// namespace to read its ID maps (and, with `unshare -Urn`'s one-ID map, fail on the proxy's UID
/// after it did).
#[test]
fn repair_never_enters_a_user_namespace_a_pod_made() -> Result<()> {
    if skip_unless_root("repair_never_enters_a_user_namespace_a_pod_made") {
        return Ok(());
    }
    let s = Scenario::new("agent-repair-userns-enrol")?;
    let attacker_cookie = netns::cookie(&s.attacker_netns())?;
    let late_cookie = s.late.netns_cookie()?;
    let mut agent = s.agent("repair")?;
    wait_until("the late pod's repair", Duration::from_secs(10), || {
        Ok(enrolled_cookies(&s.env)?.contains(&late_cookie))
    })
    .with_context(|| agent.log())?;
    s.two_more_reconciles(&agent)?;
    let log = agent.log();
    ensure!(
        !enrolled_cookies(&s.env)?.contains(&attacker_cookie),
        "the attacker's netns was enrolled as the victim:\n{log}"
    );
    ensure!(
        !log.contains("user namespace that owns network namespace"),
        "the plugin read the attacker's user namespace:\n{log}"
    );
    ensure!(
        !log.contains(&format!("sidestep-repair-{attacker_cookie}")),
        "the plugin ran for the attacker's netns:\n{log}"
    );
    ensure!(
        repair_events(&s.api, "victim").is_empty(),
        "repair acted on the victim: {:?}",
        repair_events(&s.api, "victim")
    );
    let records: Vec<String> = std::fs::read_dir(&s.d.state)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&attacker_cookie.to_string()))
        .collect();
    ensure!(records.is_empty(), "{records:?}");
    s.left_out(&mut agent)?;
    agent.child.terminate(Duration::from_secs(10))?;
    s.uninstall()
}
