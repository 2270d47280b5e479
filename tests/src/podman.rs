//! Podman as a real CNI runtime: pods made by `podman pod create --network <conflist>` with
//! podman's CNI backend, in a private configuration, with containers that run from a tiny
//! rootfs built in the env's scratch directory (busybox-static, plus the host's HAProxy and curl
//! with the shared libraries they need), so no image is pulled. The app client is curl: the
//! static busybox's `wget` crashes in glibc's static NSS even for a numeric address.
//!
//! The configuration is the one MACHINE.md lists as working here, and nothing of the host's
//! podman setup is read or written:
//! - `CONTAINERS_CONF` is a private containers.conf: `network_backend = "cni"`, the test's
//!   plugin directories before /usr/lib/cni, a private `network_config_dir`, `cgroupfs`,
//!   `runc`, file events and file locks, and private `tmp_dir`/`static_dir`/`volume_path`;
//! - `CONTAINERS_STORAGE_CONF` is a private storage.conf: the `vfs` driver (no overlay mounts)
//!   with graphroot and runroot in the scratch directory;
//! - every call passes `--runtime runc` (crun refuses hybrid cgroups) and every `podman run`
//!   `--ulimit host`. The infra container takes no `--ulimit`, so containers.conf also sets
//!   `default_ulimits` to values at or below the current hard limits: podman's own defaults
//!   (1048576) cannot be set without CAP_SYS_RESOURCE. Note that with `default_ulimits` set,
//!   podman applies them even to `--ulimit host` containers;
//! - pods get `--cgroup-parent` = the env's cgroup, so the cgroup programs the test attached
//!   there apply to every container of the pod;
//! - on a pure cgroup2 host, the deny-all device program podman 4.3 attaches to each pod's
//!   cgroup is detached after `pod create`, as podman 4.9.2 and later never attach it (see
//!   [`Podman::create_pod`]).
//!
//! What podman gives a chained plugin: `K8S_POD_NAME` only (no namespace, no runtimeConfig)
//! and a prevResult, so sidestep-cni needs a `policy` object in its config to enrol the pod.
//!
//! Dropping [`Podman`] removes every pod and container of the private storage, then whatever
//! podman left behind when it failed half-way: network namespaces, libcni result caches, host
//! mounts under the scratch directory, and the cgroup v1 directories runc made for the cgroup
//! parent (the cgroup2 subtree goes with the env's cgroup). Declare it after the
//! [`crate::Node`] and [`crate::sidestep::Loaded`] so that it drops first.

use std::fs;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use nix::mount::{MntFlags, umount2};
use serde_json::Value;

use crate::cgroup::cgroup2_mount;
use crate::env::TestEnv;
use crate::faults::bpftool;
use crate::netns;
use crate::util::{output_within, tail};

mod cleanup;
mod rootfs;
mod sidecar;

pub use cleanup::sweep_stale;
use cleanup::{cache_files, remove_cgroup_tree, unmount_under, v1_cgroup_dirs};
use rootfs::build_rootfs;
pub use sidecar::Sidecar;

/// A podman call killed after this long is reported as hung.
const PODMAN_TIMEOUT: Duration = Duration::from_secs(90);
/// PATH for podman and the tools the rootfs is built from.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// libcni's result cache (podman's CNI backend keeps the default).
const CNI_CACHE: &str = "/var/lib/cni/results";
/// busybox applets linked in the rootfs.
const APPLETS: &[&str] = &["sh", "sleep", "cat", "true", "false", "id", "ls", "echo"];
/// Rlimits for every container (see the module docs); lowered to the hard limits when those
/// are smaller.
const DEFAULT_RLIMIT: u64 = 4096;

/// Why podman cannot be used here (it is not installed), or None.
pub fn missing() -> Option<String> {
    match which("podman") {
        Some(_) => None,
        None => Some(format!(
            "podman is not installed (not found in {PATH}); `cargo xtask setup` installs it"
        )),
    }
}

