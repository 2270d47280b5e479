//! `cargo xtask bench cni`: sidestep-cni ADD and DEL as whole process invocations against
//! installing Istio's default ruleset with `iptables-restore` + `ip6tables-restore`, in one
//! interleaved run.
//!
//! Both sides are timed the same way: from just before the spawn to the exit of the process
//! (for Istio, the sum of its two processes), with stdin written from a pipe, as a runtime
//! hands a plugin its config and as istio-cni hands iptables-restore its rules. Each run gets a
//! fresh network namespace (lo, and a veth `eth0` whose peer stays inside, with an address),
//! made and deleted outside the timed part for both sides. The plugin gets the environment and
//! stdin a Kubernetes runtime gives it: CNI_* variables, K8S_* args, a prevResult naming the
//! interface and address, and the pod annotations in runtimeConfig, so it reads no API.
//!
//! istio-cni reads the Pod from the API server on every ADD, so a fifth lane measures what
//! that costs: sidestep-cni with `pod_source: api` GETs the Pod from a local API server
//! ([`PodApi`], plain HTTP on loopback) before its ADD, and the two iptables lanes get the same
//! GET (a fresh connection, the request and the decoded answer, timed in this process) added to
//! their install, which is what istio-cni pays besides its own process.
//!
//! Both iptables back ends are measured, nf_tables (what `iptables-restore` is on this machine
//! and what current Istio picks on such a host) and legacy, and the target is judged against
//! the faster of the two.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::env::TestEnv;
use crate::istio_iptables::IstioCapture;
use crate::netns;
use crate::podapi::PodApi;
use crate::sidestep::cni_bin;

/// Annotations of a pod that Istio's injector has processed (what the runtime passes in
/// runtimeConfig with the `io.kubernetes.cri.pod-annotations` capability).
pub fn injected_annotations() -> Value {
    json!({
        "sidecar.istio.io/status": "{\"initContainers\":null,\"containers\":[\"istio-proxy\"],\"volumes\":[\"istio-envoy\"],\"imagePullSecrets\":null,\"revision\":\"default\"}",
        "kubectl.kubernetes.io/default-container": "app",
        "prometheus.io/scrape": "true",
    })
}

/// The Pod the API lane's ADDs read: what an injected pod's spec holds that decides its
/// capture (the proxy container with its UID and args, the injector's annotations).
pub fn injected_pod(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": "5e5e5e5e-0000-4000-8000-000000000001",
                     "labels": {"app": name, "security.istio.io/tlsMode": "istio"},
                     "annotations": injected_annotations()},
        "spec": {
            "nodeName": "bench",
            "containers": [
                {"name": "app", "image": "nginx", "ports": [{"containerPort": 80}]},
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.28.0",
                 "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local"],
                 "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "false"}],
                 "securityContext": {"runAsUser": 1337, "runAsGroup": 1337}}
            ]
        },
        "status": {"phase": "Pending"}
    })
}

#[derive(Clone, Debug, Default)]
pub struct CniBench {
    /// Milliseconds per sidestep-cni ADD with the default `inbound_hook: sk_lookup` (maps, the
    /// netns's sk_lookup link, record).
    pub add_ms: Vec<f64>,
    /// Milliseconds per sidestep-cni DEL of that attachment.
    pub del_ms: Vec<f64>,
    /// The same two with `inbound_hook: tc` (plus a TCX link on eth0).
    pub add_tc_ms: Vec<f64>,
    pub del_tc_ms: Vec<f64>,
    /// The default ADD and its DEL with `pod_source: api`: the Pod read from the API first.
    pub add_api_ms: Vec<f64>,
    pub del_api_ms: Vec<f64>,
    /// Milliseconds of the in-process GET of the same Pod that precedes each iptables install.
    pub get_ms: Vec<f64>,
    /// Each iptables install plus the GET before it (what istio-cni pays, without its process).
    pub nft_get_ms: Vec<f64>,
    pub legacy_get_ms: Vec<f64>,
    /// Size of the Pod's JSON the API answers with.
    pub api_pod_bytes: usize,
    /// Milliseconds per Istio install with iptables-nft-restore + ip6tables-nft-restore.
    pub nft_ms: Vec<f64>,
    /// The same with the legacy back end.
    pub legacy_ms: Vec<f64>,
    /// Milliseconds per install of Istio's native nftables ruleset (`nft -f`, one inet table:
    /// `global.nativeNftables`, 1.27+), and the same plus the GET.
    pub native_nft_ms: Vec<f64>,
    pub native_nft_get_ms: Vec<f64>,
    /// Milliseconds per `sidestep-cni` VERSION: the plugin's process start-up floor.
    pub version_ms: Vec<f64>,
    /// Rule lines (v4, v6) of the installed ruleset.
    pub rule_lines: (usize, usize),
    /// File system type of the plugin's state directory (its fsync cost depends on it).
    pub state_fs: String,
    /// From a separate pass under strace (untimed): ms the kernel spent in the TCX attach of
    /// each ADD, and in the link detaches (tc and sk_lookup) of each DEL. Empty without strace.
    pub tcx_attach_ms: Vec<f64>,
    /// TCX attaches one tc-hook ADD made in that pass.
    pub tcx_attaches: usize,
    pub tcx_detach_ms: Vec<f64>,
}

