//! `/metrics`: Prometheus text (OpenMetrics).
//!
//! What comes from walking the data path (the pod map, per-CPU counters, the plugin's records)
//! is a [`DataPath`] snapshot, taken at most once per `metrics-max-age` by [`DataPathCache`]:
//! a walk's syscalls grow with the pods, and what they cost is then bounded by time, not by
//! how many scrapers ask how often. The agent's own counters, the last reconcile's figures and
//! readiness are read at each scrape: they cost a few atomic loads and file checks.
//!
//! - per pod, from the per-CPU `SIDESTEP_STATS` map summed over CPUs, labelled with the pod's
//!   namespace and name from the plugin's record (empty when it has none) and its netns cookie;
//! - per program, run count and run time, when `kernel.bpf_stats_enabled` is 1;
//! - the agent's own work: CNI config writes, records added and removed (the plugin's ADDs and
//!   DELs as seen in its state directory), FAIL_OPEN pods, GC, repairs, reconcile errors;
//! - every plugin invocation, counted and timed by outcome (`sidestep_cni_operations_total`,
//!   with a failure's CNI error code as `code`, and `sidestep_cni_operation_duration_seconds`),
//!   read from the lines the plugin appends to `<state_dir>/timings` (see [`CniTimings`]).
//!
//! `metrics-per-pod: false` leaves out the per-pod families (every series labelled with a pod)
//! for a Prometheus that cannot afford a series set per meshed pod; the node's figures stay.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

pub use super::timings::CniTimings;

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use sidestep_abi::Counters as PodCounters;

use super::{pods, report::Report};
use sidestep::{
    maps::PolicyMaps,
    pins::PinLayout,
    status::{self, ProgramStatus},
};

/// What the agent counts itself.
#[derive(Debug, Default)]
pub struct AgentCounters {
    pub cni_config_writes: AtomicU64,
    pub cni_adds_observed: AtomicU64,
    pub cni_dels_observed: AtomicU64,
    pub gc_collected: AtomicU64,
    pub repaired: AtomicU64,
    pub reconcile_errors: AtomicU64,
    pub reconciles: AtomicU64,
    pub kubeconfig_writes: AtomicU64,
    pub binary_installs: AtomicU64,
    /// Uncaptured pods repair deleted (`repair-mode: delete`) and labelled (`label`).
    pub repair_deleted: AtomicU64,
    pub repair_labelled: AtomicU64,
    /// Addresses the pods gained and lost after enrolment, followed into `SIDESTEP_ADDRS`.
    pub late_addresses_added: AtomicU64,
    pub late_addresses_removed: AtomicU64,
    /// Source routes (`SIDESTEP_SRCR`) written or removed after enrolment.
    pub late_source_routes: AtomicU64,
    /// The address follower's reads of a pod netns (one per burst of changes, rate-limited).
    pub address_syncs: AtomicU64,
    /// Entries of excluded interfaces and their routes written or removed after enrolment.
    pub late_exclusions: AtomicU64,
    /// The readiness taint is off this node (`readiness-taint`).
    pub untainted: std::sync::atomic::AtomicBool,
    /// The plugin's invocations, from its timing lines.
    pub cni: CniTimings,
    /// Competing conflist entries and skipped pods (`report::Warnings`).
    pub warnings: super::report::Warnings,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    namespace: String,
    pod: String,
    netns_cookie: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProgLabels {
    program: String,
}

pub fn bpf_stats_enabled() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").is_ok_and(|s| s.trim() == "1")
}

fn counter(reg: &mut Registry, name: &str, help: &str, v: u64) {
    let c = Counter::<u64>::default();
    c.inc_by(v);
    reg.register(name, help, c);
}

fn gauge(reg: &mut Registry, name: &str, help: &str, v: i64) {
    let g = Gauge::<i64>::default();
    g.set(v);
    reg.register(name, help, g);
}

type PodFamily = Family<PodLabels, Counter>;

type Field = fn(&PodCounters) -> u64;

