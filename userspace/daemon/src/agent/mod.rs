//! `sidestep agent`: the DaemonSet process on every node.
//!
//! Start: resolve the settings (a bad one stops the agent naming it), check capabilities, mount
//! bpffs if needed (only where the mount is the host's: [`mounts::check_mount_is_the_hosts`]),
//! load or adopt the programs (an existing pin root is upgraded in place through its links,
//! atomically), install the plugin binary, write the plugin's kubeconfig, then serve
//! `/healthz`, `/readyz`, `/metrics` and keep three things true until SIGTERM:
//! - the CNI configuration holds the sidestep entry (re-inserted within a second of another CNI
//!   rewriting it: the conf directory is watched with inotify);
//! - the plugin's kubeconfig follows the plugin's service account token (not the agent's own);
//! - the data path matches the pods that run (see [`reconcile`]).
//!
//! SIGTERM (a restart or an upgrade) leaves programs, pins and CNI configuration in place, so
//! pods keep their capture; `sidestep uninstall` removes everything.

mod addrwatch;
pub mod ambient;
pub mod apiclient;
pub mod args;
pub mod capabilities;
pub mod conflist;
pub mod http;
pub mod install;
pub mod listen;
pub mod metrics;
pub mod plugin;
pub mod podapi;
pub mod pods;
pub mod podwatch;
pub mod reconcile;
pub mod repair;
pub mod report;
pub mod settings;
pub mod template;
pub mod timings;
pub mod uninstall;
pub mod untaint;
mod verdicts;
mod watch;

use std::sync::{Arc, Mutex, atomic::Ordering};

use anyhow::Context as _;
use serde_json::Value;

pub use settings::{AgentArgs, Settings};

use self::{
    conflist::{ConfError, Ensured},
    install::ServiceAccount,
    metrics::AgentCounters,
    report::{Network, Report},
    settings::{CniMode, LogFormat},
    template::Values,
};
use sidestep::{
    loader::{self, LoadOptions, LoadOutcome},
    mounts,
    pins::PinLayout,
    sys,
};

/// The running agent, shared by its tasks and the HTTP handlers.
pub struct Agent {
    pub settings: Settings,
    /// The rendered plugin entry.
    pub entry: Value,
    pub counters: AgentCounters,
    /// The data-path part of /metrics, walked at most once per `metrics-max-age`.
    pub metrics_cache: metrics::DataPathCache,
    service_account: bool,
    /// (inode, size, mtime) of the installed binary after our last check, so a reconcile
    /// re-reads it only when something changed it.
    installed: Mutex<Option<(u64, u64, i64)>>,
    report: Mutex<Report>,
    network: Mutex<Option<Network>>,
    /// How the programs were loaded, for reloading them when their pins vanish.
    load: LoadOptions,
    /// What the load at start-up created empty: the first reconcile enrols recorded pods again
    /// accordingly (then it is cleared).
    reenrol: Mutex<reconcile::Recreated>,
    /// The node's pods from the API's watch (in a cluster).
    pub pod_watch: podwatch::PodWatch,
    /// Istio ambient mode: the ZDS server and what ztunnel has been handed.
    pub ambient: Option<ambient::Ambient>,
    /// Competing plugins' entries in the conflist, as last seen (warned about once per change).
    competing: conflist::competing::Seen,
    /// Events posted off the loops that notice them (in a cluster).
    pub events: podapi::Queue,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn init_logging(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => b.json().try_init(),
        LogFormat::Text => b.try_init(),
    };
}