/// The first executable `name` in [`PATH`].
fn which(name: &str) -> Option<PathBuf> {
    PATH.split(':').map(|d| Path::new(d).join(name)).find(|p| {
        fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// A pod made by `podman pod create`, started, so its netns has gone through CNI ADD.
#[derive(Clone, Debug)]
pub struct PodmanPod {
    pub name: String,
    pub id: String,
    /// The infra container: its ID is libcni's CNI_CONTAINERID.
    pub infra_id: String,
    /// `/run/netns/netns-<uuid>`, made by podman.
    pub netns_path: PathBuf,
    pub network: String,
    pub ipv4: Ipv4Addr,
    /// The pod's cgroup relative to the cgroup2 mount, e.g. `/sidestep-test-<id>/<pod id>`.
    pub cgroup_path: String,
}

impl PodmanPod {
    /// The pod's netns cookie, the key of sidestep's maps.
    pub fn netns_cookie(&self) -> Result<u64> {
        netns::cookie(&self.netns_path)
    }
}

/// A private podman configuration in the env's scratch directory; see the module docs.
#[derive(Debug)]
pub struct Podman {
    dir: PathBuf,
    conf: PathBuf,
    storage_conf: PathBuf,
    net_dir: PathBuf,
    rootfs: PathBuf,
    /// The env's cgroup relative to the cgroup2 mount.
    cgroup_parent: String,
    /// Everything made here, for cleanup when a test fails half-way.
    pods: Mutex<Vec<PodmanPod>>,
}

impl Podman {
    /// Writes the private configuration and builds the rootfs. `plugin_dirs` come before
    /// /usr/lib/cni in `cni_plugin_dirs` (e.g. the directory where `sidestep` is sidestep-cni).
    pub fn new(env: &TestEnv, plugin_dirs: &[PathBuf]) -> Result<Self> {
        let dir = env.tmp_dir().join("podman");
        let net_dir = dir.join("cni.d");
        for d in ["root", "runroot", "tmp", "home", "tmpfiles", "cni.d"] {
            fs::create_dir_all(dir.join(d)).with_context(|| format!("mkdir {d}"))?;
        }
        let mount = cgroup2_mount()?;
        let rel = env
            .cgroup_path()
            .strip_prefix(&mount)
            .context("the env's cgroup is not under the cgroup2 mount")?;
        let cgroup_parent = format!("/{}", rel.display());

        let mut dirs: Vec<String> = plugin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        dirs.push(crate::cni::DEBIAN_CNI_DIR.into());
        let quoted = |v: &[String]| v.iter().map(|s| toml_str(s)).collect::<Vec<_>>().join(", ");
        let nofile = DEFAULT_RLIMIT.min(hard_limit(libc::RLIMIT_NOFILE));
        let nproc = DEFAULT_RLIMIT.min(hard_limit(libc::RLIMIT_NPROC));
        let p = |s: &str| toml_str(&dir.join(s).display().to_string());
        let conf = format!(
            r#"# sidestep tests: a private podman configuration (see tests/src/podman.rs).
[containers]
log_driver = "k8s-file"
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]

[network]
network_backend = "cni"
cni_plugin_dirs = [{plugin_dirs}]
network_config_dir = {net_dir}

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
lock_type = "file"
tmp_dir = {tmp}
static_dir = {static_dir}
volume_path = {volumes}
"#,
            plugin_dirs = quoted(&dirs),
            net_dir = toml_str(&net_dir.display().to_string()),
            tmp = p("tmp"),
            static_dir = p("root/libpod"),
            volumes = p("root/volumes"),
        );
        let storage = format!(
            "[storage]\ndriver = \"vfs\"\ngraphroot = {}\nrunroot = {}\n",
            p("root"),
            p("runroot")
        );
        let conf_path = dir.join("containers.conf");
        let storage_conf = dir.join("storage.conf");
        fs::write(&conf_path, conf).context("write containers.conf")?;
        fs::write(&storage_conf, storage).context("write storage.conf")?;
        let rootfs = dir.join("rootfs");
        build_rootfs(&rootfs)?;
        Ok(Self {
            dir,
            conf: conf_path,
            storage_conf,
            net_dir,
            rootfs,
            cgroup_parent,
            pods: Mutex::new(Vec::new()),
        })
    }

    /// The rootfs every container runs from (`--rootfs`).
    pub fn rootfs(&self) -> &Path {
        &self.rootfs
    }

    /// The private containers.conf (`CONTAINERS_CONF`).
    pub fn containers_conf(&self) -> &Path {
        &self.conf
    }

    /// The cgroup parent of every pod, relative to the cgroup2 mount.
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }

    /// Runs `podman ARGS` with the private configuration; returns its output whatever the exit.
    pub fn output(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = Command::new("podman");
        cmd.arg("--runtime")
            .arg("runc")
            .args(args)
            .env_clear()
            .env("PATH", PATH)
            .env("HOME", self.dir.join("home"))
            .env("TMPDIR", self.dir.join("tmpfiles"))
            .env("CONTAINERS_CONF", &self.conf)
            .env("CONTAINERS_STORAGE_CONF", &self.storage_conf);
        output_within(&mut cmd, None, PODMAN_TIMEOUT)
            .and_then(|o| o.with_context(|| format!("hung for {PODMAN_TIMEOUT:?}; killed")))
            .with_context(|| format!("podman {}", args.join(" ")))
    }

    /// Runs `podman ARGS`; fails with its stderr when it exits non-zero. Returns stdout.
    pub fn podman(&self, args: &[&str]) -> Result<String> {
        let out = self.output(args)?;
        if !out.status.success() {
            bail!(
                "`podman {}` failed ({}): {}{}",
                args.join(" "),
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr), 4000).trim(),
                tail(&String::from_utf8_lossy(&out.stdout), 1000).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Writes `conflist` (e.g. [`crate::Node::conflist`]) into the network config dir and
    /// checks that podman lists the network. Returns its name.
    pub fn add_network(&self, conflist: &Value) -> Result<String> {
        let name = conflist["name"]
            .as_str()
            .context("conflist has no name")?
            .to_owned();
        let path = self.net_dir.join(format!("{name}.conflist"));
        fs::write(&path, serde_json::to_vec_pretty(conflist)?)
            .with_context(|| format!("write {}", path.display()))?;
        let listed = self.podman(&["network", "ls", "--format", "{{.Name}}"])?;
        ensure!(
            listed.lines().any(|l| l.trim() == name),
            "podman does not list network {name}: {listed}"
        );
        Ok(name)
    }

    /// `podman pod create --network <network> --cgroup-parent <env cgroup>`, then
    /// `podman pod start`, which runs the CNI chain (ADD) for the pod's netns.
    pub fn create_pod(&self, name: &str, network: &str) -> Result<PodmanPod> {
        self.podman(&[
            "pod",
            "create",
            "--name",
            name,
            "--network",
            network,
            "--cgroup-parent",
            &self.cgroup_parent,
        ])?;
        // Recorded before it starts, so that a failed start is still removed.
        lock(&self.pods).push(PodmanPod {
            name: name.into(),
            id: String::new(),
            infra_id: String::new(),
            netns_path: PathBuf::new(),
            network: network.into(),
            ipv4: Ipv4Addr::UNSPECIFIED,
            cgroup_path: String::new(),
        });
        self.detach_pod_device_filter(name)
            .with_context(|| format!("pod {name}: detaching podman's device filter"))?;
        let started = self.podman(&["pod", "start", name]);
        // Whatever happened, learn the IDs and the netns for cleanup.
        let info = self.inspect_pod(name, network);
        if let Ok(info) = &info {
            for p in lock(&self.pods).iter_mut().filter(|p| p.name == name) {
                *p = info.clone();
            }
        }
        started.with_context(|| format!("starting podman pod {name}"))?;
        let pod = info?;
        ensure!(
            pod.netns_path.exists(),
            "pod {name}: netns {} does not exist",
            pod.netns_path.display()
        );
        Ok(pod)
    }

    /// Podman before 4.9.2 (Debian 12 ships 4.3.1) with `cgroupfs` on a pure cgroup2 host sets
    /// the new pod cgroup's resources through runc's fs2 manager without device rules, and runc
    /// turns "no rules" into a deny-all BPF_CGROUP_DEVICE program on that cgroup. An access
    /// must pass the device programs of every ancestor, so each container of the pod then
    /// fails to reopen its /dev/null (EPERM), whatever runc allows on the container's own
    /// cgroup. Podman 4.9.2 skips devices on pod cgroups (containers/podman 35955bc), so this
    /// detaches what older releases attached there and leaves the cgroups a fixed podman makes:
    /// runc's per-container allow-list still applies. On a hybrid host podman attaches nothing
    /// (devices is a v1 controller there) and this does nothing.
    fn detach_pod_device_filter(&self, name: &str) -> Result<()> {
        let pod = first(serde_json::from_str(
            &self.podman(&["pod", "inspect", name])?,
        )?);
        let Some(rel) = pod["CgroupPath"].as_str().filter(|p| !p.is_empty()) else {
            return Ok(());
        };
        let path = cgroup2_mount()?.join(rel.trim_start_matches('/'));
        if !path.is_dir() {
            return Ok(());
        }
        let path = path.display().to_string();
        // Only what is attached to the pod cgroup itself (no --effective): runc's filters on
        // the container cgroups below stay.
        for prog in bpftool(&["cgroup", "show", &path])?
            .as_array()
            .into_iter()
            .flatten()
        {
            // bpftool 7 prints "cgroup_device", older releases "device".
            if !matches!(
                prog["attach_type"].as_str(),
                Some("cgroup_device" | "device")
            ) {
                continue;
            }
            let id = prog["id"]
                .as_u64()
                .context("bpftool cgroup show: no id")?
                .to_string();
            bpftool(&["cgroup", "detach", &path, "device", "id", &id])?;
        }
        Ok(())
    }

    fn inspect_pod(&self, name: &str, network: &str) -> Result<PodmanPod> {
        let pod = first(serde_json::from_str(
            &self.podman(&["pod", "inspect", name])?,
        )?);
        let id = pod["Id"].as_str().context("pod inspect: Id")?.to_owned();
        let infra_id = pod["InfraContainerID"]
            .as_str()
            .context("pod inspect: InfraContainerID")?
            .to_owned();
        let cgroup_path = pod["CgroupPath"].as_str().unwrap_or_default().to_owned();
        let infra = self.inspect(&infra_id)?;
        let ns = &infra["NetworkSettings"];
        let netns_path = PathBuf::from(ns["SandboxKey"].as_str().unwrap_or_default());
        let ipv4 = ns["Networks"][network]["IPAddress"]
            .as_str()
            .unwrap_or_default()
            .parse()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        Ok(PodmanPod {
            name: name.into(),
            id,
            infra_id,
            netns_path,
            network: network.into(),
            ipv4,
            cgroup_path,
        })
    }

    /// `podman inspect <container>`: the container's JSON object.
    pub fn inspect(&self, container: &str) -> Result<Value> {
        let v: Value =
            serde_json::from_str(&self.podman(&["inspect", "--type", "container", container])?)?;
        Ok(first(v))
    }

    /// The host pid of a running container's main process.
    pub fn pid(&self, container: &str) -> Result<u32> {
        let v = self.inspect(container)?;
        match v["State"]["Pid"].as_u64() {
            Some(p) if p > 0 => Ok(p as u32),
            _ => bail!("container {container} is not running: {}", v["State"]),
        }
    }

    /// `podman run -d --pod <pod> --name <name> --user uid:gid --ulimit host --rootfs <rootfs>
    /// ARGV`. Returns the container ID.
    pub fn run_detached(
        &self,
        pod: &PodmanPod,
        name: &str,
        uid: u32,
        gid: u32,
        argv: &[&str],
    ) -> Result<String> {
        let user = format!("{uid}:{gid}");
        let rootfs = self.rootfs.display().to_string();
        let mut args = vec![
            "run", "-d", "--pod", &pod.name, "--name", name, "--user", &user, "--ulimit", "host",
            "--rootfs", &rootfs,
        ];
        args.extend_from_slice(argv);
        Ok(self.podman(&args)?.trim().to_owned())
    }

    /// `podman exec --user uid:uid <container> ARGV`; returns the output whatever the exit.
    pub fn exec(&self, container: &str, uid: u32, argv: &[&str]) -> Result<Output> {
        let user = format!("{uid}:{uid}");
        let mut args = vec!["exec", "--user", &user, container];
        args.extend_from_slice(argv);
        self.output(&args)
    }

    /// GETs `url` with curl run as `uid` in `container`. Fails on a curl error or an HTTP
    /// status >= 400.
    pub fn http_get(&self, container: &str, uid: u32, url: &str) -> Result<String> {
        let argv = [
            "curl",
            "--max-time",
            "5",
            "-sS",
            "-g",
            "--fail-with-body",
            "--noproxy",
            "*",
            url,
        ];
        let out = self.exec(container, uid, &argv)?;
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "curl {url} in container {container} as uid {uid} failed ({}): {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                tail(&body, 1000)
            );
        }
        Ok(body)
    }

    /// What the container wrote to stdout and stderr so far (`podman logs`).
    pub fn logs(&self, container: &str) -> Result<String> {
        let out = self.output(&["logs", container])?;
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }

    /// `podman stop -t 0`: SIGKILL now, and wait for the exit.
    pub fn stop(&self, container: &str) -> Result<()> {
        self.podman(&["stop", "-t", "0", container]).map(drop)
    }

    /// Names of the pods in the private storage.
    pub fn pod_names(&self) -> Result<Vec<String>> {
        Ok(self
            .podman(&["pod", "ls", "--format", "{{.Name}}"])?
            .lines()
            .map(|l| l.trim().to_owned())
            .filter(|l| !l.is_empty())
            .collect())
    }

    /// IDs of all containers (running or not) in the private storage.
    pub fn container_ids(&self) -> Result<Vec<String>> {
        Ok(self
            .podman(&["ps", "-a", "--format", "{{.ID}}"])?
            .lines()
            .map(|l| l.trim().to_owned())
            .filter(|l| !l.is_empty())
            .collect())
    }

    /// `podman pod rm -f -t 0 <pod>`: stops every container (CNI DEL for the netns) and
    /// removes the pod.
    pub fn remove_pod(&self, pod: &PodmanPod) -> Result<()> {
        self.podman(&["pod", "rm", "-f", "-t", "0", &pod.name])?;
        lock(&self.pods).retain(|p| p.name != pod.name);
        Ok(())
    }

    /// libcni's cached results for `pod` (there is one per attachment while it exists).
    pub fn cni_cache_files(&self, pod: &PodmanPod) -> Vec<PathBuf> {
        cache_files(&pod.network, &pod.infra_id)
    }

    fn cleanup(&mut self) -> Vec<String> {
        let mut errors = Vec::new();
        let pods = std::mem::take(&mut *lock(&self.pods));
        for pod in &pods {
            if let Err(e) = self.podman(&["pod", "rm", "-f", "-t", "0", &pod.name]) {
                let msg = format!("{e:#}");
                if !msg.contains("no pod with name or ID") {
                    errors.push(msg);
                }
            }
        }
        // Anything else in the private storage (a container made outside a pod, a pod whose
        // create half-failed).
        for args in [
            &["pod", "rm", "-a", "-f", "-t", "0"][..],
            &["rm", "-a", "-f", "-t", "0"][..],
        ] {
            if let Err(e) = self.podman(args) {
                errors.push(format!("{e:#}"));
            }
        }
        // What podman leaves behind when a removal failed half-way.
        for pod in &pods {
            if !pod.netns_path.as_os_str().is_empty() && pod.netns_path.exists() {
                let _ = umount2(&pod.netns_path, MntFlags::MNT_DETACH);
                if let Err(e) = fs::remove_file(&pod.netns_path) {
                    errors.push(format!("rm {}: {e}", pod.netns_path.display()));
                }
            }
            if !pod.infra_id.is_empty() {
                for f in cache_files(&pod.network, &pod.infra_id) {
                    let _ = fs::remove_file(f);
                }
            }
        }
        unmount_under(&self.dir, &mut errors);
        for dir in v1_cgroup_dirs(&self.cgroup_parent) {
            if let Err(e) = remove_cgroup_tree(&dir) {
                errors.push(format!("{e:#}"));
            }
        }
        errors
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for e in self.cleanup() {
            eprintln!("sidestep-tests: podman cleanup: {e}");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves valid data; keep going so that Drop cleans up.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `podman pod inspect` prints an object in podman 4.3 and an array in later releases.
fn first(v: Value) -> Value {
    match v {
        Value::Array(mut a) if !a.is_empty() => a.swap_remove(0),
        other => other,
    }
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn hard_limit(resource: libc::__rlimit_resource_t) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one rlimit struct into a valid, exclusively borrowed one.
    let ret = unsafe { libc::getrlimit(resource, &mut lim) };
    if ret == 0 { lim.rlim_max } else { 1024 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_strings_are_escaped() {
        assert_eq!(toml_str(r#"/tmp/a"b\c"#), r#""/tmp/a\"b\\c""#);
    }

    #[test]
    fn inspect_output_shapes() {
        assert_eq!(first(serde_json::json!([{"Id": "a"}]))["Id"], "a");
        assert_eq!(first(serde_json::json!({"Id": "b"}))["Id"], "b");
    }
}
