//! [`Node`]: the root netns with a Linux bridge, and pods attached to it by the real
//! containernetworking `bridge` + `host-local` + `loopback` plugins.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde_json::{Value, json};

use crate::cni::{self, DEBIAN_CNI_DIR, Invocation};
use crate::env::{TestEnv, next_counter};
use crate::netns;
use crate::pod::{Pod, PodOptions};
use crate::subnet::create_bridge;
use crate::util::cmd;

/// How a node is set up.
#[derive(Clone, Debug, Default)]
pub struct NodeOptions {
    /// Give pods an IPv6 ULA address (fd5e:7e57:0:<n>::/64) besides IPv4.
    pub dual_stack: bool,
    /// Plugin configurations chained after `bridge` (each needs `"type"`), e.g. sidestep-cni.
    /// They get `prevResult` on ADD and the cached final result on DEL, as libcni does.
    pub chain: Vec<Value>,
    /// Directories searched before /usr/lib/cni for plugin binaries.
    pub plugin_dirs: Vec<PathBuf>,
}

impl NodeOptions {
    pub fn dual_stack() -> Self {
        Self {
            dual_stack: true,
            ..Self::default()
        }
    }

    pub fn ipv4_only() -> Self {
        Self::default()
    }
}

/// A bridge in the root netns plus the pods attached to it.
///
/// The bridge is created (with the gateway addresses, IPv6 `nodad`) under a machine-wide lock
/// right after its subnets are chosen, so concurrent tests never pick the same one; the bridge
/// plugin then adopts it. `isGateway` is false so that the plugin does not turn on
/// `net.ipv4.ip_forward` and IPv6 forwarding for the whole host: pods reach each other over L2
/// and the host via the gateway address, which needs no forwarding.
///
/// Dropping the node runs CNI DEL for every pod (chain in reverse, then loopback), deletes the
/// netns, then the bridge and the host-local data directory. Errors are logged, never panicked.
#[derive(Debug)]
pub struct Node {
    env_id: String,
    network: String,
    bridge: String,
    v4: Ipv4Net,
    v6: Option<Ipv6Net>,
    ipam_dir: tempfile::TempDir,
    plugin_dirs: Vec<PathBuf>,
    chain: Vec<Value>,
    pods: Mutex<Vec<Arc<Pod>>>,
    /// Pods of other nodes attached to this network as a second interface ([`Node::attach`]).
    attached: Mutex<Vec<Attached>>,
}

/// A second interface of a pod on this node's network, as Multus or `podman network connect`
/// adds one: the same container ID and netns, another CNI_IFNAME.
#[derive(Debug, Clone)]
struct Attached {
    pod: Arc<Pod>,
    ifname: String,
    result: Value,
}

/// `ssb` + 6 hex digits of pid + 4 of a per-process counter: 13 characters (IFNAMSIZ is 16).
pub(crate) fn bridge_name(pid: u32, counter: u32) -> String {
    format!("ssb{:06x}{:04x}", pid & 0xff_ffff, counter & 0xffff)
}

impl Node {
    pub fn new(env: &TestEnv, opts: NodeOptions) -> Result<Self> {
        let counter = next_counter();
        let bridge = bridge_name(std::process::id(), counter);
        let ipam_dir = tempfile::Builder::new()
            .prefix(&format!("sidestep-ipam-{}-", env.id()))
            .tempdir()
            .context("host-local data dir")?;
        let mut plugin_dirs = opts.plugin_dirs.clone();
        plugin_dirs.push(PathBuf::from(DEBIAN_CNI_DIR));
        for t in ["bridge", "host-local", "loopback"] {
            cni::find_plugin(&plugin_dirs, t)?;
        }
        let start = std::process::id()
            .wrapping_mul(2_654_435_761)
            .wrapping_add(counter.wrapping_mul(40_503));
        let (v4, v6) = create_bridge(&bridge, start, opts.dual_stack)?;
        Ok(Self {
            env_id: env.id().to_owned(),
            network: format!("sidestep-test-{}-{counter}", env.id()),
            bridge,
            v4,
            v6,
            ipam_dir,
            plugin_dirs,
            chain: opts.chain,
            pods: Mutex::new(Vec::new()),
            attached: Mutex::new(Vec::new()),
        })
    }

