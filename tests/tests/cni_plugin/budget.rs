//! Issue 35: one pod's annotations could fill the maps every pod of the node shares. Two pods
//! listing 32,764 excluded ports each put 65,536 entries in `SIDESTEP_PORTS` (with Istio's four
//! fixed inbound exclusions), and every later meshed ADD on the node failed with a full map. Now
//! each is refused by its own ADD, naming the annotation and the limit, with nothing written.

use std::process::Command;

use anyhow::{Context as _, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{netns, skip_unless_root};

use super::corpus::annotated;
use super::sandbox::{Sandbox, call, expect_err, expect_ok};

const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
/// One pod's share of each map (`MAX_POD_PORT_RULES`, `MAX_POD_CIDR_RULES` in
/// userspace/src/limits.rs).
const MAX_POD_PORT_RULES: usize = 512;
const MAX_POD_CIDR_RULES: usize = 256;

fn entries(sb: &Sandbox, map: &str) -> Result<usize> {
    let path = sb.pin_root.join("maps").join(map);
    let out = Command::new("bpftool")
        .args(["map", "dump", "pinned"])
        .arg(&path)
        .arg("--json")
        .output()
        .context("bpftool")?;
    ensure!(out.status.success(), "bpftool map dump {}", path.display());
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v.as_array().map_or(0, Vec::len))
}

fn ports(n: usize) -> String {
    (1..=n).map(|p| p.to_string()).collect::<Vec<_>>().join(",")
}

#[test]
fn pods_past_their_map_budget_are_refused_and_a_normal_pod_still_enrols() {
    if skip_unless_root("pods_past_their_map_budget_are_refused_and_a_normal_pod_still_enrols") {
        return;
    }
    budget().unwrap();
}

fn budget() -> Result<()> {
    let mut sb = Sandbox::new("budget")?;
    sb.load()?;
    let conf = sb.conf("1.0.0");
    // 32,764 ports and Istio's four fixed inbound exclusions: half of SIDESTEP_PORTS per pod.
    let flood = ports(32_764);
    let hostile = [
        (
            "f1",
            EXCLUDE_OUTBOUND_PORTS,
            flood.clone(),
            MAX_POD_PORT_RULES,
        ),
        ("f2", EXCLUDE_OUTBOUND_PORTS, flood, MAX_POD_PORT_RULES),
        (
            "ci",
            EXCLUDE_OUTBOUND_IP_RANGES,
            (0..30_000)
                .map(|i| format!("10.{}.{}.0/24", i / 256 % 256, i % 256))
                .collect::<Vec<_>>()
                .join(","),
            MAX_POD_CIDR_RULES,
        ),
    ];
    let mut outcomes = Vec::new();
    for (i, (cid, key, value, _)) in hostile.iter().enumerate() {
        let ns = sb.add_netns(cid)?;
        let mut conf = annotated(&conf, json!({ *key: value }));
        // Each pod its own address, as on a node: only the maps are shared.
        conf["prevResult"]["ips"][0]["address"] = json!(format!("10.254.0.{}/24", 20 + i));
        outcomes.push(call(&sb, "ADD", cid, &ns, &conf)?);
    }
    // First what the issue is about: a pod without such lists still enrols on the node.
    let normal = sb.add_netns("ok")?;
    expect_ok(&call(&sb, "ADD", "normal", &normal, &conf)?, "ADD normal")?;
    ensure!(
        sb.pods()? == [netns::cookie(&normal)?],
        "pods {:?}",
        sb.pods()?
    );
    for ((cid, key, _, limit), o) in hostile.iter().zip(&outcomes) {
        expect_err(o, 101, cid)?;
        let msg = o.json["msg"].as_str().unwrap_or_default();
        ensure!(
            msg.contains(key) && msg.contains(&limit.to_string()),
            "{cid}: {msg}"
        );
        ensure!(msg.len() < 1024, "{cid}: a {}-byte message", msg.len());
        eprintln!("{cid}: {msg}");
    }
    // Nothing of the refused pods: the normal pod's record and entries alone.
    let files: Vec<String> = sb.state_files().into_keys().collect();
    ensure!(
        files
            == [
                format!("cookies/{}/normal@eth0", netns::cookie(&normal)?),
                "normal@eth0.json".to_owned()
            ],
        "{files:?}"
    );
    ensure!(
        sb.pod_links() == [format!("sklookup/{}", netns::cookie(&normal)?)],
        "links {:?}",
        sb.pod_links()
    );
    ensure!(entries(&sb, "SIDESTEP_PORTS")? == 5);
    ensure!(entries(&sb, "SIDESTEP_CIDRS")? == 1);

    // A pod at its budget exactly enrols, with that many entries.
    let full = sb.add_netns("at")?;
    let mut at = annotated(
        &conf,
        json!({ EXCLUDE_OUTBOUND_PORTS: ports(MAX_POD_PORT_RULES - 4) }),
    );
    at["prevResult"]["ips"][0]["address"] = json!("10.254.0.10/24");
    expect_ok(&call(&sb, "ADD", "at", &full, &at)?, "ADD at the budget")?;
    ensure!(entries(&sb, "SIDESTEP_PORTS")? == 5 + MAX_POD_PORT_RULES);
    expect_ok(&call(&sb, "DEL", "at", &full, &at)?, "DEL at the budget")?;
    expect_ok(&call(&sb, "DEL", "normal", &normal, &conf)?, "DEL normal")?;
    ensure!(entries(&sb, "SIDESTEP_PORTS")? == 0);
    Ok(())
}
