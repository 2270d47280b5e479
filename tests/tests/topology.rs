//! Smoke tests of the test topology itself: node, pods, nginx, HAProxy, and full cleanup.
//! Needs root; skips otherwise. The tests run in parallel, so they also show that two
//! topologies in one process do not collide.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use sidestep_tests::haproxy::{Sidecar, SidecarConfig};
use sidestep_tests::{
    Node, NodeOptions, TestEnv, http_get, link_exists, netns, nginx, skip_unless_root, tcp_connect,
    url,
};

const APP_UID: u32 = 1000;

/// What a topology left on the host, to check after it is dropped.
struct Traces {
    id: String,
    cgroup: PathBuf,
    bridge: String,
}

fn netns_of(id: &str) -> Result<Vec<String>> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .context("ip netns list")?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(id))
        .map(str::to_owned)
        .collect())
}

fn assert_cleaned(t: &Traces) -> Result<()> {
    let left = netns_of(&t.id)?;
    ensure!(left.is_empty(), "netns left behind: {left:?}");
    ensure!(!link_exists(&t.bridge), "bridge {} left behind", t.bridge);
    ensure!(
        !t.cgroup.exists(),
        "cgroup {} left behind",
        t.cgroup.display()
    );
    let pins = Path::new("/sys/fs/bpf").join(format!("sidestep-test-{}", t.id));
    ensure!(!pins.exists(), "pin root {} left behind", pins.display());
    Ok(())
}

fn smoke(name: &str, dual_stack: bool) -> Result<()> {
    let env = TestEnv::new(name)?;
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack,
            ..Default::default()
        },
    )?;
    let traces = Traces {
        id: env.id().to_owned(),
        cgroup: env.cgroup_path().to_owned(),
        bridge: node.bridge().to_owned(),
    };
    ensure!(env.cgroup_path().is_dir());
    ensure!(link_exists(node.bridge()));

    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    ensure!(
        server.ipv6.is_some() == dual_stack,
        "server ipv6: {:?}",
        server.ipv6
    );
    ensure!(node.subnet_v4().contains(&server.ipv4));
    ensure!(netns_of(env.id())?.len() == 2);

    let web = nginx::Server::start(&env, &server, 80)?;
    let sidecar = Sidecar::start(&env, &client, SidecarConfig::default())?;
    ensure!(sidecar.ipv6() == netns::ipv6_enabled(&client.netns_path));

    // Pod to pod, as an app UID, over each family.
    let body = http_get(&env, &client, APP_UID, &url(server.ipv4.into(), 80, "/"))?;
    ensure!(body == web.body(), "IPv4 body {body:?}");
    ensure!(body == "hello from server\n");
    if let Some(v6) = server.ipv6 {
        let body = http_get(&env, &client, APP_UID, &url(v6.into(), 80, "/"))?;
        ensure!(body == web.body(), "IPv6 body {body:?}");
        let who = http_get(&env, &client, APP_UID, &url(v6.into(), 80, "/whoami"))?;
        let want = format!("remote={}:", client.ipv6.context("client ipv6")?);
        ensure!(who.starts_with(&want), "whoami over IPv6: {who:?}");
    }
    let who = http_get(
        &env,
        &client,
        APP_UID,
        &url(server.ipv4.into(), 80, "/whoami"),
    )?;
    ensure!(
        who.starts_with(&format!("remote={}:", client.ipv4)),
        "whoami: {who:?}"
    );
    ensure!(web.access_log().contains(&client.ipv4.to_string()));

    // The sidecar's outbound listener is reachable inside the client pod. Nothing redirected
    // the connection, so its original destination is the listener itself: the loop guard
    // logs and closes it.
    tcp_connect(&client, sidecar.outbound_v4(), Duration::from_secs(2))?;
    let mut guarded = vec!["dst=127.0.0.1:15001 be=loop_guard"];
    if sidecar.ipv6() {
        let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 15001);
        tcp_connect(&client, v6, Duration::from_secs(2))?;
        guarded.push("dst=::1:15001 be=loop_guard");
    }
    sidecar.wait_log(&guarded, Duration::from_secs(5))?;

    // Processes run as the requested UID, in the pod's netns, in (or outside) the test cgroup.
    let cg_name = format!("sidestep-test-{}", env.id());
    let out = client.run(
        &env,
        APP_UID,
        &["sh", "-c", "id -u; id -G; cat /proc/self/cgroup"],
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{out:?}");
    let mut lines = text.lines();
    ensure!(
        lines.next() == Some("1000") && lines.next() == Some("1000"),
        "ids: {text}"
    );
    ensure!(text.contains(&cg_name), "not in the test cgroup: {text}");
    let out = client.run_outside_cgroup(&env, APP_UID, &["cat", "/proc/self/cgroup"])?;
    ensure!(!String::from_utf8_lossy(&out.stdout).contains(&cg_name));
    let addrs = client.ip(&["-br", "addr", "show", "dev", "eth0"])?;
    ensure!(addrs.contains(&client.ipv4.to_string()), "{addrs}");
    ensure!(client.netns_cookie()? != server.netns_cookie()?);

    // Drop in the documented order, checking that each layer cleans up after itself.
    drop(sidecar);
    drop(web);
    drop(node);
    ensure!(
        netns_of(&traces.id)?.is_empty(),
        "netns left after node drop"
    );
    ensure!(!link_exists(&traces.bridge), "bridge left after node drop");
    ensure!(
        traces.cgroup.exists(),
        "cgroup must live as long as the env"
    );
    drop(env);
    assert_cleaned(&traces)
}