/// A throwaway netns `sidestep-<env id>-<tag>-<n>` (so the crate's sweep removes it if this
/// process dies), deleted on drop.
pub struct FreshNetns {
    pub name: String,
    pub path: PathBuf,
}

impl FreshNetns {
    /// lo up, and a veth `eth0` (peer `peer0`, both inside the netns, so no host interface is
    /// touched) with `cidr`. Two `ip` processes: `netns add`, then one batch.
    pub fn new(env: &TestEnv, tag: &str, n: usize, cidr: &str) -> Result<Self> {
        let name = format!("sidestep-{}-{tag}-{n}", env.id());
        let path = netns::create(&name)?;
        let ns = Self { name, path };
        let batch = format!(
            "link set lo up\nlink add eth0 type veth peer name peer0\nlink set peer0 up\n\
             addr add {cidr} dev eth0\nlink set eth0 up\n"
        );
        let mut child = Command::new("ip")
            .args(["-n", &ns.name, "-b", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawn ip -b")?;
        child
            .stdin
            .take()
            .context("ip stdin")?
            .write_all(batch.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "ip -n {} -b: {}",
                ns.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(ns)
    }
}

impl Drop for FreshNetns {
    fn drop(&mut self) {
        if let Err(e) = netns::delete(&self.name) {
            eprintln!("bench: deleting netns {}: {e:#}", self.name);
        }
    }
}

/// A pod that stays enrolled (default hook) for the whole run, as on a node that runs meshed
/// pods: the first sk_lookup link on a machine turns a kernel static key on (text patching on
/// every CPU) and the last one off, which a node pays once, not per pod. DEL on drop.
struct ResidentPod<'a> {
    call: PluginCall<'a>,
    _netns: &'a FreshNetns,
}

impl Drop for ResidentPod<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.call.run("DEL") {
            eprintln!("bench: DEL of the resident pod: {e:#}");
        }
    }
}

