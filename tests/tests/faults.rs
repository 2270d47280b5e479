//! Faults of the CNI plugin and its state directory, with the real plugin binary on real pods
//! (netns made by the bridge + host-local plugins) and the programs loaded into the test's
//! cgroup and pin root. Needs root.
//!
//! - The plugin is SIGKILLed at each named step of ADD and DEL (`SIDESTEP_FAILPOINT`, see
//!   `sidestep::sys::failpoint`). After each kill the runtime's retry (ADD again, or DEL) must
//!   leave the pod exactly as a clean ADD does (captured) or exactly as before it (released):
//!   the same map entries, pinned links, kernel links and state files (the netns-cookie index
//!   included).
//! - Damaged records (truncated, garbage, empty, unknown format, a directory in their place):
//!   DEL exits 0, names the file, and still removes the pod from the kernel; ADD replaces them.
//! - DEL removes exactly its pod's map entries, and none of another pod's: by its record's keys,
//!   and by a scan of the maps when the record is gone or older than the netns-cookie index.
//! - An ADD stopped between its enrolment and its record while a load recreates the pod map
//!   (`stop:` failpoint) still leaves the pod in the pinned map.
//! - An upgrade moves each pod's tc and sk_lookup links to the new programs, and a pinned map
//!   whose layout changed stops the load with an error naming it, before anything changes.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use sidestep_tests::{
    Node, NodeOptions, PodOptions, TestEnv,
    faults::{Plugin, bpftool},
    sidestep::{Loaded, sidestep},
    skip_unless_root,
};

const ADD_POINTS: [&str; 8] = [
    "add:after-index",
    "state:before-rename",
    "add:after-pending",
    "enroll:before-pod-entry",
    "enroll:after-maps",
    "enroll:after-links",
    "add:after-enroll",
    "add:after-record",
];

const DEL_POINTS: [&str; 4] = [
    "del:before-unenroll",
    "unenroll:after-pod-entry",
    "del:after-unenroll",
    "del:after-record",
];

fn pod_options() -> PodOptions {
    PodOptions {
        namespace: "shop".into(),
        ..Default::default()
    }
}

struct Setup {
    // Drop order: node (CNI DEL of the bridge, netns), the programs, then the env.
    node: Node,
    plugin: Plugin,
    loaded: Loaded,
    env: TestEnv,
}

fn setup(name: &str) -> Result<Setup> {
    let env = TestEnv::new(name)?;
    let loaded = Loaded::load(&env)?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let plugin = Plugin::new(&env, loaded.pin_root());
    Ok(Setup {
        node,
        plugin,
        loaded,
        env,
    })
}

#[test]
fn plugin_killed_at_each_step_of_add_and_del_converges() -> Result<()> {
    if skip_unless_root("plugin_killed_at_each_step_of_add_and_del_converges") {
        return Ok(());
    }
    let s = setup("faults-steps")?;
    let pod = s.node.add_pod_with("app", pod_options())?;
    let released = s.plugin.snapshot()?;
    s.plugin.ok("ADD", &pod)?;
    let captured = s.plugin.snapshot()?;
    ensure!(
        captured.maps["SIDESTEP_POD"] == released.maps["SIDESTEP_POD"] + 1
            && captured.pod_link_pins.len() > released.pod_link_pins.len()
            // The record and its netns-cookie index entry.
            && captured.files.len() == 2
            && captured.files.iter().any(|f| f == &format!("cookies/{}/{}@eth0", pod.netns_cookie().unwrap_or(0), pod.container_id))
            && !captured.pending,
        "a clean ADD did not enrol the pod: {captured:?}"
    );
    let status = s.loaded.status()?;
    let cookie = pod.netns_cookie()?;
    ensure!(
        status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["netns_cookie"] == cookie
                && p["inbound_hook"] == "sk_lookup"
                && p["inbound_ifindexes"].as_array().map(Vec::len) == Some(1)),
        "status does not show the pod with inbound by sk_lookup on its one interface: {status}"
    );
    s.plugin.ok("DEL", &s.node.pods()[0])?;
    s.plugin.expect("a clean DEL", &released)?;

    for point in ADD_POINTS {
        s.plugin.killed("ADD", &pod, point)?;
        let after_kill = s.plugin.snapshot()?;
        if !matches!(point, "add:after-index" | "state:before-rename") {
            // From the first map write on, a record names the cookie.
            ensure!(
                after_kill.files.iter().any(|f| !f.starts_with('.')),
                "ADD killed at {point} left no record: {after_kill:?}"
            );
        }
        eprintln!("ADD killed at {point}: {after_kill:?}");
        // The runtime gives up on the pod: DEL.
        s.plugin.ok("DEL", &pod)?;
        s.plugin
            .expect(&format!("DEL after an ADD killed at {point}"), &released)?;
        // The runtime retries: ADD again, later DEL.
        s.plugin.killed("ADD", &pod, point)?;
        s.plugin.ok("ADD", &pod)?;
        s.plugin
            .expect(&format!("ADD retried after a kill at {point}"), &captured)?;
        s.plugin.ok("DEL", &pod)?;
        s.plugin
            .expect(&format!("DEL after the retried ADD ({point})"), &released)?;
    }
    for point in DEL_POINTS {
        s.plugin.ok("ADD", &pod)?;
        s.plugin.killed("DEL", &pod, point)?;
        eprintln!("DEL killed at {point}: {:?}", s.plugin.snapshot()?);
        s.plugin.ok("DEL", &pod)?;
        s.plugin
            .expect(&format!("DEL retried after a kill at {point}"), &released)?;
    }

    // The netns gone before the DEL that follows a killed ADD: only the pending record knows
    // the cookie.
    let gone = s.node.add_pod_with("gone", pod_options())?;
    s.plugin.killed("ADD", &gone, "enroll:after-links")?;
    s.node.remove_pod(&gone)?;
    s.plugin.ok("DEL", &gone)?;
    s.plugin
        .expect("DEL with the netns gone, after a killed ADD", &released)?;
    Ok(())
}