const POD_COUNTERS: [(&str, &str, Field); 9] = [
    (
        "sidestep_pod_redirected_outbound",
        "Outbound connections sent to the proxy",
        |c| c.redirected_outbound,
    ),
    (
        "sidestep_pod_redirected_inbound",
        "Inbound connections handed to the proxy",
        |c| c.redirected_inbound,
    ),
    (
        "sidestep_pod_passed_outbound",
        "Outbound connections left alone by the policy",
        |c| c.passed_outbound,
    ),
    (
        "sidestep_pod_passed_inbound",
        "Inbound connections left alone by the policy",
        |c| c.passed_inbound,
    ),
    (
        "sidestep_pod_dns_redirected",
        "DNS queries sent to the DNS proxy",
        |c| c.dns_redirected,
    ),
    (
        "sidestep_pod_orig_dst_hits",
        "SO_ORIGINAL_DST answered from sidestep's record",
        |c| c.orig_dst_hits,
    ),
    (
        "sidestep_pod_orig_dst_misses",
        "SO_ORIGINAL_DST asked for an unredirected socket",
        |c| c.orig_dst_misses,
    ),
    (
        "sidestep_pod_sk_msg_redirects",
        "Messages sk_msg handed from socket to socket (pods with sidestep.io/sk-msg)",
        |c| c.sk_msg_redirects,
    ),
    (
        "sidestep_pod_sk_msg_fallbacks",
        "Sockets sk_msg switched to the TCP path for good (the proxy's queue was full, or no peer)",
        |c| c.sk_msg_fallbacks,
    ),
];

/// What /metrics reads from the data path and the plugin's state directory.
#[derive(Debug, Default)]
pub struct DataPath {
    programs: Vec<ProgramStatus>,
    attachments: usize,
    pod_capacity: u32,
    enrolled: usize,
    /// Every enrolled pod, with its counters summed over CPUs; empty unless `per_pod`.
    pods: Vec<(PodLabels, PodCounters)>,
    /// `metrics-per-pod`: export the per-pod families.
    per_pod: bool,
    failopen: usize,
}

impl DataPath {
    /// One walk of the pod map (a per-CPU lookup per pod) and of the plugin's records. Not
    /// `status::collect`, which also scans the interface map and the pin directories for
    /// `sidestep status`. Without `per_pod` it only counts the pods: no per-CPU lookups.
    pub fn collect(pin_root: &Path, state_dir: &Path, per_pod: bool) -> Self {
        let layout = PinLayout::new(pin_root);
        let by_cookie: BTreeMap<u64, pods::Record> = pods::records(state_dir)
            .into_values()
            .map(|r| (r.netns_cookie, r))
            .collect();
        let (enrolled, pods, pod_capacity) = match PolicyMaps::open(pin_root) {
            Ok(maps) => {
                let all = maps.pods();
                let enrolled = all.len();
                let pods = all
                    .into_iter()
                    .filter(|_| per_pod)
                    .map(|(cookie, _)| {
                        let record = by_cookie.get(&cookie);
                        let labels = PodLabels {
                            namespace: record
                                .and_then(|r| r.pod_namespace.clone())
                                .unwrap_or_default(),
                            pod: record.and_then(|r| r.pod_name.clone()).unwrap_or_default(),
                            netns_cookie: cookie.to_string(),
                        };
                        (labels, maps.counters(cookie))
                    })
                    .collect();
                (enrolled, pods, maps.pod_capacity)
            }
            Err(_) => (0, Vec::new(), 0),
        };
        Self {
            programs: status::programs(&layout),
            attachments: status::cgroup_links(&layout).len(),
            pod_capacity,
            enrolled,
            pods,
            per_pod,
            failopen: pods::failopen_markers(state_dir),
        }
    }
}

/// Hands out a [`DataPath`] no older than `max_age`. A scrape that finds it stale takes the
/// walk itself while holding the lock, so scrapes arriving meanwhile wait for that walk and
/// share it instead of starting their own.
#[derive(Debug)]
pub struct DataPathCache {
    max_age: Duration,
    per_pod: bool,
    last: Mutex<Option<(Instant, Arc<DataPath>)>>,
    walks: AtomicU64,
}

impl DataPathCache {
    /// `per_pod` is `metrics-per-pod`.
    pub fn new(max_age: Duration, per_pod: bool) -> Self {
        Self {
            max_age,
            per_pod,
            last: Mutex::new(None),
            walks: AtomicU64::new(0),
        }
    }

    pub fn get(&self, pin_root: &Path, state_dir: &Path) -> Arc<DataPath> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((at, data)) = last.as_ref()
            && at.elapsed() < self.max_age
        {
            return data.clone();
        }
        let data = Arc::new(DataPath::collect(pin_root, state_dir, self.per_pod));
        self.walks.fetch_add(1, Ordering::Relaxed);
        // Aged from the walk's end: a walk slower than max_age still leaves room between walks.
        *last = Some((Instant::now(), data.clone()));
        data
    }

    /// Walks taken so far.
    pub fn walks(&self) -> u64 {
        self.walks.load(Ordering::Relaxed)
    }
}

