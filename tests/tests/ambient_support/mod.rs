//! The ambient tests' node: the local API with namespaces, the agent with `--ambient`, the
//! node whose chain the agent completed, and the ztunnel stand-in's reports.

#![allow(dead_code)]

use std::time::Duration;

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{ChildGuard, PodOptions, Spawn, TestEnv};

use crate::agent_support::{Agent, Dirs, PodApi, base_args, free_port};

pub const NODE: &str = "node-1";

pub fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// The test agent's plugin entry, reading pods (and namespaces) from the local API server.
pub fn plugin_json(kubeconfig: &std::path::Path) -> String {
    json!({
        "type": "sidestep",
        "pin_root": "__PIN_ROOT__",
        "state_dir": "__STATE_DIR__",
        "log_level": "__LOG_LEVEL__",
        "pod_namespace": "__POD_NAMESPACE__",
        "pod_source": "api",
        "kubernetes": {"kubeconfig": kubeconfig.display().to_string(), "pod_read_retries": 5}
    })
    .to_string()
}

/// The stand-in's JSON lines so far.
pub fn lines(z: &ChildGuard) -> Vec<Value> {
    z.stdout()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub fn zds_events(z: &ChildGuard, kind: &str, uid: &str) -> usize {
    lines(z)
        .iter()
        .filter(|l| l["zds"] == kind && l["uid"] == uid)
        .count()
}

/// The accepted connections the stand-in reported for `workload` on `listener`.
pub fn accepted(z: &ChildGuard, workload: &str, listener: &str) -> Vec<Value> {
    lines(z)
        .into_iter()
        .filter(|l| l["workload"] == workload && l["listener"] == listener)
        .collect()
}

pub fn start_ztunnel(env: &TestEnv, uds: &std::path::Path) -> Result<ChildGuard> {
    let uds = uds.display().to_string();
    env.spawn(Spawn::new(&[probe(), "ztunnel", &uds]))
}

/// A node in ambient mode: the local API with namespace `mesh` labelled ambient and `plain` not,
/// holding `pods`; the agent with `--ambient` and repair (on, as in a cluster); the node whose
/// chain the agent completed.
pub struct AmbientNode {
    pub api: PodApi,
    pub agent: Agent,
    /// The agent's arguments and port, to start it again.
    pub args: Vec<String>,
    pub port: u16,
    pub node: sidestep_tests::Node,
    /// The agent's ZDS socket.
    pub uds: std::path::PathBuf,
    pub _dirs: Dirs,
}

impl AmbientNode {
    pub fn start(env: &TestEnv, pods: Vec<Value>) -> Result<Self> {
        let d = Dirs::new(env)?;
        let api = PodApi::start(env.tmp_dir(), Vec::new())?;
        api.set_namespace("mesh", json!({"istio.io/dataplane-mode": "ambient"}));
        api.set_namespace("plain", json!({}));
        api.set_namespace("istio-system", json!({}));
        api.set_namespace("later", json!({}));
        // Pods exist in the API before their sandboxes, as in a cluster; the plugin reads them
        // at ADD.
        for p in pods {
            api.add(p);
        }
        d.write_primary("10-test.conflist")?;
        let uds = env.tmp_dir().join("ztunnel").join("ztunnel.sock");
        let port = free_port()?;
        let mut args = base_args(env, &d, port);
        args[2] = plugin_json(&api.kubeconfig);
        args.extend(
            [
                "--node-name",
                NODE,
                "--api-kubeconfig",
                &api.kubeconfig.display().to_string(),
                "--reconcile-interval",
                "2s",
                "--ambient",
                "true",
                "--ztunnel-socket",
                &uds.display().to_string(),
            ]
            .map(String::from),
        );
        let mut agent = Agent::start(env, &args, port)?;
        agent.wait_ready(Duration::from_secs(30))?;
        ensure!(
            d.entry("10-test.conflist")?["ambient_enabled"] == true,
            "the plugin entry lacks ambient_enabled"
        );
        let node = d.node(env, "10-test.conflist")?;
        Ok(Self {
            api,
            agent,
            args,
            port,
            node,
            uds,
            _dirs: d,
        })
    }

    pub fn pod(&self, name: &str, ns: &str) -> Result<std::sync::Arc<sidestep_tests::Pod>> {
        self.node.add_pod_with(
            name,
            PodOptions {
                namespace: ns.into(),
                ..Default::default()
            },
        )
    }

    pub fn annotation(&self, ns: &str, name: &str) -> Value {
        self.api
            .pod(ns, name)
            .map(|p| p["metadata"]["annotations"]["ambient.istio.io/redirection"].clone())
            .unwrap_or(Value::Null)
    }
}
