//! `cargo xtask e2e up`: start the node's daemons from the scratch directory, each in a cgroup
//! of its own below xtask's, wait for each to be ready, and prove the node runs a pod.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use super::Phases;
use super::components::{self, Built};
use super::config::{self, Layout, NODE_NAME};
use super::host;
use super::images;
use super::kubectl::Kubectl;
use super::pki::{self, Pki};
use super::state::State;
use super::teardown;
use crate::cmd::Cmd;

/// The daemons, in start order; `down` stops them in reverse, kubelet first.
pub const DAEMONS: &[&str] = &[
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
];

pub fn up(dir: &Path, fail: Option<&str>) -> Result<()> {
    let mut phases = Phases::default();
    let node = start(dir, fail, &mut phases)?;
    node.built.print_versions()?;
    phases.print("e2e up: wall time per phase");
    println!("\nnode {NODE_NAME} is Ready; it keeps running until `cargo xtask e2e down`");
    println!("  export KUBECONFIG={}", node.kubectl.kubeconfig.display());
    println!("  {} get nodes,pods -A", node.kubectl.bin.display());
    Ok(())
}

/// Refuse to start over another node; install the Debian packages the node uses.
fn preflight(dir: &Path) -> Result<()> {
    if State::path(dir).exists() {
        bail!(
            "a node is already up in {}\n  fix: cargo xtask e2e down --dir {0}",
            dir.display()
        );
    }
    if dir.exists() && fs::read_dir(dir)?.next().is_some() {
        bail!(
            "{} exists and is not empty; choose another --dir",
            dir.display()
        );
    }
    // One node per machine: the bridge, the subnet and the cgroup name are fixed.
    if Cmd::new("ip")
        .args(["link", "show", config::BRIDGE])
        .read()
        .is_ok()
    {
        bail!(
            "bridge {} exists: another e2e node is up on this machine\n  fix: cargo xtask e2e down --dir <its dir>",
            config::BRIDGE
        );
    }
    crate::packages::ensure_packages(&[
        "runc",
        "containernetworking-plugins",
        "openssl",
        "iptables",
        "iproute2",
        "curl",
    ])
}

/// A node that is up: what the scenarios need to drive it.
pub struct Running {
    pub layout: Layout,
    pub built: Built,
    pub kubectl: Kubectl,
    pub apiserver_port: u16,
    /// kubelet's pod cgroup (`<cgroupRoot>/kubepods`), relative to each hierarchy's root.
    pub pods_cgroup: String,
    /// Our daemons, not reaped while they run; `down` stops them.
    _children: Vec<(String, Child)>,
}

/// Build (or find) the components and bring the node up; on failure, tear down what was made
/// and return the error.
pub fn start(dir: &Path, fail: Option<&str>, phases: &mut Phases) -> Result<Running> {
    preflight(dir)?;
    let built = phases.time("build (or cache)", components::build_all)?;
    let mut node = Node {
        layout: Layout {
            dir: std::path::absolute(dir)?,
        },
        built,
        state: State::default(),
        children: Vec::new(),
        fail: fail.map(str::to_owned),
    };
    match node.bring_up(phases) {
        Ok(()) => Ok(Running {
            kubectl: Kubectl {
                bin: node.built.kube("kubectl"),
                kubeconfig: node.layout.at("pki/admin.kubeconfig"),
            },
            apiserver_port: node.state.port("apiserver"),
            pods_cgroup: format!("{}/kubepods", config::pods_cgroup(&node.state)),
            layout: node.layout,
            built: node.built,
            _children: node.children,
        }),
        Err(e) => {
            // The error itself is printed last, after the teardown's output.
            eprintln!("\ne2e up failed; tearing the node down");
            // The children must not be left as zombies of ours for `down` to see them gone.
            drop(node.children);
            if let Err(down) = teardown::down(dir) {
                eprintln!("teardown after the failure also failed: {down:#}");
            }
            Err(e)
        }
    }
}

