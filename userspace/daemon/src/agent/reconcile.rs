//! Reconciling the data path with the pods that really run, at start and periodically:
//!
//! - **GC.** A record whose netns is gone (no live netns has its cookie, and its netns path is
//!   gone or names another netns) lost its DEL: its enrolment and per-pod links are removed
//!   (`unenroll_by_cookie`) and then the record, and the record's entry in the plugin's
//!   netns-cookie index ([`sidestep::statedir::Index`]). When the agent cannot tell (the path's
//!   directory is not mounted into it, an open fails otherwise), nothing is collected.
//! - **Never enrolled.** A live pod netns whose cookie is not in the pod map is reported (log,
//!   `/metrics`, `/readyz` body): typically a pod that started before the agent was ready. The
//!   agent cannot tell a meshed pod from an unmeshed one without the API server, so the report
//!   names every uncaptured netns in scope (narrow it with `netns-dirs` / `netns-prefix`). A
//!   netns that only a process vouches for is in scope only if the node's user namespace owns
//!   it or a record names it ([`pods`]): a pod's root cannot pass its own for another pod.
//! - **Repair** (`repair`, off by default) enrols each of them in place by running the installed
//!   plugin's ADD for it, exactly as the runtime would, with the netns's own addresses as
//!   prevResult and `repair-policy` as the plugin's `policy`. The plugin writes the record, so
//!   DEL and GC treat the pod like any other.
//! - **Half-done ADDs.** A pending record (the plugin writes one before its first map write)
//!   whose plugin process is gone, or that is older than [`PENDING_TIMEOUT`], is an ADD that was
//!   killed: the runtime saw it fail, so its enrolment is undone and the record removed; the
//!   runtime's retry enrols the pod again.
//! - **After a reload** (pins deleted or bpffs unmounted behind the agent, or a first load over
//!   records that outlived their pins) every pod with a record and a live netns is enrolled
//!   again from its record, with the recorded policy and interfaces, but inbound through tc:
//!   its proxy listened before this enrolment, which the sk_lookup hook would not see. The
//!   record is rewritten to say so, so that CHECK agrees.
//! - **Damaged records** are reported by path (log, `reconcile_errors`); DEL still finds their
//!   pod through the netns or the record's text. Pods enrolled with no record are reported.

use std::{collections::BTreeSet, path::Path, time::Duration};

use serde_json::Value;

use super::{
    pods::{self, LiveNetns, Record},
    settings::Settings,
};
use sidestep_abi::map_names;

use sidestep::{
    enroll,
    error::MapsError,
    maps::PolicyMaps,
    pins::PinLayout,
    podlinks,
    policy::InboundHook,
    statedir::{RECORD_FORMAT, Record as FullRecord, StateDir},
};

pub use super::report::{Network, ReconcileError, Report};

/// Unenrols a cookie whether or not it is still in the maps, and whether or not the programs are
/// still loaded (its tc links may outlive them).
pub fn unenroll(pin_root: &Path, cookie: u64) -> Result<bool, ReconcileError> {
    let err = |source| ReconcileError::Unenroll { cookie, source };
    let loaded = match PolicyMaps::open(pin_root) {
        // Also without a pod entry: an unenrolment killed after removing it left the rules.
        Ok(_) => true,
        Err(MapsError::NotLoaded(_)) => false,
        Err(e) => return Err(err(e.into())),
    };
    if loaded {
        return enroll::unenroll_by_cookie(pin_root, cookie).map_err(err);
    }
    podlinks::detach_inbound(&PinLayout::new(pin_root), cookie).map_err(|e| err(e.into()))?;
    Ok(false)
}

/// Whether the kernel says a pod's netns is gone though no record says so: its sk_lookup link
/// lost its netns, or (a pod without one) it had tc links and every one lost its interface (a
/// TCX link keeps no ifindex once its device is destroyed with the netns). A pod without
/// inbound links is never judged this way.
fn links_say_gone(pin_root: &Path, cookie: u64) -> bool {
    use std::os::fd::AsFd as _;
    let layout = PinLayout::new(pin_root);
    let info =
        |pin: &Path| sidestep::sys::obj_get(pin).and_then(|l| sidestep::sys::link_info(l.as_fd()));
    // The netns's sk_lookup link (every pod with inbound capture has one): the kernel detaches
    // it when the netns dies, and then reports no netns inode.
    let lookup = layout.sk_lookup_pin(cookie);
    if lookup.exists() {
        return matches!(info(&lookup), Ok(i) if i.link_type == sidestep::sys::BPF_LINK_TYPE_NETNS && i.netns_ino == 0);
    }
    let dir = layout.pod_links_dir(cookie);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return false;
    };
    let mut any = false;
    for e in entries.flatten() {
        // A re-routed interface (a VM's) may go while its pod lives; only inbound links count.
        if sidestep::pins::is_reroute_pin(&e.file_name().to_string_lossy()) {
            continue;
        }
        match info(&e.path()) {
            Ok(i) if i.link_type == sidestep::sys::BPF_LINK_TYPE_TCX && i.ifindex == 0 => {
                any = true
            }
            _ => return false,
        }
    }
    any
}