/// Damages the record of `pod` in one of the ways a disk or a person does.
/// A reload that recreates a map while an ADD is between its enrolment and its record (the
/// agent reloading after lost pins, an upgrade that changed a map's layout) took that enrolment
/// with the old map, and the agent's re-enrolment after the reload read the records before this
/// one existed. The plugin sees its maps are no longer the pinned ones and enrols again into the
/// new ones; before, the pod ran uncaptured behind a record that said it was captured.
#[test]
fn add_racing_a_reload_that_recreates_the_maps_still_captures_the_pod() -> Result<()> {
    if skip_unless_root("add_racing_a_reload_that_recreates_the_maps_still_captures_the_pod") {
        return Ok(());
    }
    let s = setup("faults-reload")?;
    let pod = s.node.add_pod_with("app", pod_options())?;
    let root = s.plugin.pin_root.display().to_string();
    let cgroup = s.env.cgroup_path().display().to_string();
    let pod_map = s.plugin.pin_root.join("maps/SIDESTEP_POD");
    let before = pinned_id("map", &pod_map)?;
    let out = s.plugin.paused("ADD", &pod, "add:after-enroll", || {
        std::fs::remove_file(&pod_map)?;
        sidestep(&["load", "--cgroup", &cgroup, "--pin-root", &root])?;
        Ok(())
    })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "ADD failed: {stderr}");
    ensure!(
        pinned_id("map", &pod_map)? != before,
        "the load did not recreate the pod map"
    );
    let cookie = pod.netns_cookie()?;
    let status = s.loaded.status()?;
    ensure!(
        status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["netns_cookie"] == cookie),
        "the pod is not in the pinned pod map after the ADD: {status}"
    );
    ensure!(
        stderr.contains("maps were recreated during ADD"),
        "the plugin did not notice the reload: {stderr}"
    );
    s.plugin.ok("CHECK", &pod)?;
    s.plugin.ok("DEL", &pod)?;
    Ok(())
}

fn damage(path: &Path, how: &str) -> Result<()> {
    let full = std::fs::read_to_string(path)?;
    match how {
        "truncated" => {
            let at = full
                .find("\"netnsCookie\"")
                .context("no cookie in the record")?;
            let cut = at + full[at..].find(',').context("cookie line")? + 1;
            std::fs::write(path, &full[..cut])?;
        }
        "garbage" => std::fs::write(path, b"\x00\x17not json at all\xff")?,
        "empty" => std::fs::write(path, b"")?,
        "unknown-format" => {
            let mut v: Value = serde_json::from_str(&full)?;
            v["format"] = json!(99);
            std::fs::write(path, v.to_string())?;
        }
        "directory" => {
            std::fs::remove_file(path)?;
            std::fs::create_dir(path)?;
            std::fs::write(path.join("stray"), "x")?;
        }
        other => bail!("unknown damage {other}"),
    }
    Ok(())
}

