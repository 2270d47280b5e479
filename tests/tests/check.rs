//! `sidestep check` and `sidestep status` on a node the agent runs. `check`: every line passes
//! and the exit code is 0; then each fault an operator meets turns its own line ✖ and the exit
//! code 1: a conflist the runtime cannot read, a competing istio-cni entry, a pin root off
//! bpffs, a container runtime reading another CNI directory, programs another build loaded, and
//! a pod that started uncaptured (named `namespace/name`). `status`: pods by `namespace/name`,
//! and `--pod`. Needs root.

mod agent_support;

use std::{path::Path, time::Duration};

use agent_support::{Agent, Dirs, PodApi, api_pod, base_args, free_port, wait_until};
use anyhow::{Result, ensure};
use serde_json::Value;
use sidestep_tests::{Node, NodeOptions, TestEnv, skip_unless_root};

/// The items of a node check, and of `--pre`.
const NODE_ITEMS: usize = 12;
const PRE_ITEMS: usize = 7;

/// `args` with `flag`'s value replaced (or the flag added).
fn with(args: &[String], flag: &str, value: &str) -> Vec<String> {
    let mut out = args.to_vec();
    match out.iter().position(|a| a == flag) {
        Some(i) => out[i + 1] = value.to_owned(),
        None => out.extend([flag.to_owned(), value.to_owned()]),
    }
    out
}

/// A proc directory holding one containerd, whose root is the host's and whose configuration
/// (`--config`, a file of the test's) names `bin` and `conf` as its CNI directories.
fn fake_containerd(dir: &Path, bin: &Path, conf: &Path) -> Result<std::path::PathBuf> {
    let proc_dir = dir.join("proc");
    let pid = proc_dir.join("4242");
    std::fs::create_dir_all(&pid)?;
    let config = dir.join("containerd.toml");
    std::fs::write(
        &config,
        format!(
            "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = ['{}']\n  \
             conf_dir = '{}'\n",
            bin.display(),
            conf.display()
        ),
    )?;
    std::fs::write(pid.join("comm"), "containerd\n")?;
    std::fs::write(
        pid.join("cmdline"),
        format!("containerd\0--config\0{}\0", config.display()),
    )?;
    if !pid.join("root").exists() {
        std::os::unix::fs::symlink("/", pid.join("root"))?;
    }
    Ok(proc_dir)
}

type Verdicts = Vec<(String, String, String)>;

