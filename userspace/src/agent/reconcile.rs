//! Reconciling the data path with the pods that really run, at start and periodically:
//!
//! - **GC.** A record whose netns is gone (no live netns has its cookie, and its netns path is
//!   gone or names another netns) lost its DEL: its enrolment and tc links are removed
//!   (`unenroll_by_cookie`) and then the record. When the agent cannot tell (the path's
//!   directory is not mounted into it, an open fails otherwise), nothing is collected.
//! - **Never enrolled.** A live pod netns whose cookie is not in the pod map is reported (log,
//!   `/metrics`, `/readyz` body): typically a pod that started before the agent was ready. The
//!   agent cannot tell a meshed pod from an unmeshed one without the API server, so the report
//!   names every uncaptured netns in scope (narrow it with `netns-dirs` / `netns-prefix`).
//! - **Repair** (`repair`, off by default) enrols each of them in place by running the installed
//!   plugin's ADD for it, exactly as the runtime would, with the netns's own addresses as
//!   prevResult and `repair-policy` as the plugin's `policy`. The plugin writes the record, so
//!   DEL and GC treat the pod like any other.

use std::{
    collections::BTreeSet,
    io::Write as _,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use super::{
    pods::{self, LiveNetns, Record},
    settings::Settings,
};
use crate::{enroll, error::MapsError, maps::PolicyMaps, pins::PinLayout, tc};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("cannot unenrol netns cookie {cookie}: {source}")]
    Unenroll {
        cookie: u64,
        source: crate::error::EnrollError,
    },
    #[error("cannot remove the record {path}: {source}")]
    RemoveRecord {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("repair of {netns}: {reason}")]
    Repair { netns: String, reason: String },
}

/// What one reconcile found and did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub live: usize,
    pub enrolled: usize,
    pub records: usize,
    pub failopen: usize,
    pub collected: Vec<Record>,
    pub unenrolled: Vec<LiveNetns>,
    pub repaired: Vec<LiveNetns>,
    pub errors: Vec<String>,
}

/// Unenrols a cookie whether or not it is still in the maps, and whether or not the programs are
/// still loaded (its tc links may outlive them).
pub fn unenroll(pin_root: &Path, cookie: u64) -> Result<bool, ReconcileError> {
    let err = |source| ReconcileError::Unenroll { cookie, source };
    let enrolled = match PolicyMaps::open(pin_root) {
        Ok(maps) => maps.pods.get(&cookie, 0).is_ok(),
        Err(MapsError::NotLoaded(_)) => false,
        Err(e) => return Err(err(e.into())),
    };
    if enrolled {
        return enroll::unenroll_by_cookie(pin_root, cookie).map_err(err);
    }
    tc::detach_inbound(&PinLayout::new(pin_root), cookie).map_err(|e| err(e.into()))?;
    Ok(false)
}

/// The cookies in the pod map (empty when not loaded).
pub fn enrolled_cookies(pin_root: &Path) -> BTreeSet<u64> {
    PolicyMaps::open(pin_root)
        .map(|m| m.pods().into_iter().map(|(c, _)| c).collect())
        .unwrap_or_default()
}

/// The network the plugin runs in: (name, cniVersion) for the repair's config.
pub type Network = (String, String);

