//! `cargo xtask demo`: a local node with pods, run by the node agent as a cluster would run it.
//!
//! `sidestep agent` starts on the demo's own cgroup and pin root (never the cgroup2 root), loads
//! the programs, installs the plugin into the demo's CNI bin directory and chains its entry into
//! the demo's primary conflist (bridge + host-local, portmap), as it does on a node. Two meshed
//! clients and a meshed server are then made by that CNI chain, as libcni runs it, so they are
//! enrolled at CNI ADD from their pod annotations. Each gets an unmodified HAProxy sidecar;
//! traffic is sent; every claim is checked, the agent's /metrics included; CNI DEL,
//! `sidestep uninstall` and the teardown are checked too, and everything is removed also when a
//! step fails. The exit code is non-zero when any check fails.

// A binary's modules would be found beside it in src/bin/ and be taken for binaries themselves,
// hence the explicit path.
#[path = "sidestep-demo/agent.rs"]
mod agent;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use sidestep_tests::{
    Node, NodeOptions, Pod, PodOptions, TestEnv, haproxy, link_exists, nginx, sidestep::sidestep,
    skip_unless_root, url,
};

use agent::{
    AgentProc, Dirs, Uninstall, capture, check_agent, counter, enrolled, sidestep_entries,
};

const APP_UID: u32 = 1000;
const REQUESTS: usize = 50;
/// What istio-sidecar-injector writes on a pod it injected; sidestep-cni enrols on it.
const ISTIO_STATUS: &str =
    r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
/// The primary network's file, as the node's CNI (here bridge + host-local) would write it.
const PRIMARY: &str = "10-demo.conflist";

struct Line {
    what: String,
    ok: usize,
    total: usize,
    note: String,
}

impl Line {
    fn new(what: impl Into<String>, ok: usize, total: usize, note: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            ok,
            total,
            note: note.into(),
        }
    }
}

/// What the demo made on the host, to check after everything is dropped.
struct Made {
    env_id: String,
    pin_root: PathBuf,
    cgroup: PathBuf,
    bridge: String,
    tmp: PathBuf,
}

fn requests(env: &TestEnv, pod: &Pod, target: &str, expect: &str) -> Result<usize> {
    // One curl process sends every request; `Connection: close` makes each a new connection.
    let mut argv = vec![
        "curl",
        "-sS",
        "--max-time",
        "5",
        "-H",
        "Connection: close",
        "-w",
        "\n",
    ];
    for _ in 0..REQUESTS {
        argv.push(target);
    }
    let out = pod.run(env, APP_UID, &argv)?;
    Ok(String::from_utf8_lossy(&out.stdout).matches(expect).count())
}

