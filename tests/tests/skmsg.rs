//! sk_msg acceleration: with `--sk-msg`, app <-> sidecar bytes on loopback go socket to socket,
//! and requests through HAProxy still succeed byte for byte. Needs root; skips otherwise.

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{
    Node, NodeOptions, PodOptions, TestEnv, haproxy, http_get, nginx,
    sidestep::{Loaded, cni_chain, cni_plugin_dir},
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;

/// Restores kernel.bpf_stats_enabled on drop.
struct BpfStats(String);

impl BpfStats {
    fn enable() -> Result<Self> {
        let old = std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled")?;
        std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1")?;
        Ok(Self(old.trim().to_string()))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/kernel/bpf_stats_enabled", &self.0);
    }
}

fn sk_msg_runs(loaded: &Loaded) -> Result<u64> {
    let path = loaded
        .pin_root()
        .join("progs/sidestep_sk_msg")
        .display()
        .to_string();
    let out = std::process::Command::new("bpftool")
        .args(["prog", "show", "pinned", &path, "--json"])
        .output()?;
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["run_cnt"].as_u64().unwrap_or(0))
}

#[test]
fn sk_msg_carries_app_sidecar_traffic() -> Result<()> {
    if skip_unless_root("sk_msg_carries_app_sidecar_traffic") {
        return Ok(());
    }
    let env = TestEnv::new("skmsg")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let loaded = Loaded::load(&env)?;
    let _sidecar = haproxy::Sidecar::start(&env, &client, Default::default())?;
    let target = url(server.ipv4.into(), 80, "/");
    let body = nginx::body_for("server");
    let _stats = BpfStats::enable()?;

    loaded.enroll(&client, &[])?;
    let before = sk_msg_runs(&loaded)?;
    ensure!(http_get(&env, &client, APP_UID, &target)? == body);
    ensure!(
        sk_msg_runs(&loaded)? == before,
        "sk_msg ran for a pod without --sk-msg"
    );

    loaded.enroll(&client, &["--sk-msg"])?;
    for _ in 0..20 {
        ensure!(
            http_get(&env, &client, APP_UID, &target)? == body,
            "wrong body over sk_msg"
        );
    }
    let runs = sk_msg_runs(&loaded)? - before;
    // Each request crosses app -> proxy and proxy -> app at least once.
    ensure!(runs >= 40, "sk_msg ran {runs} times for 20 requests");
    let redirected = loaded
        .counters(client.netns_cookie()?)?
        .and_then(|c| c["sk_msg_redirects"].as_u64())
        .context("no sk_msg counter")?;
    ensure!(
        redirected >= 40,
        "only {redirected} of {runs} messages went socket to socket"
    );
    let status = loaded.status()?;
    let pod = status["pods"]
        .as_array()
        .and_then(|p| p.first())
        .context("no pod")?;
    ensure!(
        pod["policy"]["capture"].to_string().contains("sk_msg"),
        "{pod}"
    );
    Ok(())
}

/// The same opt-in for Kubernetes pods: the `sidestep.io/sk-msg` annotation, through the CNI chain.
#[test]
fn sk_msg_annotation_opts_a_pod_in_through_the_chain() -> Result<()> {
    if skip_unless_root("sk_msg_annotation_opts_a_pod_in_through_the_chain") {
        return Ok(());
    }
    const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
    let env = TestEnv::new("skmsg-chain")?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack: false,
            chain: cni_chain(loaded.pin_root(), &state_dir),
            plugin_dirs: vec![cni_plugin_dir(&env)?],
        },
    )?;
    let pod = |name: &str, sk_msg: Option<&str>| {
        let mut annotations = json!({"sidecar.istio.io/status": STATUS});
        if let Some(v) = sk_msg {
            annotations["sidestep.io/sk-msg"] = json!(v);
        }
        node.add_pod_with(
            name,
            PodOptions {
                runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": annotations})),
                ..Default::default()
            },
        )
    };
    let fast = pod("fast", Some("true"))?;
    let plain = pod("plain", None)?;
    // A value that is not a boolean fails the ADD with the annotation named.
    let bad = pod("bad", Some("yes")).expect_err("ADD accepted sidestep.io/sk-msg: yes");
    ensure!(
        format!("{bad:#}").contains("sidestep.io/sk-msg"),
        "the error does not name the annotation: {bad:#}"
    );
    // Unmeshed (no status annotation): skipped by the plugin.
    let server = node.add_pod_with(
        "server",
        PodOptions {
            runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": {}})),
            ..Default::default()
        },
    )?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let target = url(server.ipv4.into(), 80, "/");
    let body = nginx::body_for("server");
    let _fast_proxy = haproxy::Sidecar::start(&env, &fast, Default::default())?;
    let _plain_proxy = haproxy::Sidecar::start(&env, &plain, Default::default())?;
    for _ in 0..20 {
        ensure!(http_get(&env, &fast, APP_UID, &target)? == body);
        ensure!(http_get(&env, &plain, APP_UID, &target)? == body);
    }
    let redirects = |p: &sidestep_tests::Pod| -> Result<u64> {
        loaded
            .counters(p.netns_cookie()?)?
            .and_then(|c| c["sk_msg_redirects"].as_u64())
            .context("no sk_msg counter")
    };
    let fast_n = redirects(&fast)?;
    ensure!(fast_n >= 40, "only {fast_n} messages went socket to socket");
    ensure!(
        redirects(&plain)? == 0,
        "sk_msg ran for a pod without the annotation"
    );
    Ok(())
}