/// setns(2) into a network namespace; for `pre_exec`.
fn setns_net(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: plain system call on an integer fd and a flag; no memory is passed.
    if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Spawns `c` with `stdin` on a pipe and waits for it; the time from spawn to exit. `netns`:
/// the child joins it between fork and exec (as istio-cni runs iptables-restore).
pub fn timed(mut c: Command, stdin: &[u8], netns: Option<&Path>) -> Result<(Duration, Value)> {
    let ns = netns
        .map(|p| std::fs::File::open(p).with_context(|| format!("open {}", p.display())))
        .transpose()?;
    if let Some(fd) = ns.as_ref().map(AsRawFd::as_raw_fd) {
        // SAFETY: the hook runs in the forked child before exec and only calls setns(2), which
        // is async-signal-safe, on `fd`, which stays open in the parent until the child exits.
        unsafe {
            c.pre_exec(move || setns_net(fd));
        }
    }
    c.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let mut child = c.spawn().with_context(|| format!("spawn {c:?}"))?;
    // A config or a ruleset is a few KiB: the pipe takes it whole before the child reads.
    child.stdin.take().context("stdin")?.write_all(stdin)?;
    let out = child.wait_with_output()?;
    let took = t.elapsed();
    drop(ns);
    if !out.status.success() {
        bail!(
            "{c:?} failed ({}): {} {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    Ok((took, v))
}

/// One sidestep-cni invocation, as a Kubernetes runtime makes it.
pub struct PluginCall<'a> {
    pub pin_root: &'a Path,
    pub state_dir: &'a Path,
    pub netns: &'a Path,
    pub container_id: &'a str,
    pub pod: &'a str,
    /// The address (CIDR) prevResult reports for eth0.
    pub cidr: &'a str,
    /// The plugin's `inbound_hook` (`None`: its default, sk_lookup).
    pub inbound_hook: Option<&'a str>,
    /// `Some`: no runtime annotations; the plugin reads the Pod through this kubeconfig
    /// (`pod_source: api`).
    pub kubeconfig: Option<&'a Path>,
}

impl PluginCall<'_> {
    pub fn stdin(&self) -> Vec<u8> {
        let mut conf = json!({
            "cniVersion": "1.0.0",
            "name": "bench",
            "type": "sidestep",
            "pin_root": self.pin_root,
            "state_dir": self.state_dir,
            "log_level": "warn",
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": injected_annotations()},
            "prevResult": {
                "cniVersion": "1.0.0",
                "interfaces": [{"name": "eth0", "sandbox": self.netns}],
                "ips": [{"address": self.cidr, "interface": 0}],
            },
        });
        if let Some(hook) = self.inbound_hook {
            conf["inbound_hook"] = json!(hook);
        }
        if let (Some(kubeconfig), Some(obj)) = (self.kubeconfig, conf.as_object_mut()) {
            obj.remove("capabilities");
            obj.remove("runtimeConfig");
            obj.insert("pod_source".into(), json!("api"));
            obj.insert("kubernetes".into(), json!({"kubeconfig": kubeconfig}));
        }
        serde_json::to_vec(&conf).expect("JSON")
    }

    pub fn command(&self, cni_command: &str) -> Command {
        let mut c = Command::new(cni_bin());
        c.env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("CNI_COMMAND", cni_command)
            .env("CNI_CONTAINERID", self.container_id)
            .env("CNI_NETNS", self.netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/opt/cni/bin:/usr/lib/cni")
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={};\
                     K8S_POD_INFRA_CONTAINER_ID={}",
                    self.pod, self.container_id
                ),
            );
        c
    }

    /// Runs `cni_command` under `strace -f -T -e trace=bpf` and returns the durations (ms) of
    /// the bpf(2) calls whose line contains `what`.
    pub fn bpf_call_ms(&self, cni_command: &str, what: &str, out: &Path) -> Result<Vec<f64>> {
        let inner = self.command(cni_command);
        let mut c = Command::new("strace");
        c.args(["-f", "-T", "-e", "trace=bpf", "-o"]).arg(out);
        c.arg(inner.get_program()).args(inner.get_args());
        c.env_clear();
        for (k, v) in inner.get_envs() {
            if let Some(v) = v {
                c.env(k, v);
            }
        }
        timed(c, &self.stdin(), None)?;
        let text = std::fs::read_to_string(out)?;
        Ok(text
            .lines()
            .filter(|l| l.contains(what))
            .filter_map(|l| {
                let t = l.rsplit_once('<')?.1.strip_suffix('>')?;
                t.parse::<f64>().ok().map(|s| s * 1e3)
            })
            .collect())
    }

    /// Runs `cni_command` (ADD, DEL) and returns its wall time.
    pub fn run(&self, cni_command: &str) -> Result<Duration> {
        let (d, out) = timed(self.command(cni_command), &self.stdin(), None)?;
        if cni_command == "ADD" && out.get("interfaces").is_none() {
            bail!("sidestep-cni ADD printed no result: {out}");
        }
        Ok(d)
    }
}

