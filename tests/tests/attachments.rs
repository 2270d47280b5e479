//! A pod with several network attachments, as Multus or `podman network connect` makes them: a
//! second interface (`net1`) on another network, with the same container ID and netns. Istio's
//! `-A PREROUTING -p tcp -j ISTIO_INBOUND` has no `-i`, so every interface is captured:
//! - a second interface sidestep-cni was not chained on is captured all the same;
//! - chained on both networks, the second ADD adds to the pod's capture and never takes the
//!   first's addresses or interfaces away; DEL of one attachment leaves the other captured and
//!   CHECKed; DEL of the last removes everything.
//!
//! Clients sit on each network's bridge; the app listens on every address, so a connection that
//! is not captured reaches it. Needs root; skips otherwise.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, Pod, PodOptions, Spawn, TestEnv,
    sidestep::{Loaded, cni_chain, cni_plugin_dir},
    skip_unless_root,
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;
const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// A pod the plugin skips: the runtime passed its (empty) annotations.
fn plain() -> PodOptions {
    PodOptions {
        namespace: "shop".into(),
        runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": {}})),
        ..Default::default()
    }
}

fn meshed() -> PodOptions {
    PodOptions {
        namespace: "shop".into(),
        runtime_config: Some(json!({
            "io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}
        })),
        ..Default::default()
    }
}

/// A recording proxy on 15006 (UID 1337) and a recording app on 8080 in `pod`; a connection
/// shows up in exactly one of them.
struct Listeners {
    proxy: ChildGuard,
    app: ChildGuard,
}

impl Listeners {
    fn start(env: &TestEnv, pod: &Pod) -> Result<Self> {
        let spawn = |addr: &str, uid: u32| {
            pod.spawn(
                env,
                Spawn::new(&[probe(), "proxy", addr, "-", "--no-forward"]).user(uid, uid),
            )
        };
        let proxy = spawn("[::]:15006", PROXY_UID)?;
        let app = spawn("[::]:8080", APP_UID)?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(Self { proxy, app })
    }

    fn lines(guard: &ChildGuard) -> Vec<Value> {
        guard
            .stdout()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Connects from `client` to `ip`:8080 and says who accepted it.
    fn who_accepts(&self, env: &TestEnv, client: &Pod, ip: IpAddr) -> Result<&'static str> {
        let before = (Self::lines(&self.proxy).len(), Self::lines(&self.app).len());
        let target = SocketAddr::new(ip, 8080).to_string();
        let out = client.run(env, APP_UID, &[probe(), "connect", &target])?;
        ensure!(
            out.status.success(),
            "connect to {target} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for _ in 0..100 {
            let proxy = Self::lines(&self.proxy);
            let app = Self::lines(&self.app);
            if proxy.len() > before.0 {
                let line = &proxy[before.0];
                let local = line["local"]
                    .as_str()
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                    .map(|a| (a.ip().to_canonical(), a.port()));
                ensure!(
                    local == Some((ip, 8080)),
                    "the proxy's getsockname is not the original destination {target}: {line}"
                );
                return Ok("proxy");
            }
            if app.len() > before.1 {
                return Ok("app");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        anyhow::bail!("nobody reported the connection to {target}")
    }
}

/// Every address `result` (a CNI result) put on the pod.
fn result_ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str())
        .filter_map(|a| a.split('/').next()?.parse().ok())
        .collect()
}

/// Every connection from `client` to each of `ips` reaches the proxy.
fn all_captured(
    env: &TestEnv,
    l: &Listeners,
    client: &Pod,
    ips: &[IpAddr],
    what: &str,
) -> Result<()> {
    ensure!(!ips.is_empty(), "{what}: no addresses");
    for ip in ips {
        let who = l.who_accepts(env, client, *ip)?;
        ensure!(
            who == "proxy",
            "{what}: a connection to {ip} reached the app around the proxy"
        );
    }
    Ok(())
}

#[test]
fn a_second_interface_without_the_plugin_is_captured() -> Result<()> {
    if skip_unless_root("a_second_interface_without_the_plugin_is_captured") {
        return Ok(());
    }
    for hook in ["sk_lookup", "tc"] {
        second_interface_without_the_plugin(hook).with_context(|| format!("hook {hook}"))?;
    }
    Ok(())
}

