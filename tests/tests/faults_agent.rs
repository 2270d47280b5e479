//! Faults of the node agent, with the real `sidestep agent` in the test's cgroup and pin root.
//! Needs root.
//!
//! - The agent SIGKILLed at each step of a first load, and of an adopt/upgrade over pins that
//!   serve an enrolled pod (`SIDESTEP_FAILPOINT`): the pod's capture holds while the agent is
//!   dead (its connects are still redirected), and the restarted agent ends with exactly the pins
//!   of a clean load, every link (cgroup and per pod) running a pinned program of the right name.
//! - Pins deleted behind the agent, and its (private) bpffs unmounted: reported (log, /readyz,
//!   `sidestep_reconcile_errors`), reloaded, and the recorded pod enrolled again and redirected.
//! - Damaged state records: the agent starts, names each file, and keeps serving.
//! - A plugin killed in the middle of ADD: the reconcile undoes the half-done enrolment.

mod agent_support;

use std::{
    collections::BTreeMap,
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use agent_support::{APP_UID, Agent, Dirs, base_args, free_port, meshed, object_b};
use anyhow::{Context, Result, bail, ensure};
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv,
    faults::{Plugin, bpftool},
    parity::Listeners,
    sidestep::{bin_dir, sidestep},
    skip_unless_root,
};

const LOAD_POINTS: [&str; 7] = [
    "load:after-maps",
    "load:after-sk-msg",
    "load:after-pod-programs",
    "load:mid-links",
    "load:after-links",
    "agent:after-load",
    "agent:after-install",
];

const UPGRADE_POINTS: [&str; 7] = [
    "load:after-maps",
    "load:after-sk-msg",
    "load:after-pod-programs",
    "upgrade:mid-pod-links",
    "load:mid-links",
    "load:after-links",
    "agent:after-load",
];

fn start(env: &TestEnv, args: &[String], port: u16, failpoint: Option<&str>) -> Result<Agent> {
    let bin = bin_dir().join("sidestep").display().to_string();
    let mut argv: Vec<&str> = vec![&bin];
    argv.extend(args.iter().map(String::as_str));
    let mut vars = vec![
        ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
        ("KUBERNETES_SERVICE_PORT", "6443"),
    ];
    if let Some(f) = failpoint {
        vars.push(("SIDESTEP_FAILPOINT", f));
    }
    let child = env.spawn(Spawn::new(&argv).env(&vars))?;
    Ok(Agent {
        child,
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
    })
}

/// Starts the agent with `failpoint` armed and requires it to die there by SIGKILL.
fn killed_at(env: &TestEnv, args: &[String], port: u16, failpoint: &str) -> Result<()> {
    let mut a = start(env, args, port, Some(failpoint))?;
    let st = a
        .child
        .wait_timeout(Duration::from_secs(60))?
        .with_context(|| format!("agent with failpoint {failpoint} still runs:\n{}", a.log()))?;
    ensure!(
        st.signal() == Some(libc::SIGKILL) && a.log().contains(&format!("failpoint {failpoint}")),
        "agent with failpoint {failpoint} ended with {st}:\n{}",
        a.log()
    );
    Ok(())
}

/// Every pin under the root, and for each link pin the name of the program it runs; each of
/// those programs must be the one pinned under progs/ now.
fn layout(root: &Path) -> Result<BTreeMap<String, String>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                walk(&e.path(), out);
            } else {
                out.push(e.path());
            }
        }
    }
    let mut pins = Vec::new();
    walk(root, &mut pins);
    let mut pinned_progs = BTreeMap::new();
    for p in pins.iter().filter(|p| p.starts_with(root.join("progs"))) {
        let v = bpftool(&["prog", "show", "pinned", &p.display().to_string()])?;
        pinned_progs.insert(v["id"].as_u64().context("prog id")?, v["name"].clone());
    }
    let mut out = BTreeMap::new();
    for p in &pins {
        let rel = p.strip_prefix(root)?.display().to_string();
        let what = if p.starts_with(root.join("links")) {
            let v = bpftool(&["link", "show", "pinned", &p.display().to_string()])?;
            let id = v["prog_id"].as_u64().context("link prog id")?;
            // The identity programs are per pod and never pinned (docs/ARCHITECTURE.md).
            if p.starts_with(root.join("links/podid")) {
                let prog = bpftool(&["prog", "show", "id", &id.to_string()])?;
                ensure!(
                    prog["name"] == "sidestep_pod_id",
                    "{rel} runs {}, not an identity program",
                    prog["name"]
                );
                out.insert(rel, "runs sidestep_pod_id".into());
                continue;
            }
            let name = pinned_progs.get(&id).with_context(|| {
                format!("{rel} runs program {id}, which is not pinned (pinned: {pinned_progs:?})")
            })?;
            format!("runs {name}")
        } else {
            "pinned".into()
        };
        out.insert(rel, what);
    }
    Ok(out)
}