/// A 64-hex container ID, as containerd makes them.
pub fn container_id(tag: &str, n: usize) -> String {
    let seed = format!("{tag}{n}");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = String::new();
    for i in 0..4u64 {
        for b in seed.bytes().chain(i.to_le_bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        out.push_str(&format!("{h:016x}"));
    }
    out
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

fn fs_type(path: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(path)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// One GET of `path` over a fresh connection, as a plugin process makes it, with the answer
/// decoded; its duration.
fn get_once(addr: SocketAddr, path: &str) -> Result<Duration> {
    let t = Instant::now();
    let mut conn = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    conn.set_nodelay(true)?;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n\
         Authorization: Bearer sidestep-test-token\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer)?;
    let body = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| &answer[i + 4..])
        .context("GET: no HTTP body")?;
    let pod: Value = serde_json::from_slice(body).context("GET: the Pod's JSON")?;
    let took = t.elapsed();
    ensure!(
        answer.starts_with(b"HTTP/1.1 200") && pod["kind"] == "Pod",
        "GET {path}: {}",
        String::from_utf8_lossy(&answer[..answer.len().min(200)])
    );
    Ok(took)
}

/// A kubeconfig for `api` that names a cluster CA, as every real one does (the agent writes the
/// service account's). Without a CA, kube's client loads the host's native root certificates
/// on every start (about 5 ms here, 150 files), which no node's plugin pays. The CA is a fresh
/// self-signed one; the server speaks plain HTTP, so it only has to parse.
fn kubeconfig_with_ca(api: &PodApi, dir: &Path) -> Result<PathBuf> {
    let (key, cert) = (dir.join("bench-ca.key"), dir.join("bench-ca.crt"));
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=sidestep-bench-ca",
            "-keyout",
        ])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .context("spawn openssl")?;
    ensure!(
        out.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let path = dir.join("bench-kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: b\n\
             clusters: [{{name: b, cluster: {{server: 'http://{}', certificate-authority: '{}'}}}}]\n\
             contexts: [{{name: b, context: {{cluster: b, user: b}}}}]\n\
             users: [{{name: b, user: {{token: sidestep-test-token}}}}]\n",
            api.addr,
            cert.display()
        ),
    )?;
    Ok(path)
}

fn restore_pair(netns: &Path, variant: &str, v4: &[u8], v6: &[u8]) -> Result<Duration> {
    let mut total = Duration::ZERO;
    for (tool, rules) in [("iptables", v4), ("ip6tables", v6)] {
        let mut c = Command::new(format!("{tool}-{variant}-restore"));
        c.args(["--noflush", "-w", "5"]);
        total += timed(c, rules, Some(netns))?.0;
    }
    Ok(total)
}

