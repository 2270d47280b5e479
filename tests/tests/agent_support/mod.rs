//! Running the real `sidestep agent` in a test: its own CNI bin, conf and state directories in
//! the test's scratch space, the test's cgroup and pin root (never the cgroup2 root), a free
//! port on loopback for /healthz, /readyz and /metrics.

#![allow(dead_code)]

#[allow(unused_imports)]
pub use sidestep_tests::podapi::PodApi;

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, PodOptions, Spawn, TestEnv,
    sidestep::{bin_dir, cni_bin},
};

pub const APP_UID: u32 = 1000;
pub const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

/// The host directories the agent manages, all under the test's scratch directory.
pub struct Dirs {
    pub bin: PathBuf,
    pub conf: PathBuf,
    pub state: PathBuf,
    /// The agent's own service account (its token: `agent-token-1`).
    pub sa: PathBuf,
    /// The plugin's service account token Secret (`cni-token-1`), which the plugin's kubeconfig
    /// carries.
    pub cni_sa: PathBuf,
    /// Searched after `bin` by the test's runtime: the plugin answers DEL after uninstall.
    pub fallback_bin: PathBuf,
}

impl Dirs {
    pub fn new(env: &TestEnv) -> Result<Self> {
        let t = env.tmp_dir();
        let d = Self {
            bin: t.join("cni-bin"),
            conf: t.join("net.d"),
            state: t.join("cni-state"),
            sa: t.join("serviceaccount"),
            cni_sa: t.join("sidestep-cni"),
            fallback_bin: t.join("cni-fallback"),
        };
        for p in [&d.bin, &d.conf, &d.sa, &d.cni_sa, &d.fallback_bin] {
            std::fs::create_dir_all(p)?;
        }
        std::os::unix::fs::symlink(cni_bin(), d.fallback_bin.join("sidestep"))?;
        std::fs::write(d.sa.join("token"), "agent-token-1")?;
        std::fs::write(d.cni_sa.join("token"), "cni-token-1")?;
        for sa in [&d.sa, &d.cni_sa] {
            std::fs::write(sa.join("ca.crt"), "-----BEGIN CERTIFICATE-----\nfake\n")?;
        }
        Ok(d)
    }

    /// A primary network for the agent to chain into (the runtime uses the Node's own copy).
    pub fn write_primary(&self, name: &str) -> Result<PathBuf> {
        let p = self.conf.join(name);
        let v = json!({"cniVersion": "1.0.0", "name": "test-net", "plugins": [{"type": "bridge"}]});
        std::fs::write(&p, serde_json::to_vec_pretty(&v)?)?;
        Ok(p)
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.conf.join("ZZZ-sidestep-kubeconfig")
    }

    /// The sidestep entry the agent wrote into `file`.
    pub fn entry(&self, file: &str) -> Result<Value> {
        let v: Value = serde_json::from_slice(&std::fs::read(self.conf.join(file))?)?;
        v["plugins"]
            .as_array()
            .and_then(|p| p.iter().find(|e| e["type"] == "sidestep"))
            .cloned()
            .with_context(|| format!("no sidestep entry in {file}: {v}"))
    }

    pub fn entries_in(&self, file: &str) -> Result<usize> {
        let v: Value = serde_json::from_slice(&std::fs::read(self.conf.join(file))?)?;
        Ok(v["plugins"]
            .as_array()
            .map_or(0, |p| p.iter().filter(|e| e["type"] == "sidestep").count()))
    }

    /// The usual start of a test that needs pods: a primary network `10-test.conflist`, the
    /// agent with [`base_args`] on a free port and ready, and a node whose chain it completed.
    pub fn ready_agent_and_node(&self, env: &TestEnv) -> Result<(Agent, Node)> {
        self.ready_agent_and_node_with(env, &[])
    }

    /// As [`Self::ready_agent_and_node`], the agent with `extra` arguments.
    pub fn ready_agent_and_node_with(
        &self,
        env: &TestEnv,
        extra: &[&str],
    ) -> Result<(Agent, Node)> {
        self.write_primary("10-test.conflist")?;
        let port = free_port()?;
        let mut args = base_args(env, self, port);
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let mut agent = Agent::start(env, &args, port)?;
        agent.wait_ready(std::time::Duration::from_secs(30))?;
        let node = self.node(env, "10-test.conflist")?;
        Ok((agent, node))
    }

