//! The agent's default cgroup is the node's cgroup2 root, and it refuses to start where the
//! cgroup2 mount it finds is not that root, instead of attaching, going ready and capturing no
//! pod:
//! - in a private cgroup namespace (a container without `--cgroupns=host`): the agent runs in
//!   the test's cgroup, unshares its cgroup namespace there and remounts cgroup2, so the mount
//!   mountinfo names is that cgroup, shown as `/`;
//! - under a cgroup2 mount that shows a subtree (the test's cgroup bind-mounted over the mount
//!   point), in the initial namespace.
//!
//! It exits naming the problem and the fix, /readyz never answers, nothing is pinned. With
//! `cgroup` set, the same private namespace starts, and attaches where it was told (the test's
//! cgroup, reached through the node's hierarchy bind-mounted into the namespace, as
//! deploy/configmap.yaml does with /host/sys/fs/cgroup). Needs root.
//!
//! Never the real root: had the agent accepted the private view or the subtree, that would
//! have been the test's own cgroup too.

mod agent_support;

use std::{path::Path, time::Duration};

use agent_support::{Agent, Dirs, base_args, free_port, refuses};
use anyhow::{Context as _, Result, ensure};
use sidestep_tests::{TestEnv, cgroup::cgroup2_mount, skip_unless_root};

/// `sh -c SCRIPT sh MOUNT VIEW program args...`: the script's mounts, then exec of the agent.
fn wrapped(script: &str, mount: &Path, view: &Path, agent_args: &[String]) -> Vec<String> {
    let bin = sidestep_tests::sidestep::bin_dir().join("sidestep");
    let mut v: Vec<String> = vec![
        "sh".into(),
        "-c".into(),
        format!(
            "set -e; {script}; echo \"view: $(grep ^0:: /proc/self/cgroup)\" >&2; shift 2; exec \"$@\""
        ),
        "sh".into(),
        mount.display().to_string(),
        view.display().to_string(),
        bin.display().to_string(),
    ];
    v.extend(agent_args.iter().cloned());
    v
}

/// Drops `--cgroup VALUE` from the test agent's flags: the default is under test.
fn without_cgroup(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--cgroup" {
            it.next();
        } else {
            out.push(a.clone());
        }
    }
    out
}

#[test]
fn agent_refuses_a_cgroup_that_is_not_the_nodes_root() -> Result<()> {
    if skip_unless_root("agent_refuses_a_cgroup_that_is_not_the_nodes_root") {
        return Ok(());
    }
    let env = TestEnv::new("agent-cgroupns")?;
    // The agent's private mount namespace would see no bpffs of the host's, and refuse to mount
    // its own.
    sidestep_tests::env::ensure_host_bpffs()?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let mount = cgroup2_mount()?;
    let view = env.tmp_dir().join("host-cgroup");
    std::fs::create_dir(&view)?;
    let port = free_port()?;
    let args = base_args(&env, &d, port);

    // A private cgroup namespace rooted at the test's cgroup (where env spawns the process),
    // and a private mount namespace in which the node's hierarchy stays reachable at `view`
    // and cgroup2 is mounted again at the mount point mountinfo names, as a runtime does.
    let private = |agent_args: &[String]| {
        let mut v: Vec<String> = ["--cgroup", "--mount", "--propagation", "private", "--"]
            .map(String::from)
            .to_vec();
        v.extend(wrapped(
            // The kernel refuses cgroup2 straight onto a cgroup2 mount (EBUSY): a tmpfs between.
            r#"mount --bind "$1" "$2"; mount -t tmpfs none "$1"; mount -t cgroup2 none "$1""#,
            &mount,
            &view,
            agent_args,
        ));
        v
    };
    let mut agent = Agent::start_program(&env, "unshare", &private(&without_cgroup(&args)), port)?;
    let log = refuses(
        &env,
        &mut agent,
        &[
            "setting cgroup",
            "private cgroup namespace",
            "SIDESTEP_CGROUP",
            "--cgroupns=host",
        ],
    )?;
    ensure!(log.contains("view: 0::/\n"), "not a private view:\n{log}");
    eprintln!(
        "private cgroup namespace: {}",
        log.lines().last().unwrap_or_default()
    );

    // The same namespace with cgroup named through the node's hierarchy: it starts, and its
    // links are on the test's cgroup.
    let name = env
        .cgroup_path()
        .file_name()
        .context("test cgroup name")?
        .to_owned();
    let mut explicit = without_cgroup(&args);
    explicit.extend(["--cgroup".into(), view.join(&name).display().to_string()]);
    let mut agent = Agent::start_program(&env, "unshare", &private(&explicit), port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let ns = std::fs::metadata(format!("/proc/{}/ns/cgroup", agent.child.pid()))?;
    ensure!(
        std::os::unix::fs::MetadataExt::ino(&ns) != 0xEFFF_FFFB,
        "the agent is in the initial cgroup namespace"
    );
    let status = agent_support::status(&env)?;
    let cgroups: Vec<&str> = status["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["cgroup"].as_str())
        .collect();
    let want = env.cgroup_path().display().to_string();
    ensure!(
        cgroups.len() >= 10 && cgroups.iter().all(|c| *c == want),
        "links attached at {cgroups:?}, want {want}"
    );
    eprintln!(
        "explicit cgroup in the private namespace: {} links on {want}",
        cgroups.len()
    );
    agent.child.terminate(Duration::from_secs(10))?;
    agent_support::uninstall(&env, &d)?;

    // The initial namespace, with the test's cgroup bind-mounted over the cgroup2 mount point:
    // mountinfo shows the subtree, and the agent says so.
    let subtree = [
        "--mount".to_string(),
        "--propagation".into(),
        "private".into(),
        "--".into(),
    ]
    .into_iter()
    .chain(wrapped(
        &format!(r#"mount --bind "$1/{}" "$1""#, name.to_string_lossy()),
        &mount,
        &view,
        &without_cgroup(&args),
    ))
    .collect::<Vec<_>>();
    let mut agent = Agent::start_program(&env, "unshare", &subtree, port)?;
    refuses(
        &env,
        &mut agent,
        &[
            "setting cgroup",
            &format!("shows the subtree /{}", name.to_string_lossy()),
            "SIDESTEP_CGROUP",
        ],
    )?;
    Ok(())
}
