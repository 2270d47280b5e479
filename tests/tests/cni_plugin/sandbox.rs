//! The test's sandbox (cgroup, pin root, netns, state directory) and a runner that executes the
//! plugin exactly as libcni does.

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{Cgroup, cgroup2_mount, netns, sidestep::cni_bin};

pub const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
pub const K8S_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=shop";

pub fn bin_dir() -> PathBuf {
    std::env::var_os("SIDESTEP_BIN_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug"),
        PathBuf::from,
    )
}

pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One test's cgroup, pin root, netns and state; all removed on drop, also after a panic.
pub struct Sandbox {
    name: String,
    pub pin_root: PathBuf,
    cni_path: tempfile::TempDir,
    state: tempfile::TempDir,
    /// The plugin's working directory: kubelet's runtime gives it one it does not own, so a
    /// file appearing here is a write the config did not ask for.
    cwd: tempfile::TempDir,
    netns: Vec<String>,
    /// Host ends of the veth pairs; deleted before the netns so that none outlives the test
    /// while the kernel tears the namespace down asynchronously.
    veths: Vec<String>,
    loaded: bool,
    // Dropped after Drop::drop has unloaded: the cgroup goes last.
    cgroup: Cgroup,
}

impl Sandbox {
    pub fn new(tag: &str) -> Result<Self> {
        let name = format!("cni-{}-{tag}", std::process::id());
        let cgroup = Cgroup::create(cgroup2_mount()?.join(format!("sidestep-test-{name}")))?;
        for bin in ["sidestep", "sidestep-cni"] {
            let p = bin_dir().join(bin);
            ensure!(
                p.is_file(),
                "{} is missing: build with `cargo xtask build` (or set SIDESTEP_BIN_DIR)",
                p.display()
            );
        }
        let cni_path = tempfile::tempdir()?;
        // libcni finds a plugin by its `type` in CNI_PATH; the type is "sidestep".
        std::os::unix::fs::symlink(cni_bin(), cni_path.path().join("sidestep"))?;
        Ok(Self {
            pin_root: Path::new("/sys/fs/bpf").join(format!("sidestep-test-{name}")),
            name,
            cni_path,
            state: tempfile::tempdir()?,
            cwd: tempfile::tempdir()?,
            netns: Vec::new(),
            veths: Vec::new(),
            loaded: false,
            cgroup,
        })
    }

    pub fn load(&mut self) -> Result<()> {
        run(Command::new(bin_dir().join("sidestep"))
            .arg("load")
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--pin-root")
            .arg(&self.pin_root))?;
        self.loaded = true;
        Ok(())
    }

    pub fn unload(&mut self) -> Result<()> {
        run(Command::new(bin_dir().join("sidestep"))
            .args(["unload", "--pin-root"])
            .arg(&self.pin_root))?;
        self.loaded = false;
        Ok(())
    }

    /// A netns with an `eth0` (one end of a veth pair), as a primary plugin leaves it.
    pub fn add_netns(&mut self, short: &str) -> Result<PathBuf> {
        let name = format!("sidestep-test-{}-{short}", self.name);
        let path = netns::create(&name)?;
        self.netns.push(name.clone());
        let host = format!("scn{:x}{short}", std::process::id() & 0xffffff);
        run(Command::new("ip").args([
            "link", "add", &host, "type", "veth", "peer", "name", "eth0", "netns", &name,
        ]))?;
        self.veths.push(host);
        run(Command::new("ip").args(["-n", &name, "link", "set", "eth0", "up"]))?;
        run(Command::new("ip").args(["-n", &name, "link", "set", "lo", "up"]))?;
        Ok(path)
    }

    pub fn del_netns(&mut self, path: &Path) -> Result<()> {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        netns::delete(&name)?;
        self.netns.retain(|n| *n != name);
        Ok(())
    }

