//! `cargo xtask e2e down`: stop the node and remove everything it made, then check that
//! nothing is left. Idempotent: without a state file there is nothing of ours to remove.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};

use super::Phases;
use super::config::{self, BRIDGE, NETWORK};
use super::host;
use super::node::DAEMONS;
use super::state::State;
use crate::cmd::Cmd;

pub fn down(dir: &Path) -> Result<()> {
    let dir = std::path::absolute(dir)?;
    let Some(state) = State::load(&dir)? else {
        if dir.exists() {
            bail!(
                "{} has no state.json: it is not a node that `e2e up` made (or its state is lost); \
                 remove it by hand after checking",
                dir.display()
            );
        }
        println!("no node in {}: nothing to do", dir.display());
        return Ok(());
    };
    let mut phases = Phases::default();
    // Only through a live kubelet and containerd: after a crash the API would just wait.
    let running = |name: &str| {
        state
            .daemons
            .iter()
            .any(|(n, pid)| n == name && host::alive(*pid) && is_ours(*pid, &state))
    };
    if running("kubelet") && running("containerd") {
        phases.time("delete pods", || {
            delete_pods(&dir);
            Ok(())
        })?;
    }
    phases.time("stop daemons", || {
        stop_daemons(&state);
        Ok(())
    })?;
    phases.time("kill leftovers", || {
        kill_leftovers(&state);
        Ok(())
    })?;
    phases.time("unmount", || unmount_all(&dir))?;
    if state.bpffs_made_shared {
        // Best effort like the rest: `leftovers` reports it if it stayed shared.
        phases.time("bpffs propagation", || {
            if let Err(e) = host::make_propagation(Path::new(host::BPFFS), "--make-private") {
                println!("  {}: {e:#}", host::BPFFS);
            }
            Ok(())
        })?;
    }
    phases.time("sidestep pins", || {
        remove_pins();
        Ok(())
    })?;
    phases.time("host state", || {
        remove_host_state(&state);
        Ok(())
    })?;
    phases.time("cgroups", || {
        remove_cgroups(&state);
        Ok(())
    })?;
    let left = phases.time("check", || Ok(leftovers(&state)))?;
    if left.is_empty() {
        fs::remove_dir_all(&dir)?;
        println!("removed {}", dir.display());
    }
    phases.print("e2e down: wall time per phase");
    if !left.is_empty() {
        bail!(
            "left on the host (the scratch directory {} is kept for a look):\n  {}",
            dir.display(),
            left.join("\n  ")
        );
    }
    println!(
        "nothing left: processes, mounts, netns, cgroups, bridge, iptables chains, sysctls, files"
    );
    Ok(())
}

/// With the node still running, delete every pod so kubelet stops the sandboxes through the
/// CRI, which runs CNI DEL: the tidy path. Best effort, bounded; what it misses is removed by
/// force below.
fn delete_pods(dir: &Path) {
    let kubeconfig = dir.join("pki/admin.kubeconfig");
    let Some(kubectl) = kubectl_path() else {
        return;
    };
    if !kubeconfig.exists() {
        return;
    }
    let run = |args: &[&str]| {
        Cmd::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--request-timeout=10s"])
            .args(args)
            .read()
    };
    if run(&["get", "--raw", "/readyz"]).is_err() {
        return;
    }
    // Controllers first, or they recreate the pods.
    let _ = run(&[
        "delete",
        "daemonsets,deployments,replicasets,statefulsets,jobs",
        "--all",
        "--all-namespaces",
        "--wait=false",
    ]);
    match run(&[
        "delete",
        "pods",
        "--all",
        "--all-namespaces",
        "--grace-period=2",
        "--wait=true",
        "--timeout=30s",
    ]) {
        Ok(out) if !out.trim().is_empty() => println!("  {}", out.trim().replace('\n', "\n  ")),
        Ok(_) => {}
        Err(e) => println!("  deleting pods: {e:#} (continuing by force)"),
    }
}

fn kubectl_path() -> Option<PathBuf> {
    let path = super::components::cache_root()
        .join(format!("kubernetes-{}", super::KUBERNETES_VERSION))
        .join("bin/kubectl");
    path.exists().then_some(path)
}

