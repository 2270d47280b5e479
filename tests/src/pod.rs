//! [`Pod`]: a network namespace attached to a [`crate::Node`] through CNI, and running
//! processes in it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::env::TestEnv;
use crate::netns;
use crate::process::{self, ChildGuard, Spawn};

/// Default timeout of [`Pod::run`].
pub const RUN_TIMEOUT: Duration = Duration::from_secs(30);

/// Per-pod CNI inputs, as a Kubernetes runtime would pass them.
#[derive(Clone, Debug)]
pub struct PodOptions {
    /// `K8S_POD_NAMESPACE` in CNI_ARGS.
    pub namespace: String,
    /// More `K=V` pairs for CNI_ARGS.
    pub extra_cni_args: Vec<(String, String)>,
    /// `runtimeConfig` given to every plugin of the chain (e.g. pod annotations).
    pub runtime_config: Option<Value>,
    /// A user namespace of its own for the pod's netns (`hostUsers: false`): its IDs `0..count`
    /// are the host's `base..base + count`.
    pub userns: Option<(u32, u32)>,
}

impl Default for PodOptions {
    fn default() -> Self {
        Self {
            namespace: "default".into(),
            extra_cni_args: Vec::new(),
            runtime_config: None,
            userns: None,
        }
    }
}

/// A pod: netns `/run/netns/sidestep-<env id>-<name>` with `lo` and `eth0` set up by CNI.
///
/// Shared as `Arc<Pod>`; the [`crate::Node`] that made it removes it.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    /// Name in `/run/netns`.
    pub netns_name: String,
    pub netns_path: PathBuf,
    /// CNI_CONTAINERID.
    pub container_id: String,
    pub ipv4: Ipv4Addr,
    pub ipv6: Option<Ipv6Addr>,
    /// The final result of the ADD chain (cached for DEL, as libcni does).
    pub cni_result: Value,
    /// CNI_ARGS used for ADD and DEL.
    pub cni_args: String,
    pub runtime_config: Option<Value>,
}

