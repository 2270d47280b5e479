//! The agent's loops: the CNI conf directory (inotify through notify, plus a slow tick), the
//! service account token, the plugin's records, and the periodic reconcile; they run until
//! SIGTERM or SIGINT, which leave everything in place.

use std::{
    collections::BTreeSet,
    path::Path,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use notify::{RecursiveMode, Watcher as _};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    time::sleep,
};

use super::{
    Agent,
    conflist::{ConfError, Ensured},
    pods,
};

/// Whether an event in a watched directory may have changed a file. Opening and closing a file
/// without writing it does not; and each loop reads the files it watches, so poking on those
/// would wake it again after every look of its own, for ever.
fn may_change(event: &notify::Event) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// A watcher on `dir` that pokes `tx` (coalescing: one pending poke is enough).
fn watcher(dir: &Path, tx: mpsc::Sender<()>) -> notify::Result<notify::RecommendedWatcher> {
    let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.as_ref().is_ok_and(may_change) {
            let _ = tx.try_send(());
        }
    })?;
    w.watch(dir, RecursiveMode::NonRecursive)?;
    Ok(w)
}

async fn blocking<T: Send + 'static>(
    agent: &Arc<Agent>,
    f: impl FnOnce(&Agent) -> T + Send + 'static,
) -> Option<T> {
    let a = agent.clone();
    tokio::task::spawn_blocking(move || f(&a)).await.ok()
}

async fn cni_loop(agent: Arc<Agent>, mut rx: mpsc::Receiver<()>) {
    let mut waiting_logged = false;
    let mut uninstall_logged = false;
    let mut wait = Duration::ZERO;
    loop {
        tokio::select! {
            _ = rx.recv() => {
                // Let a writer finish its burst of events; still well within a second.
                sleep(Duration::from_millis(50)).await;
                while rx.try_recv().is_ok() {}
            }
            _ = sleep(wait) => {}
        }
        wait = Duration::from_secs(5);
        let uninstalling = blocking(&agent, |a| a.settings.uninstall_requested_now()).await;
        if uninstalling == Some(true) {
            if !uninstall_logged {
                tracing::info!("uninstall requested: the CNI entry is not restored");
            }
            uninstall_logged = true;
            continue;
        }
        if std::mem::take(&mut uninstall_logged) {
            tracing::info!("uninstall no longer requested: restoring the CNI entry");
        }
        match blocking(&agent, |a| a.ensure_cni()).await {
            Some(Ok(done)) => {
                match &done {
                    Ensured::Written(p) => {
                        tracing::info!(path = %p.display(), "inserted the sidestep entry into the CNI configuration")
                    }
                    Ensured::Wrapped { from, to } => {
                        tracing::info!(from = %from.display(), to = %to.display(), "wrapped a lone .conf into a .conflist with the sidestep entry")
                    }
                    Ensured::Waiting if !waiting_logged => {
                        tracing::info!(dir = %agent.settings.cni_conf_dir.display(), "waiting for the primary CNI's configuration");
                    }
                    _ => {}
                }
                waiting_logged = matches!(done, Ensured::Waiting);
            }
            // Another CNI is half-way through writing; its next event or this retry catches it.
            Some(Err(e @ ConfError::Invalid { .. })) => {
                tracing::debug!(error = %e, "CNI configuration not readable yet");
                wait = Duration::from_millis(200);
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "CNI configuration");
                wait = Duration::from_secs(1);
            }
            None => {}
        }
    }
}

async fn kubeconfig_loop(agent: Arc<Agent>, mut rx: mpsc::Receiver<()>) {
    loop {
        tokio::select! {
            _ = rx.recv() => sleep(Duration::from_millis(100)).await,
            _ = sleep(Duration::from_secs(30)) => {}
        }
        while rx.try_recv().is_ok() {}
        if blocking(&agent, |a| a.settings.uninstall_requested_now()).await == Some(true) {
            continue;
        }
        if let Some(Err(e)) = blocking(&agent, |a| a.refresh_kubeconfig()).await {
            tracing::warn!(error = %format!("{e:#}"), "kubeconfig");
        }
    }
}

