//! `cargo xtask demo`: a local node with pods. sidestep is loaded into the demo's own cgroup and
//! pin root; two meshed clients and a meshed server are made by the real CNI chain (bridge +
//! host-local, portmap, then sidestep-cni, run as libcni runs them), so they are enrolled at CNI
//! ADD from their pod annotations, as a kubelet would have them. Each gets an unmodified HAProxy
//! sidecar; traffic is sent; every claim is checked; CNI DEL and the teardown are checked too.
//! The exit code is non-zero when any check fails.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;
use sidestep_tests::{
    Node, NodeOptions, Pod, PodOptions, TestEnv, haproxy, link_exists, nginx,
    sidestep::{Loaded, sidestep},
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;
const REQUESTS: usize = 50;
/// What istio-sidecar-injector writes on a pod it injected; sidestep-cni enrols on it.
const ISTIO_STATUS: &str =
    r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

struct Line {
    what: String,
    ok: usize,
    total: usize,
    note: String,
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

fn counter(loaded: &Loaded, pod: &Pod, name: &str) -> Result<u64> {
    loaded
        .counters(pod.netns_cookie()?)?
        .and_then(|c| c[name].as_u64())
        .with_context(|| format!("no counter {name} for {}", pod.name))
}

fn enrolled(loaded: &Loaded) -> Result<Vec<u64>> {
    Ok(loaded.status()?["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["netns_cookie"].as_u64())
        .collect())
}

fn run(lines: &mut Vec<Line>) -> Result<Made> {
    let env = TestEnv::new("demo")?;
    let loaded = Loaded::load(&env)?;
    println!(
        "loaded sidestep into {} (pins under {})",
        env.cgroup_path().display(),
        env.pin_root().display()
    );
    let state_dir = env.tmp_dir().join("cni-state");
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack: true,
            chain: sidestep_tests::sidestep::cni_chain(loaded.pin_root(), &state_dir),
            plugin_dirs: vec![sidestep_tests::sidestep::cni_plugin_dir(&env)?],
        },
    )?;
    let made = Made {
        env_id: env.id().to_owned(),
        pin_root: env.pin_root().to_owned(),
        cgroup: env.cgroup_path().to_owned(),
        bridge: node.bridge().to_owned(),
        tmp: env.tmp_dir().to_owned(),
    };
    println!(
        "CNI network {}: bridge + host-local, portmap, sidestep-cni",
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
    let now = enrolled(&loaded)?;
    lines.push(Line {
        what: "pods enrolled by sidestep-cni at CNI ADD".into(),
        ok: cookies.iter().filter(|c| now.contains(c)).count(),
        total: pods.len(),
        note: "from the sidecar.istio.io/status annotation".into(),
    });

    let _web = nginx::Server::start(&env, &server, 80)?;
    let body = nginx::body_for("server-1");
    let mut sidecars = Vec::new();
    for pod in &pods {
        sidecars.push(haproxy::Sidecar::start(&env, pod, Default::default())?);
    }

    // IPv4 only: HAProxy 2.6 takes an IPv6 destination from getsockname, never from
    // IP6T_SO_ORIGINAL_DST, so it cannot follow an IPv6 REDIRECT (sidestep's or iptables').
    let target = url(server.ipv4.into(), 80, "/");
    let first = lines.len();
    for (i, client) in clients.iter().enumerate() {
        let ok = requests(&env, client, &target, &body)?;
        lines.push(Line {
            what: format!("{} -> server-1:80 (IPv4)", client.name),
            ok,
            total: REQUESTS,
            note: String::new(),
        });
        // The client's sidecar logged each forwarded connection with its original destination.
        sidecars[i].wait_log(&[&format!("{}:80", server.ipv4)], Duration::from_secs(5))?;
    }
    let redirected: u64 = clients
        .iter()
        .map(|c| counter(&loaded, c, "redirected_outbound"))
        .sum::<Result<u64>>()?;
    let hits: u64 = clients
        .iter()
        .map(|c| counter(&loaded, c, "orig_dst_hits"))
        .sum::<Result<u64>>()?;
    let inbound = counter(&loaded, &server, "redirected_inbound")?;
    let sent = (clients.len() * REQUESTS) as u64;
    for line in &mut lines[first..] {
        line.note = "via both sidecars".into();
    }
    lines.push(Line {
        what: "outbound redirects / original-dst answers".into(),
        ok: redirected.min(hits).min(sent) as usize,
        total: sent as usize,
        note: format!("redirected {redirected}, SO_ORIGINAL_DST hits {hits}"),
    });
    lines.push(Line {
        what: "inbound sk_assign to server-1's sidecar".into(),
        ok: inbound.min(sent) as usize,
        total: sent as usize,
        note: format!("redirected inbound {inbound}"),
    });

    // Capture is real: with client-1's sidecar gone, its requests cannot leave the pod.
    sidecars[0].child().kill()?;
    let leaked = requests(&env, &clients[0], &target, &body)?;
    lines.push(Line {
        what: "client-1 with its sidecar stopped".into(),
        ok: REQUESTS - leaked,
        total: REQUESTS,
        note: "blocked, as capture must".into(),
    });

    let pin_root = env.pin_root().display().to_string();
    let status = sidestep(&["status", "--pin-root", &pin_root])?;
    println!("\n{}", String::from_utf8_lossy(&status.stdout));
    drop(sidecars);

    // CNI DEL through the chain, in reverse: enrolment, tc links and records go.
    for pod in &pods {
        node.remove_pod(pod)?;
    }
    let now = enrolled(&loaded)?;
    let tc = loaded.pin_root().join("links/tc");
    let records = std::fs::read_dir(&state_dir)
        .map(|d| d.flatten().filter(|e| e.path().is_file()).count())
        .unwrap_or(0);
    let clean = pods
        .iter()
        .zip(&cookies)
        .filter(|(pod, cookie)| {
            !now.contains(cookie)
                && !tc.join(cookie.to_string()).exists()
                && !state_dir
                    .join(format!("{}@eth0.json", pod.container_id))
                    .exists()
        })
        .count();
    lines.push(Line {
        what: "CNI DEL: enrolment, tc links, records gone".into(),
        ok: if records == 0 { clean } else { 0 },
        total: pods.len(),
        note: format!("{} pods enrolled, {records} records left", now.len()),
    });
    loaded.unload()?;
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