struct Node {
    layout: Layout,
    built: Built,
    state: State,
    /// Our own children, so a daemon that exits is noticed at once (as a zombie of ours it
    /// would still look alive in /proc).
    children: Vec<(String, Child)>,
    /// The daemon to start with a flag it rejects (`up --fail`).
    fail: Option<String>,
}

impl Node {
    fn bring_up(&mut self, phases: &mut Phases) -> Result<()> {
        phases.time("prepare host", || self.prepare())?;
        let pki = phases.time("certificates", || {
            pki::create(
                &self.layout.dir,
                NODE_NAME,
                self.state.port("apiserver"),
                config::SERVICE_IP,
            )
        })?;
        phases.time("etcd", || self.start_etcd())?;
        phases.time("kube-apiserver", || self.start_apiserver(&pki))?;
        phases.time("kube-controller-manager", || {
            self.start_control_plane("kube-controller-manager", &pki)
        })?;
        phases.time("kube-scheduler", || {
            self.start_control_plane("kube-scheduler", &pki)
        })?;
        phases.time("containerd + pause image", || self.start_containerd())?;
        phases.time("kubelet to node Ready", || self.start_kubelet(&pki))?;
        phases.time("smoke pod Running", || self.smoke_pod(&pki))?;
        Ok(())
    }

    /// Directories, ports, the node's cgroup, and a record of the host state that `down`
    /// restores, saved before anything starts.
    fn prepare(&mut self) -> Result<()> {
        let l = &self.layout;
        for sub in [
            "logs",
            "run",
            "etcd",
            "containerd/root",
            "containerd/state",
            "containerd/tmp",
            "containerd/opt",
            "containerd/runc",
            "cni/bin",
            "cni/net.d",
            "cni/ipam",
            "kubelet",
            "kubelet-plugins",
            "pod-logs",
            "images",
            "manifests",
        ] {
            fs::create_dir_all(l.at(sub))?;
        }
        self.state.dir = l.dir.clone();
        self.state.cgroup = format!(
            "{}/{}",
            host::own_cgroup()?.trim_end_matches('/'),
            config::NETWORK
        );
        for port in [
            "etcd",
            "etcd-peer",
            "apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubelet",
            "kubelet-healthz",
        ] {
            self.state.ports.insert(port.into(), host::free_port()?);
        }
        self.state.sysctls = host::SYSCTLS
            .iter()
            .filter_map(|s| Some((s.to_string(), host::read_sysctl(s)?)))
            .collect();
        self.state.chains_before = host::kube_chains();
        self.state.host_dirs_absent_before = config::HOST_DIRS
            .iter()
            .map(PathBuf::from)
            .filter(|d| !d.exists())
            .collect();
        self.state.save()?;
        // HostToContainer volumes (the agent's bpffs and pod netns) need the host side shared
        // or slave, as systemd leaves every mount; this machine's are private. The scratch
        // directory becomes a shared mount of its own (unmounted by `down` with the rest).
        host::bind_shared(&l.dir)?;
        if host::propagation(Path::new(host::BPFFS))?.as_deref() == Some("private") {
            self.state.bpffs_made_shared = true;
            self.state.save()?;
            host::make_propagation(Path::new(host::BPFFS), "--make-shared")?;
        }
        let created = host::create_cgroup(&config::pods_cgroup(&self.state))?;
        self.state.cgroups_created.extend(created);
        self.state.save()?;
        println!(
            "  scratch {}, cgroup {}",
            l.dir.display(),
            self.state.cgroup
        );
        fs::write(
            l.cni_conf_dir().join("10-sidestep-e2e.conflist"),
            config::cni_conflist(l),
        )?;
        Ok(())
    }