#[test]
fn damaged_records_are_reported_and_del_still_releases_the_pod() -> Result<()> {
    if skip_unless_root("damaged_records_are_reported_and_del_still_releases_the_pod") {
        return Ok(());
    }
    let s = setup("faults-state")?;
    let pod = s.node.add_pod_with("app", pod_options())?;
    let released = s.plugin.snapshot()?;
    s.plugin.ok("ADD", &pod)?;
    let captured = s.plugin.snapshot()?;
    s.plugin.ok("DEL", &pod)?;
    let record = s.plugin.record_path(&pod);
    let strip_aside = |p: &Plugin| -> Result<Vec<String>> {
        let mut aside = Vec::new();
        for e in std::fs::read_dir(&p.state)?.flatten() {
            if e.file_name().to_string_lossy().contains(".corrupt-") {
                aside.push(e.file_name().to_string_lossy().into_owned());
                std::fs::remove_dir_all(e.path())?;
            }
        }
        Ok(aside)
    };
    for how in [
        "truncated",
        "garbage",
        "empty",
        "unknown-format",
        "directory",
    ] {
        // ADD over a damaged record replaces it.
        s.plugin.ok("ADD", &pod)?;
        damage(&record, how)?;
        s.plugin.ok("ADD", &pod)?;
        let aside = strip_aside(&s.plugin)?;
        ensure!(
            (how == "directory") != aside.is_empty(),
            "{how}: moved aside {aside:?}"
        );
        s.plugin
            .expect(&format!("ADD over a {how} record"), &captured)?;
        // DEL with a damaged record: exit 0, the file named, the pod gone from the kernel.
        damage(&record, how)?;
        let out = s.plugin.ok("DEL", &pod)?;
        let log = String::from_utf8_lossy(&out.stderr);
        ensure!(
            log.contains(&record.display().to_string()),
            "{how}: DEL's log does not name {}: {log}",
            record.display()
        );
        strip_aside(&s.plugin)?;
        s.plugin
            .expect(&format!("DEL with a {how} record"), &released)?;
    }
    // A truncated record and no netns: the cookie comes from the record's text.
    let gone = s.node.add_pod_with("gone", pod_options())?;
    s.plugin.ok("ADD", &gone)?;
    damage(&s.plugin.record_path(&gone), "truncated")?;
    s.node.remove_pod(&gone)?;
    let out = s.plugin.ok("DEL", &gone)?;
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("read from the damaged record"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.plugin
        .expect("DEL of a truncated record, netns gone", &released)?;
    Ok(())
}

fn pinned_id(kind: &str, path: &Path) -> Result<u64> {
    let v = bpftool(&[kind, "show", "pinned", &path.display().to_string()])?;
    v["id"]
        .as_u64()
        .with_context(|| format!("{kind} {path:?}: {v}"))
}

/// The program a pinned pod attachment runs: a link's program, or on a kernel without TCX the
/// program pinned as the record of its tc filter (tests/tests/tc_netlink.rs checks that the
/// filter runs what the record names).
fn link_prog(path: &Path) -> Result<u64> {
    let shown = path.display().to_string();
    match bpftool(&["link", "show", "pinned", &shown]) {
        Ok(v) => v["prog_id"]
            .as_u64()
            .with_context(|| format!("link {path:?}: {v}")),
        Err(e) if format!("{e:#}").contains("incorrect object type: prog") => {
            let v = bpftool(&["prog", "show", "pinned", &shown])?;
            v["id"]
                .as_u64()
                .with_context(|| format!("filter record {path:?}: {v}"))
        }
        Err(e) => Err(e),
    }
}

#[test]
fn upgrade_moves_pod_links_and_refuses_a_changed_map_layout() -> Result<()> {
    if skip_unless_root("upgrade_moves_pod_links_and_refuses_a_changed_map_layout") {
        return Ok(());
    }
    let mut s = setup("faults-upgrade")?;
    // Both kinds of per-pod link: tc on eth0 and the netns's sk_lookup link.
    s.plugin.entry["inbound_hook"] = json!("tc");
    let pod = s.node.add_pod_with("app", pod_options())?;
    s.plugin.ok("ADD", &pod)?;
    let cookie = pod.netns_cookie()?;
    let root = s.loaded.pin_root();
    let tc_link = root.join(format!("links/tc/{cookie}/eth0"));
    let lookup_link = root.join(format!("links/sklookup/{cookie}"));
    // Which pinned program each pod link runs, by name.
    let progs: Vec<PathBuf> = std::fs::read_dir(root.join("progs"))?
        .flatten()
        .map(|e| e.path())
        .collect();
    let name_of = |link: &Path| -> Result<PathBuf> {
        let id = link_prog(link)?;
        for p in &progs {
            if pinned_id("prog", p)? == id {
                return Ok(p.clone());
            }
        }
        bail!("{link:?} runs program {id}, which is not pinned under {root:?}")
    };
    let tc_prog = name_of(&tc_link)?;
    let lookup_prog = name_of(&lookup_link)?;
    let (tc_before, lookup_before) = (link_prog(&tc_link)?, link_prog(&lookup_link)?);
    let root_arg = root.display().to_string();
    let cgroup_arg = s.env.cgroup_path().display().to_string();
    sidestep(&["load", "--cgroup", &cgroup_arg, "--pin-root", &root_arg])?;
    let (tc_after, lookup_after) = (link_prog(&tc_link)?, link_prog(&lookup_link)?);
    ensure!(
        tc_after != tc_before && tc_after == pinned_id("prog", &tc_prog)?,
        "the pod's tc link runs {tc_after} (before {tc_before}), not the new {tc_prog:?}"
    );
    ensure!(
        lookup_after != lookup_before && lookup_after == pinned_id("prog", &lookup_prog)?,
        "the pod's sk_lookup link runs {lookup_after} (before {lookup_before}), not the new program"
    );

    // An "old version" pinned SIDESTEP_IFACES with 8-byte values; this build's are 1 byte.
    let map = root.join("maps/SIDESTEP_IFACES");
    let info = bpftool(&["map", "show", "pinned", &map.display().to_string()])?;
    let (key, value) = (
        info["bytes_key"].as_u64().context("key size")?,
        info["bytes_value"].as_u64().context("value size")?,
    );
    let old_value = value + 7;
    std::fs::remove_file(&map)?;
    let out = Command::new("bpftool")
        .args(["map", "create", &map.display().to_string(), "type", "hash"])
        .args(["key", &key.to_string(), "value", &old_value.to_string()])
        .args(["entries", "16", "name", "SIDESTEP_IFACES"])
        .output()?;
    ensure!(
        out.status.success(),
        "bpftool map create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let attachments = |st: &Value| st["attachments"].clone();
    let before = s.loaded.status()?;
    let e = sidestep(&["load", "--cgroup", &cgroup_arg, "--pin-root", &root_arg])
        .expect_err("a load over a changed map layout must fail");
    let msg = format!("{e:#}");
    ensure!(
        msg.contains(&format!(
            "map SIDESTEP_IFACES layout changed (value {old_value} -> {value} bytes"
        )) && msg.contains("sidestep unload"),
        "unclear error: {msg}"
    );
    ensure!(
        attachments(&s.loaded.status()?) == attachments(&before)
            && link_prog(&tc_link)? == tc_after,
        "the refused load changed the attachments"
    );
    Ok(())
}

/// Every entry of the per-pod maps, as bpftool prints it.
fn map_contents(p: &Plugin) -> Result<BTreeMap<&'static str, Vec<String>>> {
    let mut out = BTreeMap::new();
    for m in sidestep_tests::faults::POD_MAPS {
        let path = p.pin_root.join("maps").join(m).display().to_string();
        let mut v: Vec<String> = bpftool(&["map", "dump", "pinned", &path])?
            .as_array()
            .into_iter()
            .flatten()
            .map(Value::to_string)
            .collect();
        v.sort();
        out.insert(m, v);
    }
    Ok(out)
}

#[test]
fn del_removes_exactly_its_pods_keys_by_record_and_by_scan() -> Result<()> {
    if skip_unless_root("del_removes_exactly_its_pods_keys_by_record_and_by_scan") {
        return Ok(());
    }
    let s = setup("faults-del-keys")?;
    let other = s.node.add_pod_with("other", pod_options())?;
    let pod = s.node.add_pod_with("app", pod_options())?;
    let released = map_contents(&s.plugin)?;
    s.plugin.ok("ADD", &other)?;
    let only_other = map_contents(&s.plugin)?;
    ensure!(only_other != released, "ADD wrote nothing");

    // With its record: the record's keys, and nothing of the other pod's.
    s.plugin.ok("ADD", &pod)?;
    let out = s.plugin.ok("DEL", &pod)?;
    let log = String::from_utf8_lossy(&out.stderr);
    ensure!(log.contains("by its record's keys"), "{log}");
    ensure!(
        map_contents(&s.plugin)? == only_other,
        "DEL by the record's keys left or took entries"
    );

    // Lost state (no record, no index): the netns names the cookie, and the scan finds all.
    s.plugin.ok("ADD", &pod)?;
    std::fs::remove_file(s.plugin.record_path(&pod))?;
    std::fs::remove_dir_all(s.plugin.state.join("cookies"))?;
    let out = s.plugin.ok("DEL", &pod)?;
    let log = String::from_utf8_lossy(&out.stderr);
    ensure!(log.contains("by scanning the maps"), "{log}");
    ensure!(
        map_contents(&s.plugin)? == only_other,
        "DEL by a scan left or took entries"
    );

    // A record older than the index (no entry, no ifindexes): counted and removed by the scans.
    s.plugin.ok("ADD", &pod)?;
    let path = s.plugin.record_path(&pod);
    let mut rec: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    rec.as_object_mut()
        .context("record")?
        .remove("inboundIfindexes");
    std::fs::write(&path, rec.to_string())?;
    std::fs::remove_dir_all(s.plugin.state.join("cookies"))?;
    let out = s.plugin.ok("DEL", &pod)?;
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("by scanning the maps"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(map_contents(&s.plugin)? == only_other);

    s.plugin.ok("DEL", &other)?;
    ensure!(map_contents(&s.plugin)? == released);
    Ok(())
}
