//! Running the installed plugin as a runtime would, for the agent's repair of pods that run
//! uncaptured: the configuration it is given, and the process itself; and what every
//! invocation of the plugin tells the agent ([`log`]).

pub mod log;

use std::{
    io::Write as _,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::agent::{
    pods::{self, LiveNetns},
    report::{Network, ReconcileError},
    settings::Settings,
};

/// The plugin configuration for a repair: the entry as the runtime passes it, plus `policy`, a
/// prevResult with the pod's addresses, and the netns's cookie (`expect_netns_cookie`: the
/// plugin opens the path again, and a `/proc/PID` one may name another netns by then).
pub fn repair_config(
    entry: &Value,
    network: &Network,
    policy: &sidestep::policy::Policy,
    netns: &LiveNetns,
    addrs: &pods::PodAddresses,
) -> Value {
    let (name, version) = network;
    let legacy = version.starts_with("0.");
    let ips: Vec<Value> = addrs
        .ips
        .iter()
        .map(|(ip, len)| {
            let mut v = json!({ "address": format!("{ip}/{len}"), "interface": 0 });
            if legacy {
                v["version"] = json!(if ip.is_ipv4() { "4" } else { "6" });
            }
            v
        })
        .collect();
    let mut conf = entry.clone();
    conf["cniVersion"] = json!(version);
    conf["name"] = json!(name);
    conf["policy"] = serde_json::to_value(policy).unwrap_or(Value::Null);
    // The pod runs: its proxy listened before this enrolment, which the sk_lookup hook (the
    // plugin's default, for pods enrolled before they start) would not see. tc finds it.
    conf["inbound_hook"] = json!("tc");
    conf["expect_netns_cookie"] = json!(netns.cookie);
    conf["prevResult"] = json!({
        "cniVersion": version,
        "interfaces": [{ "name": addrs.ifname, "sandbox": netns.path }],
        "ips": ips,
    });
    conf
}

/// Repair outside a cluster: ADD with `repair-policy` (see [`super::repair`] for the API path).
pub fn repair(
    s: &Settings,
    entry: &Value,
    network: Option<&Network>,
    l: &LiveNetns,
) -> Result<(), ReconcileError> {
    let fail = |reason: String| ReconcileError::Repair {
        netns: l.path.display().to_string(),
        reason,
    };
    let network =
        network.ok_or_else(|| fail("the CNI configuration is not in place yet".into()))?;
    let addrs = pods::pod_addresses(l).map_err(|e| fail(e.to_string()))?;
    let conf = repair_config(entry, network, &s.repair_policy, l, &addrs);
    let container_id = format!("sidestep-repair-{}", l.cookie);
    run_plugin(s, "ADD", &container_id, &l.path, &addrs.ifname, &conf).map_err(fail)?;
    tracing::info!(
        netns = %l.path.display(),
        netns_cookie = l.cookie,
        interface = %addrs.ifname,
        "repaired: enrolled a running pod in place"
    );
    Ok(())
}

/// Runs the installed plugin as a runtime would. Returns its stdout.
pub fn run_plugin(
    s: &Settings,
    command: &str,
    container_id: &str,
    netns: &Path,
    ifname: &str,
    conf: &Value,
) -> Result<String, String> {
    let args = "IgnoreUnknown=1";
    run_plugin_with_args(s, command, container_id, netns, ifname, args, conf).map(|(out, _)| out)
}

/// [`run_plugin`] with CNI_ARGS; returns stdout and stderr (the plugin's log).
pub fn run_plugin_with_args(
    s: &Settings,
    command: &str,
    container_id: &str,
    netns: &Path,
    ifname: &str,
    cni_args: &str,
    conf: &Value,
) -> Result<(String, String), String> {
    let bin = s.installed_binary();
    let mut child = Command::new(&bin)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", ifname)
        .env("CNI_ARGS", cni_args)
        .env("CNI_PATH", &s.cni_bin_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(&serde_json::to_vec(conf).unwrap_or_default());
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{} {command} did not finish in 60s", bin.display()));
            }
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for {}: {e}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{} {command} failed ({}): {} {}",
            bin.display(),
            out.status,
            stdout.trim(),
            stderr.trim()
        ));
    }
    Ok((stdout, stderr))
}