/// The whole exposition: `data` from the cache, which has walked `walks` times; the rest now.
pub fn render(
    state_dir: &Path,
    ready: bool,
    report: &Report,
    counters: &AgentCounters,
    data: &DataPath,
    walks: u64,
) -> String {
    let mut reg = Registry::default();
    // The agent's build, as a label on a constant 1 (Prometheus' info-metric convention), so
    // that alerts and dashboards can tell a rollout's two versions apart.
    let build = Family::<BuildLabels, Gauge>::default();
    build
        .get_or_create(&BuildLabels {
            version: env!("CARGO_PKG_VERSION").to_owned(),
        })
        .set(1);
    reg.register(
        "sidestep_build_info",
        "The agent's version (always 1)",
        build,
    );
    gauge(
        &mut reg,
        "sidestep_ready",
        "1 when /readyz is ready",
        i64::from(ready),
    );
    gauge(
        &mut reg,
        "sidestep_programs_attached",
        "Cgroup attachments (links) in place",
        data.attachments as i64,
    );
    gauge(
        &mut reg,
        "sidestep_pod_capacity",
        "Slots in the pod map",
        i64::from(data.pod_capacity),
    );
    gauge(
        &mut reg,
        "sidestep_pods_enrolled",
        "Pods in the pod map",
        data.enrolled as i64,
    );
    gauge(
        &mut reg,
        "sidestep_pods_unenrolled",
        "Running pod netns not enrolled at the last reconcile",
        report.unenrolled.len() as i64,
    );
    gauge(
        &mut reg,
        "sidestep_pods_skipped",
        "Running pods repair left uncaptured because their ADD would (not meshed, excluded)",
        report.skipped.len() as i64,
    );
    gauge(
        &mut reg,
        "sidestep_cni_failopen_pods",
        "Pods the plugin let through uncaptured (FAIL_OPEN markers)",
        data.failopen as i64,
    );
    gauge(
        &mut reg,
        "sidestep_readiness_taint_removed",
        "1 once the agent removed its node's readiness taint (readiness-taint)",
        i64::from(counters.untainted.load(Ordering::Relaxed)),
    );
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    for (name, help, v) in [
        (
            "sidestep_cni_config_writes",
            "Writes of the CNI configuration (insertions and repairs)",
            &counters.cni_config_writes,
        ),
        (
            "sidestep_cni_adds_observed",
            "Attachment records the plugin created (its ADDs)",
            &counters.cni_adds_observed,
        ),
        (
            "sidestep_cni_dels_observed",
            "Attachment records the plugin removed (its DELs)",
            &counters.cni_dels_observed,
        ),
        (
            "sidestep_gc_attachments",
            "Attachments removed because their netns was gone",
            &counters.gc_collected,
        ),
        (
            "sidestep_repaired_pods",
            "Running pods enrolled in place by repair",
            &counters.repaired,
        ),
        (
            "sidestep_repair_deleted_pods",
            "Uncaptured pods repair deleted to be recreated through the CNI chain (repair-mode: delete)",
            &counters.repair_deleted,
        ),
        (
            "sidestep_repair_labelled_pods",
            "Uncaptured pods repair labelled sidestep.io/uninitialized=true (repair-mode: label)",
            &counters.repair_labelled,
        ),
        (
            "sidestep_late_addresses_added",
            "Addresses pods gained after enrolment, registered as theirs (captured as the pod's own)",
            &counters.late_addresses_added,
        ),
        (
            "sidestep_late_addresses_removed",
            "Addresses registered after enrolment and removed again (the pod lost them, or went)",
            &counters.late_addresses_removed,
        ),
        (
            "sidestep_late_source_routes",
            "Source routes of multi-homed pods written or removed after enrolment (an interface attached after the ADD, a route changed)",
            &counters.late_source_routes,
        ),
        (
            "sidestep_address_syncs",
            "Reads of a pod netns by the address follower, one per burst of address or route changes (at most 10 a second per pod)",
            &counters.address_syncs,
        ),
        (
            "sidestep_late_exclusions",
            "Entries of excluded interfaces that appeared after enrolment (Multus attaches them after the default network's chain), and of their routes, written or removed",
            &counters.late_exclusions,
        ),
        (
            "sidestep_reconcile_errors",
            "Errors during reconcile",
            &counters.reconcile_errors,
        ),
        (
            "sidestep_reconciles",
            "Reconcile runs",
            &counters.reconciles,
        ),
        (
            "sidestep_kubeconfig_writes",
            "Writes of the plugin's kubeconfig",
            &counters.kubeconfig_writes,
        ),
        (
            "sidestep_cni_binary_installs",
            "Installs of the plugin binary",
            &counters.binary_installs,
        ),
    ] {
        counter(&mut reg, name, help, c(v));
    }
    counter(
        &mut reg,
        "sidestep_metrics_datapath_walks",
        "Walks of the pod map and records for /metrics (at most one per metrics-max-age)",
        walks,
    );

    counters.cni.poll(state_dir);
    counters.cni.register(&mut reg);
    counters.warnings.register(&mut reg);

    // Without metrics-per-pod the families are left out whole, not summed into node series: a
    // sum over pods would drop when a pod goes, which Prometheus takes for a counter reset and
    // counts the remaining pods' totals again in rate().
    if data.per_pod {
        let families: Vec<PodFamily> = POD_COUNTERS.iter().map(|_| PodFamily::default()).collect();
        for (labels, totals) in &data.pods {
            for (family, (_, _, get)) in families.iter().zip(POD_COUNTERS) {
                family.get_or_create(labels).inc_by(get(totals));
            }
        }
        for (family, (name, help, _)) in families.into_iter().zip(POD_COUNTERS) {
            reg.register(name, help, family);
        }
    }

    if bpf_stats_enabled() {
        let runs = Family::<ProgLabels, Counter>::default();
        let time = Family::<ProgLabels, Counter<f64, std::sync::atomic::AtomicU64>>::default();
        for p in &data.programs {
            let l = ProgLabels {
                program: p.name.clone(),
            };
            runs.get_or_create(&l).inc_by(p.run_count);
            time.get_or_create(&l).inc_by(p.run_time_ns as f64 / 1e9);
        }
        reg.register(
            "sidestep_program_runs",
            "Program runs (kernel.bpf_stats_enabled=1)",
            runs,
        );
        reg.register(
            "sidestep_program_run_seconds",
            "Time spent in the program (kernel.bpf_stats_enabled=1)",
            time,
        );
    }
    let mut out = String::new();
    let _ = encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pod_counter_is_exported_with_the_pods_labels() {
        let counters = PodCounters {
            redirected_outbound: 1,
            sk_msg_redirects: 7,
            ..PodCounters::default()
        };
        let labels = PodLabels {
            namespace: "shop".into(),
            pod: "web-1".into(),
            netns_cookie: "42".into(),
        };
        let data = DataPath {
            enrolled: 1,
            pods: vec![(labels, counters)],
            per_pod: true,
            ..DataPath::default()
        };
        let dir = std::env::temp_dir();
        let out = render(
            &dir,
            true,
            &Report::default(),
            &AgentCounters::default(),
            &data,
            1,
        );
        for (name, _, _) in POD_COUNTERS {
            assert!(
                out.contains(&format!("# TYPE {name} counter")),
                "{name}:\n{out}"
            );
        }
        let build = format!(
            "sidestep_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(out.contains(&build), "{build}:\n{out}");
        let line = out
            .lines()
            .find(|l| l.starts_with("sidestep_pod_sk_msg_redirects_total{"))
            .expect("sk_msg series");
        assert!(
            line.contains("pod=\"web-1\"") && line.ends_with(" 7"),
            "{line}"
        );
    }

    #[test]
    fn without_per_pod_series_only_the_nodes_figures_remain() {
        let labels = PodLabels {
            namespace: "shop".into(),
            pod: "web-1".into(),
            netns_cookie: "42".into(),
        };
        let render_with = |per_pod: bool| {
            let data = DataPath {
                pod_capacity: 100,
                enrolled: 1,
                pods: if per_pod {
                    vec![(labels.clone(), PodCounters::default())]
                } else {
                    Vec::new()
                },
                per_pod,
                ..DataPath::default()
            };
            render(
                &std::env::temp_dir(),
                true,
                &Report::default(),
                &AgentCounters::default(),
                &data,
                1,
            )
        };
        let on = render_with(true);
        let off = render_with(false);
        for (name, _, _) in POD_COUNTERS {
            assert!(on.contains(&format!("# TYPE {name} counter")), "{on}");
            assert!(!off.contains(name), "{name} without per-pod series:\n{off}");
        }
        assert!(on.contains("pod=\"web-1\""), "{on}");
        for l in off.lines().filter(|l| !l.starts_with('#')) {
            assert!(
                !l.contains("pod=") && !l.contains("netns_cookie="),
                "a per-pod series without per-pod series: {l}"
            );
        }
        // The node's figures stay, the same both ways.
        for want in ["sidestep_pods_enrolled 1", "sidestep_pod_capacity 100"] {
            assert!(on.contains(want) && off.contains(want), "{want}:\n{off}");
        }
    }
}