/// What a load or reload had to create empty, which decides which recorded pods are enrolled
/// again (see [`reenrol`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recreated {
    /// The pod map: every enrolment made before is gone from the kernel.
    pub pods: bool,
    /// The proxies' listeners (`SIDESTEP_LSTN`): pods on the sk_lookup hook lost theirs.
    pub listeners: bool,
    /// Another map with per-pod entries (port and CIDR rules, addresses, interfaces, counters,
    /// re-routed interfaces, source addresses): pods still in the pod map lost part of their policy.
    pub entries: bool,
}

/// Maps that hold per-pod entries besides the pod map.
const ENTRY_MAPS: [&str; 8] = [
    map_names::PORT_RULES,
    map_names::CIDR_RULES,
    map_names::COUNTERS,
    map_names::POD_ADDRESSES,
    map_names::INTERFACES,
    map_names::REROUTE_IFACES,
    map_names::SOURCE_ADDRESSES,
    map_names::SOURCE_ROUTES,
];

impl Recreated {
    /// What is not pinned under `pin_root` now, and a load would create.
    pub fn missing(pin_root: &Path) -> Self {
        let layout = PinLayout::new(pin_root);
        Self {
            pods: !layout.map(map_names::POD_POLICY).exists(),
            listeners: !layout.map(map_names::LISTENERS).exists(),
            entries: ENTRY_MAPS.iter().any(|m| !layout.map(m).exists()),
        }
    }

    pub fn any(self) -> bool {
        self.pods || self.listeners || self.entries
    }

    /// Either's maps.
    pub fn or(self, other: Self) -> Self {
        Self {
            pods: self.pods || other.pods,
            listeners: self.listeners || other.listeners,
            entries: self.entries || other.entries,
        }
    }
}

/// A pending record older than this is a dead ADD even if a process with its writer's PID runs
/// (PIDs are reused; no ADD takes this long between its first map write and its record).
pub const PENDING_TIMEOUT: Duration = Duration::from_secs(60);

/// The full record at `path` (its policy and what a half-done ADD left): enough to undo a
/// half-done ADD and to enrol the pod again after a reload. `None` when it is gone or does not
/// read (a newer plugin's policy: the agent does not act on what it cannot parse).
fn enrolment(path: &Path) -> Option<FullRecord> {
    let dir = path.parent()?;
    StateDir::new(dir).read_record_at(path).ok().flatten()
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Record-named entries of the state directory that are no readable record: a directory, an
/// empty or truncated file, garbage, an unknown format.
fn damaged_records(state_dir: &Path) -> Vec<(std::path::PathBuf, String)> {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with('.') || path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let why = match std::fs::read(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => e.to_string(),
            Ok(b) if b.is_empty() => "empty file".into(),
            Ok(b) => match serde_json::from_slice::<Value>(&b) {
                Err(e) => e.to_string(),
                Ok(v)
                    if v.get("format").and_then(Value::as_u64)
                        != Some(u64::from(RECORD_FORMAT)) =>
                {
                    format!("unknown record format {}", v["format"])
                }
                Ok(v) => match serde_json::from_value::<Record>(v) {
                    Ok(_) => continue,
                    Err(e) => e.to_string(),
                },
            },
        };
        out.push((path, why));
    }
    out.sort();
    out
}

/// Undoes a pending record's enrolment when its ADD is dead. Returns whether it did.
fn undo_dead_add(
    s: &Settings,
    path: &Path,
    record: &Record,
    records: &std::collections::BTreeMap<std::path::PathBuf, Record>,
) -> Result<bool, ReconcileError> {
    let Some(e) = enrolment(path).filter(|e| e.pending) else {
        return Ok(false);
    };
    let old = now_unix().saturating_sub(e.created_unix) >= PENDING_TIMEOUT.as_secs();
    let writer_gone = e
        .writer_pid
        .is_some_and(|pid| !s.proc_dir.join(pid.to_string()).exists());
    if !old && !writer_gone {
        return Ok(false);
    }
    let shared = records
        .iter()
        .any(|(p, r)| p != path && r.netns_cookie == record.netns_cookie);
    if !shared {
        unenroll(&s.pin_root, record.netns_cookie)?;
    }
    // A retried ADD may have rewritten the record meanwhile; only the dead one goes.
    if enrolment(path).is_some_and(|now| now.pending && now.created_unix == e.created_unix) {
        std::fs::remove_file(path).map_err(|source| ReconcileError::RemoveRecord {
            path: path.to_path_buf(),
            source,
        })?;
        unindex(s, record, !shared);
    }
    tracing::warn!(
        pod = %pod_label(record),
        record = %path.display(),
        netns_cookie = record.netns_cookie,
        writer_pid = e.writer_pid,
        "undid a half-done ADD (its plugin died before finishing); the runtime's retry enrols the pod"
    );
    Ok(true)
}