    /// A stand-in API server on loopback that answers every GET with `pod` (or, with `None`,
    /// refuses connections), and a kubeconfig pointing at it. It serves for at most ten seconds.
    pub fn api_server(&self, pod: Option<Value>) -> Result<PathBuf> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        match pod {
            None => drop(listener),
            Some(pod) => {
                listener.set_nonblocking(true)?;
                std::thread::spawn(move || {
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                    while std::time::Instant::now() < deadline {
                        let Ok((mut s, _)) = listener.accept() else {
                            std::thread::sleep(std::time::Duration::from_millis(5));
                            continue;
                        };
                        let _ = s.set_nonblocking(false);
                        let mut head = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                            match std::io::Read::read(&mut s, &mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        let body = pod.to_string();
                        let _ = write!(
                            s,
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                });
            }
        }
        let kc = self.state.path().join(format!("kubeconfig-{port}"));
        fs::write(
            &kc,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: t\n\
                 clusters: [{{name: t, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n\
                 contexts: [{{name: t, context: {{cluster: t, user: t}}}}]\n\
                 users: [{{name: t, user: {{token: t}}}}]\n"
            ),
        )?;
        Ok(kc)
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state.path().join("cni")
    }

    /// The plugin's conf as a runtime hands it over, prevResult in `version`'s format.
    pub fn conf(&self, version: &str) -> Value {
        let mut ip = json!({"address": "10.254.0.9/24", "gateway": "10.254.0.1", "interface": 0});
        if version.starts_with("0.") {
            ip["version"] = json!("4");
        }
        json!({
            "cniVersion": version, "name": "sidestep-test", "type": "sidestep",
            "pin_root": self.pin_root, "state_dir": self.state_dir(),
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}},
            "prevResult": {
                "cniVersion": version,
                "interfaces": [{"name": "eth0", "sandbox": "/run/netns/x"}],
                "ips": [ip],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dns": {}
            }
        })
    }

    /// Pod map cookies, from `sidestep status --json`.
    pub fn pods(&self) -> Result<Vec<u64>> {
        let out = run(Command::new(bin_dir().join("sidestep"))
            .args(["status", "--json", "--pin-root"])
            .arg(&self.pin_root))?;
        let v: Value = serde_json::from_str(&out)?;
        let mut c: Vec<u64> = v["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["netns_cookie"].as_u64())
            .collect();
        c.sort_unstable();
        Ok(c)
    }

    /// Per-pod link pins: `tc/<cookie>/<ifname>` (and re-route links) and `sklookup/<cookie>`.
    pub fn pod_links(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(rd) = fs::read_dir(self.pin_root.join("links/tc")) {
            for d in rd.flatten() {
                for f in fs::read_dir(d.path()).into_iter().flatten().flatten() {
                    out.push(format!(
                        "tc/{}/{}",
                        d.file_name().to_string_lossy(),
                        f.file_name().to_string_lossy()
                    ));
                }
            }
        }
        if let Ok(rd) = fs::read_dir(self.pin_root.join("links/sklookup")) {
            out.extend(
                rd.flatten()
                    .map(|f| format!("sklookup/{}", f.file_name().to_string_lossy())),
            );
        }
        out.sort();
        out
    }

    /// Every record under the state directory with its contents. The invocation log
    /// (`timings`, which every call appends to for the agent's metrics) is not state.
    /// What the plugin left in its working directory (nothing, ever).
    pub fn cwd_files(&self) -> Vec<String> {
        std::fs::read_dir(self.cwd.path())
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn state_files(&self) -> BTreeMap<String, String> {
        fn walk(dir: &Path, base: &Path, out: &mut BTreeMap<String, String>) {
            for e in fs::read_dir(dir).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, base, out);
                } else if dir == base && e.file_name().to_string_lossy().starts_with("timings") {
                    continue;
                } else {
                    let rel = p.strip_prefix(base).unwrap().display().to_string();
                    out.insert(rel, fs::read_to_string(&p).unwrap_or_default());
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(&self.state_dir(), &self.state_dir(), &mut out);
        out
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if self.loaded
            && let Err(e) = self.unload()
        {
            eprintln!("cni_plugin: unload {}: {e:#}", self.pin_root.display());
        }
        for v in std::mem::take(&mut self.veths) {
            // Gone already when its netns was deleted earlier in the test.
            let _ = Command::new("ip")
                .args(["link", "del", &v])
                .stderr(Stdio::null())
                .status();
        }
        for n in std::mem::take(&mut self.netns) {
            if let Err(e) = netns::delete(&n) {
                eprintln!("cni_plugin: ip netns del {n}: {e:#}");
            }
        }
        let _ = fs::remove_dir_all(&self.pin_root);
    }
}

/// What the plugin printed and whether it exited 0.
pub struct Out {
    pub ok: bool,
    pub json: Value,
    pub stderr: String,
}

/// Runs the plugin as libcni does: found by type in CNI_PATH, clean environment, conf on stdin.
pub fn cni(sb: &Sandbox, env: &[(&str, &str)], stdin: &[u8]) -> Result<Out> {
    let mut cmd = Command::new(sb.cni_path.path().join("sidestep"));
    cmd.env_clear()
        .current_dir(sb.cwd.path())
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_PATH", sb.cni_path.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child.stdin.take().unwrap().write_all(stdin)?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let json = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("stdout is not JSON: {text}"))?
    };
    Ok(Out {
        ok: out.status.success(),
        json,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

pub fn cmd_env<'a>(command: &'a str, cid: &'a str, netns: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", cid),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", K8S_ARGS),
    ]
}

pub fn call(sb: &Sandbox, command: &str, cid: &str, netns: &Path, conf: &Value) -> Result<Out> {
    let ns = netns.to_string_lossy();
    cni(sb, &cmd_env(command, cid, &ns), &serde_json::to_vec(conf)?)
}

pub fn expect_ok(o: &Out, what: &str) -> Result<()> {
    ensure!(o.ok, "{what} failed: {} / {}", o.json, o.stderr);
    Ok(())
}

pub fn expect_err(o: &Out, code: u64, what: &str) -> Result<()> {
    ensure!(
        !o.ok,
        "{what}: expected error {code}, got success {}",
        o.json
    );
    for k in ["cniVersion", "code", "msg", "details"] {
        ensure!(
            o.json.get(k).is_some(),
            "{what}: error JSON lacks {k}: {}",
            o.json
        );
    }
    ensure!(
        o.json["code"] == code,
        "{what}: expected code {code}, got {}",
        o.json
    );
    Ok(())
}