/// Counts the plugin's ADDs and DELs as records appearing and disappearing, reads its timing
/// lines, and in a cluster turns what the plugin did into Events on the pods: a new record is
/// `SidestepEnrolled`, a new FAIL_OPEN marker `SidestepUncaptured` (a failed ADD under
/// FAIL_CLOSE needs none: kubelet reports the plugin's error on the pod itself).
async fn records_loop(agent: Arc<Agent>) {
    let dir = agent.settings.state_dir.clone();
    let markers_dir = dir.join("failopen");
    let mut seen: BTreeSet<String> = pods::record_names(&dir).into_iter().collect();
    let mut seen_markers: BTreeSet<String> = pods::record_names(&markers_dir).into_iter().collect();
    loop {
        sleep(Duration::from_secs(1)).await;
        let now: BTreeSet<String> = pods::record_names(&dir).into_iter().collect();
        let markers: BTreeSet<String> = pods::record_names(&markers_dir).into_iter().collect();
        let c = &agent.counters;
        c.cni_adds_observed
            .fetch_add(now.difference(&seen).count() as u64, Ordering::Relaxed);
        c.cni_dels_observed
            .fetch_add(seen.difference(&now).count() as u64, Ordering::Relaxed);
        let added: Vec<_> = now
            .difference(&seen)
            .map(|n| (dir.join(n), super::podapi::Reason::Enrolled))
            .chain(
                markers
                    .difference(&seen_markers)
                    .map(|n| (markers_dir.join(n), super::podapi::Reason::Uncaptured)),
            )
            .collect();
        if !added.is_empty() {
            blocking(&agent, move |a| post_add_events(a, &added)).await;
        }
        seen = now;
        seen_markers = markers;
        c.cni.poll(&dir);
    }
}

/// What one of the plugin's ADDs left: a record (enrolled) or a fail-open marker (uncaptured).
struct AddOutcome {
    pod_namespace: Option<String>,
    pod_name: Option<String>,
    container_id: String,
    /// The interface captured, or why the pod was let through.
    detail: String,
}

impl AddOutcome {
    fn read(path: &std::path::Path, reason: super::podapi::Reason) -> Option<Self> {
        let bytes = std::fs::read(path).ok()?;
        if reason == super::podapi::Reason::Uncaptured {
            let m: sidestep::statedir::FailOpenMarker = serde_json::from_slice(&bytes).ok()?;
            return Some(Self {
                pod_namespace: m.pod_namespace,
                pod_name: m.pod_name,
                container_id: m.container_id,
                detail: m.reason,
            });
        }
        let r: sidestep::statedir::RecordSummary = serde_json::from_slice(&bytes).ok()?;
        Some(Self {
            pod_namespace: r.pod_namespace,
            pod_name: r.pod_name,
            container_id: r.container_id,
            detail: r.ifname,
        })
    }
}

/// Events for what the plugin's ADDs did, named by the pod the plugin recorded.
fn post_add_events(agent: &Agent, files: &[(std::path::PathBuf, super::podapi::Reason)]) {
    let s = &agent.settings;
    let Some(api) = super::repair::api_access(s).filter(|_| !s.node_name.is_empty()) else {
        return;
    };
    for (path, reason) in files {
        let Some(written) = AddOutcome::read(path, *reason) else {
            continue;
        };
        let name = written.pod_name.filter(|n| !n.is_empty());
        let (Some(namespace), Some(name)) = (written.pod_namespace, name) else {
            // Not a Kubernetes pod.
            continue;
        };
        // Repair records its own event.
        if written.container_id.starts_with("sidestep-repair-") {
            continue;
        }
        // The watch usually has the pod (kubelet makes the sandbox of a pod the API holds);
        // a pod it has not seen yet costs one GET. An Event without a UID still shows in
        // `kubectl get events`, only not in `kubectl describe pod`.
        let uid = agent
            .pod_watch
            .uid_of(&namespace, &name)
            .or_else(|| super::podapi::uid(&api, &namespace, &name).ok())
            .unwrap_or_default();
        let pod = super::podapi::NodePod {
            namespace,
            name,
            uid,
        };
        let message = match reason {
            super::podapi::Reason::Uncaptured => format!(
                "started WITHOUT traffic capture (fail_strategy FAIL_OPEN): {}",
                written.detail
            ),
            _ => format!("traffic captured on {} (CNI ADD)", written.detail),
        };
        if let Err(e) = super::podapi::event(&api, &s.node_name, &pod, *reason, &message) {
            tracing::debug!(error = %e, "could not record an event");
        }
    }
}

