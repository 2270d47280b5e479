//! Fault-test helpers: the CNI plugin run as a runtime would but with a failpoint armed
//! (`SIDESTEP_FAILPOINT`, see `sidestep::sys::failpoint`), and a snapshot of everything a pod's
//! enrolment consists of (map entries, pinned and kernel links, state files), so a test can
//! require "exactly as a clean ADD leaves it" or "exactly as before".

use std::{
    collections::BTreeMap,
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::{cni, env::TestEnv, pod::Pod, sidestep::cni_bin};

/// Maps with one or more entries per enrolled pod.
pub const POD_MAPS: [&str; 6] = [
    "SIDESTEP_POD",
    "SIDESTEP_ADDRS",
    "SIDESTEP_PORTS",
    "SIDESTEP_CIDRS",
    "SIDESTEP_STATS",
    "SIDESTEP_IFACES",
];

/// `bpftool ARGS --json`. A whole-system walk (`link show`, `prog show`) fails now and then when
/// another process removes an object under it, so a failure is retried twice. An empty listing
/// (`cgroup show` of a cgroup with nothing attached prints a bare newline) is an empty array.
/// In JSON mode bpftool reports its errors on stdout, so the error names both streams.
pub fn bpftool(args: &[&str]) -> Result<Value> {
    let mut attempt = 0;
    loop {
        let out = Command::new("bpftool")
            .args(args)
            .arg("--json")
            .output()
            .context("running bpftool")?;
        attempt += 1;
        if out.status.success() {
            if out.stdout.trim_ascii().is_empty() {
                return Ok(Value::Array(Vec::new()));
            }
            return serde_json::from_slice(&out.stdout)
                .with_context(|| format!("bpftool {args:?} output"));
        }
        ensure!(
            attempt < 3,
            "bpftool {args:?}: {} {}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Everything a pod's enrolment consists of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub maps: BTreeMap<&'static str, usize>,
    /// Pins under links/tc and links/sklookup.
    pub pod_link_pins: Vec<String>,
    /// Kernel links running one of this pin root's programs.
    pub links: usize,
    /// Files in the state directory (hidden ones too), the plugin's timing log aside.
    pub files: Vec<String>,
    pub pending: bool,
}

fn tree(dir: &Path, base: &Path, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            tree(&p, base, out);
        } else {
            out.push(p.strip_prefix(base).unwrap_or(&p).display().to_string());
        }
    }
}

/// A meshed pod's annotations, as the runtime passes them.
const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

/// The plugin invoked as a runtime would (the real binary, the pod's prevResult and CNI_ARGS,
/// a meshed pod's annotations), with a failpoint when asked.
pub struct Plugin {
    pub pin_root: PathBuf,
    pub state: PathBuf,
    pub network: String,
    /// The plugin's configuration entry (`type` sidestep).
    pub entry: Value,
}

impl Plugin {
    /// The plugin on `pin_root`, with its state in the env's scratch directory.
    pub fn new(env: &TestEnv, pin_root: &Path) -> Self {
        let state = env.tmp_dir().join("cni-state");
        let entry = json!({
            "type": "sidestep",
            "pin_root": pin_root,
            "state_dir": state,
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        });
        Self::with_entry(env, entry)
    }

    /// The plugin with a given entry (e.g. the one the agent wrote).
    pub fn with_entry(env: &TestEnv, entry: Value) -> Self {
        let path = |k: &str| PathBuf::from(entry[k].as_str().unwrap_or_default());
        Self {
            pin_root: path("pin_root"),
            state: path("state_dir"),
            network: format!("faults-{}", env.id()),
            entry,
        }
    }

    pub fn run(&self, command: &str, pod: &Pod, failpoint: Option<&str>) -> Result<Output> {
        Ok(self.spawn(command, pod, failpoint)?.wait_with_output()?)
    }

    /// Runs with the plugin stopped at `point` (`stop:<point>`), runs `meanwhile`, lets the
    /// plugin go on, and returns how it ended.
    pub fn paused(
        &self,
        command: &str,
        pod: &Pod,
        point: &str,
        meanwhile: impl FnOnce() -> Result<()>,
    ) -> Result<Output> {
        let child = self.spawn(command, pod, Some(&format!("stop:{point}")))?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
        let stat = format!("/proc/{pid}/stat");
        let deadline = Instant::now() + Duration::from_secs(10);
        // The state is the field after the parenthesised command name.
        let stopped = || {
            std::fs::read_to_string(&stat).is_ok_and(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
            })
        };
        while !stopped() {
            if Instant::now() > deadline {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                let out = child.wait_with_output()?;
                bail!(
                    "{command} never stopped at {point} ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let result = meanwhile();
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT)?;
        let out = child.wait_with_output()?;
        result.map(|()| out)
    }

    fn spawn(&self, command: &str, pod: &Pod, failpoint: Option<&str>) -> Result<Child> {
        let rc = json!({"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}});
        let conf = cni::plugin_conf(&self.network, &self.entry, Some(&pod.cni_result), Some(&rc));
        let mut cmd = Command::new(cni_bin());
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &pod.container_id)
            .env("CNI_NETNS", &pod.netns_path)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_ARGS", &pod.cni_args)
            .env("CNI_PATH", "/usr/lib/cni")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(f) = failpoint {
            cmd.env("SIDESTEP_FAILPOINT", f);
        }
        let mut child = cmd.spawn().context("spawning sidestep-cni")?;
        std::io::Write::write_all(
            &mut child.stdin.take().context("stdin")?,
            &serde_json::to_vec(&conf)?,
        )?;
        Ok(child)
    }

    /// Runs and requires success.
    pub fn ok(&self, command: &str, pod: &Pod) -> Result<Output> {
        let out = self.run(command, pod, None)?;
        ensure!(
            out.status.success(),
            "{command} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(out)
    }

    /// Runs with `failpoint` armed and requires the plugin to have died by SIGKILL there.
    pub fn killed(&self, command: &str, pod: &Pod, failpoint: &str) -> Result<()> {
        let out = self.run(command, pod, Some(failpoint))?;
        ensure!(
            out.status.signal() == Some(libc::SIGKILL),
            "{command} with failpoint {failpoint} was not killed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    pub fn record_path(&self, pod: &Pod) -> PathBuf {
        self.state.join(format!("{}@eth0.json", pod.container_id))
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut maps = BTreeMap::new();
        for m in POD_MAPS {
            let path = self.pin_root.join("maps").join(m).display().to_string();
            let n = bpftool(&["map", "dump", "pinned", &path])?
                .as_array()
                .map_or(0, Vec::len);
            maps.insert(m, n);
        }
        let mut pod_link_pins = Vec::new();
        let links_dir = self.pin_root.join("links");
        for d in ["tc", "sklookup", "podid"] {
            tree(&links_dir.join(d), &links_dir, &mut pod_link_pins);
        }
        pod_link_pins.sort();
        let root = format!("{}/", self.pin_root.display());
        let own: Vec<u64> = bpftool(&["prog", "show", "-f"])?
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| {
                p["pinned"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|x| x.as_str().is_some_and(|x| x.starts_with(&root)))
            })
            .filter_map(|p| p["id"].as_u64())
            .collect();
        let links = bpftool(&["link", "show"])?
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| l["prog_id"].as_u64().is_some_and(|id| own.contains(&id)))
            .count();
        let mut files = Vec::new();
        tree(&self.state, &self.state, &mut files);
        files.retain(|f| !f.starts_with("timings"));
        files.sort();
        // The record, not the netns-cookie index entries under cookies/.
        let record = files
            .iter()
            .find(|f| f.ends_with(".json") && !f.contains('/'))
            .cloned()
            .unwrap_or_default();
        let pending = std::fs::read(self.state.join(record))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["pending"] == true);
        Ok(Snapshot {
            maps,
            pod_link_pins,
            links,
            files,
            pending,
        })
    }

    /// Waits (links and map entries go after an RCU grace period) for `want`.
    pub fn expect(&self, what: &str, want: &Snapshot) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = self.snapshot()?;
            if now == *want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("{what}:\n want {want:?}\n have {now:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