pub fn reconcile(s: &Settings, entry: &Value, network: Option<&Network>) -> Report {
    let scan = pods::Scan {
        netns_dirs: &s.netns_dirs,
        prefix: &s.netns_prefix,
        scan_proc: s.scan_proc,
        proc_dir: &s.proc_dir,
    };
    let live = pods::live_netns(&scan);
    let live_cookies: BTreeSet<u64> = live.iter().map(|l| l.cookie).collect();
    let records = pods::records(&s.state_dir);
    let mut report = Report {
        live: live.len(),
        failopen: pods::failopen_markers(&s.state_dir),
        ..Report::default()
    };
    // Records are read after the scan, so a pod added in between is re-checked by its path.
    for (path, record) in &records {
        if record.pin_root.as_deref().is_some_and(|p| p != s.pin_root) {
            continue;
        }
        if live_cookies.contains(&record.netns_cookie) {
            continue;
        }
        match pods::fate(
            &pods::agent_view(&record.netns, &s.proc_dir),
            record.netns_cookie,
        ) {
            pods::Fate::Alive => continue,
            pods::Fate::Gone => {}
            pods::Fate::Unknown(why) => {
                tracing::debug!(record = %path.display(), why, "not collecting");
                continue;
            }
        }
        let done = unenroll(&s.pin_root, record.netns_cookie).and_then(|was| {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(ReconcileError::RemoveRecord {
                        path: path.clone(),
                        source: e,
                    })
                }
                _ => Ok(was),
            }
        });
        match done {
            Ok(was) => {
                tracing::info!(
                    pod = %pod_label(record),
                    netns = %record.netns.display(),
                    netns_cookie = record.netns_cookie,
                    was_enrolled = was,
                    "garbage-collected an attachment whose netns is gone"
                );
                report.collected.push(record.clone());
            }
            Err(e) => report.errors.push(e.to_string()),
        }
    }
    report.records = records.len() - report.collected.len();
    let enrolled = enrolled_cookies(&s.pin_root);
    report.enrolled = enrolled.len();
    report.unenrolled = live
        .into_iter()
        .filter(|l| !enrolled.contains(&l.cookie))
        .collect();
    if s.repair {
        for l in std::mem::take(&mut report.unenrolled) {
            match repair(s, entry, network, &l) {
                Ok(()) => report.repaired.push(l),
                Err(e) => {
                    report.errors.push(e.to_string());
                    report.unenrolled.push(l);
                }
            }
        }
    }
    for l in &report.unenrolled {
        tracing::warn!(
            netns = %l.path.display(),
            netns_cookie = l.cookie,
            processes = l.processes,
            repair = s.repair,
            "running pod netns is not enrolled (started before sidestep was ready, or not meshed)"
        );
    }
    report
}

pub fn pod_label(r: &Record) -> String {
    match (&r.pod_namespace, &r.pod_name) {
        (Some(ns), Some(n)) => format!("{ns}/{n}"),
        (None, Some(n)) => n.clone(),
        _ => r.container_id.clone(),
    }
}

/// The plugin configuration for a repair: the entry as the runtime passes it, plus `policy` and
/// a prevResult with the pod's addresses.
pub fn repair_config(
    entry: &Value,
    network: &Network,
    policy: &crate::policy::Policy,
    netns: &Path,
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
    conf["prevResult"] = json!({
        "cniVersion": version,
        "interfaces": [{ "name": addrs.ifname, "sandbox": netns }],
        "ips": ips,
    });
    conf
}

fn repair(
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
    let addrs = pods::pod_addresses(&l.path)
        .ok_or_else(|| fail("it has no interface with an address".into()))?;
    let conf = repair_config(entry, network, &s.repair_policy, &l.path, &addrs);
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
    let bin = s.installed_binary();
    let mut child = Command::new(&bin)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", ifname)
        .env("CNI_ARGS", "IgnoreUnknown=1")
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
    if !out.status.success() {
        return Err(format!(
            "{} {command} failed ({}): {} {}",
            bin.display(),
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repair_config_matches_the_network_version() {
        let entry = json!({"type": "sidestep", "pin_root": "/p"});
        let addrs = pods::PodAddresses {
            ifname: "eth0".into(),
            ips: vec![
                ("10.1.2.3".parse().unwrap(), 24),
                ("fd00::3".parse().unwrap(), 64),
            ],
        };
        let policy = crate::policy::Policy::default();
        let net = ("k8s".to_string(), "0.3.1".to_string());
        let c = repair_config(&entry, &net, &policy, Path::new("/run/netns/x"), &addrs);
        assert_eq!(c["name"], "k8s");
        assert_eq!(c["cniVersion"], "0.3.1");
        assert_eq!(c["prevResult"]["ips"][0]["version"], "4");
        assert_eq!(c["prevResult"]["ips"][1]["address"], "fd00::3/64");
        assert_eq!(c["prevResult"]["interfaces"][0]["sandbox"], "/run/netns/x");
        assert!(c["policy"].is_object());
        let net1 = ("k8s".to_string(), "1.0.0".to_string());
        let c = repair_config(&entry, &net1, &policy, Path::new("/run/netns/x"), &addrs);
        assert!(c["prevResult"]["ips"][0].get("version").is_none());
    }
}