    /// A node whose chain is the entry the agent wrote, run from the installed binary.
    pub fn node(&self, env: &TestEnv, file: &str) -> Result<Node> {
        Node::new(
            env,
            NodeOptions {
                dual_stack: false,
                chain: vec![self.entry(file)?],
                plugin_dirs: vec![self.bin.clone(), self.fallback_bin.clone()],
            },
        )
    }
}

pub fn meshed() -> PodOptions {
    PodOptions {
        namespace: "shop".into(),
        runtime_config: Some(json!({
            "io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}
        })),
        ..Default::default()
    }
}

/// A port free now for an agent to listen on, below the kernel's ephemeral range: a port from
/// that range (what binding port 0 gives) can be taken by any outgoing connection of the
/// machine between this check and the agent's bind (CI saw `Address already in use` so). The
/// scan starts at a place of its own per process and call, so concurrent tests rarely try the
/// same ports.
pub fn free_port() -> Result<u16> {
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    const LOW: u32 = 20000;
    let span = ephemeral_low.saturating_sub(LOW).max(1000);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = (std::process::id() * 7919 + call * 104_729) % span;
    for i in 0..span {
        let port = (LOW + (start + i) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The agent's default plugin entry (`pod_source: auto`: the Pod from the API first), with a
/// budget of one API try: the test nodes' API (127.0.0.1:6443 from the service account) does not
/// answer, so each ADD takes the default path's fallback, the runtime's annotations, at once
/// rather than after the 30 tries a real node's budget allows.
const TEST_PLUGIN_JSON: &str = r#"{
  "type": "sidestep",
  "pin_root": "__PIN_ROOT__",
  "state_dir": "__STATE_DIR__",
  "log_level": "__LOG_LEVEL__",
  "pod_namespace": "__POD_NAMESPACE__",
  "capabilities": { "io.kubernetes.cri.pod-annotations": true },
  "kubernetes": { "kubeconfig": "__KUBECONFIG_FILEPATH__", "pod_read_retries": 1 }
}"#;

/// The flags every test agent gets.
pub fn base_args(env: &TestEnv, d: &Dirs, port: u16) -> Vec<String> {
    let s = |p: &Path| p.display().to_string();
    vec![
        "agent".into(),
        "--plugin-json".into(),
        TEST_PLUGIN_JSON.into(),
        "--log-level".into(),
        "sidestep=debug,info".into(),
        "--cni-bin-dir".into(),
        s(&d.bin),
        "--cni-conf-dir".into(),
        s(&d.conf),
        "--state-dir".into(),
        s(&d.state),
        "--service-account-dir".into(),
        s(&d.sa),
        "--cni-service-account-dir".into(),
        s(&d.cni_sa),
        "--pin-root".into(),
        s(env.pin_root()),
        "--cgroup".into(),
        s(env.cgroup_path()),
        "--cni-binary".into(),
        s(&cni_bin()),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--netns-prefix".into(),
        format!("sidestep-{}-", env.id()),
        "--scan-proc".into(),
        "false".into(),
    ]
}

pub struct Agent {
    pub child: ChildGuard,
    pub addr: SocketAddr,
}

impl Agent {
    pub fn start(env: &TestEnv, args: &[String], port: u16) -> Result<Self> {
        let bin = bin_dir().join("sidestep");
        Self::start_program(env, &bin.display().to_string(), args, port)
    }

    /// Runs `program args` (a wrapper such as setpriv that execs the agent, or the agent).
    pub fn start_program(env: &TestEnv, program: &str, args: &[String], port: u16) -> Result<Self> {
        let bin = program.to_owned();
        let mut argv: Vec<&str> = vec![&bin];
        argv.extend(args.iter().map(String::as_str));
        let child = env.spawn(Spawn::new(&argv).env(&[
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "6443"),
        ]))?;
        Ok(Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        })
    }

    /// GET `path`: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.addr, path)
    }

    pub fn wait_ready(&mut self, timeout: Duration) -> Result<String> {
        let timeout = sidestep_tests::scaled(timeout);
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
                    "agent not ready after {timeout:?}: {last}\nlog:\n{}",
                    self.child.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A metric's value (the first sample whose line starts with `name`).
    pub fn metric(&self, name: &str) -> Result<f64> {
        let (_, body) = self.get("/metrics")?;
        body.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no metric {name} in:\n{body}"))
    }

    pub fn log(&self) -> String {
        self.child.stderr()
    }

    /// Waits until the log contains `needle`.
    pub fn wait_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let timeout = sidestep_tests::scaled(timeout);
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            self.child.ensure_running()?;
            if Instant::now() >= deadline {
                bail!(
                    "agent log has no {needle:?} after {timeout:?}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

/// GET `path` from `addr`: (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad HTTP response: {out}"))?;
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}

/// Polls `f` until it returns true.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<bool>,
) -> Result<()> {
    // A wait, not a claim: it stretches with the machine's speed (claims check elapsed time).
    let timeout = sidestep_tests::scaled(timeout);
    let deadline = Instant::now() + timeout;
    loop {
        if f()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// wrk's totals: (requests, errors of any kind).
pub fn parse_wrk(out: &str) -> Result<(u64, u64)> {
    let mut requests = None;
    let mut errors = 0;
    for l in out.lines().map(str::trim) {
        if let Some(v) = l.strip_prefix("Socket errors:") {
            for part in v.split(',') {
                errors += part
                    .split_whitespace()
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        } else if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if l.contains(" requests in ") {
            requests = l.split_whitespace().next().and_then(|n| n.parse().ok());
        }
    }
    Ok((requests.context("no `N requests in` line")?, errors))
}

/// `sidestep status --json` for the env's pin root.
pub fn status(env: &TestEnv) -> Result<Value> {
    let out = sidestep_tests::sidestep::sidestep(&[
        "status",
        "--json",
        "--pin-root",
        &env.pin_root().display().to_string(),
    ])?;
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// (attach point, link id, prog id) of every cgroup attachment.
pub fn attachments(env: &TestEnv) -> Result<Vec<(String, u64, u64)>> {
    let s = status(env)?;
    Ok(s["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            (
                a["attach_point"].as_str().unwrap_or_default().to_owned(),
                a["link_id"].as_u64().unwrap_or(0),
                a["prog_id"].as_u64().unwrap_or(0),
            )
        })
        .collect())
}

pub fn enrolled_cookies(env: &TestEnv) -> Result<Vec<u64>> {
    let s = status(env)?;
    Ok(s["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["netns_cookie"].as_u64())
        .collect())
}

/// `sidestep uninstall --force` with the agent's settings, a test's clean-up: everything goes,
/// whatever pods still run; returns its stdout.
pub fn uninstall(env: &TestEnv, d: &Dirs) -> Result<String> {
    uninstall_with(env, d, &["--force"])
}

/// `sidestep uninstall` with the agent's settings and `extra` flags: a drain without any.
pub fn uninstall_with(env: &TestEnv, d: &Dirs, extra: &[&str]) -> Result<String> {
    let s = |p: &Path| p.display().to_string();
    let mut args = vec![
        "uninstall".to_string(),
        "--netns-prefix".into(),
        format!("sidestep-{}-", env.id()),
        "--scan-proc".into(),
        "false".into(),
        "--cni-bin-dir".into(),
        s(&d.bin),
        "--cni-conf-dir".into(),
        s(&d.conf),
        "--state-dir".into(),
        s(&d.state),
        "--pin-root".into(),
        s(env.pin_root()),
        "--cni-binary".into(),
        s(&cni_bin()),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = sidestep_tests::sidestep::sidestep(&argv)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Every sample of /metrics, keyed by the text before its value (`name{labels}`).
pub fn samples(agent: &Agent) -> Result<std::collections::BTreeMap<String, f64>> {
    let (code, body) = agent.get("/metrics")?;
    if code != 200 {
        bail!("/metrics answered {code}: {body}");
    }
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect())
}

/// The capability sets of every thread of `pid`: (CapInh, CapPrm, CapEff, CapBnd, CapAmb).
pub fn thread_caps(pid: u32) -> Result<Vec<[u64; 5]>> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let text = std::fs::read_to_string(t?.path().join("status"))?;
        let get = |k: &str| -> Result<u64> {
            let v = text
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .with_context(|| format!("no {k} in /proc/{pid}/task/*/status"))?;
            Ok(u64::from_str_radix(v.trim(), 16)?)
        };
        out.push([
            get("CapInh:")?,
            get("CapPrm:")?,
            get("CapEff:")?,
            get("CapBnd:")?,
            get("CapAmb:")?,
        ]);
    }
    Ok(out)
}

/// A Pod object as the API serves it: on `node`, with `ips`; with Istio's injection (its
/// status annotation, istio-validation init container and istio-proxy sidecar) when `injected`.
pub fn api_pod(node: &str, ns: &str, name: &str, ips: &[String], injected: bool) -> Value {
    let mut containers = vec![json!({"name": "app", "image": "nginx"})];
    let mut init = Vec::new();
    let mut annotations = json!({});
    if injected {
        annotations["sidecar.istio.io/status"] = json!(STATUS);
        init.push(json!({"name": "istio-validation", "image": "docker.io/istio/proxyv2:1.22.0"}));
        containers.push(
            json!({"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0",
            "args": ["proxy", "sidecar"],
            "securityContext": {"runAsUser": 1337, "runAsGroup": 1337}}),
        );
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}"),
                     "labels": {"app": name}, "annotations": annotations},
        "spec": {"nodeName": node, "initContainers": init, "containers": containers},
        "status": {"phase": "Running", "podIP": ips.first(),
                   "podIPs": ips.iter().map(|i| json!({"ip": i})).collect::<Vec<_>>()}
    })
}

