//! The running agent keeps exactly the capabilities it needs (CAP_SYS_ADMIN and CAP_NET_ADMIN
//! without scan-proc), in every thread and in the bounding set, and still does its work after
//! dropping the rest: readiness from the pinned links, pod counts from the maps, the netns scan,
//! and GC of a pod whose netns vanished without a DEL (map entries and its sk_lookup link removed). It
//! also starts with nothing more than what deploy/daemonset.yaml grants. Needs root.

mod agent_support;

use std::{collections::BTreeSet, path::Path, process::Command, time::Duration};

use agent_support::{Agent, Dirs, base_args, free_port, meshed, thread_caps, wait_until};
use anyhow::{Context as _, Result, bail, ensure};
use sidestep_tests::{TestEnv, netns, skip_unless_root};

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;

fn mask(caps: &[u32]) -> u64 {
    caps.iter().fold(0, |m, c| m | (1u64 << c))
}

/// The `add:` list of the agent container's capabilities in the DaemonSet, lower case.
fn daemonset_caps() -> Result<Vec<String>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml");
    let text = std::fs::read_to_string(&path)?;
    let line = text
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("add:"))
        .with_context(|| format!("no capabilities add: in {}", path.display()))?;
    Ok(line
        .trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(',')
        .map(|c| c.trim().trim_matches('"').to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect())
}

/// Every thread of the agent holds exactly `want` as permitted, effective and bounding, and
/// nothing inheritable or ambient.
fn check_caps(agent: &Agent, want: u64) -> Result<()> {
    let threads = thread_caps(agent.child.pid())?;
    ensure!(!threads.is_empty());
    for [inh, prm, eff, bnd, amb] in &threads {
        ensure!(
            *prm == want && *eff == want && *bnd == want && *inh == 0 && *amb == 0,
            "a thread has CapInh {inh:x} CapPrm {prm:x} CapEff {eff:x} CapBnd {bnd:x} CapAmb \
             {amb:x}; want {want:x} (of {} threads)",
            threads.len()
        );
    }
    eprintln!(
        "{} threads, each CapPrm = CapEff = CapBnd = {want:016x}",
        threads.len()
    );
    Ok(())
}

/// The agent's work after the drop: enrolled pods seen, the netns scan, GC.
fn check_work(env: &TestEnv, d: &Dirs, agent: &mut Agent) -> Result<()> {
    let node = d.node(env, "10-test.conflist")?;
    let kept = node.add_pod_with("kept", meshed())?;
    let gone = node.add_pod_with("gone", meshed())?;
    let gone_cookie = gone.netns_cookie()?;
    wait_until("both pods in /metrics", Duration::from_secs(5), || {
        Ok(agent.metric("sidestep_pods_enrolled")? == 2.0)
    })?;
    // The plugin's default inbound hook pins one sk_lookup link per pod netns.
    let links_of = |cookie: u64| env.pin_root().join(format!("links/sklookup/{cookie}"));
    ensure!(
        links_of(gone_cookie).exists(),
        "no sk_lookup link for the pod"
    );
    // The netns vanishes without a DEL reaching sidestep: the reconcile (setns for cookies,
    // bpf(2) on the maps, link removal) collects it.
    netns::delete(&gone.netns_name)?;
    wait_until("GC", Duration::from_secs(10), || {
        Ok(agent.metric("sidestep_gc_attachments_total")? == 1.0)
    })
    .with_context(|| agent.log())?;
    let left: BTreeSet<u64> = agent_support::enrolled_cookies(env)?.into_iter().collect();
    ensure!(
        left == [kept.netns_cookie()?].into(),
        "enrolled after GC: {left:?}"
    );
    ensure!(
        !links_of(gone_cookie).exists(),
        "sk_lookup link left after GC"
    );
    ensure!(agent.get("/readyz")?.0 == 200);
    ensure!(
        !agent.log().contains("Operation not permitted"),
        "{}",
        agent.log()
    );
    node.remove_pod(&kept)?;
    Ok(())
}

#[test]
fn agent_drops_every_capability_it_does_not_need() -> Result<()> {
    if skip_unless_root("agent_drops_every_capability_it_does_not_need") {
        return Ok(());
    }
    let env = TestEnv::new("agent-caps")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend(["--reconcile-interval".into(), "1s".into()]);
    let want = mask(&[CAP_SYS_ADMIN, CAP_NET_ADMIN]);

    // Started as full root (every capability).
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    check_caps(&agent, want)?;
    ensure!(agent.log().contains("dropped every other capability"));
    check_work(&env, &d, &mut agent)?;
    check_caps(&agent, want)?;
    agent.child.terminate(Duration::from_secs(10))?;

    // Started with only what the DaemonSet grants (its bounding set, as a container runtime
    // sets it), on a node without pins: it loads, and ends with the same set.
    agent_support::uninstall(&env, &d)?;
    ensure!(!env.pin_root().exists());
    let granted = daemonset_caps()?;
    ensure!(
        granted.iter().any(|c| c == "sys_admin") && granted.iter().any(|c| c == "net_admin"),
        "{granted:?}"
    );
    let setpriv = Command::new("setpriv").arg("--version").output();
    if setpriv.is_err() {
        bail!("setpriv (util-linux) is needed");
    }
    let bounding = std::iter::once("-all".to_string())
        .chain(granted.iter().map(|c| format!("+{c}")))
        .collect::<Vec<_>>()
        .join(",");
    let bin = sidestep_tests::sidestep::bin_dir()
        .join("sidestep")
        .display()
        .to_string();
    let mut wrapped = vec![
        format!("--bounding-set={bounding}"),
        "--inh-caps=-all".into(),
        bin,
    ];
    wrapped.extend(args.iter().cloned());
    let mut agent = Agent::start_program(&env, "setpriv", &wrapped, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    check_caps(&agent, want)?;
    check_work(&env, &d, &mut agent)?;
    agent.child.terminate(Duration::from_secs(10))?;

    agent_support::uninstall(&env, &d)?;
    Ok(())
}
