//! `cargo xtask demo`: a local node with pods. Two meshed clients and a meshed server, each with an
//! unmodified HAProxy sidecar, on a bridge made by the real CNI plugins; sidestep loaded into the
//! demo's own cgroup and pin root; traffic sent; every claim checked; everything removed.

use std::time::Duration;

use anyhow::{Context, Result};
use sidestep_tests::{
    Node, NodeOptions, Pod, TestEnv, haproxy, nginx, sidestep::Loaded, skip_unless_root, url,
};

const APP_UID: u32 = 1000;
const REQUESTS: usize = 50;

struct Line {
    what: String,
    ok: usize,
    total: usize,
    note: String,
}

fn requests(env: &TestEnv, pod: &Pod, target: &str, expect: &str) -> Result<usize> {
    // One curl process sends every request; `Connection: close` makes each a new connection.
    let mut argv = vec!["curl", "-sS", "--max-time", "5", "-H", "Connection: close", "-w", "\n"];
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

fn run() -> Result<Vec<Line>> {
    let env = TestEnv::new("demo")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let clients = [node.add_pod("client-1")?, node.add_pod("client-2")?];
    let server = node.add_pod("server-1")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let body = nginx::body_for("server-1");

    let loaded = Loaded::load(&env)?;
    println!(
        "loaded sidestep into {} (pins under {})",
        env.cgroup_path().display(),
        env.pin_root().display()
    );
    for pod in clients.iter().chain([&server]) {
        loaded.enroll(pod, &[])?;
    }
    let mut sidecars = Vec::new();
    for pod in clients.iter().chain([&server]) {
        sidecars.push(haproxy::Sidecar::start(&env, pod, Default::default())?);
    }

    let mut lines = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        // IPv4 only: HAProxy 2.6 takes an IPv6 destination from getsockname, never from
        // IP6T_SO_ORIGINAL_DST, so it cannot follow an IPv6 REDIRECT (sidestep's or iptables').
        for (family, ip) in [("IPv4", server.ipv4.into())] {
            let target = url(ip, 80, "/");
            let ok = requests(&env, client, &target, &body)?;
            lines.push(Line {
                what: format!("{} -> server-1:80 ({family})", client.name),
                ok,
                total: REQUESTS,
                note: String::new(),
            });
        }
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
    for line in &mut lines {
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
    let leaked = requests(&env, &clients[0], &url(server.ipv4.into(), 80, "/"), &body)?;
    lines.push(Line {
        what: "client-1 with its sidecar stopped".into(),
        ok: REQUESTS - leaked,
        total: REQUESTS,
        note: "blocked, as capture must".into(),
    });

    println!("\n{}", sidestep_tests::sidestep::sidestep(&[
        "status",
        "--pin-root",
        &env.pin_root().display().to_string(),
    ])
    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())?);
    drop(sidecars);
    loaded.unload()?;
    Ok(lines)
}

fn main() -> std::process::ExitCode {
    if skip_unless_root("the demo") {
        return std::process::ExitCode::FAILURE;
    }
    match run() {
        Ok(lines) => {
            println!("sidestep demo report");
            let mut all_ok = true;
            for l in &lines {
                let ok = l.ok == l.total;
                all_ok &= ok;
                println!(
                    "  [{}] {:<44} {:>3}/{:<3} {}",
                    if ok { "ok" } else { "FAIL" },
                    l.what,
                    l.ok,
                    l.total,
                    l.note
                );
            }
            println!("cleaned up: netns, bridge, cgroup, pins and links removed");
            if all_ok {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("demo failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
