//! Permissions (issue 7): with the agent running at the test's own pin root and a meshed pod
//! enrolled through the CNI chain, a process as UID/GID 65534 (no groups, no capabilities) can
//! neither read nor change any map, program, link or pin, nor any state record, nor the
//! kubeconfig the agent writes for the plugin. Every mode is checked too, so that the result does
//! not rest on one guard alone (bpffs mounted 0700, or unprivileged bpf(2) being off on this
//! host): pin directories and the state directory are root's and 0700, pins and records 0600,
//! the kubeconfig 0600. Needs root.

mod agent_support;

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::Duration,
};

use agent_support::{Dirs, enrolled_cookies, meshed};
use anyhow::{Context, Result, ensure};
use sidestep_tests::{Spawn, TestEnv, sidestep::bin_dir, skip_unless_root};

/// `nobody` on Debian; any UID without a home in the test's files would do.
const NOBODY: u32 = 65534;
const RUN_TIMEOUT: Duration = Duration::from_secs(20);

/// Every path under `root` (itself included) with its owner and permission bits.
fn tree(root: &Path) -> Result<BTreeMap<PathBuf, (u32, u32, bool)>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(p) = todo.pop() {
        let m = fs::symlink_metadata(&p).with_context(|| format!("stat {}", p.display()))?;
        if m.is_dir() {
            for e in fs::read_dir(&p)? {
                todo.push(e?.path());
            }
        }
        out.insert(p, (m.uid(), m.mode() & 0o7777, m.is_dir()));
    }
    Ok(out)
}

/// The tree without the invocation log, which the agent reads and rotates while it runs.
fn records_only(t: BTreeMap<PathBuf, (u32, u32, bool)>) -> BTreeMap<PathBuf, (u32, u32, bool)> {
    t.into_iter()
        .filter(|(p, _)| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("timings"))
        })
        .collect()
}

