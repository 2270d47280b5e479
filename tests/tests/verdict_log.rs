//! The per-pod verdict log (`sidestep debug`, annotation `sidestep.io/debug`): off, a pod's
//! decisions leave no line; on, every connect and inbound SYN is reported with its outcome and
//! the istio-iptables rule that decided it, read back through aya-log from the pinned programs.
//! Needs root; skips otherwise.

use std::time::Duration;

use anyhow::{Result, ensure};
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv, nginx, sidestep::Loaded,
    sidestep::sidestep, sidestep::sidestep_bin, skip_unless_root,
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// A connect from `pod` as `uid`; its outcome does not matter, only the decision it causes.
fn connect(env: &TestEnv, pod: &Pod, uid: u32, target: &str) -> Result<()> {
    pod.run(
        env,
        uid,
        &[probe(), "connect", target, "--timeout-ms", "300"],
    )
    .map(drop)
}

fn debug(loaded: &Loaded, pod: &Pod, on: bool) -> Result<()> {
    let root = loaded.pin_root().display().to_string();
    let netns = pod.netns_path().display().to_string();
    let mut args = vec!["debug", "--pin-root", &root, "--netns", &netns];
    if !on {
        args.push("--off");
    }
    sidestep(&args).map(drop)
}

fn lines_about(follower: &ChildGuard, cookie: u64) -> usize {
    let prefix = format!("netns {cookie}:");
    follower
        .stdout()
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .count()
}

#[test]
fn verdict_log_reports_each_decision_of_a_pod_with_debug_on() -> Result<()> {
    if skip_unless_root("verdict_log_reports_each_decision_of_a_pod_with_debug_on") {
        return Ok(());
    }
    let env = TestEnv::new("verdictlog")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &["--inbound-hook", "sk_lookup"])?;
    loaded.enroll(&server, &["--inbound-hook", "sk_lookup"])?;
    let (client_cookie, server_cookie) = (client.netns_cookie()?, server.netns_cookie()?);
    let root = loaded.pin_root().display().to_string();
    let bin = sidestep_bin().display().to_string();
    let argv = [bin.as_str(), "debug", "--pin-root", &root, "--follow"];
    let follower = env.spawn(Spawn::new(&argv).outside_cgroup())?;

    // Off (the default): decisions happen, no line appears.
    let server_v4 = format!("{}:80", server.ipv4);
    connect(&env, &client, APP_UID, &server_v4)?;
    std::thread::sleep(Duration::from_secs(1));
    ensure!(
        lines_about(&follower, client_cookie) + lines_about(&follower, server_cookie) == 0,
        "lines with the log off:\n{}",
        follower.stdout()
    );

    // On: the app's connect is redirected by the last include rule, the proxy's passes by its UID.
    debug(&loaded, &client, true)?;
    connect(&env, &client, APP_UID, &server_v4)?;
    let app_line = format!(
        "netns {client_cookie}: connect to {server_v4} by uid {APP_UID}: redirected to the \
         outbound port (rule 13: includeOutboundIPRanges)"
    );
    follower.wait_stdout(&[&app_line], Duration::from_secs(5))?;
    connect(&env, &client, PROXY_UID, &server_v4)?;
    let server_v6 = format!("[{}]:80", server.ipv6.expect("dual-stack pod"));
    connect(&env, &client, APP_UID, &server_v6)?;
    follower.wait_stdout(
        &[
            &format!("connect to {server_v4} by uid {PROXY_UID}: passed (rule 5: proxy UID)"),
            &format!("connect to {server_v6} by uid {APP_UID}: redirected to the outbound port"),
        ],
        Duration::from_secs(5),
    )?;

    // Inbound, on the server: the SYN to a captured port with no proxy listening is refused,
    // and the log says so rather than leaving the operator with a timeout.
    debug(&loaded, &server, true)?;
    connect(&env, &client, PROXY_UID, &server_v4)?;
    follower.wait_stdout(
        &[&format!(
            "netns {server_cookie}: inbound connection to {server_v4}: refused (rule 203:"
        )],
        Duration::from_secs(5),
    )?;

    // Off again: no more lines for the client.
    debug(&loaded, &client, false)?;
    let before = lines_about(&follower, client_cookie);
    connect(&env, &client, APP_UID, &server_v4)?;
    std::thread::sleep(Duration::from_secs(1));
    ensure!(
        lines_about(&follower, client_cookie) == before,
        "lines after --off:\n{}",
        follower.stdout()
    );
    let status = loaded.status()?;
    ensure!(
        status.to_string().contains("debug-log"),
        "status names the server's log flag: {status}"
    );
    drop(follower);
    loaded.unload()
}

#[test]
fn debug_refuses_a_netns_that_is_not_enrolled() -> Result<()> {
    if skip_unless_root("debug_refuses_a_netns_that_is_not_enrolled") {
        return Ok(());
    }
    let env = TestEnv::new("verdictlog-refuse")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let bystander = node.add_pod("bystander")?;
    let loaded = Loaded::load(&env)?;
    let root = loaded.pin_root().display().to_string();
    let netns = bystander.netns_path().display().to_string();
    let err = sidestep(&["debug", "--pin-root", &root, "--netns", &netns])
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    ensure!(err.contains("is not enrolled"), "{err}");
    loaded.unload()
}