/// Held by a reconcile pass, which enrols pods again from their records, and by whatever else
/// removes the records of a live pod (the ambient thread, for a pod leaving the mesh).
static RECORDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The records lock, unless a reconcile pass holds it.
pub(super) fn records_lock_if_free() -> Option<std::sync::MutexGuard<'static, ()>> {
    match RECORDS.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Removes the record with its index entry and the netns's markers, as a DEL of its last
/// attachment would.
pub(super) fn forget(s: &Settings, path: &Path, record: &Record) -> Result<(), ReconcileError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(ReconcileError::RemoveRecord {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => {
            unindex(s, record, true);
            Ok(())
        }
    }
}

/// Removes a removed record's entry from the plugin's netns-cookie index
/// ([`sidestep::statedir::Index`]), with the cookie's markers when `last`. A stale entry only costs a
/// lookup (an entry counts with its record), and the plugin's GC sweeps it: a warning.
fn unindex(s: &Settings, record: &Record, last: bool) {
    if let Err(e) = sidestep::statedir::Index::new(&s.state_dir).remove(
        record.netns_cookie,
        &record.container_id,
        &record.ifname,
        last,
    ) {
        tracing::warn!(
            netns_cookie = record.netns_cookie,
            error = %e,
            "cannot remove the record's entry from the netns-cookie index"
        );
    }
}

/// Enrols a recorded pod again, as its ADD did, after the data path was reloaded.
fn reenrol(
    s: &Settings,
    path: &Path,
    record: &Record,
    recreated: Recreated,
) -> Result<bool, ReconcileError> {
    let Some(e) = enrolment(path).filter(|e| !e.pending) else {
        return Ok(false);
    };
    let netns = pods::agent_view(&record.netns, &s.proc_dir);
    if pods::fate(&netns, record.netns_cookie) != pods::Fate::Alive {
        return Ok(false);
    }
    // In the pod map: enrolled by an ADD after the map was recreated (its proxy listens after
    // it), or the map survived; then only an sk_lookup pod whose listener map was recreated
    // needs anything.
    let in_pod_map =
        PolicyMaps::open(&s.pin_root).is_ok_and(|m| m.pods.get(&record.netns_cookie, 0).is_ok());
    let lost_listener =
        !recreated.pods && recreated.listeners && e.policy.inbound_hook == InboundHook::SkLookup;
    // With the pod map recreated too, an entry in it was written after the reload, by an ADD
    // that wrote the other maps as well. With only another per-pod map recreated, the pod map
    // says nothing: every recorded pod lost part of its policy (enrolment is idempotent, so one
    // an ADD completed after the reload is written again unchanged).
    let lost_entries = recreated.entries && !recreated.pods;
    if in_pod_map && !lost_listener && !lost_entries {
        return Ok(false);
    }
    // The reload emptied SIDESTEP_LSTN, and the pod's proxy will not listen again: only tc finds
    // its listener now.
    let mut policy = e.policy.clone();
    let switch_hook = policy.inbound_hook == InboundHook::SkLookup;
    policy.inbound_hook = InboundHook::Tc;
    let done = enroll::enroll(
        &s.pin_root,
        &netns,
        &policy,
        Some(std::slice::from_ref(&e.ifname)),
    )
    .map_err(|err| ReconcileError::Repair {
        netns: netns.display().to_string(),
        reason: format!("enrolling again from {}: {err}", path.display()),
    })?;
    if switch_hook {
        let state = StateDir::new(path.parent().unwrap_or(&s.state_dir));
        state.set_inbound_hook(path, &e, InboundHook::Tc).map_err(|err| ReconcileError::Repair {
            netns: netns.display().to_string(),
            reason: format!(
                "enrolled again with the tc inbound hook, but cannot record it in {} (CHECK will \
                 report the pod map entry differs): {err}",
                path.display()
            ),
        })?;
    }
    tracing::info!(
        pod = %pod_label(record),
        netns = %netns.display(),
        netns_cookie = done.netns_cookie,
        interfaces = %done.interfaces.join(","),
        "enrolled again from its record after the reload"
    );
    Ok(true)
}