    /// Start `program` detached (its own process group, so it outlives `up`), logging to
    /// `logs/<name>.log`, inside `<node cgroup>/<name>` in every hierarchy: a shell writes its
    /// own pid into each `cgroup.procs` and then execs the daemon, so the daemon and all it
    /// forks (containerd's shims) start there.
    fn spawn(&mut self, name: &str, program: &Path, args: Vec<std::ffi::OsString>) -> Result<()> {
        let cgroup = format!("{}/{name}", self.state.cgroup);
        let created = host::create_cgroup(&cgroup)?;
        self.state.cgroups_created.extend(created);
        self.state.save()?;
        let log = fs::File::create(self.layout.log(name))?;
        let procs = host::cgroup_procs_files(&cgroup)?;
        let mut args = args;
        if self.fail.as_deref() == Some(name) {
            args.push("--sidestep-e2e-fails-on-purpose".into());
        }
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(
                r#"for f in $SIDESTEP_CGROUP_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@""#,
            )
            .arg(name)
            .arg(program)
            .args(args)
            .env("SIDESTEP_CGROUP_PROCS", config::path_list(&procs))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // containerd finds its shim on PATH.
        let path = format!(
            "{}:{}",
            self.built.containerd_bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        command.env("PATH", path);
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        self.state.daemons.push((name.into(), child.id() as i32));
        self.state.save()?;
        self.children.push((name.into(), child));
        Ok(())
    }

    /// Poll `ready` until it holds; fail, naming the daemon and showing its log's tail, if the
    /// daemon exits or `timeout` passes first.
    fn wait_ready(
        &mut self,
        name: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some((_, child)) = self.children.iter_mut().find(|(n, _)| n == name)
                && let Some(status) = child.try_wait()?
            {
                return Err(self.failure(name, &format!("exited ({status})")));
            }
            if ready() {
                println!(
                    "  {name} ready after {:.1} s",
                    start.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(self.failure(name, &format!("not ready after {} s", timeout.as_secs())));
            }
            sleep(Duration::from_millis(250));
        }
    }

    fn failure(&self, name: &str, what: &str) -> anyhow::Error {
        let log = self.layout.log(name);
        anyhow!(
            "{name} {what}; last lines of {}:\n{}",
            log.display(),
            tail(&log, 25)
        )
    }

    fn start_etcd(&mut self) -> Result<()> {
        let args = config::etcd_args(&self.layout, &self.state);
        let program = self.built.etcd_bin.join("etcd");
        self.spawn("etcd", &program, args)?;
        let url = format!("http://127.0.0.1:{}/health", self.state.port("etcd"));
        self.wait_ready("etcd", Duration::from_secs(60), || {
            curl(&["-sf", &url]).is_some_and(|b| b.contains(r#""health":"true""#))
        })
    }

    fn start_apiserver(&mut self, pki: &Pki) -> Result<()> {
        let args = config::apiserver_args(&self.state, pki);
        self.spawn("kube-apiserver", &self.built.kube("kube-apiserver"), args)?;
        let kubectl = self.kubectl(pki);
        self.wait_ready("kube-apiserver", Duration::from_secs(120), || {
            kubectl(&["get", "--raw", "/readyz"]).is_ok_and(|out| out.trim() == "ok")
        })
    }

    fn start_control_plane(&mut self, name: &str, pki: &Pki) -> Result<()> {
        let args = config::control_plane_args(name, &self.state, pki, &self.layout);
        self.spawn(name, &self.built.kube(name), args)?;
        let url = format!("https://127.0.0.1:{}/healthz", self.state.port(name));
        self.wait_ready(name, Duration::from_secs(60), || {
            curl(&["-sk", &url]).is_some_and(|b| b.trim() == "ok")
        })
    }

    fn start_containerd(&mut self) -> Result<()> {
        let config_file = self.layout.at("containerd/config.toml");
        fs::write(&config_file, config::containerd_config(&self.layout))?;
        let program = self.built.containerd_bin.join("containerd");
        let args = vec!["--config".into(), config_file.into_os_string()];
        self.spawn("containerd", &program, args)?;
        let ctr = self.built.containerd_bin.join("ctr");
        let socket = self.layout.containerd_socket();
        self.wait_ready("containerd", Duration::from_secs(60), || {
            Cmd::new(&ctr)
                .arg("--address")
                .arg(&socket)
                .arg("version")
                .read()
                .is_ok()
        })?;
        let archive = images::archive(
            &self.layout.at("images"),
            &images::ImageSpec {
                name: images::pause_image(),
                files: vec![(self.built.pause.clone(), "/pause".into())],
                symlinks: Vec::new(),
                dirs: Vec::new(),
                entrypoint: vec!["/pause".into()],
                cmd: Vec::new(),
                user: "65535:65535".into(),
            },
        )?;
        images::import(&ctr, &socket, &archive)?;
        println!("  imported {}", images::pause_image());
        Ok(())
    }

    fn start_kubelet(&mut self, pki: &Pki) -> Result<()> {
        fs::write(
            self.layout.at("kubelet.yaml"),
            config::kubelet_config(&self.layout, &self.state, pki),
        )?;
        let args = config::kubelet_args(&self.layout, pki);
        self.spawn("kubelet", &self.built.kube("kubelet"), args)?;
        let kubectl = self.kubectl(pki);
        let ready = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#;
        self.wait_ready("kubelet", Duration::from_secs(180), || {
            kubectl(&["get", "node", NODE_NAME, "-o", ready]).is_ok_and(|s| s.trim() == "True")
        })?;
        // kubelet writes its kernel tunables (kernel.panic_on_oops=1 among them) once, at
        // start: put the shared machine's values back now rather than at `down`.
        let restored = host::restore_sysctls(&self.state.sysctls);
        if !restored.is_empty() {
            println!("  restored after kubelet's start: {}", restored.join(" "));
        }
        Ok(())
    }

    /// A pod through the whole path: scheduler, kubelet, containerd, CNI ADD, runc; then its
    /// deletion (CNI DEL).
    fn smoke_pod(&mut self, pki: &Pki) -> Result<()> {
        let kubectl = self.kubectl(pki);
        // The ServiceAccount admission plugin rejects pods until kcm has made `default`.
        self.wait_ready("kube-controller-manager", Duration::from_secs(60), || {
            kubectl(&["get", "serviceaccount", "default", "-o", "name"]).is_ok()
        })?;
        let manifest = self.layout.at("manifests/smoke.yaml");
        fs::write(&manifest, config::smoke_pod())?;
        let file = manifest.display().to_string();
        kubectl(&["apply", "-f", &file])?;
        let waited = kubectl(&[
            "wait",
            "--for=condition=Ready",
            "pod/smoke",
            "--timeout=120s",
        ]);
        if let Err(e) = waited {
            let describe = kubectl(&["describe", "pod", "smoke"]).unwrap_or_default();
            return Err(self.failure(
                "kubelet",
                &format!("did not run the smoke pod: {e:#}\n{describe}"),
            ));
        }
        let ip = kubectl(&["get", "pod", "smoke", "-o", "jsonpath={.status.podIP}"])?;
        println!("  pod smoke Running, IP {}", ip.trim());
        kubectl(&["delete", "pod", "smoke", "--wait=true", "--timeout=60s"])?;
        println!("  pod smoke deleted");
        Ok(())
    }

    /// A kubectl runner with the admin kubeconfig, no request timeout; returns stdout.
    fn kubectl(&self, pki: &Pki) -> impl Fn(&[&str]) -> Result<String> + use<> {
        let kubectl = Kubectl {
            bin: self.built.kube("kubectl"),
            kubeconfig: pki.kubeconfig("admin"),
        };
        move |args| kubectl.run_unbounded(args)
    }
}

fn curl(args: &[&str]) -> Option<String> {
    Cmd::new("curl")
        .args(["--max-time", "3"])
        .args(args)
        .read()
        .ok()
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_else(|e| format!("(cannot read: {e})"));
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