impl Pod {
    pub(crate) fn new(
        name: &str,
        netns_name: String,
        netns_path: PathBuf,
        container_id: String,
        opts: PodOptions,
    ) -> Self {
        let mut args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={container_id}",
            opts.namespace
        );
        for (k, v) in &opts.extra_cni_args {
            args.push_str(&format!(";{k}={v}"));
        }
        Self {
            name: name.to_owned(),
            netns_name,
            netns_path,
            container_id,
            ipv4: Ipv4Addr::UNSPECIFIED,
            ipv6: None,
            cni_result: Value::Null,
            cni_args: args,
            runtime_config: opts.runtime_config,
        }
    }

    pub fn netns_path(&self) -> &Path {
        &self.netns_path
    }

    /// The pod's addresses: IPv4, then IPv6 when dual-stack.
    pub fn ips(&self) -> Vec<IpAddr> {
        let mut v = vec![IpAddr::V4(self.ipv4)];
        v.extend(self.ipv6.map(IpAddr::V6));
        v
    }

    /// Starts a long-running process in the pod (and the test cgroup unless
    /// `spec.in_cgroup` is false). It is killed when the guard drops.
    pub fn spawn(&self, env: &TestEnv, spec: Spawn<'_>) -> Result<ChildGuard> {
        process::spawn(env, Some(&self.netns_path), &spec, false)
    }

    /// Runs `argv` as `uid`/`uid` in the pod and the test cgroup; waits up to [`RUN_TIMEOUT`].
    pub fn run(&self, env: &TestEnv, uid: u32, argv: &[&str]) -> Result<Output> {
        self.run_with(env, Spawn::new(argv).user(uid, uid), RUN_TIMEOUT)
    }

    /// Like [`Pod::run`] but the process stays in the test runner's cgroup, outside anything
    /// attached to the test cgroup.
    pub fn run_outside_cgroup(&self, env: &TestEnv, uid: u32, argv: &[&str]) -> Result<Output> {
        self.run_with(
            env,
            Spawn::new(argv).user(uid, uid).outside_cgroup(),
            RUN_TIMEOUT,
        )
    }

    /// Runs `spec` in the pod; kills it and fails after `timeout`.
    pub fn run_with(&self, env: &TestEnv, spec: Spawn<'_>, timeout: Duration) -> Result<Output> {
        process::run(env, Some(&self.netns_path), &spec, timeout)
    }

    /// Runs `f` on a thread inside the pod's netns (the thread is in the test runner's cgroup).
    pub fn in_netns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        netns::run_in(&self.netns_path, f)
    }

    /// The pod's netns cookie (SO_NETNS_COOKIE).
    pub fn netns_cookie(&self) -> Result<u64> {
        netns::cookie(&self.netns_path)
    }

    /// `ip -n <netns> <args...>`, returning stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut argv = vec!["ip", "-n", &self.netns_name];
        argv.extend_from_slice(args);
        crate::util::cmd(&argv)
    }

    /// `ip -n <netns> -batch` of `commands` (one per line, without `ip`): thousands of addresses
    /// or routes in one process.
    pub fn ip_batch(&self, env: &crate::TestEnv, commands: &str) -> Result<()> {
        let file = env
            .tmp_dir()
            .join(format!("ip-{}-{}.batch", self.name, env.next_seq()));
        std::fs::write(&file, commands)?;
        self.ip(&["-batch", &file.display().to_string()]).map(drop)
    }

    /// A second interface as Multus would leave it: a veth `name` with `cidr` (not every kernel
    /// has the dummy driver), its peer `<name>-peer` up in the pod without an address.
    pub fn add_veth(&self, name: &str, cidr: &str) -> Result<()> {
        let peer = format!("{name}-peer");
        self.ip(&["link", "add", name, "type", "veth", "peer", "name", &peer])?;
        self.ip(&["addr", "add", cidr, "dev", name])?;
        self.ip(&["link", "set", &peer, "up"])?;
        self.ip(&["link", "set", name, "up"])?;
        Ok(())
    }

    /// The IPv6 link-local address of `dev` in the pod's netns.
    pub fn link_local(&self, dev: &str) -> Result<Ipv6Addr> {
        let out = self.ip(&["-6", "-o", "addr", "show", "dev", dev, "scope", "link"])?;
        out.split_whitespace()
            .skip_while(|w| *w != "inet6")
            .nth(1)
            .and_then(|a| a.split('/').next()?.parse().ok())
            .with_context(|| format!("no link-local address on {dev} in pod {}: {out}", self.name))
    }

    /// `ip -j link show dev`'s object for `dev` in the pod's netns.
    fn link(&self, dev: &str) -> Result<Value> {
        let out = self.ip(&["-j", "link", "show", dev])?;
        let v: Value = serde_json::from_str(&out)
            .with_context(|| format!("ip -j link show {dev} in pod {}: {out}", self.name))?;
        Ok(v[0].clone())
    }

    /// The index of `dev` in the pod's netns.
    pub fn ifindex(&self, dev: &str) -> Result<u32> {
        let link = self.link(dev)?;
        link["ifindex"]
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .with_context(|| format!("no ifindex for {dev} in pod {}: {link}", self.name))
    }

    /// The index, in the node's netns, of the other end of the pod's veth `dev`: where a frame
    /// the pod sends on `dev` arrives on the node.
    pub fn node_side_ifindex(&self, dev: &str) -> Result<u32> {
        let link = self.link(dev)?;
        link["link_index"]
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .with_context(|| {
                format!(
                    "{dev} in pod {} is not one end of a veth: {link}",
                    self.name
                )
            })
    }

    /// The MAC address of `dev` in the pod's netns, as `ip` prints it.
    pub fn mac(&self, dev: &str) -> Result<String> {
        let link = self.link(dev)?;
        link["address"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("no address for {dev} in pod {}: {link}", self.name))
    }
}