fn run(lines: &mut Vec<Line>) -> Result<Made> {
    let env = TestEnv::new("demo")?;
    let t = env.tmp_dir();
    let d = Dirs {
        bin: t.join("cni-bin"),
        conf: t.join("net.d"),
        state: t.join("cni-state"),
    };
    for p in [&d.bin, &d.conf] {
        std::fs::create_dir_all(p)?;
    }
    // The primary CNI's configuration; its bridge entry stands for the node's network, which
    // the demo's Node sets up (bridge name and subnet of its own).
    std::fs::write(
        d.conf.join(PRIMARY),
        serde_json::to_vec_pretty(&json!({
            "cniVersion": "1.0.0", "name": "demo-net",
            "plugins": [{"type": "bridge"},
                        {"type": "portmap", "capabilities": {"portMappings": true}, "snat": false}]
        }))?,
    )?;
    // Dropped in reverse order: pods (Node), then the agent, then the uninstall, then the env.
    let mut uninstall = Uninstall {
        args: d.agent_args(&env),
        done: false,
    };
    let mut agent = AgentProc::start(&env, &d)?;
    let chain = check_agent(&d, &mut agent, lines)?;
    let pin_root = env.pin_root().to_path_buf();
    println!(
        "the agent loaded sidestep into {} (pins under {})",
        env.cgroup_path().display(),
        pin_root.display()
    );
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack: true,
            chain,
            // The binary the agent installed, found by its type as libcni finds it.
            plugin_dirs: vec![d.bin.clone()],
        },
    )?;
    let made = Made {
        env_id: env.id().to_owned(),
        pin_root: pin_root.clone(),
        cgroup: env.cgroup_path().to_owned(),
        bridge: node.bridge().to_owned(),
        tmp: env.tmp_dir().to_owned(),
    };
    println!(
        "CNI network {}: bridge + host-local, then the agent's chain",
        node.network()
    );
    // Pods as a kubelet makes them after Istio's injector: the status annotation, passed by the
    // runtime in runtimeConfig.
    let meshed = PodOptions {
        namespace: "demo".into(),
        runtime_config: Some(json!({
            "io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": ISTIO_STATUS}
        })),
        ..Default::default()
    };
    let clients = [
        node.add_pod_with("client-1", meshed.clone())?,
        node.add_pod_with("client-2", meshed.clone())?,
    ];
    let server = node.add_pod_with("server-1", meshed)?;
    let pods: Vec<_> = clients.iter().chain([&server]).cloned().collect();
    let cookies = pods
        .iter()
        .map(|p| p.netns_cookie())
        .collect::<Result<Vec<u64>>>()?;
    let now = enrolled(&pin_root)?;
    lines.push(Line::new(
        "pods enrolled by sidestep-cni at CNI ADD",
        cookies.iter().filter(|c| now.contains(c)).count(),
        pods.len(),
        "from the sidecar.istio.io/status annotation",
    ));

    let _web = nginx::Server::start(&env, &server, 80)?;
    let body = nginx::body_for("server-1");
    let mut sidecars = Vec::new();
    for pod in &pods {
        sidecars.push(haproxy::Sidecar::start(&env, pod, Default::default())?);
    }

    // IPv4 only: HAProxy 2.6 takes an IPv6 destination from getsockname, never from
    // IP6T_SO_ORIGINAL_DST, so it cannot follow an IPv6 REDIRECT (sidestep's or iptables').
    let target = url(server.ipv4.into(), 80, "/");
    for (i, client) in clients.iter().enumerate() {
        let ok = requests(&env, client, &target, &body)?;
        lines.push(Line::new(
            format!("{} -> server-1:80 (IPv4)", client.name),
            ok,
            REQUESTS,
            "via both sidecars",
        ));
        // The client's sidecar logged each forwarded connection with its original destination.
        sidecars[i].wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    }
    let redirected: u64 = clients
        .iter()
        .map(|c| counter(&pin_root, c, "redirected_outbound"))
        .sum::<Result<u64>>()?;
    let hits: u64 = clients
        .iter()
        .map(|c| counter(&pin_root, c, "orig_dst_hits"))
        .sum::<Result<u64>>()?;
    let inbound = counter(&pin_root, &server, "redirected_inbound")?;
    let sent = (clients.len() * REQUESTS) as u64;
    lines.push(Line::new(
        "outbound redirects / original-dst answers",
        redirected.min(hits).min(sent) as usize,
        sent as usize,
        format!("redirected {redirected}, SO_ORIGINAL_DST hits {hits}"),
    ));
    lines.push(Line::new(
        "inbound sk_assign to server-1's sidecar",
        inbound.min(sent) as usize,
        sent as usize,
        format!("redirected inbound {inbound}"),
    ));
    // The agent's /metrics shows the same per-pod counters.
    let samples = agent.samples()?;
    let from_metrics: f64 = samples
        .iter()
        .filter(|(k, _)| k.starts_with("sidestep_pod_redirected_outbound_total{"))
        .map(|(_, v)| v)
        .sum();
    lines.push(Line::new(
        "agent /metrics: outbound redirects",
        usize::from(from_metrics >= redirected as f64),
        1,
        format!("sidestep_pod_redirected_outbound_total sums to {from_metrics}"),
    ));

    capture(&agent, "with pods running, after the traffic")?;

    // Capture is real: with client-1's sidecar gone, its requests cannot leave the pod.
    sidecars[0].child().kill()?;
    let leaked = requests(&env, &clients[0], &target, &body)?;
    lines.push(Line::new(
        "client-1 with its sidecar stopped",
        REQUESTS - leaked,
        REQUESTS,
        "blocked, as capture must",
    ));

    let st = sidestep(&["status", "--pin-root", &pin_root.display().to_string()])?;
    println!("\n{}", String::from_utf8_lossy(&st.stdout));
    drop(sidecars);

    // CNI DEL through the chain, in reverse: enrolment, per-pod links and records go.
    for pod in &pods {
        node.remove_pod(pod)?;
    }
    let now = enrolled(&pin_root)?;
    let tc = pin_root.join("links/tc");
    let lookup = pin_root.join("links/sklookup");
    let records = std::fs::read_dir(&d.state)
        .map(|r| {
            r.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                .count()
        })
        .unwrap_or(0);
    let clean = pods
        .iter()
        .zip(&cookies)
        .filter(|(pod, cookie)| {
            !now.contains(cookie)
                && !tc.join(cookie.to_string()).exists()
                && !lookup.join(cookie.to_string()).exists()
                && !d
                    .state
                    .join(format!("{}@eth0.json", pod.container_id))
                    .exists()
        })
        .count();
    lines.push(Line::new(
        "CNI DEL: enrolment, per-pod links, records gone",
        if records == 0 { clean } else { 0 },
        pods.len(),
        format!("{} pods enrolled, {records} records left", now.len()),
    ));

    // The plugin's ADDs and DELs as the agent counts and times them.
    let n = pods.len() as f64;
    let key = |m: &str, cmd: &str| format!(r#"{m}{{command="{cmd}",result="ok"}}"#);
    let mut seen = (0.0, 0.0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let s = agent.samples()?;
        let get = |k: String| s.get(&k).copied().unwrap_or(0.0);
        seen = (
            get(key("sidestep_cni_operations_total", "ADD")),
            get(key("sidestep_cni_operations_total", "DEL")),
        );
        if seen == (n, n) {
            let h = "sidestep_cni_operation_duration_seconds";
            let mean = |cmd| {
                get(key(&format!("{h}_sum"), cmd)) / get(key(&format!("{h}_count"), cmd)) * 1e3
            };
            println!(
                "plugin time as the agent reports it: ADD mean {:.1} ms, DEL mean {:.1} ms",
                mean("ADD"),
                mean("DEL")
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    lines.push(Line::new(
        "agent /metrics: plugin ADDs and DELs",
        (seen.0.min(n) + seen.1.min(n)) as usize * usize::from(seen == (n, n)),
        2 * pods.len(),
        format!(
            "sidestep_cni_operations_total: ADD {}, DEL {}",
            seen.0, seen.1
        ),
    ));
    capture(&agent, "after every pod's DEL")?;
    drop(node);

    // Stopping the agent leaves capture in place; `sidestep uninstall` drains, and with every
    // pod of the demo gone the drain has nothing to wait for: it removes it all. Only the demo's
    // own netns count as pods (this machine runs others).
    agent.child.terminate(Duration::from_secs(10))?;
    drop(agent);
    let prefix = format!("sidestep-{}-", env.id());
    let out = uninstall.run(&["--netns-prefix", &prefix, "--scan-proc", "false"])?;
    print!("\nsidestep uninstall:\n{out}");
    let entries = sidestep_entries(&d.conf.join(PRIMARY))?
        .iter()
        .filter(|p| p["type"] == "sidestep")
        .count();
    let gone = [
        entries == 0,
        !d.bin.join("sidestep").exists(),
        !pin_root.exists(),
        !d.state.exists(),
    ];
    lines.push(Line::new(
        "uninstall: conflist entry, binary, pins, state",
        gone.iter().filter(|g| **g).count(),
        gone.len(),
        "",
    ));
    Ok(made)
}

/// What is still on the host from the demo once everything was dropped.
fn leftovers(made: &Made) -> Vec<String> {
    let mut left = Vec::new();
    let prefix = format!("sidestep-{}-", made.env_id);
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        left.extend(
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .map(|n| format!("netns {n}")),
        );
    }
    if link_exists(&made.bridge) {
        left.push(format!("bridge {}", made.bridge));
    }
    for (what, p) in [
        ("cgroup", &made.cgroup),
        ("pin root", &made.pin_root),
        ("scratch dir", &made.tmp),
    ] {
        if Path::new(p).exists() {
            left.push(format!("{what} {}", p.display()));
        }
    }
    left
}

fn main() -> ExitCode {
    if skip_unless_root("the demo") {
        return ExitCode::FAILURE;
    }
    let mut lines = Vec::new();
    let result = run(&mut lines);
    let mut all_ok = result.is_ok();
    if let Ok(made) = &result {
        let left = leftovers(made);
        lines.push(Line {
            what: "teardown: netns, bridge, cgroup, pins, scratch".into(),
            ok: 5usize.saturating_sub(left.len()),
            total: 5,
            note: if left.is_empty() {
                "all removed".into()
            } else {
                format!("left: {}", left.join(", "))
            },
        });
    }
    println!("sidestep demo report");
    for l in &lines {
        let ok = l.ok == l.total;
        all_ok &= ok;
        println!(
            "  [{}] {:<46} {:>3}/{:<3} {}",
            if ok { "ok" } else { "FAIL" },
            l.what,
            l.ok,
            l.total,
            l.note
        );
    }
    if let Err(e) = &result {
        eprintln!("demo failed: {e:#}");
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