/// `sidestep check -o json` with the agent's settings (`args`, minus `agent`): (item, verdict,
/// line) of each item, and whether it exited 0.
fn check(args: &[String], extra: &[&str]) -> Result<(Verdicts, bool)> {
    let mut argv: Vec<&str> = vec!["check", "-o", "json"];
    argv.extend(args.iter().skip(1).map(String::as_str));
    argv.extend(extra);
    let out = sidestep_tests::sidestep::sidestep_unchecked(&argv)?;
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let items = v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|i| {
            (
                i["id"].as_str().unwrap_or_default().to_owned(),
                i["verdict"].as_str().unwrap_or_default().to_owned(),
                i["line"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    ensure!(
        v["passed"].as_bool() == Some(out.status.success()),
        "exit status and `passed` disagree: {v}"
    );
    Ok((items, out.status.success()))
}

fn failed(items: &Verdicts) -> Vec<&str> {
    items
        .iter()
        .filter(|(_, v, _)| v == "fail")
        .map(|(i, _, _)| i.as_str())
        .collect()
}

fn verdict<'a>(items: &'a Verdicts, id: &str) -> (&'a str, &'a str) {
    items
        .iter()
        .find(|(i, _, _)| i == id)
        .map_or(("missing", ""), |(_, v, l)| (v.as_str(), l.as_str()))
}

#[test]
fn each_fault_fails_its_own_line() -> Result<()> {
    if skip_unless_root("each_fault_fails_its_own_line") {
        return Ok(());
    }
    let env = TestEnv::new("check")?;
    let d = Dirs::new(&env)?;
    let (agent, _node) = d.ready_agent_and_node(&env)?;
    let proc_dir = fake_containerd(env.tmp_dir(), &d.bin, &d.conf)?;
    let args = with(
        &with(&base_args(&env, &d, 0), "--listen", &agent.addr.to_string()),
        "--proc-dir",
        &proc_dir.display().to_string(),
    );
    // The agent's first reconcile may come a moment after it is ready.
    let mut items = Vec::new();
    wait_until("a check that passes", Duration::from_secs(10), || {
        let (found, ok) = check(&args, &[])?;
        items = found;
        Ok(ok
            && items.iter().all(|(_, v, _)| v == "pass" || v == "warn")
            && ["runtime", "build", "api", "pods"]
                .iter()
                .all(|id| verdict(&items, id).0 == "pass"))
    })
    .map_err(|e| anyhow::anyhow!("a healthy node: {e}: {items:#?}"))?;
    ensure!(items.len() == NODE_ITEMS, "{items:?}");

    // The runtime reads another conf directory than the agent writes.
    let elsewhere = env.tmp_dir().join("other-net.d");
    std::fs::create_dir_all(&elsewhere)?;
    fake_containerd(env.tmp_dir(), &d.bin, &elsewhere)?;
    let (items, ok) = check(&args, &[])?;
    ensure!(
        !ok && failed(&items) == ["runtime"]
            && verdict(&items, "runtime").1.contains("other-net.d"),
        "runtime with another conf dir: {items:#?}"
    );
    fake_containerd(env.tmp_dir(), &d.bin, &d.conf)?;

    // Programs another build loaded: the marker names another version and object.
    let build_dir = env.pin_root().join("build");
    let ours = std::fs::read_dir(&build_dir)?
        .flatten()
        .map(|e| e.path())
        .next()
        .ok_or_else(|| anyhow::anyhow!("no build marker under {}", build_dir.display()))?;
    let other = build_dir.join("0_0_1-000000000000");
    std::fs::rename(&ours, &other)?;
    let (items, ok) = check(&args, &[])?;
    std::fs::rename(&other, &ours)?;
    ensure!(
        !ok && failed(&items) == ["build"] && verdict(&items, "build").1.contains("0_0_1"),
        "another build's programs: {items:#?}"
    );

    let conf = |name: &str, text: &str| std::fs::write(d.conf.join(name), text);
    conf("99-other.conflist", "{")?;
    let (items, ok) = check(&args, &[])?;
    ensure!(
        !ok && failed(&items) == ["conflist"],
        "broken conflist: {items:?}"
    );
    conf(
        "99-other.conflist",
        r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"istio-cni"}]}"#,
    )?;
    let (items, _) = check(&args, &[])?;
    ensure!(failed(&items) == ["conflist"], "istio-cni entry: {items:?}");
    std::fs::remove_file(d.conf.join("99-other.conflist"))?;

    // A pin root on a plain directory: the pins would die with the agent's container.
    let plain = env.tmp_dir().join("not-bpffs/sidestep");
    std::fs::create_dir_all(&plain)?;
    let off_bpffs: Vec<String> = args
        .iter()
        .map(|a| {
            if *a == env.pin_root().display().to_string() {
                plain.display().to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let (items, ok) = check(&off_bpffs, &[])?;
    let f = failed(&items);
    ensure!(!ok && f.contains(&"bpffs"), "pin root off bpffs: {items:?}");
    // Before an install only what the node offers counts, and that passes.
    let (items, ok) = check(&args, &["--pre"])?;
    ensure!(ok && items.len() == PRE_ITEMS, "--pre: {items:?}");
    Ok(())
}

/// The node the test's pods run on, as the API knows it.
const NODE: &str = "node-1";

/// A meshed pod that started before the agent, with repair off, stays uncaptured: the `pods`
/// line fails naming it (the agent names it by its address among the API's pods).
#[test]
fn an_uncaptured_pod_fails_the_pods_line_by_name() -> Result<()> {
    if skip_unless_root("an_uncaptured_pod_fails_the_pods_line_by_name") {
        return Ok(());
    }
    let env = TestEnv::new("check-pods")?;
    let d = Dirs::new(&env)?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let web = node.add_pod("web")?;
    let api = PodApi::start(
        env.tmp_dir(),
        vec![api_pod(NODE, "shop", "web", &[web.ipv4.to_string()], true)],
    )?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend(
        [
            "--reconcile-interval",
            "1s",
            "--node-name",
            NODE,
            "--repair",
            "false",
        ]
        .map(String::from),
    );
    // The check runs without the API (the stand-in serves pods, not access reviews), beside a
    // runtime of the test's (a containerd on the machine may read other directories).
    let proc_dir = fake_containerd(env.tmp_dir(), &d.bin, &d.conf)?;
    let check_args = with(&args, "--proc-dir", &proc_dir.display().to_string());
    args.extend([
        "--api-kubeconfig".into(),
        api.kubeconfig.display().to_string(),
    ]);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    wait_until("the report", Duration::from_secs(10), || {
        Ok(agent.get("/readyz")?.1.contains("1 not enrolled"))
    })?;
    let (items, ok) = check(&check_args, &[])?;
    let (v, line) = verdict(&items, "pods");
    ensure!(
        !ok && failed(&items) == ["pods"] && v == "fail" && line.contains("shop/web"),
        "an uncaptured pod: {items:#?}"
    );
    let (_, body) = agent.get("/debug/pods")?;
    let pods: Value = serde_json::from_str(&body)?;
    ensure!(pods["unenrolled"][0]["pod"] == "shop/web", "{pods}");

    // No agent answering: said, not failed.
    agent.child.terminate(Duration::from_secs(10))?;
    let (items, _) = check(&check_args, &[])?;
    ensure!(verdict(&items, "pods").0 == "warn", "no agent: {items:#?}");
    Ok(())
}

/// `sidestep status` names each pod by its record (`namespace/name`), and `--pod` keeps one, or
/// fails listing the names there are.
#[test]
fn status_names_pods_and_picks_one() -> Result<()> {
    if skip_unless_root("status_names_pods_and_picks_one") {
        return Ok(());
    }
    let env = TestEnv::new("status-pods")?;
    let d = Dirs::new(&env)?;
    let (_agent, node) = d.ready_agent_and_node(&env)?;
    let _pod = node.add_pod_with("web", agent_support::meshed())?;
    let pin_root = env.pin_root().display().to_string();
    let state_dir = d.state.display().to_string();
    let status = |extra: &[&str]| {
        let mut argv = vec!["status", "--pin-root", &pin_root, "--state-dir", &state_dir];
        argv.extend(extra);
        sidestep_tests::sidestep::sidestep_unchecked(&argv)
    };
    let out = status(&["-o", "json", "--pod", "shop/web"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let pods = v["pods"].as_array().cloned().unwrap_or_default();
    ensure!(pods.len() == 1 && pods[0]["pod"] == "shop/web", "{v}");
    let text = String::from_utf8_lossy(&status(&[])?.stdout).into_owned();
    ensure!(text.contains("  shop/web\n"), "{text}");
    let out = status(&["--pod", "shop/nope"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("no enrolled pod shop/nope; enrolled: shop/web"),
        "{err}"
    );
    Ok(())
}
