//! `sidestep check` and `sidestep status` on a node the agent runs. `check`: every line passes
//! and the exit code is 0; then each fault an operator meets turns its own line ✖ and the exit
//! code 1: a conflist the runtime cannot read, a competing istio-cni entry, and a pin root off
//! bpffs. `status`: pods by `namespace/name`, and `--pod`. Needs root.

mod agent_support;

use agent_support::{Dirs, base_args};
use anyhow::{Result, ensure};
use serde_json::Value;
use sidestep_tests::{TestEnv, skip_unless_root};

/// `sidestep check -o json` with the agent's settings (`args`, minus `agent`), its verdicts by
/// item, and whether it exited 0.
fn check(args: &[String], extra: &[&str]) -> Result<(Vec<(String, String)>, bool)> {
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
            )
        })
        .collect();
    ensure!(
        v["passed"].as_bool() == Some(out.status.success()),
        "exit status and `passed` disagree: {v}"
    );
    Ok((items, out.status.success()))
}

fn failed(items: &[(String, String)]) -> Vec<&str> {
    items
        .iter()
        .filter(|(_, v)| v == "fail")
        .map(|(i, _)| i.as_str())
        .collect()
}

#[test]
fn each_fault_fails_its_own_line() -> Result<()> {
    if skip_unless_root("each_fault_fails_its_own_line") {
        return Ok(());
    }
    let env = TestEnv::new("check")?;
    let d = Dirs::new(&env)?;
    let (_agent, _node) = d.ready_agent_and_node(&env)?;
    let args = base_args(&env, &d, 0);
    let (items, ok) = check(&args, &[])?;
    ensure!(ok && failed(&items).is_empty(), "a healthy node: {items:?}");
    ensure!(items.len() == 8, "{items:?}");

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
    ensure!(ok && items.len() == 6, "--pre: {items:?}");
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
