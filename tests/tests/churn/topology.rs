//! The churn tests' node: the real CNI chain ending in sidestep-cni, with sidestep loaded at
//! the test's pin root, and pod sandboxes attached and detached through it as a runtime does.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use sidestep_tests::{
    Node, NodeOptions, Pod, PodOptions, TestEnv,
    cni::{self, Invocation},
    netns,
    sidestep::Loaded,
};

use super::state::Sandbox;
use super::{NAMESPACE, STATUS};

/// The chain after bridge: portmap, then sidestep-cni.
pub fn chain(pin_root: &Path, state_dir: &Path) -> Vec<Value> {
    vec![
        json!({"type": "portmap", "capabilities": {"portMappings": true}, "snat": false}),
        json!({
            "type": "sidestep",
            "pin_root": pin_root,
            "state_dir": state_dir,
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        }),
    ]
}

pub fn meshed_runtime_config() -> Value {
    json!({"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}})
}

/// A node whose chain ends in sidestep-cni, sidestep loaded, and the plugin's state_dir.
pub struct ChainNode {
    pub node: Node,
    pub loaded: Loaded,
    pub sandbox: Sandbox,
    pub plugins: Vec<Value>,
}

impl ChainNode {
    pub fn new(env: &TestEnv, dual_stack: bool) -> Result<Self> {
        let loaded = Loaded::load(env)?;
        let state_dir = env.tmp_dir().join("cni-state");
        let chain = chain(loaded.pin_root(), &state_dir);
        let node = Node::new(
            env,
            NodeOptions {
                dual_stack,
                chain: chain.clone(),
                plugin_dirs: vec![sidestep_tests::sidestep::cni_plugin_dir(env)?],
            },
        )?;
        let mut plugins = vec![node.bridge_plugin()];
        plugins.extend(chain);
        Ok(Self {
            sandbox: Sandbox {
                pin_root: loaded.pin_root().to_path_buf(),
                state_dir,
            },
            node,
            loaded,
            plugins,
        })
    }

    pub fn meshed(&self, name: &str) -> Result<Arc<Pod>> {
        self.node.add_pod_with(
            name,
            PodOptions {
                namespace: NAMESPACE.into(),
                runtime_config: Some(meshed_runtime_config()),
                ..Default::default()
            },
        )
    }
}

/// A network namespace that many pod sandboxes use in turn (one at a time): the CNI chain is run
/// against it as the runtime would for a new pod, without the cost of a new netns per cycle.
pub struct Netns {
    pub name: String,
    pub path: PathBuf,
}

impl Netns {
    pub fn new(env: &TestEnv, label: &str) -> Result<Self> {
        let name = format!("sidestep-{}-{label}", env.id());
        let path = netns::create(&name)?;
        let ns = Self { name, path };
        for k in [
            "net.ipv6.conf.all.accept_dad",
            "net.ipv6.conf.default.accept_dad",
        ] {
            netns::set_sysctl(&ns.path, k, "0")?;
        }
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = netns::delete(&self.name) {
            eprintln!("churn: deleting netns {}: {e:#}", self.name);
        }
    }
}

/// One pod sandbox's attachment: ADD through the chain, DEL in reverse with the cached result.
pub struct Attachment<'a> {
    pub cn: &'a ChainNode,
    pub ns: &'a Netns,
    pub container_id: String,
    pub args: String,
    pub result: Option<Value>,
}

impl<'a> Attachment<'a> {
    pub fn new(cn: &'a ChainNode, ns: &'a Netns, env: &TestEnv, name: &str) -> Self {
        let container_id = format!("{}-{name}", env.id());
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={NAMESPACE};K8S_POD_NAME={name};\
             K8S_POD_INFRA_CONTAINER_ID={container_id}"
        );
        Self {
            cn,
            ns,
            container_id,
            args,
            result: None,
        }
    }

    pub fn invocation<'b>(&'b self, command: &'b str, dirs: &'b [PathBuf]) -> Invocation<'b> {
        Invocation {
            command,
            container_id: &self.container_id,
            netns: &self.ns.path,
            ifname: "eth0",
            args: &self.args,
            plugin_dirs: dirs,
        }
    }

    pub fn add(&mut self) -> Result<()> {
        let rc = meshed_runtime_config();
        let dirs = self.cn.node.plugin_dirs();
        let mut prev: Option<Value> = None;
        for plugin in &self.cn.plugins {
            let conf = cni::plugin_conf(self.cn.node.network(), plugin, prev.as_ref(), Some(&rc));
            let result = cni::exec(&self.invocation("ADD", dirs), &conf)
                .with_context(|| format!("ADD {}", self.container_id))?;
            self.result = Some(result.clone());
            prev = Some(result);
        }
        Ok(())
    }

    pub fn del(&mut self) -> Result<()> {
        let rc = meshed_runtime_config();
        let dirs = self.cn.node.plugin_dirs();
        let mut errors = Vec::new();
        for plugin in self.cn.plugins.iter().rev() {
            let conf = cni::plugin_conf(
                self.cn.node.network(),
                plugin,
                self.result.as_ref(),
                Some(&rc),
            );
            if let Err(e) = cni::exec(&self.invocation("DEL", dirs), &conf) {
                errors.push(format!("{e:#}"));
            }
        }
        self.result = None;
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("DEL {}: {}", self.container_id, errors.join("; "))
        }
    }
}

impl Drop for Attachment<'_> {
    /// A test that fails between ADD and DEL still releases the IP and the enrolment.
    fn drop(&mut self) {
        if self.result.is_some()
            && let Err(e) = self.del()
        {
            eprintln!("churn: cleanup: {e:#}");
        }
    }
}