#[test]
fn dual_stack_topology() -> Result<()> {
    if skip_unless_root("dual_stack_topology") {
        return Ok(());
    }
    smoke("topo-dual", true)
}

#[test]
fn ipv4_topology() -> Result<()> {
    if skip_unless_root("ipv4_topology") {
        return Ok(());
    }
    smoke("topo-v4", false)
}

/// A test that panics halfway still leaves nothing behind: no netns, bridge, cgroup, pins or
/// processes.
#[test]
fn cleanup_after_panic() -> Result<()> {
    if skip_unless_root("cleanup_after_panic") {
        return Ok(());
    }
    let mut traces = None;
    let mut pids = Vec::new();
    let res = catch_unwind(AssertUnwindSafe(|| {
        let env = TestEnv::new("topo-panic").unwrap();
        let node = Node::new(&env, NodeOptions::dual_stack()).unwrap();
        traces = Some(Traces {
            id: env.id().to_owned(),
            cgroup: env.cgroup_path().to_owned(),
            bridge: node.bridge().to_owned(),
        });
        let pod = node.add_pod("lonely").unwrap();
        let web = nginx::Server::start(&env, &pod, 8080).unwrap();
        pids.push(web.pid());
        // Something the guards do not know about: only the cgroup kill catches it.
        let stray = pod
            .spawn(&env, sidestep_tests::Spawn::new(&["sleep", "1000"]))
            .unwrap();
        pids.push(stray.pid());
        std::mem::forget(stray);
        std::fs::create_dir_all(env.pin_root().join("sub")).ok();
        panic!("deliberate panic with a live topology");
    }));
    ensure!(res.is_err(), "the closure should have panicked");
    let traces = traces.context("topology was not built")?;
    assert_cleaned(&traces)?;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Gone, or a zombie waiting for this process to reap it.
        ensure!(
            stat.is_empty() || stat.contains(") Z "),
            "process {pid} survived: {stat}"
        );
    }
    Ok(())
}