/// `runs` timed runs of each of ADD+DEL (default sk_lookup hook), ADD+DEL (tc hook), ADD+DEL
/// with the Pod from the API, nft install, legacy install and Istio's native nftables install
/// (each install after the API GET),
/// after two untimed warm-up rounds, rotating their order every round. One other pod stays
/// enrolled throughout.
pub fn run(env: &TestEnv, pin_root: &Path, runs: usize) -> Result<CniBench> {
    let istio = IstioCapture {
        ipv6: true,
        ..IstioCapture::default()
    };
    let v4 = istio.iptables_restore_v4();
    let v6 = istio.iptables_restore_v6();
    let native_nft = crate::istio_nftables::default_sidecar(true);
    let lines = |s: &str| s.lines().filter(|l| !l.trim().is_empty()).count();
    let state_dir = env.tmp_dir().join("cni-state");
    std::fs::create_dir_all(&state_dir)?;
    let mut res = CniBench {
        rule_lines: (lines(&v4), lines(&v6)),
        state_fs: fs_type(&state_dir),
        ..CniBench::default()
    };
    let api_pod = injected_pod("bench", "api-pod");
    res.api_pod_bytes = api_pod.to_string().len();
    let api = PodApi::start(env.tmp_dir(), vec![api_pod])?;
    let kubeconfig = kubeconfig_with_ca(&api, env.tmp_dir())?;
    let api_path = "/api/v1/namespaces/bench/pods/api-pod";
    let cidr = "100.64.0.2/16";
    let resident_cidr = "100.64.0.3/16";
    let resident_ns = FreshNetns::new(env, "cni-resident", 0, resident_cidr)?;
    let resident_cid = container_id("resident", 0);
    let resident = ResidentPod {
        call: PluginCall {
            pin_root,
            state_dir: &state_dir,
            netns: &resident_ns.path,
            container_id: &resident_cid,
            pod: "resident",
            cidr: resident_cidr,
            inbound_hook: None,
            kubeconfig: None,
        },
        _netns: &resident_ns,
    };
    resident
        .call
        .run("ADD")
        .context("ADD of the resident pod")?;
    let warmup = 2;
    let mut n = 0;
    for round in 0..runs + warmup {
        let timed_round = round >= warmup;
        for k in 0..6 {
            n += 1;
            let ns = FreshNetns::new(env, "cni", n, cidr)?;
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            match (round + k) % 6 {
                lane @ (0 | 3 | 4) => {
                    let cid = container_id("cni", n);
                    let pod = if lane == 4 {
                        "api-pod".to_owned()
                    } else {
                        format!("pod-{n}")
                    };
                    let call = PluginCall {
                        pin_root,
                        state_dir: &state_dir,
                        netns: &ns.path,
                        container_id: &cid,
                        pod: &pod,
                        cidr,
                        inbound_hook: (lane == 3).then_some("tc"),
                        kubeconfig: (lane == 4).then_some(kubeconfig.as_path()),
                    };
                    let add = call.run("ADD").context("sidestep-cni ADD")?;
                    let del = call.run("DEL").context("sidestep-cni DEL")?;
                    if timed_round {
                        let (adds, dels) = match lane {
                            3 => (&mut res.add_tc_ms, &mut res.del_tc_ms),
                            4 => (&mut res.add_api_ms, &mut res.del_api_ms),
                            _ => (&mut res.add_ms, &mut res.del_ms),
                        };
                        adds.push(ms(add));
                        dels.push(ms(del));
                    }
                }
                5 => {
                    let get = get_once(api.addr, api_path)?;
                    let mut c = Command::new("nft");
                    c.args(["-f", "-"]);
                    let (d, _) = timed(c, native_nft.as_bytes(), Some(&ns.path))?;
                    if timed_round {
                        res.native_nft_ms.push(ms(d));
                        res.native_nft_get_ms.push(ms(d + get));
                    }
                }
                lane => {
                    let get = get_once(api.addr, api_path)?;
                    let variant = if lane == 1 { "nft" } else { "legacy" };
                    let d = restore_pair(&ns.path, variant, v4.as_bytes(), v6.as_bytes())?;
                    if timed_round {
                        let (alone, with_get) = if lane == 1 {
                            (&mut res.nft_ms, &mut res.nft_get_ms)
                        } else {
                            (&mut res.legacy_ms, &mut res.legacy_get_ms)
                        };
                        alone.push(ms(d));
                        with_get.push(ms(d + get));
                        res.get_ms.push(ms(get));
                    }
                }
            }
            drop(ns);
        }
        let mut c = Command::new(cni_bin());
        c.env_clear().env("CNI_COMMAND", "VERSION");
        let (d, _) = timed(c, b"{\"cniVersion\":\"1.0.0\"}", None)?;
        if timed_round {
            res.version_ms.push(d.as_secs_f64() * 1e3);
        }
    }
    if on_path("strace") {
        let out = env.tmp_dir().join("cni-strace.txt");
        for i in 0..20 {
            n += 1;
            let ns = FreshNetns::new(env, "cni", n, cidr)?;
            let cid = container_id("cnis", i);
            let call = PluginCall {
                pin_root,
                state_dir: &state_dir,
                netns: &ns.path,
                container_id: &cid,
                pod: "strace",
                cidr,
                inbound_hook: Some("tc"),
                kubeconfig: None,
            };
            // TCX_INGRESS is attach type 46; strace prints it as a number or by name.
            let attach = call.bpf_call_ms("ADD", "BPF_LINK_CREATE", &out)?;
            let text = std::fs::read_to_string(&out)?;
            let tcx: Vec<f64> = text
                .lines()
                .filter(|l| l.contains("BPF_LINK_CREATE"))
                .zip(attach)
                .filter(|(l, _)| l.contains("attach_type=0x2e") || l.contains("TCX_INGRESS"))
                .map(|(_, ms)| ms)
                .collect();
            // Per ADD: one TCX link per captured interface (here eth0 and its peer, which
            // also lives in the pod netns).
            res.tcx_attach_ms.push(tcx.iter().sum());
            res.tcx_attaches = tcx.len();
            // Per DEL: its tc and sk_lookup detaches together.
            let detach = call.bpf_call_ms("DEL", "BPF_LINK_DETACH", &out)?;
            res.tcx_detach_ms.push(detach.iter().sum());
        }
    }
    drop(resident);
    drop(resident_ns);
    eprintln!(
        "bench: cni: {} ADD/DEL ({} with the API GET), {} nft, {} legacy and {} native nftables installs",
        res.add_ms.len(),
        res.add_api_ms.len(),
        res.nft_ms.len(),
        res.legacy_ms.len(),
        res.native_nft_ms.len()
    );
    Ok(res)
}
