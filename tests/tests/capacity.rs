//! Map sizes and layouts: a pod map configured small refuses the enrolment past capacity with a
//! clear error and changes nothing; an upgrade over a counters map of an older layout replaces it
//! instead of refusing. Needs root; skips otherwise.

use anyhow::{Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, TestEnv,
    sidestep::{Loaded, sidestep},
    skip_unless_root,
};

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

/// A release that adds a counter changes the counters map's value size. The upgrade replaces that
/// statistics-only map (the pods' counts restart at 0) rather than stopping until someone runs
/// `sidestep unload`, and every enrolled pod has its entry again, so its counting goes on.
#[test]
fn an_upgrade_replaces_a_counters_map_of_an_older_layout() -> Result<()> {
    if skip_unless_root("an_upgrade_replaces_a_counters_map_of_an_older_layout") {
        return Ok(());
    }
    let env = TestEnv::new("ctrlayout")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pods = [node.add_pod("a")?, node.add_pod("b")?];
    let root = env.pin_root().display().to_string();
    let cgroup = env.cgroup_path().display().to_string();
    let loaded = Loaded::load(&env)?;
    for pod in &pods {
        loaded.enroll(pod, &[])?;
    }
    let load = || sidestep(&["load", "--cgroup", &cgroup, "--pin-root", &root]);
    // What an older release pinned: the same map with a smaller value.
    let counters = env.pin_root().join("maps/SIDESTEP_STATS");
    let path = counters.display().to_string();
    let shown = bpftool(&["map", "show", "pinned", &path, "--json"])?;
    let value_size = shown["bytes_value"].as_u64().unwrap_or(0);
    ensure!(value_size > 8, "{shown}");
    std::fs::remove_file(&counters)?;
    let older = (value_size - 8).to_string();
    bpftool(&[
        "map",
        "create",
        &path,
        "type",
        "percpu_hash",
        "key",
        "8",
        "value",
        &older,
        "entries",
        "4096",
        "name",
        "SIDESTEP_STATS",
    ])?;
    let out = load()?;
    ensure!(String::from_utf8_lossy(&out.stdout).contains("upgraded"));
    let shown = bpftool(&["map", "show", "pinned", &path, "--json"])?;
    ensure!(
        shown["bytes_value"].as_u64() == Some(value_size),
        "the old counters map is still pinned: {shown}"
    );
    ensure!(
        map_entries(env.pin_root(), "SIDESTEP_STATS")? == pods.len(),
        "the enrolled pods have no counters entry"
    );
    // Other maps keep refusing a changed layout.
    let pod_map = env.pin_root().join("maps/SIDESTEP_POD");
    let pod_path = pod_map.display().to_string();
    let pod_shown = bpftool(&["map", "show", "pinned", &pod_path, "--json"])?;
    let pod_value = (pod_shown["bytes_value"].as_u64().unwrap_or(0) + 8).to_string();
    std::fs::remove_file(&pod_map)?;
    bpftool(&[
        "map",
        "create",
        &pod_path,
        "type",
        "hash",
        "key",
        "8",
        "value",
        &pod_value,
        "entries",
        "4096",
        "name",
        "SIDESTEP_POD",
    ])?;
    let err = load().expect_err("a pod map of another layout was taken over");
    ensure!(format!("{err:#}").contains("layout changed"), "{err:#}");
    loaded.unload()?;
    Ok(())
}