/// Build B for upgrade tests: build A's object with one more ELF section. The programs, maps and
/// their layout are unchanged (compatible); the bytes, and so the loaded programs, are new.
pub fn object_b(env: &TestEnv) -> Result<std::path::PathBuf> {
    let a = std::env::var_os("SIDESTEP_BPF_OBJECT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bpf/sidestep.bpf.o")
        });
    let note = env.tmp_dir().join("build-b.txt");
    std::fs::write(&note, "sidestep build B\n")?;
    let b = env.tmp_dir().join("sidestep-b.bpf.o");
    let out = std::process::Command::new("llvm-objcopy")
        .arg(format!("--add-section=.sidestep.build={}", note.display()))
        .arg(&a)
        .arg(&b)
        .output()
        .context("llvm-objcopy (apt-get install llvm)")?;
    anyhow::ensure!(
        out.status.success(),
        "llvm-objcopy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(std::fs::read(&a)? != std::fs::read(&b)?);
    Ok(b)
}

/// The agent exits within a while, failing, with each of `want` in its log; /readyz never
/// answers 200 meanwhile, and nothing is pinned at the test's pin root. Returns the log.
pub fn refuses(env: &TestEnv, agent: &mut Agent, want: &[&str]) -> Result<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = agent.child.try_wait()? {
            break st;
        }
        if let Ok((200, body)) = agent.get("/readyz") {
            anyhow::bail!("the agent went ready:\n{body}\nlog:\n{}", agent.log());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the agent still runs after 30s:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = agent.log();
    ensure!(!status.success(), "exited {status}:\n{log}");
    for w in want {
        ensure!(log.contains(w), "no {w:?} in the agent's error:\n{log}");
    }
    ensure!(
        agent.get("/readyz").is_err(),
        "something answers /readyz after the agent exited"
    );
    ensure!(
        !env.pin_root().exists(),
        "the refusing agent pinned {}",
        env.pin_root().display()
    );
    Ok(log)
}

/// An ADD the plugin refuses (the netns is not a network namespace: CNI code 8), run as a runtime
/// would, so that /metrics has a failure to count.
pub fn failing_add(d: &Dirs, entry: &Value, container_id: &str) -> Result<()> {
    let mut conf = entry.clone();
    conf["cniVersion"] = json!("1.0.0");
    conf["name"] = json!("test-net");
    let mut child = std::process::Command::new(d.bin.join("sidestep"))
        .env_clear()
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", "/dev/null")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", &d.bin)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        !out.status.success(),
        "ADD into /dev/null succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}