fn second_interface_without_the_plugin(hook: &str) -> Result<()> {
    let env = TestEnv::new(&format!("att-{}", &hook[..2]))?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let mut chain = cni_chain(loaded.pin_root(), &state_dir);
    chain[1]["inbound_hook"] = json!(hook);
    let eth0_net = Node::new(
        &env,
        NodeOptions {
            dual_stack: true,
            chain,
            plugin_dirs: vec![cni_plugin_dir(&env)?],
        },
    )?;
    // The second network has no sidestep-cni in its chain.
    let net1_net = Node::new(&env, NodeOptions::dual_stack())?;
    let server = eth0_net.add_pod_with("server", meshed())?;
    let client0 = eth0_net.add_pod_with("client0", plain())?;
    let client1 = net1_net.add_pod("client1")?;
    let listeners = Listeners::start(&env, &server)?;
    let net1 = result_ips(&net1_net.attach(&server, "net1")?);
    ensure!(net1.len() == 2, "net1 is dual-stack: {net1:?}");
    all_captured(&env, &listeners, &client0, &server.ips(), "eth0")?;
    all_captured(&env, &listeners, &client1, &net1, "net1, not chained")?;
    Ok(())
}

#[test]
fn attachments_add_to_the_capture_and_leave_one_by_one() -> Result<()> {
    if skip_unless_root("attachments_add_to_the_capture_and_leave_one_by_one") {
        return Ok(());
    }
    for hook in ["sk_lookup", "tc"] {
        two_attachments(hook).with_context(|| format!("hook {hook}"))?;
    }
    Ok(())
}

fn two_attachments(hook: &str) -> Result<()> {
    let env = TestEnv::new(&format!("att2-{}", &hook[..2]))?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let mut chain = cni_chain(loaded.pin_root(), &state_dir);
    chain[1]["inbound_hook"] = json!(hook);
    let plugin_dirs = vec![cni_plugin_dir(&env)?];
    let network = |chain: Vec<Value>| {
        Node::new(
            &env,
            NodeOptions {
                dual_stack: true,
                chain,
                plugin_dirs: plugin_dirs.clone(),
            },
        )
    };
    let eth0_net = network(chain.clone())?;
    let net1_net = network(chain)?;
    let server = eth0_net.add_pod_with("server", meshed())?;
    let client0 = eth0_net.add_pod_with("client0", plain())?;
    let client1 = net1_net.add_pod_with("client1", plain())?;
    let listeners = Listeners::start(&env, &server)?;
    let eth0 = server.ips();

    // The second ADD (net1) adds to the capture, and eth0's addresses stay captured.
    let net1 = result_ips(&net1_net.attach(&server, "net1")?);
    all_captured(&env, &listeners, &client0, &eth0, "eth0 after net1's ADD")?;
    all_captured(&env, &listeners, &client1, &net1, "net1")?;
    let records = attachment_records(&state_dir)?;
    ensure!(
        records.len() == 2,
        "one record per attachment: {:?}",
        records.keys()
    );
    for (name, rec) in &records {
        let own: Vec<IpAddr> = rec["netnsKeys"]["interfaceAddresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str()?.parse().ok())
            .collect();
        let want = if name.contains("@net1") { &net1 } else { &eth0 };
        ensure!(
            want.iter().all(|a| own.contains(a)),
            "record {name} does not own its interface's addresses {want:?}: {rec}"
        );
    }
    let cookie = server.netns_cookie()?;
    ensure!(
        loaded.status()?["pods"].as_array().is_some_and(|p| p
            .iter()
            .filter(|p| p["netns_cookie"] == cookie)
            .count()
            == 1),
        "the netns is one pod entry"
    );

    // DEL of net1 leaves eth0 captured; the netns stays enrolled and eth0's CHECK passes.
    net1_net.detach(&server, "net1")?;
    all_captured(&env, &listeners, &client0, &eth0, "eth0 after net1's DEL")?;
    ensure!(
        attachment_records(&state_dir)?.len() == 1,
        "net1's record is gone"
    );
    // The eth0 attachment's CHECK, through the chain's real plugins as libcni runs it.
    eth0_net.check(&server)?;

    // DEL of the last attachment removes everything.
    eth0_net.remove_pod(&server)?;
    ensure!(
        !loaded.status()?["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["netns_cookie"] == cookie),
        "the pod is still enrolled after its last DEL"
    );
    ensure!(
        attachment_records(&state_dir)?.is_empty(),
        "records left: {:?}",
        attachment_records(&state_dir)?.keys()
    );
    let links = loaded.pin_root().join("links");
    for dir in ["sklookup", "podid", "tc"] {
        ensure!(
            !links.join(dir).join(cookie.to_string()).exists(),
            "links/{dir}/{cookie} left behind"
        );
    }
    Ok(())
}

/// The plugin's attachment records in its state directory, by file name.
fn attachment_records(state_dir: &Path) -> Result<std::collections::BTreeMap<String, Value>> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(state_dir)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "json") && p.is_file() {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            out.insert(name, serde_json::from_slice(&std::fs::read(&p)?)?);
        }
    }
    Ok(out)
}