fn bpftool(args: &[&str]) -> Result<Value> {
    let out = std::process::Command::new("bpftool").args(args).output()?;
    ensure!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if out.stdout.is_empty() {
        return Ok(Value::Null);
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// `sidestep status` on a full node: 4,000 pods with two captured interfaces each, written
/// straight into the maps (status only reads them). It scans the interface map once, not once
/// per pod (pods x entries syscalls took minutes), so it answers within seconds.
#[test]
fn status_of_a_full_node_answers_in_seconds() -> Result<()> {
    if skip_unless_root("status_of_a_full_node_answers_in_seconds") {
        return Ok(());
    }
    let env = TestEnv::new("status-scale")?;
    let loaded = Loaded::load(&env)?;
    let maps = env.pin_root().join("maps");
    let size = |map: &str| -> Result<usize> {
        let path = maps.join(map).display().to_string();
        let shown = bpftool(&["map", "show", "pinned", &path, "--json"])?;
        Ok(shown["bytes_value"].as_u64().unwrap_or(0) as usize)
    };
    let zeros = |n: usize| vec!["00"; n].join(" ");
    let hex = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (pod_value, iface_value) = (
        zeros(size("SIDESTEP_POD")?),
        zeros(size("SIDESTEP_IFACES")?),
    );
    let pods = 4000u64;
    let mut batch = String::new();
    for i in 0..pods {
        // Far from any real netns cookie.
        let cookie = (1u64 << 40) + i;
        batch.push_str(&format!(
            "map update pinned {} key hex {} value hex {pod_value}\n",
            maps.join("SIDESTEP_POD").display(),
            hex(&cookie.to_ne_bytes())
        ));
        for ifindex in [2u32, 3] {
            let key: Vec<u8> =
                [&cookie.to_ne_bytes()[..], &ifindex.to_ne_bytes(), &[0; 4]].concat();
            batch.push_str(&format!(
                "map update pinned {} key hex {} value hex {iface_value}\n",
                maps.join("SIDESTEP_IFACES").display(),
                hex(&key)
            ));
        }
    }
    let file = env.tmp_dir().join("full-node.batch");
    std::fs::write(&file, batch)?;
    let filled = std::process::Command::new("bpftool")
        .args(["batch", "file", &file.display().to_string()])
        .output()?;
    ensure!(
        filled.status.success(),
        "bpftool batch: {}",
        String::from_utf8_lossy(&filled.stderr)
    );

    let root = env.pin_root().display().to_string();
    let started = std::time::Instant::now();
    let out = sidestep(&["status", "--pin-root", &root, "--json"])?;
    let took = started.elapsed();
    let status: Value = serde_json::from_slice(&out.stdout)?;
    let listed = status["pods"].as_array().map_or(0, Vec::len);
    ensure!(
        listed as u64 == pods,
        "status lists {listed} pods of {pods}"
    );
    ensure!(
        status["pods"][0]["inbound_ifindexes"] == serde_json::json!([2, 3]),
        "{}",
        status["pods"][0]
    );
    let bound = sidestep_tests::scaled(std::time::Duration::from_secs(10));
    ensure!(
        took < bound,
        "sidestep status of {pods} pods took {took:?} (bound {bound:?})"
    );
    loaded.unload()?;
    Ok(())
}

/// Enrolment of a netns that already holds more addresses and routes than one pod may register
/// (a pod enrolled again after its root flooded it): at most the caps go into `SIDESTEP_ADDRS`
/// and `SIDESTEP_SRCR`, and the attachment's own addresses are among them however the netns
/// lists its interfaces.
#[test]
fn enrolment_registers_at_most_the_cap_with_the_attachments_addresses_first() -> Result<()> {
    if skip_unless_root("enrolment_registers_at_most_the_cap_with_the_attachments_addresses_first")
    {
        return Ok(());
    }
    let env = TestEnv::new("addrcap")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("flooded")?;
    let loaded = Loaded::load(&env)?;
    // eth0 (listed first) gets 100 more addresses; the attachment is net1, made after it.
    let lines: String = (0..100)
        .map(|i| format!("addr add 10.250.0.{i}/32 dev eth0\n"))
        .collect();
    pod.ip_batch(&env, &lines)?;
    pod.add_veth("net1", "10.77.0.2/24")?;
    // And more routes through net1 than one pod's source routes may be.
    let routes: String = (0..100)
        .map(|i| format!("route add 10.100.{i}.0/24 dev net1\n"))
        .collect();
    pod.ip_batch(&env, &routes)?;
    loaded.enroll(&pod, &["--interface", "net1"])?;
    let trie = env
        .pin_root()
        .join("maps/SIDESTEP_SRCR")
        .display()
        .to_string();
    let source_routes = bpftool(&["map", "dump", "pinned", &trie, "--json"])?
        .as_array()
        .map_or(0, Vec::len);
    // userspace/src/enroll/source.rs, MAX_FOLLOWED_ROUTES.
    ensure!(
        source_routes == 64,
        "{source_routes} source routes of one pod"
    );

    let cookie = pod.netns_cookie()?;
    let path = env
        .pin_root()
        .join("maps/SIDESTEP_ADDRS")
        .display()
        .to_string();
    let held: Vec<u64> = bpftool(&["map", "dump", "pinned", &path, "--json"])?
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["formatted"]["value"].as_u64() == Some(cookie))
        .filter_map(|e| e["formatted"]["key"][3].as_u64())
        .collect();
    let word = |ip: std::net::Ipv4Addr| u64::from(u32::from_ne_bytes(ip.octets()));
    // userspace/src/enroll/addresses.rs, MAX_POD_ADDRESSES.
    ensure!(
        held.len() == 64,
        "{} addresses registered for one pod",
        held.len()
    );
    ensure!(held.contains(&word(pod.ipv4)), "the pod IP was left out");
    ensure!(
        held.contains(&word(std::net::Ipv4Addr::new(10, 77, 0, 2))),
        "the attachment's (net1's) address was left out"
    );
    loaded.unenroll(&pod)?;
    loaded.unload()?;
    Ok(())
}

/// `sidestep enroll` without `--interface` captures every interface but lo; a netns whose root
/// added dozens is refused, naming the fix, with nothing written, and enrols once told which.
#[test]
fn enrolment_of_every_interface_of_a_crowded_netns_is_refused() -> Result<()> {
    if skip_unless_root("enrolment_of_every_interface_of_a_crowded_netns_is_refused") {
        return Ok(());
    }
    let env = TestEnv::new("ifcap")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("crowded")?;
    let loaded = Loaded::load(&env)?;
    // eth0 and 17 veth pairs inside the pod: 35 interfaces (userspace/src/limits.rs,
    // MAX_UNNAMED_INTERFACES = 32).
    let lines: String = (0..17)
        .map(|i| format!("link add x{i} type veth peer name y{i}\n"))
        .collect();
    pod.ip_batch(&env, &lines)?;
    let err = loaded
        .enroll(&pod, &["--inbound-hook", "tc"])
        .expect_err("a netns of 35 interfaces enrolled whole");
    let msg = format!("{err:#}");
    ensure!(
        msg.contains("35 interfaces") && msg.contains("--interface"),
        "{msg}"
    );
    for map in ["SIDESTEP_POD", "SIDESTEP_IFACES", "SIDESTEP_ADDRS"] {
        let n = map_entries(env.pin_root(), map)?;
        ensure!(n == 0, "{n} entries in {map} after a refused enrolment");
    }
    loaded.enroll(&pod, &["--inbound-hook", "tc", "--interface", "eth0"])?;
    ensure!(
        map_entries(env.pin_root(), "SIDESTEP_POD")? == 1,
        "not enrolled with --interface"
    );
    loaded.unenroll(&pod)?;
    loaded.unload()?;
    Ok(())
}