/// Runs `argv` as `uid` in the host's namespaces, outside the test cgroup. Returns whether it
/// succeeded, and its stdout and stderr.
fn run_as(env: &TestEnv, uid: u32, argv: &[&str]) -> Result<(bool, String)> {
    let out = env.run(
        Spawn::new(argv).user(uid, uid).outside_cgroup(),
        RUN_TIMEOUT,
    )?;
    Ok((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

/// A read: it must work as root, which shows the command itself is right, and fail as NOBODY.
/// The root run is tried up to three times: a whole-system walk (`bpftool link show`) fails now
/// and then when another test removes a link under it.
fn read_denied(env: &TestEnv, argv: &[&str], failures: &mut Vec<String>) -> Result<()> {
    let (mut root_ok, mut root_text) = run_as(env, 0, argv)?;
    for _ in 0..2 {
        if root_ok {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        (root_ok, root_text) = run_as(env, 0, argv)?;
    }
    ensure!(
        root_ok,
        "`{}` fails even as root: {root_text}",
        argv.join(" ")
    );
    let (ok, text) = run_as(env, NOBODY, argv)?;
    if ok {
        failures.push(format!(
            "`{}` as {NOBODY} succeeded: {}",
            argv.join(" "),
            text.trim()
        ));
    }
    Ok(())
}

/// A change, which cannot be tried as root first: it must fail as NOBODY, for want of
/// permission. bpftool reports a path it may not search as "directory not in bpf file system"
/// under "bpf obj get"; the pin exists (the reads showed it), so that too is a refusal.
fn change_denied(env: &TestEnv, argv: &[&str], failures: &mut Vec<String>) -> Result<()> {
    let (ok, text) = run_as(env, NOBODY, argv)?;
    let lower = text.to_lowercase();
    let refused = [
        "permission denied",
        "operation not permitted",
        "needs root",
        "bpf obj get",
    ]
    .iter()
    .any(|w| lower.contains(w));
    if ok || !refused {
        failures.push(format!(
            "`{}` as {NOBODY}: {} ({})",
            argv.join(" "),
            if ok {
                "succeeded"
            } else {
                "failed, but not for permission"
            },
            text.trim()
        ));
    }
    Ok(())
}

#[test]
fn non_root_can_neither_read_nor_change_pins_records_or_kubeconfig() -> Result<()> {
    if skip_unless_root("non_root_can_neither_read_nor_change_pins_records_or_kubeconfig") {
        return Ok(());
    }
    let env = TestEnv::new("perm")?;
    let d = Dirs::new(&env)?;
    let (mut agent, node) = d.ready_agent_and_node(&env)?;
    let pod = node.add_pod_with("web", meshed())?;
    let cookie = pod.netns_cookie()?;
    ensure!(enrolled_cookies(&env)? == [cookie]);

    let pin_root = env.pin_root().to_path_buf();
    let state_dir = PathBuf::from(
        d.entry("10-test.conflist")?["state_dir"]
            .as_str()
            .context("the agent's entry names no state_dir")?,
    );
    let kubeconfig = d.kubeconfig();
    let records: Vec<PathBuf> = tree(&state_dir)?
        .into_iter()
        .filter(|(p, (_, _, dir))| !dir && p.extension().is_some_and(|e| e == "json"))
        .map(|(p, _)| p)
        .collect();
    ensure!(
        records.len() == 1,
        "state records in {}: {records:?}",
        state_dir.display()
    );
    let record = &records[0];
    let record_text = fs::read(record)?;

    // Modes: nothing under the pin root or the state directory is open to group or others.
    let mut failures = Vec::new();
    let pins = tree(&pin_root)?;
    for (dir, tag) in [("maps", "maps"), ("progs", "programs"), ("links", "links")] {
        ensure!(
            pins.keys().any(|p| p.parent() == Some(&pin_root.join(dir))),
            "no {tag} pinned under {}",
            pin_root.display()
        );
    }
    ensure!(
        pins.keys()
            .any(|p| p == &pin_root.join("links/sklookup").join(cookie.to_string())),
        "the pod's sk_lookup link is not pinned"
    );
    let state_tree = tree(&state_dir)?;
    for (p, (uid, mode, dir)) in pins.iter().chain(&state_tree) {
        if *uid != 0 || mode & 0o077 != 0 {
            failures.push(format!(
                "{} ({}) is owned by {uid} with mode {mode:o}",
                p.display(),
                if *dir { "directory" } else { "file" }
            ));
        }
    }
    let st = fs::metadata(&state_dir)?;
    ensure!(
        st.mode() & 0o7777 == 0o700,
        "state dir mode {:o}",
        st.mode() & 0o7777
    );
    let kc = fs::metadata(&kubeconfig)?;
    if kc.uid() != 0 || kc.mode() & 0o7777 != 0o600 {
        failures.push(format!(
            "kubeconfig {} is owned by {} with mode {:o}",
            kubeconfig.display(),
            kc.uid(),
            kc.mode() & 0o7777
        ));
    }

    // Behaviour: each read or change as NOBODY is refused.
    let s = |p: &Path| p.display().to_string();
    let pod_map = s(&pin_root.join("maps/SIDESTEP_POD"));
    let sidestep = s(&bin_dir().join("sidestep"));
    let netns = s(pod.netns_path());
    let (pin, state, rec, kcs) = (s(&pin_root), s(&state_dir), s(record), s(&kubeconfig));
    let forged = format!("echo '{{}}' > {state}/forged@eth0.json");
    let append = format!("echo 'users: []' >> {kcs}");
    let key = ["key", "hex", "01", "00", "00", "00", "00", "00", "00", "00"];
    let mut update = vec!["bpftool", "map", "delete", "pinned", &pod_map];
    update.extend(key);
    let update = update;
    let reads: [&[&str]; 9] = [
        &["ls", &pin],
        &["stat", &pod_map],
        &["bpftool", "map", "dump", "pinned", &pod_map],
        &["bpftool", "map", "show"],
        &["bpftool", "prog", "show"],
        &["bpftool", "link", "show"],
        &["ls", &state],
        &["cat", &rec],
        &["cat", &kcs],
    ];
    for argv in reads {
        read_denied(&env, argv, &mut failures)?;
    }
    let changes: [&[&str]; 7] = [
        &update,
        &["rm", "-rf", &pin],
        &[&sidestep, "unenroll", "--netns", &netns, "--pin-root", &pin],
        &["rm", "-f", &rec],
        &["sh", "-c", &forged],
        &["sh", "-c", &append],
        &["sh", "-c", &format!("echo x > {pin}/maps/forged")],
    ];
    for argv in changes {
        change_denied(&env, argv, &mut failures)?;
    }
    // `sidestep status` as NOBODY learns nothing, and says why instead of "not loaded".
    let status = [&*sidestep, "status", "--json", "--pin-root", &pin];
    let (_, root_view) = run_as(&env, 0, &status)?;
    ensure!(root_view.contains(&cookie.to_string()), "{root_view}");
    let (ok, view) = run_as(&env, NOBODY, &status)?;
    if ok || view.contains(&cookie.to_string()) || !view.contains("run `sidestep status` as root") {
        failures.push(format!(
            "`sidestep status` as {NOBODY} did not refuse clearly (exit ok: {ok}): {view}"
        ));
    }

    // Nothing changed: the same pins, the same records, the pod still enrolled.
    let after = (
        tree(&pin_root)?,
        records_only(tree(&state_dir)?),
        fs::read(record)?,
    );
    let before = (pins, records_only(state_tree), record_text);
    if after != before {
        let changed: Vec<String> = before
            .0
            .iter()
            .filter(|(p, v)| after.0.get(*p) != Some(*v))
            .map(|(p, _)| format!("pin {} changed or went", p.display()))
            .chain(
                after
                    .0
                    .keys()
                    .filter(|p| !before.0.contains_key(*p))
                    .map(|p| format!("pin {} appeared", p.display())),
            )
            .chain((after.1 != before.1).then(|| "the state directory's files".to_owned()))
            .chain((after.2 != before.2).then(|| {
                format!(
                    "the record: {}",
                    String::from_utf8_lossy(&after.2).replace('\n', " ")
                )
            }))
            .collect();
        failures.push(format!(
            "the pins or the state directory changed: {}",
            changed.join("; ")
        ));
    }
    if enrolled_cookies(&env)? != [cookie] {
        failures.push("the pod is no longer enrolled".into());
    }
    agent.child.ensure_running()?;
    ensure!(
        failures.is_empty(),
        "{} permission problems:\n{}",
        failures.len(),
        failures.join("\n")
    );
    node.remove_pod(&pod)?;
    Ok(())
}