/// Capabilities the agent uses: bpf(2), tc, setns into pod netns, mount bpffs, and reading other
/// processes' /proc/PID/ns/net (only with scan-proc).
pub fn check_capabilities(scan_proc: bool) -> anyhow::Result<()> {
    use caps::{CapSet, Capability as C};
    let have = caps::read(None, CapSet::Effective).context("reading the capability sets")?;
    let mut need = vec![C::CAP_SYS_ADMIN, C::CAP_NET_ADMIN];
    if !have.contains(&C::CAP_SYS_ADMIN) {
        need.push(C::CAP_BPF);
    }
    if scan_proc {
        need.push(C::CAP_SYS_PTRACE);
    }
    let missing: Vec<String> = need
        .iter()
        .filter(|c| !have.contains(c))
        .map(ToString::to_string)
        .collect();
    if !missing.is_empty() {
        anyhow::bail!(
            "the agent lacks {}; grant them in the DaemonSet's securityContext.capabilities.add{}",
            missing.join(", "),
            if scan_proc {
                " (CAP_SYS_PTRACE only for scan-proc: set scan-proc=false to do without)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

impl Agent {
    /// The synchronous part of the start: load or adopt, install, kubeconfig.
    pub fn start(settings: Settings) -> anyhow::Result<Self> {
        let cgroup = match &settings.cgroup {
            Some(c) => c.clone(),
            None => mounts::node_cgroup2_root()
                .context("setting cgroup: unset, and the node's cgroup2 root is not in sight")?,
        };
        let object = settings
            .bpf_object
            .as_ref()
            .map(|p| {
                std::fs::read(p).with_context(|| format!("setting bpf-object: {}", p.display()))
            })
            .transpose()?;
        let load = LoadOptions {
            cgroup: cgroup.clone(),
            pin_root: settings.pin_root.clone(),
            pod_capacity: settings.pod_capacity,
            object,
            // A bpffs of the container's own would take the pins with it when it stops.
            bpffs_mount: mounts::BpffsMount::OnlyTheHosts,
        };
        // Without a pod map, any enrolment the records name is gone from the kernel; without the
        // listener map, any sk_lookup pod's proxy listener.
        let recreated = reconcile::Recreated::missing(&load.pin_root);
        // An agent started while uninstall-requested is set, after a drain finished, puts
        // nothing back; one started during a drain adopts what is pinned, as always.
        let uninstalled = settings.uninstall_requested_now() && !settings.pin_root.exists();
        if uninstalled {
            tracing::info!("uninstall requested and nothing is pinned: loading nothing");
        } else {
            let outcome = loader::load(&load)?;
            sys::failpoint("agent:after-load");
            tracing::info!(
                outcome = match outcome {
                    LoadOutcome::Fresh => "loaded",
                    LoadOutcome::Upgraded => "adopted",
                },
                cgroup = %cgroup.display(),
                pin_root = %settings.pin_root.display(),
                "programs attached"
            );
        }
        let sa = ServiceAccount::plugins_from_env(&settings.cni_service_account_dir)?;
        let kubeconfig = if sa.is_some() {
            settings
                .host_cni_conf_dir
                .join(&settings.kubeconfig_name)
                .display()
                .to_string()
        } else {
            tracing::info!("not in a cluster (no KUBERNETES_SERVICE_HOST): no kubeconfig written");
            String::new()
        };
        let mut entry = settings.template.render(&Values {
            pin_root: settings.pin_root.display().to_string(),
            state_dir: settings.state_dir.display().to_string(),
            kubeconfig,
            log_level: settings.cni_log_level.clone(),
            node_name: settings.node_name.clone(),
            pod_namespace: settings.pod_namespace.clone(),
            cni_net_dir: settings.host_cni_conf_dir.display().to_string(),
        });
        if settings.ambient
            && let Some(obj) = entry.as_object_mut()
        {
            obj.insert("ambient_enabled".into(), Value::Bool(true));
        }
        let ambient = if settings.ambient {
            Some(ambient::Ambient::listen(&settings.ztunnel_socket)?)
        } else {
            None
        };
        let events = podapi::Queue::new(repair::api_access(&settings), &settings.node_name);
        let agent = Self {
            metrics_cache: metrics::DataPathCache::new(
                settings.metrics_max_age,
                settings.metrics_per_pod,
            ),
            settings,
            entry,
            counters: AgentCounters::default(),
            service_account: sa.is_some(),
            installed: Mutex::new(None),
            report: Mutex::new(Report::default()),
            network: Mutex::new(None),
            load,
            // Records that outlived their pins (a reboot keeps /var/lib, not bpffs) name pods
            // whose netns may still run.
            reenrol: Mutex::new(recreated),
            pod_watch: podwatch::PodWatch::default(),
            ambient,
            competing: conflist::competing::Seen::default(),
            events,
        };
        if !uninstalled {
            agent.install_binary()?;
            sys::failpoint("agent:after-install");
            agent.refresh_kubeconfig()?;
        }
        Ok(agent)
    }

    /// Installs the plugin unless the installed file is the one we checked last time.
    pub fn install_binary(&self) -> anyhow::Result<()> {
        use std::os::unix::fs::MetadataExt as _;
        let dest = self.settings.installed_binary();
        let stamp = |p: &std::path::Path| {
            std::fs::metadata(p)
                .ok()
                .map(|m| (m.ino(), m.size(), m.mtime()))
        };
        let mut last = lock(&self.installed);
        if last.is_some() && *last == stamp(&dest) {
            return Ok(());
        }
        if install::install_binary(&self.settings.cni_binary, &dest)? {
            self.counters
                .binary_installs
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(from = %self.settings.cni_binary.display(), to = %dest.display(), "installed the CNI plugin");
        }
        *last = stamp(&dest);
        Ok(())
    }

    /// Rewrites the plugin's kubeconfig when its token (or CA) changed. It carries the plugin's
    /// own token (sidestep-cni: get on pods and namespaces), never the agent's, whose verbs
    /// depend on the repair mode: the file lies on the node, where every CNI plugin can read it.
    pub fn refresh_kubeconfig(&self) -> anyhow::Result<()> {
        if !self.service_account {
            return Ok(());
        }
        let Some(sa) = ServiceAccount::plugins_from_env(&self.settings.cni_service_account_dir)?
        else {
            return Ok(());
        };
        let path = self.settings.kubeconfig_path();
        if install::write_kubeconfig(&path, &sa.kubeconfig(), self.settings.kubeconfig_mode)? {
            self.counters
                .kubeconfig_writes
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(path = %path.display(), "wrote the plugin's kubeconfig");
        }
        Ok(())
    }

    /// Puts the entry in place (chained or standalone).
    pub fn ensure_cni(&self) -> Result<Ensured, ConfError> {
        let s = &self.settings;
        let done = match s.cni_mode {
            CniMode::Chained => {
                conflist::ensure_chained(&s.cni_conf_dir, s.cni_conf_name.as_deref(), &self.entry)?
            }
            CniMode::Standalone => conflist::ensure_standalone(
                &s.cni_conf_dir,
                s.cni_conf_name
                    .as_deref()
                    .unwrap_or(settings::DEFAULT_STANDALONE_NAME),
                &self.entry,
            )?,
        };
        if let Some(path) = done.path() {
            let net = conflist::read_as_list(path).ok().map(|(l, _)| {
                let s = |k: &str| l[k].as_str().unwrap_or_default().to_owned();
                (s("name"), s("cniVersion"))
            });
            *lock(&self.network) = net;
        }
        conflist::competing::check(
            &self.competing,
            &self.counters.warnings,
            &self.events,
            done.path(),
        );
        if done.wrote() {
            self.counters
                .cni_config_writes
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(done)
    }

    /// Ready when every cgroup link is attached, the plugin is installed and the configuration
    /// the runtime uses holds the entry. The body says what is missing.
    pub fn readiness(&self) -> (bool, String) {
        let s = &self.settings;
        let layout = PinLayout::new(&s.pin_root);
        let mut missing = Vec::new();
        let lost = loader::missing_pins(&layout);
        if !layout.is_loaded() {
            missing.push(format!(
                "programs are not loaded at {}",
                s.pin_root.display()
            ));
        } else if !lost.is_empty() {
            missing.push(format!(
                "{} pins are missing under {} (first: {}); the next reconcile reloads them",
                lost.len(),
                s.pin_root.display(),
                lost[0].display()
            ));
        } else {
            for attach_point in sidestep::status::detached_cgroup_links(&layout) {
                missing.push(format!("link {attach_point} is not attached"));
            }
        }
        if s.uninstall_requested_now() {
            let status = lock(&self.report).draining.clone();
            missing.push(format!(
                "uninstall-requested is set ({}); unset it to install again",
                status.as_deref().unwrap_or("draining")
            ));
        }
        if !s.installed_binary().is_file() {
            missing.push(format!(
                "{} is not installed",
                s.installed_binary().display()
            ));
        }
        let standalone = s.cni_mode == CniMode::Standalone;
        let name = match s.cni_mode {
            CniMode::Standalone => Some(
                s.cni_conf_name
                    .as_deref()
                    .unwrap_or(settings::DEFAULT_STANDALONE_NAME),
            ),
            CniMode::Chained => s.cni_conf_name.as_deref(),
        };
        if !conflist::entry_in_place(&s.cni_conf_dir, name, standalone, &self.entry) {
            missing.push(format!(
                "the CNI configuration in {} has no sidestep entry yet",
                s.cni_conf_dir.display()
            ));
        }
        let report = lock(&self.report);
        let mut tail = format!(
            "pods: {} enrolled, {} not enrolled, {} repaired at the last reconcile\n",
            report.enrolled,
            report.unenrolled.len(),
            report.repaired.len()
        );
        if let Some(why) = &report.reloaded {
            tail.push_str(&format!(
                "data path reloaded at the last reconcile: {why}\n"
            ));
        }
        if let Some(a) = &self.ambient {
            tail.push_str(&a.summary());
        }
        if missing.is_empty() {
            (true, format!("ready\n{tail}"))
        } else {
            (false, format!("not ready: {}\n{tail}", missing.join("; ")))
        }
    }

    pub fn metrics(&self) -> String {
        let ready = self.readiness().0;
        let report = lock(&self.report).clone();
        let s = &self.settings;
        let data = self.metrics_cache.get(&s.pin_root, &s.state_dir);
        metrics::render(
            &s.state_dir,
            ready,
            &report,
            &self.counters,
            &data,
            self.metrics_cache.walks(),
        )
    }

    /// Reloads the programs when pins are missing (bpffs unmounted, pins deleted behind our
    /// back), and marks every recorded pod for enrolment at once: the maps may be new and empty.
    /// Returns what was missing when it reloaded.
    fn ensure_data_path(&self) -> Result<Option<(String, reconcile::Recreated)>, String> {
        let layout = PinLayout::new(&self.settings.pin_root);
        let lost = loader::missing_pins(&layout);
        if lost.is_empty() {
            return Ok(None);
        }
        let recreated = reconcile::Recreated::missing(&self.settings.pin_root);
        let why = format!(
            "{} pins were missing under {} (first: {}): bpffs unmounted or pins deleted",
            lost.len(),
            layout.root().display(),
            lost[0].display()
        );
        tracing::error!(reason = %why, "the data path lost its pins; reloading");
        let outcome =
            loader::reload(&self.load).map_err(|e| format!("{why}; reload failed: {e}"))?;
        tracing::info!(
            ?outcome,
            "reloaded the programs; enrolling recorded pods again"
        );
        Ok(Some((why, recreated)))
    }

    /// The last reconcile's report, for `/debug/pods`.
    pub fn last_report(&self) -> Report {
        lock(&self.report).clone()
    }

    /// The network (name, cniVersion) the entry was last put into.
    pub fn network(&self) -> Option<Network> {
        lock(&self.network).clone()
    }

    /// One step of the uninstall drain ([`uninstall`]): the conflist entry stays removed, dead
    /// pods are collected, and everything goes after the last pod that needs it.
    fn drain(&self) -> Report {
        // The plugin's log socket would keep the state directory from being removed at the
        // drain's end; the plugin's lines go to its own stderr meanwhile.
        plugin::log::unbind(&self.settings.state_dir);
        let report = self.drain_step();
        for e in &report.errors {
            tracing::warn!(error = %e, "uninstall drain");
        }
        *lock(&self.report) = report.clone();
        report
    }

    fn drain_step(&self) -> Report {
        match uninstall::uninstall(&self.settings, uninstall::Mode::Drain) {
            Ok(removed) => {
                let status = match removed.draining {
                    Some(d) => d.to_string(),
                    None => {
                        if removed.pin_root.is_some() || removed.binary.is_some() {
                            tracing::info!(%removed, "drain finished: the last pod is gone");
                        }
                        "uninstalled: everything sidestep put on this node is removed".into()
                    }
                };
                Report {
                    draining: Some(status),
                    ..Report::default()
                }
            }
            Err(e) => Report {
                draining: Some("draining: the last step failed; retried at the next".into()),
                errors: vec![format!("uninstall drain: {e}")],
                ..Report::default()
            },
        }
    }

    /// One reconcile; the report is kept for /readyz and /metrics.
    pub fn reconcile(&self) -> Report {
        if self.settings.uninstall_requested_now() {
            // Restoring what the uninstall removes would undo it: the drain runs instead, and
            // removes everything once the last pod that needs it is gone.
            return self.drain();
        }
        uninstall::forget_drain(&self.settings);
        let network = lock(&self.network).clone();
        if let Err(e) = self.install_binary() {
            tracing::warn!(error = %format!("{e:#}"), "reinstalling the CNI plugin");
        }
        let reloaded = self.ensure_data_path();
        let at_start = std::mem::take(&mut *lock(&self.reenrol));
        let recreated = match &reloaded {
            Ok(Some((_, r))) => r.or(at_start),
            _ => at_start,
        };
        let watched = self.pod_watch.pods();
        let mut report = reconcile::reconcile(
            &self.settings,
            &self.entry,
            network.as_ref(),
            recreated,
            watched,
        );
        match reloaded {
            Ok(None) => {}
            Ok(Some((why, _))) => {
                report.errors.push(format!("data path reloaded: {why}"));
                report.reloaded = Some(why);
            }
            Err(e) => report.errors.push(e),
        }
        let c = &self.counters;
        c.reconciles.fetch_add(1, Ordering::Relaxed);
        c.gc_collected
            .fetch_add(report.collected.len() as u64, Ordering::Relaxed);
        c.repaired
            .fetch_add(report.repaired.len() as u64, Ordering::Relaxed);
        c.repair_deleted
            .fetch_add(report.deleted.len() as u64, Ordering::Relaxed);
        c.repair_labelled
            .fetch_add(report.labelled.len() as u64, Ordering::Relaxed);
        c.reconcile_errors
            .fetch_add(report.errors.len() as u64, Ordering::Relaxed);
        for e in &report.errors {
            tracing::warn!(error = %e, "reconcile");
        }
        tracing::info!(
            live = report.live,
            enrolled = report.enrolled,
            records = report.records,
            failopen = report.failopen,
            collected = report.collected.len(),
            unenrolled = report.unenrolled.len(),
            repaired = report.repaired.len(),
            "reconciled"
        );
        *lock(&self.report) = report.clone();
        report
    }
}

/// `sidestep agent`: runs until SIGTERM or SIGINT.
pub fn main(args: &AgentArgs, log_level: Option<&str>) -> anyhow::Result<()> {
    let settings = Settings::resolve(args, log_level)?;
    init_logging(&settings.log_level, settings.log_format);
    check_capabilities(settings.scan_proc)?;
    let agent = Arc::new(Agent::start(settings)?);
    // Before the runtime starts its threads: capabilities are per thread.
    capabilities::drop_after_start(&agent.settings)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(watch::run(agent))
}