/// Runs a command line (split on whitespace) as root in `pod`, failing on a non-zero exit.
fn root_cmd(env: &TestEnv, pod: &sidestep_tests::Pod, line: &str) -> Result<()> {
    let argv: Vec<&str> = line.split_whitespace().collect();
    let out = pod.run_outside_cgroup(env, 0, &argv)?;
    ensure!(
        out.status.success(),
        "`{line}` in {}: {}",
        pod.name,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The HAProxy sidecar behaves like Envoy under istio-iptables: with plain iptables REDIRECT
/// (a minimal Istio ruleset) an app's request goes app -> client sidecar (outbound, to the
/// original destination) -> server pod -> server sidecar (inbound, from 127.0.0.6 / ::6) ->
/// nginx. This checks the sidecar config that the sidestep tests rely on. Over IPv6 HAProxy
/// cannot follow REDIRECT (see [`sidestep_tests::haproxy`]); the test pins that down too.
#[test]
fn sidecar_with_iptables_redirect() -> Result<()> {
    if skip_unless_root("sidecar_with_iptables_redirect") {
        return Ok(());
    }
    let env = TestEnv::new("topo-ipt")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let web = nginx::Server::start(&env, &server, 80)?;
    let cfg = SidecarConfig::default();
    let client_proxy = Sidecar::start(&env, &client, cfg)?;
    let server_proxy = Sidecar::start(&env, &server, cfg)?;
    for (ipt, lo) in [("iptables", "127.0.0.0/8"), ("ip6tables", "::1/128")] {
        let owner = "-m owner ! --uid-owner 1337";
        root_cmd(
            &env,
            &client,
            &format!(
                "{ipt} -w -t nat -A OUTPUT -p tcp ! -d {lo} {owner} -j REDIRECT --to-ports 15001"
            ),
        )?;
        root_cmd(
            &env,
            &server,
            &format!(
                "{ipt} -w -t nat -A PREROUTING -p tcp --dport 80 -j REDIRECT --to-ports 15006"
            ),
        )?;
    }
    let v4 = http_get(
        &env,
        &client,
        APP_UID,
        &url(server.ipv4.into(), 80, "/whoami"),
    )?;
    ensure!(
        v4.starts_with("remote=127.0.0.6:"),
        "inbound v4 source: {v4:?}"
    );
    ensure!(v4.contains(&format!("local={}:80", server.ipv4)), "{v4:?}");
    let body = http_get(&env, &client, APP_UID, &url(server.ipv4.into(), 80, "/"))?;
    ensure!(body == web.body());
    let c4 = client.ipv4;
    let s4 = server.ipv4;
    client_proxy.wait_log(
        &[
            &format!("outbound client={c4}:"),
            &format!("dst={s4}:80 be=outbound_orig"),
        ],
        Duration::from_secs(5),
    )?;
    server_proxy.wait_log(
        &[
            &format!("inbound client={c4}:"),
            &format!("dst={s4}:80 be=inbound_orig"),
        ],
        Duration::from_secs(5),
    )?;

    // HAProxy 2.6 reads the original destination of IPv6 connections with getsockname only,
    // never IP6T_SO_ORIGINAL_DST, so after an ip6tables REDIRECT it sees its own listener and
    // the loop guard closes the connection instead of looping.
    let server6 = server.ipv6.context("server ipv6")?;
    let res = http_get(&env, &client, APP_UID, &url(server6.into(), 80, "/whoami"));
    ensure!(
        res.is_err(),
        "HAProxy followed an ip6tables REDIRECT?: {res:?}"
    );
    client_proxy.wait_log(&["dst=::1:15001 be=loop_guard"], Duration::from_secs(5))?;
    ensure!(!client_proxy.log().contains(&server6.to_string()));
    Ok(())
}

/// Plugins chained after `bridge` run with `prevResult` on ADD and DEL, as sidestep-cni will.
#[test]
fn chained_plugin() -> Result<()> {
    if skip_unless_root("chained_plugin") {
        return Ok(());
    }
    let env = TestEnv::new("topo-chain")?;
    let tuning = serde_json::json!({ "type": "tuning", "sysctl": { "net.core.somaxconn": "321" } });
    let node = Node::new(
        &env,
        NodeOptions {
            chain: vec![tuning],
            ..NodeOptions::dual_stack()
        },
    )?;
    let pod = node.add_pod("tuned")?;
    ensure!(netns::get_sysctl(&pod.netns_path, "net.core.somaxconn")? == "321");
    // tuning passes prevResult through, so the pod IPs still come from the bridge's result.
    ensure!(node.subnet_v4().contains(&pod.ipv4) && pod.ipv6.is_some());
    node.remove_pod(&pod)?;
    ensure!(!pod.netns_path.exists());
    ensure!(node.pods().is_empty());
    Ok(())
}
