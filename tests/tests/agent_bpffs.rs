//! The agent mounts bpffs itself only where the mount is the host's. A node without bpffs at
//! /sys/fs/bpf gives the DaemonSet's hostPath volume a plain directory; with the DaemonSet's
//! `mountPropagation: HostToContainer` a bpffs the agent mounted there would be its container's
//! alone, and every pin (every pod's capture) would go with the container. The agent refuses to
//! start instead, saying how to fix the DaemonSet or the host. Needs root.
//!
//! The test stands in for such a node with a mount namespace of its own (the "host"), where a
//! shared tmpfs hides whatever is at /sys/fs/bpf: a host without bpffs. The agent runs in a mount
//! namespace made from it as a runtime makes a container's, the tmpfs its hostPath:
//! - a slave of the host's (HostToContainer): the agent refuses, /readyz never answers, and
//!   nothing is mounted or pinned in the host's view;
//! - a peer of the host's (Bidirectional): the agent mounts bpffs, goes ready, and the host sees
//!   that bpffs and the pins in it, which outlive the agent.
//!
//! The real host's mounts are untouched: both namespaces are private copies, and everything they
//! mount goes with them when the test's processes end.

mod agent_support;

use std::{path::Path, time::Duration};

use agent_support::{Agent, Dirs, base_args, free_port, refuses};
use anyhow::{Context as _, Result, ensure};
use sidestep_tests::{ChildGuard, Spawn, TestEnv, skip_unless_root};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The stand-in host: a mount namespace whose /sys/fs/bpf is an empty shared tmpfs.
fn host_without_bpffs(env: &TestEnv) -> Result<ChildGuard> {
    let script = "mount -t tmpfs -o mode=0700 sidestep-no-bpffs /sys/fs/bpf \
                  && mount --make-shared /sys/fs/bpf && echo ready && exec sleep 3600";
    let host = env.spawn(Spawn::new(&[
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
    ]))?;
    host.wait_stdout(&["ready"], Duration::from_secs(10))?;
    Ok(host)
}

/// `/sys/fs/bpf` as the stand-in host sees it.
fn hosts_view(host: &ChildGuard) -> std::path::PathBuf {
    Path::new(&format!("/proc/{}/root", host.pid())).join("sys/fs/bpf")
}

fn fs_magic(path: &Path) -> Result<i64> {
    Ok(nix::sys::statfs::statfs(path)
        .with_context(|| format!("statfs {}", path.display()))?
        .filesystem_type()
        .0)
}

/// `nsenter` into the host's mount namespace, then a new one with `propagation`, then the agent.
fn in_container(host: &ChildGuard, propagation: &str, agent_args: &[String]) -> Vec<String> {
    let bin = sidestep_tests::sidestep::bin_dir().join("sidestep");
    let mut v: Vec<String> = [
        "--target",
        &host.pid().to_string(),
        "--mount",
        "--",
        "unshare",
        "--mount",
        "--propagation",
        propagation,
        "--",
    ]
    .map(String::from)
    .to_vec();
    v.push(bin.display().to_string());
    v.extend(agent_args.iter().cloned());
    v
}

#[test]
fn agent_refuses_a_bpffs_only_its_container_would_see() -> Result<()> {
    if skip_unless_root("agent_refuses_a_bpffs_only_its_container_would_see") {
        return Ok(());
    }
    let env = TestEnv::new("agent-bpffs")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let host = host_without_bpffs(&env)?;
    let view = hosts_view(&host);
    ensure!(
        fs_magic(&view)? != BPF_FS_MAGIC,
        "the stand-in host has bpffs"
    );
    let pin_name = env.pin_root().file_name().context("pin root name")?;
    let port = free_port()?;
    let args = base_args(&env, &d, port);

    // HostToContainer, the DaemonSet's propagation before this fix: refused.
    let mut agent =
        Agent::start_program(&env, "nsenter", &in_container(&host, "slave", &args), port)?;
    let log = refuses(
        &env,
        &mut agent,
        &[
            "no bpffs is mounted at /sys/fs/bpf",
            "is slave, as with mountPropagation: HostToContainer",
            "mountPropagation: Bidirectional",
            "mount -t bpf bpffs /sys/fs/bpf",
        ],
    )?;
    ensure!(
        fs_magic(&view)? != BPF_FS_MAGIC && !view.join(pin_name).exists(),
        "the refusing agent left a mount or pins in the host's view"
    );
    eprintln!(
        "HostToContainer: {}",
        log.lines().last().unwrap_or_default()
    );

    // Bidirectional: the agent's mount is the host's, and so are its pins.
    let mut agent = Agent::start_program(
        &env,
        "nsenter",
        &in_container(&host, "unchanged", &args),
        port,
    )?;
    agent.wait_ready(Duration::from_secs(30))?;
    ensure!(
        fs_magic(&view)? == BPF_FS_MAGIC,
        "the agent went ready, and the host has no bpffs:\n{}",
        agent.log()
    );
    let st = agent.child.terminate(Duration::from_secs(10))?;
    ensure!(st.success(), "agent exited {st}:\n{}", agent.log());
    let links = view.join(pin_name).join("links");
    let pinned = std::fs::read_dir(&links)
        .with_context(|| format!("the host's view of {}", links.display()))?
        .count();
    ensure!(
        pinned >= 10,
        "{pinned} links pinned in the host's view after the agent stopped"
    );
    eprintln!("Bidirectional: {pinned} links pinned in the host's bpffs, past the agent's exit");
    // The stand-in host goes with its processes (the TestEnv kills them), its bpffs with it,
    // and with that every pin and link of this test.
    Ok(())
}
