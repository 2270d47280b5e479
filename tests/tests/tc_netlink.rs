//! The tc inbound hook on a kernel without TCX (Linux before 6.6: Debian 12, Amazon Linux 2023,
//! Bottlerocket, COS): the program sits as a cls_bpf filter on a clsact qdisc. On a kernel with
//! TCX the test forces that path (`SIDESTEP_TC_ATTACH=netlink`); on 6.1 (`cargo xtask test
//! --kernel 6.1`) the loader picks it itself, which the test checks through `sidestep status`.
//! Needs root; skips otherwise.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, TestEnv,
    bench::bpfstats::StatsEnabled,
    haproxy, http_get, nginx,
    sidestep::{Loaded, sidestep},
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;
/// The kernel keeps 15 characters of a program's name.
const TC_FILTER_NAME: &str = "sidestep_tc_ing";

/// Whether the running kernel has TCX (6.6+): the oracle here is the version, which the loader
/// itself does not use (it probes).
fn kernel_has_tcx() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (6, 6)
}

fn tc(env: &TestEnv, pod: &Pod, args: &[&str]) -> Result<String> {
    let mut argv = vec!["tc"];
    argv.extend_from_slice(args);
    let out = pod.run_outside_cgroup(env, 0, &argv)?;
    ensure!(
        out.status.success(),
        "tc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn tc_ingress_runs(loaded: &Loaded) -> Result<u64> {
    let status = loaded.status()?;
    status["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "sidestep_tc_ingress")
        .and_then(|p| p["run_count"].as_u64())
        .context("sidestep_tc_ingress not in status")
}

/// The filter's program id, from `tc filter show` (`... bpf ... id N ...`).
fn filter_program_id(listing: &str) -> Option<u32> {
    let mut words = listing.split_whitespace();
    while let Some(w) = words.next() {
        if w == "id" {
            return words.next()?.parse().ok();
        }
    }
    None
}

fn pinned_program_id(loaded: &Loaded) -> Result<u32> {
    let status = loaded.status()?;
    let id = status["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "sidestep_tc_ingress")
        .and_then(|p| p["id"].as_u64())
        .context("sidestep_tc_ingress not in status")?;
    Ok(u32::try_from(id)?)
}

#[test]
fn netlink_filters_capture_survive_exit_and_upgrade_and_unload_leaves_nothing() -> Result<()> {
    if skip_unless_root(
        "netlink_filters_capture_survive_exit_and_upgrade_and_unload_leaves_nothing",
    ) {
        return Ok(());
    }
    let forced = kernel_has_tcx();
    if forced {
        // SAFETY: the only test of this binary sets it before it starts any thread of its own;
        // every `sidestep` it runs inherits it.
        unsafe { std::env::set_var("SIDESTEP_TC_ATTACH", "netlink") };
    }
    let env = TestEnv::new("tc-netlink")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let outsider = node.add_pod("outsider")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &["--inbound-hook", "tc"])?;
    loaded.enroll(&server, &["--inbound-hook", "tc"])?;

    let status = loaded.status()?;
    ensure!(
        status["kernel"]["tc_attach"] == "netlink",
        "forced={forced}: the loader attaches with {}",
        status["kernel"]
    );
    // The filter is where the record says, in direct-action mode at sidestep's priority, and
    // runs the pinned program; the `sidestep enroll` that put it there has exited.
    let record = env
        .pin_root()
        .join("links/tc")
        .join(server.netns_cookie()?.to_string())
        .join("eth0");
    ensure!(record.exists(), "no record at {}", record.display());
    let filters = tc(&env, &server, &["filter", "show", "dev", "eth0", "ingress"])?;
    ensure!(
        filters.contains(TC_FILTER_NAME)
            && filters.contains("direct-action")
            && filters.contains("pref 21248"),
        "tc filter show: {filters}"
    );
    ensure!(
        filter_program_id(&filters) == Some(pinned_program_id(&loaded)?),
        "the filter runs another program: {filters}"
    );

    // Fail closed before the sidecar is up, and captured through it after.
    let body = nginx::body_for("server");
    let v4 = url(server.ipv4.into(), 80, "/");
    let v6 = url(server.ipv6.context("no IPv6")?.into(), 80, "/");
    ensure!(
        http_get(&env, &outsider, APP_UID, &v4).is_err(),
        "reached the app around the proxy"
    );
    let _client_proxy = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let server_proxy = haproxy::Sidecar::start(&env, &server, Default::default())?;
    let stats = StatsEnabled::enable()?;
    let runs_before = tc_ingress_runs(&loaded)?;
    ensure!(http_get(&env, &client, APP_UID, &v4)? == body);
    ensure!(http_get(&env, &outsider, APP_UID, &v6)? == body);
    server_proxy.wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    let runs = tc_ingress_runs(&loaded)? - runs_before;
    ensure!(runs > 0, "the tc filter never ran");

    // An upgrade (load over the same pin root) points the same filter at the new program, in
    // place: no second filter, and capture goes on.
    let old_id = pinned_program_id(&loaded)?;
    sidestep(&[
        "load",
        "--cgroup",
        &env.cgroup_path().display().to_string(),
        "--pin-root",
        &env.pin_root().display().to_string(),
    ])?;
    let new_id = pinned_program_id(&loaded)?;
    ensure!(new_id != old_id, "the upgrade kept program {old_id}");
    let filters = tc(&env, &server, &["filter", "show", "dev", "eth0", "ingress"])?;
    ensure!(
        filter_program_id(&filters) == Some(new_id),
        "after the upgrade the filter runs {:?}, the pinned program is {new_id}: {filters}",
        filter_program_id(&filters)
    );
    ensure!(
        filters.matches(&format!("name {TC_FILTER_NAME}")).count() == 1,
        "more than one filter after the upgrade: {filters}"
    );
    ensure!(http_get(&env, &outsider, APP_UID, &v4)? == body);
    drop(stats);

    // Unenrolling one pod takes its filter and its qdisc; unload takes the rest.
    loaded.unenroll(&client)?;
    let client_qdiscs = tc(&env, &client, &["qdisc", "show", "dev", "eth0"])?;
    ensure!(
        !client_qdiscs.contains("clsact"),
        "clsact left on the unenrolled client: {client_qdiscs}"
    );
    loaded.unload()?;
    for pod in [&server, &client] {
        let filters = tc(&env, pod, &["filter", "show", "dev", "eth0", "ingress"])?;
        let qdiscs = tc(&env, pod, &["qdisc", "show", "dev", "eth0"])?;
        ensure!(
            filters.trim().is_empty() && !qdiscs.contains("clsact"),
            "{} after unload: filters {filters:?}, qdiscs {qdiscs:?}",
            pod.name
        );
    }
    let status: Value = serde_json::from_slice(
        &sidestep(&[
            "status",
            "--json",
            "--pin-root",
            &env.pin_root().display().to_string(),
        ])?
        .stdout,
    )?;
    ensure!(status["loaded"] == false, "{status}");
    Ok(())
}