/// kubelet first, so it restarts nothing; then the rest in reverse start order.
fn stop_daemons(state: &State) {
    let mut order: Vec<&(String, i32)> = state.daemons.iter().collect();
    order.sort_by_key(|(name, _)| {
        let at = DAEMONS.iter().position(|d| d == name).unwrap_or(0);
        if name == "kubelet" {
            0
        } else {
            DAEMONS.len() - at
        }
    });
    for (name, pid) in order {
        if host::alive(*pid) && is_ours(*pid, state) {
            println!("  stopping {name} (pid {pid})");
            host::stop(*pid, Duration::from_secs(10));
        }
    }
}

/// A recorded pid is only ours if the process still sits in the node's cgroup: after a reboot
/// or a long time, the number may belong to someone else.
fn is_ours(pid: i32, state: &State) -> bool {
    fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| {
        c.lines()
            .any(|l| l.ends_with(&state.cgroup) || l.contains(&format!("{}/", state.cgroup)))
    })
}

/// Whatever still runs in the node's cgroups (pause and pod processes, shims) or names the
/// scratch directory on its command line (shims re-parented to PID 1).
fn kill_leftovers(state: &State) {
    for round in 0..50 {
        let mut pids = host::pids_mentioning(&state.dir);
        for mount in host::cgroup_mounts().unwrap_or_default() {
            pids.extend(host::cgroup_tree_pids(&host::join_cgroup(
                &mount,
                &state.cgroup,
            )));
        }
        pids.retain(|p| host::alive(*p));
        if pids.is_empty() {
            return;
        }
        if round == 0 {
            println!("  killing {} leftover processes: {pids:?}", pids.len());
        }
        for pid in pids {
            host::signal(pid, libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every mount under the scratch directory, deepest first: overlay rootfs, shm, netns,
/// kubelet's volumes and its rshared bind of its own root.
fn unmount_all(dir: &Path) -> Result<()> {
    for _ in 0..3 {
        let points = host::mounts_under(dir)?;
        if points.is_empty() {
            return Ok(());
        }
        println!("  unmounting {} mounts", points.len());
        for point in points {
            if let Err(e) = host::unmount(&point) {
                println!("  {e:#}");
            }
        }
    }
    Ok(())
}

/// The bridge, new KUBE-*/CNI-* chains, libcni's cache entries for our network, containerd's
/// shim sockets, sysctls, and the hard-coded host directories that did not exist before.
fn remove_host_state(state: &State) {
    if Cmd::new("ip").args(["link", "show", BRIDGE]).read().is_ok() {
        let _ = Cmd::new("ip").args(["link", "del", BRIDGE]).read();
        println!("  deleted bridge {BRIDGE}");
    }
    let removed = host::remove_new_chains(&state.chains_before);
    if !removed.is_empty() {
        println!("  removed iptables chains: {}", removed.join(", "));
    }
    for entry in fs::read_dir("/var/lib/cni/results")
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(&format!("{NETWORK}-"))
        {
            let _ = fs::remove_file(entry.path());
        }
    }
    for socket in shim_sockets(state) {
        let _ = fs::remove_file(socket);
    }
    for link in fs::read_dir("/var/log/containers")
        .into_iter()
        .flatten()
        .flatten()
    {
        if fs::read_link(link.path()).is_ok_and(|t| t.starts_with(&state.dir)) {
            let _ = fs::remove_file(link.path());
        }
    }
    let restored = host::restore_sysctls(&state.sysctls);
    if !restored.is_empty() {
        println!("  restored sysctls: {}", restored.join(" "));
    }
    for file in config::HOST_FILES.iter().map(Path::new) {
        let parent = file.parent().unwrap_or(Path::new("/"));
        if state.host_dirs_absent_before.iter().any(|d| d == parent) {
            let _ = fs::remove_file(file);
        }
    }
    // Deepest first; only empty ones, so another user's files are never touched.
    let mut dirs = state.host_dirs_absent_before.clone();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for dir in dirs {
        for sub in host::dir_tree(&dir) {
            let _ = fs::remove_dir(sub);
        }
    }
}

/// containerd's shims put their sockets in /run/containerd/s, whatever the state directory:
/// the name is sha256("<grpc address>/k8s.io/<id>") for each sandbox and container.
fn shim_sockets(state: &State) -> Vec<PathBuf> {
    let tasks = state
        .dir
        .join("containerd/state/io.containerd.runtime.v2.task/k8s.io");
    let socket = state.dir.join("run/containerd.sock");
    let mut sockets = Vec::new();
    for entry in fs::read_dir(tasks).into_iter().flatten().flatten() {
        let key = format!(
            "{}/k8s.io/{}",
            socket.display(),
            entry.file_name().to_string_lossy()
        );
        let hash = Cmd::new("sh")
            .args(["-c", r#"printf %s "$1" | sha256sum"#, "sh", &key])
            .read()
            .unwrap_or_default();
        if let Some(hex) = hash.split_whitespace().next() {
            sockets.push(PathBuf::from("/run/containerd/s").join(hex));
        }
    }
    sockets
}

/// The node's cgroup subtree in every hierarchy, deepest first, then the ancestors `up`
/// created.
fn remove_cgroups(state: &State) {
    for mount in host::cgroup_mounts().unwrap_or_default() {
        for dir in host::dir_tree(&host::join_cgroup(&mount, &state.cgroup)) {
            if let Err(e) = fs::remove_dir(&dir) {
                println!("  rmdir {}: {e}", dir.display());
            }
        }
    }
    for dir in state.cgroups_created.iter().rev() {
        let _ = fs::remove_dir(dir);
    }
}

/// The agent's pins (its own pin root): the cgroup links pinned there hold kubelet's pod
/// cgroup, which could not go away while they exist.
fn remove_pins() {
    let root = Path::new(super::install::PIN_ROOT);
    if root.exists()
        && let Err(e) = fs::remove_dir_all(root)
    {
        println!("  removing {}: {e}", root.display());
    }
}

/// What is still there; empty when the host is as before `up`.
fn leftovers(state: &State) -> Vec<String> {
    let mut left = Vec::new();
    if state.bpffs_made_shared
        && host::propagation(Path::new(host::BPFFS))
            .ok()
            .flatten()
            .is_some_and(|p| p != "private")
    {
        left.push(format!("{} is not private again", host::BPFFS));
    }
    if Path::new(super::install::PIN_ROOT).exists() {
        left.push(format!("pins {}", super::install::PIN_ROOT));
    }
    let mut pids: BTreeSet<i32> = host::pids_mentioning(&state.dir);
    for mount in host::cgroup_mounts().unwrap_or_default() {
        let root = host::join_cgroup(&mount, &state.cgroup);
        pids.extend(host::cgroup_tree_pids(&root));
        if root.exists() {
            left.push(format!("cgroup {}", root.display()));
        }
    }
    pids.retain(|p| host::alive(*p));
    if !pids.is_empty() {
        left.push(format!("processes {pids:?}"));
    }
    for dir in &state.cgroups_created {
        if dir.exists() {
            left.push(format!("cgroup {}", dir.display()));
        }
    }
    for point in host::mounts_under(&state.dir).unwrap_or_default() {
        left.push(format!("mount {}", point.display()));
    }
    if Cmd::new("ip").args(["link", "show", BRIDGE]).read().is_ok() {
        left.push(format!("bridge {BRIDGE}"));
    }
    let chains: Vec<String> = host::kube_chains()
        .difference(&state.chains_before)
        .cloned()
        .collect();
    if !chains.is_empty() {
        left.push(format!("iptables chains {}", chains.join(", ")));
    }
    for (name, value) in &state.sysctls {
        if host::read_sysctl(name).as_deref() != Some(value.as_str()) {
            left.push(format!("sysctl {name} is not back to {value}"));
        }
    }
    for socket in shim_sockets(state) {
        if socket.exists() {
            left.push(format!("shim socket {}", socket.display()));
        }
    }
    for entry in fs::read_dir("/var/lib/cni/results")
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(&format!("{NETWORK}-"))
        {
            left.push(format!("libcni cache {}", entry.path().display()));
        }
    }
    for dir in &state.host_dirs_absent_before {
        if dir.exists() {
            left.push(format!("directory {} (absent before up)", dir.display()));
        }
    }
    // Pods' netns live under containerd's state dir (netns_mounts_under_state_dir): a netns
    // mount left shows among the mounts above.
    left
}
