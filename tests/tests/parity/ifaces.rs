//! The interface and address dimensions of the table. Istio's `-A PREROUTING -p tcp -j
//! ISTIO_INBOUND` has no `-i` and no `-d`, so the boundary is the pod netns: S gets a second
//! interface `net1` on a second network (plain bridge + host-local, as Multus adds one) with a
//! client pod Q there; the IPv6 link-local addresses of both interfaces; secondary addresses added
//! to eth0 after enrolment; and sidestep enrolled through sidestep-cni once per attachment.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use sidestep_tests::{
    Node, Pod, TestEnv, cni,
    parity::Names,
    sidestep::{cni_chain, cni_plugin_dir},
};

/// What the interface rows need besides S, P and the node.
pub(super) struct Ifaces {
    /// Pod Q on the second network.
    pub(super) q: Arc<Pod>,
    pub(super) q6: Ipv6Addr,
    /// S's addresses on net1.
    pub(super) n4: Ipv4Addr,
    pub(super) n6: Ipv6Addr,
    /// The CNI result of S's net1 attachment: sidestep-cni's prevResult for it.
    pub(super) net1_result: Value,
    /// IPv6 link-local addresses of S's eth0 and net1.
    pub(super) ll: Ipv6Addr,
    pub(super) ll1: Ipv6Addr,
    /// The IPv6 link-local address of P's eth0.
    pub(super) p_ll: Ipv6Addr,
    /// Interface indexes, the scope a link-local destination needs: S's eth0 and net1, P's and
    /// Q's eth0 (each client gives its own interface).
    pub(super) s_eth0: u32,
    pub(super) s_net1: u32,
    pub(super) p_eth0: u32,
    pub(super) q_eth0: u32,
    /// The secondary addresses set `LateAddrs` adds to S's eth0 after enrolment.
    pub(super) late4: Ipv4Addr,
    pub(super) late6: Ipv6Addr,
}

/// The first address of each family that a CNI result put on the pod.
fn result_ips(result: &Value) -> (Option<Ipv4Addr>, Option<Ipv6Addr>) {
    let mut v4 = None;
    let mut v6 = None;
    for ip in result["ips"].as_array().into_iter().flatten() {
        let Some(addr) = ip["address"].as_str().and_then(|a| a.split('/').next()) else {
            continue;
        };
        if let Ok(a) = addr.parse::<Ipv4Addr>() {
            v4 = v4.or(Some(a));
        } else if let Ok(a) = addr.parse::<Ipv6Addr>() {
            v6 = v6.or(Some(a));
        }
    }
    (v4, v6)
}

impl Ifaces {
    /// Attaches S to `net2` as net1 (the plain chain: nothing of sidestep's runs there) and
    /// reads what the rows need.
    pub(super) fn new(net2: &Node, s: &Arc<Pod>, p: &Pod, q: Arc<Pod>) -> Result<Self> {
        let net1_result = net2.attach(s, "net1")?;
        let (n4, n6) = result_ips(&net1_result);
        let s6 = s.ipv6.context("dual-stack pod without IPv6")?;
        let octets = s.ipv4.octets();
        Ok(Self {
            q6: q.ipv6.context("dual-stack pod without IPv6")?,
            n4: n4.context("net1 without IPv4")?,
            n6: n6.context("net1 without IPv6")?,
            ll: s.link_local("eth0")?,
            ll1: s.link_local("net1")?,
            p_ll: p.link_local("eth0")?,
            s_eth0: s.ifindex("eth0")?,
            s_net1: s.ifindex("net1")?,
            p_eth0: p.ifindex("eth0")?,
            q_eth0: q.ifindex("eth0")?,
            // In eth0's subnets (a /24 and a /64), far above what host-local hands out here.
            late4: Ipv4Addr::new(octets[0], octets[1], octets[2], 200),
            late6: Ipv6Addr::from((u128::from(s6) & !0xffff_ffff_ffff_ffff_u128) | 0x200),
            net1_result,
            q,
        })
    }

    pub(super) fn name(&self, names: &mut Names) {
        for (ip, name) in [
            (self.q.ipv4.into(), "Q4"),
            (self.q6.into(), "Q6"),
            (self.n4.into(), "S4n1"),
            (self.n6.into(), "S6n1"),
            (self.ll.into(), "S6ll"),
            (self.ll1.into(), "S6ll1"),
            (self.p_ll.into(), "P6ll"),
            (self.late4.into(), "S4b"),
            (self.late6.into(), "S6b"),
        ] {
            names.add(ip, name);
        }
    }

    /// `ip addr add` of the secondary addresses (v4 secondary in eth0's /24, v6 in its /64).
    pub(super) fn add_late(&self, s: &Pod) -> Result<()> {
        s.ip(&["addr", "add", &format!("{}/24", self.late4), "dev", "eth0"])?;
        s.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{}/64", self.late6),
            "dev",
            "eth0",
            "nodad",
        ])?;
        Ok(())
    }

    pub(super) fn remove_late(&self, s: &Pod) -> Result<()> {
        s.ip(&["addr", "del", &format!("{}/24", self.late4), "dev", "eth0"])?;
        s.ip(&[
            "-6",
            "addr",
            "del",
            &format!("{}/64", self.late6),
            "dev",
            "eth0",
        ])?;
        Ok(())
    }
}

/// A meshed pod's annotations, as a runtime with the pod-annotations capability passes them.
const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

/// sidestep-cni invoked as the runtime invokes it for one attachment of S: the real binary, the
/// attachment's own prevResult, S's container ID and CNI_ARGS, and no annotation but the
/// injector's status (Istio's defaults, as the oracle's set).
pub(super) struct Cni {
    dirs: Vec<PathBuf>,
    entry: Value,
}

impl Cni {
    pub(super) fn new(env: &TestEnv, pin_root: &Path, hook: &str) -> Result<Self> {
        let mut entry = cni_chain(pin_root, &env.tmp_dir().join("cni-state"))[1].clone();
        entry["inbound_hook"] = json!(hook);
        Ok(Self {
            dirs: vec![cni_plugin_dir(env)?, PathBuf::from(cni::DEBIAN_CNI_DIR)],
            entry,
        })
    }

    /// `command` (ADD or DEL) for `pod`'s attachment `ifname` on `network`.
    pub(super) fn run(
        &self,
        command: &str,
        network: &str,
        pod: &Pod,
        ifname: &str,
        prev: &Value,
    ) -> Result<()> {
        let rc = json!({"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}});
        let conf = cni::plugin_conf(network, &self.entry, Some(prev), Some(&rc));
        let inv = cni::Invocation {
            command,
            container_id: &pod.container_id,
            netns: &pod.netns_path,
            ifname,
            args: &pod.cni_args,
            plugin_dirs: &self.dirs,
        };
        cni::exec(&inv, &conf)
            .map(drop)
            .with_context(|| format!("sidestep-cni {command} of {ifname}"))
    }
}