    /// The bridge's interface name in the root netns.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    /// Gives the bridge (the node's side of every pod) one more local address, which goes with
    /// the bridge when the node is dropped. IPv6 ones skip duplicate address detection, so they
    /// are usable at once.
    pub fn add_bridge_address(&self, addr: IpNet) -> Result<()> {
        let addr = addr.to_string();
        let mut argv = vec!["ip", "addr", "add", &addr, "dev", &self.bridge];
        if addr.contains(':') {
            argv.push("nodad");
        }
        crate::util::cmd(&argv)?;
        Ok(())
    }

    /// The CNI network name.
    pub fn network(&self) -> &str {
        &self.network
    }

    pub fn subnet_v4(&self) -> Ipv4Net {
        self.v4
    }

    pub fn subnet_v6(&self) -> Option<Ipv6Net> {
        self.v6
    }

    /// The bridge's IPv4 address (pods' default gateway).
    pub fn gateway_v4(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.v4.network()) + 1)
    }

    pub fn gateway_v6(&self) -> Option<Ipv6Addr> {
        self.v6.map(|n| Ipv6Addr::from(u128::from(n.network()) + 1))
    }

    pub fn plugin_dirs(&self) -> &[PathBuf] {
        &self.plugin_dirs
    }

    /// The `bridge` plugin's configuration (without cniVersion/name).
    pub fn bridge_plugin(&self) -> Value {
        let mut ranges = vec![json!([{ "subnet": self.v4.to_string(),
                                        "gateway": self.gateway_v4().to_string() }])];
        let mut routes = vec![json!({ "dst": "0.0.0.0/0" })];
        if let (Some(v6), Some(gw)) = (self.v6, self.gateway_v6()) {
            ranges.push(json!([{ "subnet": v6.to_string(), "gateway": gw.to_string() }]));
            routes.push(json!({ "dst": "::/0" }));
        }
        json!({
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": false,
            "ipMasq": false,
            "hairpinMode": false,
            "ipam": {
                "type": "host-local",
                "dataDir": self.ipam_dir.path(),
                "ranges": ranges,
                "routes": routes,
            }
        })
    }

    /// The network as a conflist (bridge, then the chain), e.g. for podman's CNI backend.
    pub fn conflist(&self) -> Value {
        let mut plugins = vec![self.bridge_plugin()];
        plugins.extend(self.chain.iter().cloned());
        json!({ "cniVersion": cni::CNI_VERSION, "name": self.network, "plugins": plugins })
    }

    /// Creates netns `sidestep-<env id>-<name>` and runs CNI ADD (loopback, then bridge and the
    /// chain) for it, as a Kubernetes pod `default/<name>`.
    pub fn add_pod(&self, name: &str) -> Result<Arc<Pod>> {
        self.add_pod_with(name, PodOptions::default())
    }

    pub fn add_pod_with(&self, name: &str, opts: PodOptions) -> Result<Arc<Pod>> {
        if name.is_empty()
            || name.len() > 40
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            bail!("bad pod name {name:?}: use 1-40 of [a-z0-9-]");
        }
        if self.lock_pods().iter().any(|p| p.name == name) {
            bail!("pod {name:?} already exists on this node");
        }
        let netns_name = format!("sidestep-{}-{name}", self.env_id);
        let container_id = format!("{}-{name}", self.env_id);
        let netns_path = match opts.userns {
            Some((base, count)) => netns::create_in_userns(&netns_name, base, count)?,
            None => netns::create(&netns_name)?,
        };
        let mut pod = Pod::new(name, netns_name, netns_path, container_id, opts);
        match self.cni_add(&mut pod) {
            Ok(()) => {
                let pod = Arc::new(pod);
                self.lock_pods().push(pod.clone());
                Ok(pod)
            }
            Err(e) => {
                if let Err(e2) = self.teardown(&pod) {
                    eprintln!("sidestep-tests: cleaning up failed pod {name}: {e2:#}");
                }
                Err(e.context(format!("adding pod {name}")))
            }
        }
    }

    /// Runs CNI DEL for `pod` and deletes its netns now (instead of at drop).
    pub fn remove_pod(&self, pod: &Pod) -> Result<()> {
        self.lock_pods().retain(|p| p.name != pod.name);
        self.teardown(pod)
    }

    /// CNI CHECK of `pod`'s eth0 through the whole chain, with the cached result as prevResult,
    /// as libcni runs it; an error names the plugin that failed.
    pub fn check(&self, pod: &Pod) -> Result<()> {
        let cached = (!pod.cni_result.is_null()).then_some(&pod.cni_result);
        for plugin in self.main_plugins() {
            let conf =
                cni::plugin_conf(&self.network, &plugin, cached, pod.runtime_config.as_ref());
            cni::exec(&self.invocation(pod, "CHECK", "eth0"), &conf)
                .with_context(|| format!("CHECK of pod {} by {}", pod.name, plugin["type"]))?;
        }
        Ok(())
    }

    /// Attaches `pod` (of any node) to this node's network as interface `ifname`: CNI ADD of this
    /// node's chain with the pod's container ID and netns, as Multus runs a second network. The
    /// attachment is removed (CNI DEL) by [`Node::detach`] or when this node is dropped. Returns
    /// the chain's result.
    pub fn attach(&self, pod: &Arc<Pod>, ifname: &str) -> Result<Value> {
        let mut prev: Option<Value> = None;
        let mut att = Attached {
            pod: pod.clone(),
            ifname: ifname.to_owned(),
            result: Value::Null,
        };
        for plugin in self.attach_plugins() {
            let conf = cni::plugin_conf(
                &self.network,
                &plugin,
                prev.as_ref(),
                pod.runtime_config.as_ref(),
            );
            match cni::exec(&self.invocation(pod, "ADD", ifname), &conf) {
                Ok(result) => {
                    att.result = result.clone();
                    prev = Some(result);
                }
                Err(e) => {
                    if let Err(e2) = self.detach_one(&att) {
                        eprintln!("sidestep-tests: cleaning up attachment {ifname}: {e2:#}");
                    }
                    return Err(e.context(format!("attaching pod {} as {ifname}", pod.name)));
                }
            }
        }
        netns::wait_no_tentative(&pod.netns_name, Duration::from_secs(10))?;
        let result = att.result.clone();
        self.lock_attached().push(att);
        Ok(result)
    }

    /// CNI DEL of an attachment made by [`Node::attach`].
    pub fn detach(&self, pod: &Pod, ifname: &str) -> Result<()> {
        let mut all = self.lock_attached();
        let Some(i) = all
            .iter()
            .position(|a| a.pod.name == pod.name && a.ifname == ifname)
        else {
            bail!("pod {} has no attachment {ifname} on this node", pod.name);
        };
        let att = all.remove(i);
        drop(all);
        self.detach_one(&att)
    }

    fn detach_one(&self, att: &Attached) -> Result<()> {
        let cached = (!att.result.is_null()).then_some(&att.result);
        let mut errors = Vec::new();
        for plugin in self.attach_plugins().iter().rev() {
            let conf = cni::plugin_conf(
                &self.network,
                plugin,
                cached,
                att.pod.runtime_config.as_ref(),
            );
            if let Err(e) = cni::exec(&self.invocation(&att.pod, "DEL", &att.ifname), &conf) {
                errors.push(format!("{e:#}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!(
                "detaching {} of pod {}: {}",
                att.ifname,
                att.pod.name,
                errors.join("; ")
            )
        }
    }

    /// The chain for a second interface: its pod already has default routes (eth0's), so the
    /// bridge's IPAM adds none (as a Multus network without a gateway).
    fn attach_plugins(&self) -> Vec<Value> {
        let mut v = self.main_plugins();
        v[0]["ipam"]["routes"] = json!([]);
        v
    }

    fn lock_attached(&self) -> MutexGuard<'_, Vec<Attached>> {
        self.attached.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pods currently on the node.
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.lock_pods().clone()
    }

    fn lock_pods(&self) -> MutexGuard<'_, Vec<Arc<Pod>>> {
        // A panic while holding the lock leaves valid data; keep going so that Drop cleans up.
        self.pods.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn main_plugins(&self) -> Vec<Value> {
        let mut v = vec![self.bridge_plugin()];
        v.extend(self.chain.iter().cloned());
        v
    }

    fn invocation<'a>(&'a self, pod: &'a Pod, command: &'a str, ifname: &'a str) -> Invocation<'a> {
        Invocation {
            command,
            container_id: &pod.container_id,
            netns: &pod.netns_path,
            ifname,
            args: &pod.cni_args,
            plugin_dirs: &self.plugin_dirs,
        }
    }

    fn cni_add(&self, pod: &mut Pod) -> Result<()> {
        // New namespaces start with default.accept_dad=1: the bridge plugin would then wait for
        // DAD (about 1 s) and early connects could fail on tentative addresses.
        for k in [
            "net.ipv6.conf.all.accept_dad",
            "net.ipv6.conf.default.accept_dad",
        ] {
            netns::set_sysctl(&pod.netns_path, k, "0")?;
        }
        let lo = json!({ "type": "loopback" });
        let conf = cni::plugin_conf("cni-loopback", &lo, None, None);
        cni::exec(&self.invocation(pod, "ADD", "lo"), &conf)?;
        let mut prev: Option<Value> = None;
        for plugin in self.main_plugins() {
            let conf = cni::plugin_conf(
                &self.network,
                &plugin,
                prev.as_ref(),
                pod.runtime_config.as_ref(),
            );
            let result = cni::exec(&self.invocation(pod, "ADD", "eth0"), &conf)?;
            // Record what is known so far, so that a failure later still DELs with it.
            pod.cni_result = result.clone();
            prev = Some(result);
        }
        let (v4, v6) = pod_ips(&pod.cni_result)?;
        pod.ipv4 = v4.context("CNI result has no IPv4 address for the pod")?;
        pod.ipv6 = v6;
        if self.v6.is_some() && pod.ipv6.is_none() {
            bail!(
                "dual-stack node but the CNI result has no IPv6: {}",
                pod.cni_result
            );
        }
        netns::wait_no_tentative(&pod.netns_name, Duration::from_secs(10))
    }

    /// CNI DEL (chain in reverse, then loopback), then netns removal. Tries everything and
    /// reports all failures.
    fn teardown(&self, pod: &Pod) -> Result<()> {
        let mut errors = Vec::new();
        let cached = (!pod.cni_result.is_null()).then_some(&pod.cni_result);
        for plugin in self.main_plugins().iter().rev() {
            let conf = cni::plugin_conf(&self.network, plugin, cached, pod.runtime_config.as_ref());
            if let Err(e) = cni::exec(&self.invocation(pod, "DEL", "eth0"), &conf) {
                errors.push(format!("{e:#}"));
            }
        }
        let lo = cni::plugin_conf("cni-loopback", &json!({ "type": "loopback" }), None, None);
        if let Err(e) = cni::exec(&self.invocation(pod, "DEL", "lo"), &lo) {
            errors.push(format!("{e:#}"));
        }
        if let Err(e) = netns::delete(&pod.netns_name) {
            errors.push(format!("{e:#}"));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("removing pod {}: {}", pod.name, errors.join("; "))
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let attached = std::mem::take(&mut *self.lock_attached());
        for att in attached.iter().rev() {
            if let Err(e) = self.detach_one(att) {
                eprintln!("sidestep-tests: {e:#}");
            }
        }
        let pods = std::mem::take(&mut *self.lock_pods());
        for pod in pods.iter().rev() {
            if let Err(e) = self.teardown(pod) {
                eprintln!("sidestep-tests: {e:#}");
            }
        }
        if let Err(e) = cmd(&["ip", "link", "del", &self.bridge]) {
            eprintln!("sidestep-tests: deleting bridge: {e:#}");
        }
    }
}

/// The pod's own addresses in a CNI result: those on an interface inside the sandbox.
fn pod_ips(result: &Value) -> Result<(Option<Ipv4Addr>, Option<Ipv6Addr>)> {
    let ifaces = result["interfaces"].as_array().cloned().unwrap_or_default();
    let mut v4 = None;
    let mut v6 = None;
    for ip in result["ips"].as_array().into_iter().flatten() {
        let in_sandbox = ip["interface"]
            .as_u64()
            .and_then(|i| ifaces.get(i as usize))
            .is_none_or(|i| i.get("sandbox").is_some());
        if !in_sandbox {
            continue;
        }
        let addr = ip["address"].as_str().context("ips[].address")?;
        match addr
            .parse::<IpNet>()
            .with_context(|| format!("bad address {addr}"))?
        {
            IpNet::V4(n) => v4 = v4.or(Some(n.addr())),
            IpNet::V6(n) => v6 = v6.or(Some(n.addr())),
        }
    }
    Ok((v4, v6))
}
