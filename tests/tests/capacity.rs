//! A pod map configured small: the enrolment past capacity fails with a clear error and changes
//! nothing. Needs root; skips otherwise.

use anyhow::{Result, ensure};
use serde_json::Value;
use sidestep_tests::{Node, NodeOptions, TestEnv, sidestep::sidestep, skip_unless_root};

fn map_entries(pin_root: &std::path::Path, map: &str) -> Result<usize> {
    let path = pin_root.join("maps").join(map).display().to_string();
    let out = std::process::Command::new("bpftool")
        .args(["map", "dump", "pinned", &path, "--json"])
        .output()?;
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v.as_array().map(Vec::len).unwrap_or(0))
}

#[test]
fn enrolment_past_capacity_fails_and_changes_nothing() -> Result<()> {
    if skip_unless_root("enrolment_past_capacity_fails_and_changes_nothing") {
        return Ok(());
    }
    let env = TestEnv::new("capacity")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pods = [node.add_pod("a")?, node.add_pod("b")?, node.add_pod("c")?];
    let root = env.pin_root().display().to_string();
    let cgroup = env.cgroup_path().display().to_string();
    sidestep(&[
        "load",
        "--cgroup",
        &cgroup,
        "--pin-root",
        &root,
        "--pod-capacity",
        "2",
    ])?;
    let enroll = |i: usize| {
        let netns = pods[i].netns_path.display().to_string();
        let ip = pods[i].ipv4.to_string();
        sidestep(&[
            "enroll",
            "--pin-root",
            &root,
            "--netns",
            &netns,
            "--pod-ip",
            &ip,
            "--exclude-outbound-ports",
            "22",
            // tc: the refused enrolment must take back the link it attached first.
            "--inbound-hook",
            "tc",
        ])
    };
    enroll(0)?;
    enroll(1)?;
    let before: Vec<usize> = [
        "SIDESTEP_POD",
        "SIDESTEP_PORTS",
        "SIDESTEP_CIDRS",
        "SIDESTEP_ADDRS",
        "SIDESTEP_STATS",
    ]
    .iter()
    .map(|m| map_entries(env.pin_root(), m))
    .collect::<Result<_>>()?;
    let err = enroll(2).expect_err("a third pod fit in a map of two");
    let msg = format!("{err:#}");
    ensure!(msg.contains("SIDESTEP_POD is full (2 entries)"), "{msg}");
    let after: Vec<usize> = [
        "SIDESTEP_POD",
        "SIDESTEP_PORTS",
        "SIDESTEP_CIDRS",
        "SIDESTEP_ADDRS",
        "SIDESTEP_STATS",
    ]
    .iter()
    .map(|m| map_entries(env.pin_root(), m))
    .collect::<Result<_>>()?;
    ensure!(before == after, "maps changed: {before:?} -> {after:?}");
    let tc = env.pin_root().join("links/tc");
    ensure!(
        std::fs::read_dir(&tc)?.count() == 2,
        "a tc link was left for the refused pod"
    );
    // Re-enrolling an enrolled pod still works at capacity.
    enroll(1)?;
    sidestep(&["unload", "--pin-root", &root])?;
    Ok(())
}