/// `reenrol`: the data path was (re)created empty since the last reconcile, so every recorded
/// pod is enrolled again.
pub fn reconcile(
    s: &Settings,
    entry: &Value,
    network: Option<&Network>,
    recreated: Recreated,
    watched: Option<Vec<k8s_openapi::api::core::v1::Pod>>,
) -> Report {
    let _records = RECORDS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // The sandboxes the runtime gave the plugin: a netns found only through a process counts
    // when one of them is it, whatever user namespace owns it (see `pods`).
    let recorded: Vec<(std::path::PathBuf, u64)> = pods::records(&s.state_dir)
        .into_values()
        .map(|r| (r.netns, r.netns_cookie))
        .collect();
    let scan = pods::Scan {
        netns_dirs: &s.netns_dirs,
        prefix: &s.netns_prefix,
        scan_proc: s.scan_proc,
        proc_dir: &s.proc_dir,
        recorded: &recorded,
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
        match unenroll(&s.pin_root, record.netns_cookie)
            .and_then(|was| forget(s, path, record).map(|()| was))
        {
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
    let collected: BTreeSet<std::path::PathBuf> =
        report.collected.iter().map(|r| r.netns.clone()).collect();
    for (path, record) in &records {
        if record.pin_root.as_deref().is_some_and(|p| p != s.pin_root)
            || collected.contains(&record.netns)
        {
            continue;
        }
        match undo_dead_add(s, path, record, &records) {
            Ok(true) => {
                report.collected.push(record.clone());
                continue;
            }
            Ok(false) => {}
            Err(e) => report.errors.push(e.to_string()),
        }
        if recreated.any() {
            match reenrol(s, path, record, recreated) {
                Ok(true) => report.repaired.push(LiveNetns {
                    path: record.netns.clone(),
                    cookie: record.netns_cookie,
                    processes: 0,
                }),
                Ok(false) => {}
                Err(e) => report.errors.push(e.to_string()),
            }
        }
    }
    for (path, why) in damaged_records(&s.state_dir) {
        report.errors.push(format!(
            "state record {} is damaged ({why}); DEL of its attachment still works (through the \
             netns, or the cookie in its text); remove the file once the pod is gone",
            path.display()
        ));
    }
    report.records = records.len().saturating_sub(report.collected.len());
    let enrolled = sidestep::maps::enrolled_cookies(&s.pin_root);
    let recorded: BTreeSet<u64> = records.values().map(|r| r.netns_cookie).collect();
    let mut enrolled = enrolled;
    for cookie in enrolled
        .clone()
        .into_iter()
        .filter(|c| !recorded.contains(c))
    {
        if live_cookies.contains(&cookie) || !links_say_gone(&s.pin_root, cookie) {
            tracing::warn!(
                netns_cookie = cookie,
                "enrolled, but no state record names it (lost or damaged record, or `sidestep enroll` by hand)"
            );
            continue;
        }
        match unenroll(&s.pin_root, cookie) {
            Ok(_) => {
                tracing::info!(
                    netns_cookie = cookie,
                    "garbage-collected an enrolment no record names: its links lost their netns or interface, so its netns is gone"
                );
                enrolled.remove(&cookie);
                report.collected.push(Record {
                    network: String::new(),
                    container_id: format!("netns cookie {cookie}"),
                    ifname: String::new(),
                    netns: std::path::PathBuf::new(),
                    netns_cookie: cookie,
                    pod_name: None,
                    pod_namespace: None,
                    pin_root: Some(s.pin_root.clone()),
                    policy: Default::default(),
                    pending: false,
                    format: None,
                    created_unix: 0,
                });
            }
            Err(e) => report.errors.push(e.to_string()),
        }
    }
    report.enrolled = enrolled.len();
    report.unenrolled = live
        .into_iter()
        .filter(|l| !enrolled.contains(&l.cookie))
        .collect();
    if s.repair {
        super::repair::repair_all(s, entry, network, &mut report, watched);
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::agent::plugin::repair_config;

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
        let policy = sidestep::policy::Policy::default();
        let net = ("k8s".to_string(), "0.3.1".to_string());
        let x = LiveNetns {
            path: "/run/netns/x".into(),
            cookie: 42,
            processes: 0,
        };
        let c = repair_config(&entry, &net, &policy, &x, &addrs);
        assert_eq!(c["name"], "k8s");
        assert_eq!(c["cniVersion"], "0.3.1");
        assert_eq!(c["prevResult"]["ips"][0]["version"], "4");
        assert_eq!(c["prevResult"]["ips"][1]["address"], "fd00::3/64");
        assert_eq!(c["prevResult"]["interfaces"][0]["sandbox"], "/run/netns/x");
        assert!(c["policy"].is_object());
        assert_eq!(c["inbound_hook"], "tc");
        assert_eq!(c["expect_netns_cookie"], 42);
        let net1 = ("k8s".to_string(), "1.0.0".to_string());
        let c = repair_config(&entry, &net1, &policy, &x, &addrs);
        assert!(c["prevResult"]["ips"][0].get("version").is_none());
    }
}