fn status(root: &Path) -> Result<serde_json::Value> {
    let out = sidestep(&[
        "status",
        "--json",
        "--pin-root",
        &root.display().to_string(),
    ])?;
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn enrolled_cookies(root: &Path) -> Result<Vec<u64>> {
    Ok(status(root)?["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["netns_cookie"].as_u64())
        .collect())
}

fn redirected(root: &Path, cookie: u64) -> Result<u64> {
    let s = status(root)?;
    s["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["netns_cookie"].as_u64() == Some(cookie))
        .and_then(|p| p["counters"]["redirected_outbound"].as_u64())
        .context("pod not enrolled")
}

/// The pod's app opens a connection; its capture must redirect it (nothing listens on the
/// proxy port, so the connect itself fails: only the counter matters).
fn expect_redirect(env: &TestEnv, root: &Path, pod: &Pod, cookie: u64, what: &str) -> Result<()> {
    let before = redirected(root, cookie).with_context(|| what.to_owned())?;
    let _ = pod.run(
        env,
        APP_UID,
        &["bash", "-c", "exec 3<>/dev/tcp/192.0.2.10/8080"],
    );
    let after = redirected(root, cookie)?;
    ensure!(
        after > before,
        "{what}: the app's connect was not redirected ({before} -> {after})"
    );
    Ok(())
}

#[test]
fn agent_killed_at_each_step_of_load_adopt_and_upgrade_converges() -> Result<()> {
    if skip_unless_root("agent_killed_at_each_step_of_load_adopt_and_upgrade_converges") {
        return Ok(());
    }
    let env = TestEnv::new("faults-agent")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let args = base_args(&env, &d, port);
    let root = env.pin_root().to_path_buf();
    let root_arg = root.display().to_string();

    let mut a = start(&env, &args, port, None)?;
    a.wait_ready(Duration::from_secs(30))?;
    let fresh = layout(&root)?;
    a.child.kill()?;
    // A pod the runtime adds while the agent lies dead half-way through a load.
    let bare = Node::new(&env, NodeOptions::ipv4_only())?;
    let early = bare.add_pod_with("early", meshed())?;
    let plugin = Plugin::with_entry(&env, d.entry("10-test.conflist")?);
    for point in LOAD_POINTS {
        sidestep(&["unload", "--pin-root", &root_arg])?;
        killed_at(&env, &args, port, point)?;
        // Never enrolled into a half-attached data path: "try again later" (CNI code 11)
        // until every cgroup link is in place.
        let out = plugin.run("ADD", &early, None)?;
        let complete = fresh
            .keys()
            .filter(|k| !k.starts_with("links/tc") && !k.starts_with("links/sklookup"))
            .all(|k| root.join(k).exists());
        eprintln!(
            "ADD after a kill at {point}: {}",
            if out.status.success() {
                "enrolled (load was complete)"
            } else {
                "try again later"
            }
        );
        if out.status.success() {
            ensure!(
                complete,
                "ADD succeeded after a kill at {point} with pins missing"
            );
            plugin.ok("DEL", &early)?;
        } else {
            let err: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            ensure!(
                err["code"] == 11 && !complete,
                "ADD after a kill at {point}: {err}"
            );
        }
        let mut a = start(&env, &args, port, None)?;
        a.wait_ready(Duration::from_secs(30))
            .with_context(|| format!("restart after a kill at {point}"))?;
        let now = layout(&root)?;
        ensure!(
            now == fresh,
            "after a kill at {point}:\n want {fresh:?}\n have {now:?}"
        );
        a.child.kill()?;
    }

    // Adopt and upgrade over a running pod.
    let mut a = start(&env, &args, port, None)?;
    a.wait_ready(Duration::from_secs(30))?;
    let node = d.node(&env, "10-test.conflist")?;
    let pod = node.add_pod_with("app", meshed())?;
    // A second pod, so that an upgrade killed between per-pod links (upgrade:mid-pod-links)
    // leaves one link on each program.
    let other = node.add_pod_with("other", meshed())?;
    let cookie = pod.netns_cookie()?;
    ensure!(
        enrolled_cookies(&root)?.contains(&cookie)
            && enrolled_cookies(&root)?.contains(&other.netns_cookie()?),
        "pods not enrolled"
    );
    expect_redirect(&env, &root, &pod, cookie, "before any upgrade")?;
    let with_pod = layout(&root)?;
    // The plugin's default inbound hook: each netns's sk_lookup link.
    ensure!(
        with_pod
            .keys()
            .filter(|k| k.starts_with("links/sklookup/"))
            .count()
            == 2,
        "the pods have no per-pod links: {with_pod:?}"
    );
    a.child.kill()?;
    let b = object_b(&env)?;
    let mut args_b = args.clone();
    args_b.extend(["--bpf-object".into(), b.display().to_string()]);
    for (i, point) in UPGRADE_POINTS.into_iter().enumerate() {
        // Alternate A -> B and B -> A: every round is an upgrade to other bytes.
        let next = if i % 2 == 0 { &args_b } else { &args };
        killed_at(&env, next, port, point)?;
        // The agent is dead half-way through; the pod is still captured.
        expect_redirect(
            &env,
            &root,
            &pod,
            cookie,
            &format!("agent killed at {point}"),
        )?;
        let mut a = start(&env, next, port, None)?;
        a.wait_ready(Duration::from_secs(30))
            .with_context(|| format!("restart after an upgrade killed at {point}"))?;
        let now = layout(&root)?;
        ensure!(
            now == with_pod,
            "after an upgrade killed at {point}:\n want {with_pod:?}\n have {now:?}"
        );
        expect_redirect(
            &env,
            &root,
            &pod,
            cookie,
            &format!("restarted after {point}"),
        )?;
        a.child.kill()?;
    }
    drop(node);
    Ok(())
}

/// A private bpffs instance for the test's pin root, unmounted on drop (never the host's).
struct PrivateBpffs(PathBuf);

impl PrivateBpffs {
    fn mount(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        nix::mount::mount(
            Some("bpffs"),
            dir,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            Some("mode=0700"),
        )
        .with_context(|| format!("mount -t bpf bpffs {}", dir.display()))?;
        Ok(Self(dir.to_path_buf()))
    }

    fn mounted(&self) -> bool {
        std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| {
            m.lines()
                .any(|l| l.split(' ').nth(4) == Some(&self.0.display().to_string()))
        })
    }

    fn unmount(&self) -> Result<()> {
        nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH)
            .with_context(|| format!("umount {}", self.0.display()))
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        if self.mounted()
            && let Err(e) = self.unmount()
        {
            eprintln!("{e:#}");
        }
    }
}

/// Waits until the agent's log holds `needle` at least `n` times.
fn wait_log_count(a: &mut Agent, needle: &str, n: usize, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while a.log().matches(needle).count() < n {
        a.child.ensure_running()?;
        if Instant::now() >= deadline {
            bail!("fewer than {n} {needle:?} in the agent log:\n{}", a.log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Removes the pins (or unmounts them) and requires detection, report and repair.
fn expect_repair(
    env: &TestEnv,
    root: &Path,
    a: &mut Agent,
    pod: &Pod,
    cookie: u64,
    round: usize,
    break_it: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let errors = a.metric("sidestep_reconcile_errors")?;
    break_it()?;
    // Not ready from the moment the pins are gone until the reconcile reloaded them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut saw_not_ready = None;
    while Instant::now() < deadline {
        if let Ok((503, body)) = a.get("/readyz") {
            saw_not_ready = Some(body);
            break;
        }
        if a.log().matches("the data path lost its pins").count() >= round {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let body = saw_not_ready.context("/readyz never reported the missing pins")?;
    ensure!(
        body.contains("pins are missing") || body.contains("not loaded"),
        "{body}"
    );
    wait_log_count(
        a,
        "the data path lost its pins",
        round,
        Duration::from_secs(20),
    )?;
    let body = a.wait_ready(Duration::from_secs(20))?;
    wait_log_count(
        a,
        "enrolled again from its record",
        round,
        Duration::from_secs(20),
    )?;
    // Counted when the reconcile that logged it returns: a moment later on a slow machine.
    agent_support::wait_until(
        "the reload counted in sidestep_reconcile_errors",
        sidestep_tests::scaled(Duration::from_secs(5)),
        || Ok(a.metric("sidestep_reconcile_errors")? > errors),
    )?;
    ensure!(
        enrolled_cookies(root)?.contains(&cookie),
        "pod not enrolled again: {body}"
    );
    expect_redirect(env, root, pod, cookie, &format!("repair {round}"))?;
    Ok(())
}

#[test]
fn agent_repairs_lost_pins_and_reports_damaged_state() -> Result<()> {
    if skip_unless_root("agent_repairs_lost_pins_and_reports_damaged_state") {
        return Ok(());
    }
    let env = TestEnv::new("faults-pins")?;
    let bpffs = PrivateBpffs::mount(env.pin_root())?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let pin_root = env.pin_root().join("pins");
    let root = pin_root.clone();
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    let at = args
        .iter()
        .position(|a| a == "--pin-root")
        .context("--pin-root")?
        + 1;
    args[at] = pin_root.display().to_string();
    args.extend(["--reconcile-interval".into(), "2s".into()]);

    // Damaged records from an earlier life of the node.
    std::fs::create_dir_all(&d.state)?;
    let damaged = [
        ("garbage@eth0.json", Some(&b"\x00{{not json"[..])),
        ("empty@eth0.json", Some(&b""[..])),
        (
            "future@eth0.json",
            Some(&br#"{"format": 99, "netnsCookie": 1}"#[..]),
        ),
        ("dir@eth0.json", None),
    ];
    for (name, body) in damaged {
        match body {
            Some(b) => std::fs::write(d.state.join(name), b)?,
            None => std::fs::create_dir(d.state.join(name))?,
        }
    }
    let mut a = start(&env, &args, port, None)?;
    a.wait_ready(Duration::from_secs(30))?;
    for (name, _) in damaged {
        a.wait_log(
            &d.state.join(name).display().to_string(),
            Duration::from_secs(10),
        )?;
    }
    ensure!(a.metric("sidestep_reconcile_errors")? >= damaged.len() as f64);

    let node = d.node(&env, "10-test.conflist")?;
    let pod = node.add_pod_with("app", meshed())?;
    let cookie = pod.netns_cookie()?;
    expect_redirect(&env, &root, &pod, cookie, "after ADD")?;

    // A plugin killed half-way through ADD: the reconcile undoes it; the retry enrols.
    let bare = Node::new(&env, NodeOptions::ipv4_only())?;
    let half = bare.add_pod_with("half", meshed())?;
    let plugin = Plugin::with_entry(&env, d.entry("10-test.conflist")?);
    plugin.killed("ADD", &half, "enroll:after-links")?;
    let half_cookie = half.netns_cookie()?;
    // The kill left the pod enrolled; the agent may undo that before this look (it did under
    // TCG on 6.12), so its log line counts too.
    ensure!(
        enrolled_cookies(&root)?.contains(&half_cookie)
            || a.log().contains("undid a half-done ADD"),
        "the killed ADD left no enrolment"
    );
    a.wait_log("undid a half-done ADD", Duration::from_secs(10))?;
    ensure!(
        !enrolled_cookies(&root)?.contains(&half_cookie)
            && !plugin.record_path(&half).exists()
            && !pin_root.join(format!("links/tc/{half_cookie}")).exists()
            && !pin_root
                .join(format!("links/sklookup/{half_cookie}"))
                .exists(),
        "the half-done ADD was not undone"
    );
    plugin.ok("ADD", &half)?;
    ensure!(enrolled_cookies(&root)?.contains(&half_cookie));
    plugin.ok("DEL", &half)?;

    // A garbage record and the netns gone before DEL: DEL cannot name the cookie (it exits 0
    // and says so); the kernel can: the pod's sk_lookup link lost its netns.
    let lost = bare.add_pod_with("lost", meshed())?;
    plugin.ok("ADD", &lost)?;
    let lost_cookie = lost.netns_cookie()?;
    std::fs::write(plugin.record_path(&lost), b"\x00garbage")?;
    bare.remove_pod(&lost)?;
    let out = plugin.ok("DEL", &lost)?;
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("neither the netns nor the damaged record"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    a.wait_log(
        "garbage-collected an enrolment no record names",
        Duration::from_secs(20),
    )?;
    ensure!(
        !enrolled_cookies(&root)?.contains(&lost_cookie)
            && !pin_root.join(format!("links/tc/{lost_cookie}")).exists()
            && !pin_root
                .join(format!("links/sklookup/{lost_cookie}"))
                .exists(),
        "the lost pod's enrolment was not collected"
    );

    // A proxy listening on 15006 since before the reloads: the sk_lookup hook the ADD chose
    // knows it from its listen(2) into maps the reload replaces; the re-enrolment's tc finds it.
    let mut proxy = Listeners::default();
    let inbound_addr = std::net::SocketAddr::from(([0, 0, 0, 0], 15006));
    proxy.start(
        &env,
        env!("CARGO_BIN_EXE_probe"),
        Some(&pod),
        1337,
        1337,
        &[inbound_addr],
        |p| p.to_string(),
    )?;
    expect_inbound(&mut proxy, &pod, "before the reloads")?;
    expect_repair(&env, &pin_root, &mut a, &pod, cookie, 1, || {
        std::fs::remove_dir_all(&pin_root).context("deleting the pins")
    })?;
    expect_repair(&env, &pin_root, &mut a, &pod, cookie, 2, || bpffs.unmount())?;
    // Only one per-pod entries map lost: the pod stays in the pod map, but its entries there
    // went with the map, so the reconcile must enrol it again all the same. The port rules
    // (its excluded ports), and the source map, as a pin root from a version without it looks
    // after an upgrade (its captured connections would come from loopback until it restarts).
    for (round, map, what) in [
        (3, "SIDESTEP_PORTS", "port rules"),
        (4, "SIDESTEP_SRC", "source addresses"),
    ] {
        let path = pin_root.join("maps").join(map);
        expect_repair(&env, &pin_root, &mut a, &pod, cookie, round, || {
            std::fs::remove_file(&path).with_context(|| format!("deleting {map}'s pin"))
        })?;
        let entries = bpftool(&["map", "dump", "pinned", &path.display().to_string()])?;
        ensure!(
            entries.as_array().is_some_and(|e| !e.is_empty()),
            "the pod's {what} were not written again: {entries}"
        );
    }
    expect_inbound(&mut proxy, &pod, "after the reloads")?;
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(plugin.record_path(&pod))?)?;
    ensure!(
        record["policy"]["inboundHook"] == "tc"
            && pin_root.join(format!("links/tc/{cookie}/eth0")).exists(),
        "re-enrolled without the tc hook: {record}"
    );
    drop((bare, node));
    Ok(())
}

/// A connection from the node to the pod's app port reaches the proxy's 15006 listener.
fn expect_inbound(proxy: &mut Listeners, pod: &Pod, what: &str) -> Result<()> {
    let to = std::net::SocketAddr::from((pod.ipv4, 8080));
    let conn = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3))
        .with_context(|| format!("{what}: connect to {to}"))?;
    let got = proxy.take(Duration::from_secs(3))?;
    drop(conn);
    ensure!(
        got.len() == 1 && got[0].listener == "15006",
        "{what}: inbound to {to} was not captured: {got:?}"
    );
    Ok(())
}