/// Reconciles every `reconcile_interval`, and soon after the pod watch reports a change: a pod
/// that appears uncaptured is repaired within about a second of the API listing it.
async fn reconcile_loop(agent: Arc<Agent>, mut pods_changed: mpsc::Receiver<()>) {
    // Repair needs the network the entry is in; give the first insertion a moment.
    for _ in 0..50 {
        if agent.network().is_some() {
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    loop {
        blocking(&agent, |a| a.reconcile()).await;
        tokio::select! {
            _ = sleep(agent.settings.reconcile_interval) => {}
            Some(()) = pods_changed.recv() => {
                // A burst of events (a rollout) makes one reconcile.
                sleep(Duration::from_millis(100)).await;
                while pods_changed.try_recv().is_ok() {}
            }
        }
    }
}

pub async fn run(agent: Arc<Agent>) -> anyhow::Result<()> {
    // Before anything can report ready: the plugin's lines from the first ADDs are read.
    super::plugin::log::spawn(agent.clone())?;
    let bound = super::http::serve(agent.clone(), agent.settings.listen).await?;
    tracing::info!(addr = %bound, "serving /healthz, /readyz and /metrics");
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;

    let (cni_tx, cni_rx) = mpsc::channel(1);
    let _conf_watch = watcher(&agent.settings.cni_conf_dir, cni_tx).map_err(|e| {
        anyhow::anyhow!(
            "setting cni-conf-dir: cannot watch {}: {e}",
            agent.settings.cni_conf_dir.display()
        )
    })?;
    // The plugin's token: its kubeconfig follows it.
    let (sa_tx, sa_rx) = mpsc::channel(1);
    let _sa_watch = agent
        .settings
        .cni_service_account_dir
        .is_dir()
        .then(|| watcher(&agent.settings.cni_service_account_dir, sa_tx))
        .transpose()
        .map_err(|e| tracing::warn!(error = %e, "not watching the service account; polling it"))
        .ok()
        .flatten();

    tokio::spawn(cni_loop(agent.clone(), cni_rx));
    tokio::spawn(kubeconfig_loop(agent.clone(), sa_rx));
    tokio::spawn(records_loop(agent.clone()));
    let (pods_tx, pods_rx) = mpsc::channel(1);
    tokio::spawn(super::podwatch::run(agent.clone(), pods_tx));
    tokio::spawn(reconcile_loop(agent.clone(), pods_rx));
    tokio::spawn(super::untaint::run(agent.clone()));
    super::addrwatch::spawn(agent.clone())?;
    super::verdicts::spawn(agent.clone())?;
    super::ambient::spawn(agent.clone())?;

    let sig = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    super::plugin::log::unbind(&agent.settings.state_dir);
    tracing::info!(
        signal = sig,
        "stopping; programs, pins and the CNI configuration stay in place (`sidestep uninstall` removes them)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind};

    use super::*;

    #[test]
    fn reading_a_watched_file_pokes_no_one() {
        let ev = |kind| notify::Event::new(kind);
        assert!(!may_change(&ev(EventKind::Access(AccessKind::Open(
            AccessMode::Any
        )))));
        assert!(!may_change(&ev(EventKind::Access(AccessKind::Close(
            AccessMode::Read
        )))));
        assert!(may_change(&ev(EventKind::Access(AccessKind::Close(
            AccessMode::Write
        )))));
        assert!(may_change(&ev(EventKind::Create(CreateKind::File))));
        assert!(may_change(&ev(EventKind::Modify(ModifyKind::Any))));
    }
}
