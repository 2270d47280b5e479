//! The node agent as the demo runs it: its host directories, the `sidestep agent` process and
//! its HTTP endpoints, `sidestep uninstall`, and reading back what it enrolled. The demo's steps
//! check what the agent did, so how it is started and asked lives apart from them.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use sidestep_tests::{
    ChildGuard, Pod, Spawn, TestEnv,
    sidestep::{bin_dir, cni_bin, sidestep},
};

use crate::{Line, PRIMARY};

/// The host directories the agent manages, in the demo's scratch space.
pub(super) struct Dirs {
    pub(super) bin: PathBuf,
    pub(super) conf: PathBuf,
    pub(super) state: PathBuf,
}

impl Dirs {
    pub(super) fn agent_args(&self, env: &TestEnv) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        [
            ("cni-bin-dir", s(&self.bin)),
            ("cni-conf-dir", s(&self.conf)),
            ("state-dir", s(&self.state)),
            // No service account: outside a cluster the plugin reads pods from runtimeConfig.
            (
                "service-account-dir",
                s(&env.tmp_dir().join("no-serviceaccount")),
            ),
            ("pin-root", s(env.pin_root())),
            ("cgroup", s(env.cgroup_path())),
            ("cni-binary", s(&cni_bin())),
        ]
        .into_iter()
        .flat_map(|(k, v)| [format!("--{k}"), v])
        .collect()
    }
}

/// `sidestep agent`, stopped (SIGTERM, then SIGKILL) when dropped.
pub(super) struct AgentProc {
    pub(super) child: ChildGuard,
    addr: SocketAddr,
}

impl AgentProc {
    pub(super) fn start(env: &TestEnv, d: &Dirs) -> Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let bin = bin_dir().join("sidestep").display().to_string();
        let mut args = vec![bin, "agent".into()];
        args.extend(d.agent_args(env));
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            // Only the demo's pods are the agent's business.
            "--netns-prefix".into(),
            format!("sidestep-{}-", env.id()),
            "--scan-proc".into(),
            "false".into(),
            "--reconcile-interval".into(),
            "2s".into(),
        ]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = env.spawn(Spawn::new(&argv))?;
        Ok(Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        })
    }

    fn get(&self, path: &str) -> Result<(u16, String)> {
        let mut s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let code = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("bad HTTP response: {out}"))?;
        Ok((
            code,
            out.split_once("\r\n\r\n").map_or("", |(_, b)| b).into(),
        ))
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            self.child.ensure_running()?;
            let last = match self.get("/readyz") {
                Ok((200, body)) => return Ok(body),
                Ok((_, body)) => body,
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                bail!(
                    "agent not ready after {timeout:?}: {last}\n{}",
                    self.child.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every sample, keyed by `name{labels}`.
    pub(super) fn samples(&self) -> Result<BTreeMap<String, f64>> {
        let (_, body) = self.get("/metrics")?;
        Ok(body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect())
    }
}

/// `sidestep uninstall` with the agent's settings, once: at the end of the demo, or when
/// dropped on the way out of a failed step.
pub(super) struct Uninstall {
    pub(super) args: Vec<String>,
    pub(super) done: bool,
}

impl Uninstall {
    /// `sidestep uninstall` with `extra` flags after the agent's: a drain without `--force`.
    pub(super) fn run(&mut self, extra: &[&str]) -> Result<String> {
        self.done = true;
        let mut argv = vec!["uninstall"];
        argv.extend(self.args.iter().map(String::as_str));
        argv.extend(extra);
        let out = sidestep(&argv)?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Uninstall {
    /// On the way out of a failed step pods may still run: everything goes anyway.
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.run(&["--force"])
        {
            eprintln!("sidestep uninstall: {e:#}");
        }
    }
}

/// With SIDESTEP_DEMO_CAPTURE=FILE, appends the agent's /readyz and /metrics to FILE (the
/// examples in docs/OPERATIONS.md come from it).
pub(super) fn capture(agent: &AgentProc, when: &str) -> Result<()> {
    let Some(path) = std::env::var_os("SIDESTEP_DEMO_CAPTURE") else {
        return Ok(());
    };
    let (rc, ready) = agent.get("/readyz")?;
    let (mc, metrics) = agent.get("/metrics")?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)?;
    write!(
        f,
        "=== {when}\n--- GET /readyz ({rc})\n{ready}--- GET /metrics ({mc})\n{metrics}"
    )?;
    Ok(())
}

fn status(pin_root: &Path) -> Result<Value> {
    let out = sidestep(&[
        "status",
        "--json",
        "--pin-root",
        &pin_root.display().to_string(),
    ])?;
    serde_json::from_slice(&out.stdout).context("parsing sidestep status --json")
}

pub(super) fn counter(pin_root: &Path, pod: &Pod, name: &str) -> Result<u64> {
    let cookie = pod.netns_cookie()?;
    status(pin_root)?["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["netns_cookie"].as_u64() == Some(cookie))
        .and_then(|p| p["counters"][name].as_u64())
        .with_context(|| format!("no counter {name} for {}", pod.name))
}

pub(super) fn enrolled(pin_root: &Path) -> Result<Vec<u64>> {
    Ok(status(pin_root)?["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["netns_cookie"].as_u64())
        .collect())
}

pub(super) fn sidestep_entries(conf: &Path) -> Result<Vec<Value>> {
    let v: Value = serde_json::from_slice(&std::fs::read(conf)?)?;
    Ok(v["plugins"].as_array().cloned().unwrap_or_default())
}

/// The agent's own start: ready, plugin installed, entry chained once after the primary's.
pub(super) fn check_agent(
    d: &Dirs,
    agent: &mut AgentProc,
    lines: &mut Vec<Line>,
) -> Result<Vec<Value>> {
    let started = Instant::now();
    let ready = agent.wait_ready(Duration::from_secs(30))?;
    println!(
        "agent ready after {:.1}s: {}",
        started.elapsed().as_secs_f64(),
        ready.lines().next().unwrap_or_default()
    );
    let installed = d.bin.join("sidestep");
    let same = std::fs::read(&installed).ok() == std::fs::read(cni_bin()).ok();
    let plugins = sidestep_entries(&d.conf.join(PRIMARY))?;
    let types: Vec<&str> = plugins.iter().filter_map(|p| p["type"].as_str()).collect();
    lines.push(Line::new(
        "agent: ready, plugin installed, entry chained",
        usize::from(ready.starts_with("ready"))
            + usize::from(same)
            + usize::from(types == ["bridge", "portmap", "sidestep"]),
        3,
        format!("{PRIMARY}: {}", types.join(" + ")),
    ));
    // The runtime runs the file the agent wrote: its entries after the primary plugin.
    Ok(plugins.into_iter().skip(1).collect())
}
