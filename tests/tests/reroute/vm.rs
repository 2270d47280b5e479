//! The VM: a third netns behind the pod's `vm0`, standing in for a KubeVirt guest whose traffic
//! arrives on a re-routed interface. Both the table and the end-to-end tests connect from it.

use std::{net::SocketAddr, process::Command, time::Duration};

use anyhow::{Context, Result};
use serde_json::Value;
use sidestep_tests::{Pod, netns};

use crate::{GW4, GW6, IFACE, probe, run};

/// The VM's own addresses.
pub(super) const VM4: &str = "192.168.77.2";
pub(super) const VM6: &str = "fd77::2";

/// The VM: a netns behind `vm0` of the pod. Deleting it deletes the veth pair too.
pub(super) struct Vm {
    name: String,
    /// The pod's end of the link (`vm0`), where the VM's frames are addressed.
    pub(super) gateway_mac: String,
}

impl Vm {
    pub(super) fn attach(pod: &Pod, tag: &str) -> Result<Self> {
        let name = format!("ssrr-{}-{tag}", std::process::id());
        netns::create(&name)?;
        let mut vm = Vm {
            name,
            gateway_mac: String::new(),
        };
        let (p, v) = (pod.netns_name.as_str(), vm.name.as_str());
        run(&[
            "ip", "-n", p, "link", "add", IFACE, "type", "veth", "peer", "name", "eth0", "netns", v,
        ])?;
        run(&[
            "ip",
            "-n",
            p,
            "addr",
            "add",
            &format!("{GW4}/24"),
            "dev",
            IFACE,
        ])?;
        netns::add_addr(p, IFACE, &format!("{GW6}/64"))?;
        run(&["ip", "-n", p, "link", "set", IFACE, "up"])?;
        run(&["ip", "-n", v, "link", "set", "lo", "up"])?;
        run(&[
            "ip",
            "-n",
            v,
            "addr",
            "add",
            &format!("{VM4}/24"),
            "dev",
            "eth0",
        ])?;
        netns::add_addr(v, "eth0", &format!("{VM6}/64"))?;
        run(&["ip", "-n", v, "link", "set", "eth0", "up"])?;
        run(&["ip", "-n", v, "route", "add", "default", "via", GW4])?;
        run(&["ip", "-n", v, "-6", "route", "add", "default", "via", GW6])?;
        netns::wait_no_tentative(p, Duration::from_secs(5))?;
        netns::wait_no_tentative(v, Duration::from_secs(5))?;
        vm.gateway_mac = pod.mac(IFACE)?;
        Ok(vm)
    }

    /// `probe connect` from the VM: its JSON line.
    pub(super) fn connect(&self, to: SocketAddr, http: bool) -> Result<Value> {
        let to = to.to_string();
        let mut args = vec!["connect", &to, "--timeout-ms", "3000"];
        if http {
            args.push("--http");
        }
        self.probe(&args)
    }

    /// A probe subcommand run in the VM (as root): the last JSON line it printed.
    pub(super) fn probe(&self, args: &[&str]) -> Result<Value> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, probe()])
            .args(args)
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().last().with_context(|| {
            format!(
                "probe {} printed nothing: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        serde_json::from_str(line)
            .with_context(|| format!("probe {} printed {line:?}", args.join(" ")))
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Err(e) = netns::delete(&self.name) {
            eprintln!("deleting VM netns {}: {e:#}", self.name);
        }
    }
}

/// Whether `probe connect --http` got a 200 response.
pub(super) fn ok_200(v: &Value) -> bool {
    v["status"].as_str().is_some_and(|s| s.contains(" 200 "))
}
