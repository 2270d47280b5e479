//! The pods of this node, kept by a watch on the API (kube-runtime's watcher and reflector, with
//! `spec.nodeName=<node>`), as istio-cni's repair controller keeps them. Every change pokes a
//! reconcile, so a pod that appears uncaptured is repaired within a reconcile's time of the API
//! saying so, not at the next poll; the periodic reconcile stays as the backstop. Repair reads
//! the pods from here once the first list is in, and lists them itself before that.
//!
//! The watcher relists on its own when the API answers a watch with 410 Gone (a resourceVersion
//! too old), and backs off on errors; both are logged.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api,
    runtime::{
        WatchStreamExt as _,
        reflector::{self, Store},
        watcher,
    },
};
use tokio::sync::mpsc;

use super::Agent;

/// What the watch has seen.
#[derive(Default)]
pub struct PodWatch {
    store: OnceLock<Store<Pod>>,
    /// The first list is in: the store is the node's pods.
    synced: AtomicBool,
    /// Watch events received (applies and deletes, the initial list's included).
    pub events: AtomicU64,
    /// Namespace changes seen (ambient mode watches namespaces: their labels pick pods).
    pub namespace_events: AtomicU64,
    /// Ambient mode: the namespaces, once listed.
    namespaces: OnceLock<Store<Namespace>>,
    namespaces_synced: AtomicBool,
    /// The last watch error, for the log and /readyz.
    last_error: Mutex<Option<String>>,
}

impl std::fmt::Debug for PodWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodWatch")
            .field("synced", &self.synced.load(Ordering::Relaxed))
            .field("events", &self.events.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl PodWatch {
    /// The node's pods, once the watch has listed them.
    pub fn pods(&self) -> Option<Vec<Pod>> {
        if !self.synced.load(Ordering::Acquire) {
            return None;
        }
        let store = self.store.get()?;
        Some(store.state().iter().map(|p| (**p).clone()).collect())
    }

    /// The UID of the pod `namespace/name` as the watch holds it now, so that Events about a
    /// pod the plugin named (it records no UID) are linked to it (`kubectl describe` matches
    /// Events by UID).
    pub fn uid_of(&self, namespace: &str, name: &str) -> Option<String> {
        let key = reflector::ObjectRef::<Pod>::new(name).within(namespace);
        self.store.get()?.get(&key)?.metadata.uid.clone()
    }

    /// The pod `namespace/name` as the watch holds it now.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        let key = reflector::ObjectRef::<Pod>::new(name).within(namespace);
        self.store.get()?.get(&key).map(|p| (*p).clone())
    }

    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The labels of namespace `name` as the namespace watch holds them, once it listed them
    /// (ambient mode only); `None` when not known.
    pub fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        if !self.namespaces_synced.load(Ordering::Acquire) {
            return None;
        }
        let ns = self
            .namespaces
            .get()?
            .get(&reflector::ObjectRef::<Namespace>::new(name))?;
        Some(ns.metadata.labels.clone().unwrap_or_default())
    }
}

/// Watches the node's pods for as long as the agent runs, poking `poke` on every change, when
/// repair is on and the node is named; without a kubeconfig yet it waits for one.
pub async fn run(agent: Arc<Agent>, poke: mpsc::Sender<()>) {
    let node = agent.settings.node_name.clone();
    // Repair and ambient mode (the pods' UIDs, which ztunnel names workloads by) read the pods;
    // without either the agent asks the API nothing.
    if node.is_empty() || !(agent.settings.repair || agent.settings.ambient) {
        return;
    }
    let api = loop {
        if let Some(api) = super::repair::api_access(&agent.settings) {
            break api;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    let client = loop {
        match super::apiclient::client(&api, None).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!(error = %e, "pod watch: no API client yet");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    };
    if agent.settings.ambient {
        tokio::spawn(watch_namespaces(
            agent.clone(),
            client.clone(),
            poke.clone(),
        ));
    }
    let (reader, writer) = reflector::store::<Pod>();
    let watch = &agent.pod_watch;
    let _ = watch.store.set(reader);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher(Api::<Pod>::all(client), config)
        .default_backoff()
        .reflect(writer)
        .boxed();
    tracing::info!(node = %node, "watching this node's pods");
    // Ambient mode: each pod's `istio.io/dataplane-mode` as last seen, by UID. A pod labelled
    // into the mesh while it runs must be asked about again, although repair remembers its netns
    // as skipped; other label changes (leader election, rollouts) must not make it ask again
    // about every skipped pod.
    let mut modes_seen: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut relisted: BTreeSet<String> = BTreeSet::new();
    let ambient = agent.settings.ambient;
    while let Some(event) = stream.next().await {
        if ambient {
            follow_mode_labels(&event, &mut modes_seen, &mut relisted);
        }
        match event {
            Ok(watcher::Event::InitDone) => {
                let first = !watch.synced.swap(true, Ordering::AcqRel);
                if first {
                    tracing::info!(
                        pods = watch.store.get().map_or(0, |s| s.state().len()),
                        "pod watch: listed this node's pods"
                    );
                }
                let _ = poke.try_send(());
            }
            Ok(watcher::Event::Init) => {}
            Ok(watcher::Event::InitApply(_)) => {
                watch.events.fetch_add(1, Ordering::Relaxed);
            }
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                watch.events.fetch_add(1, Ordering::Relaxed);
                let _ = poke.try_send(());
            }
            Err(e) => {
                let text = e.to_string();
                let mut last = watch
                    .last_error
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if last.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "pod watch (it retries with backoff, and relists after 410 Gone)");
                }
                *last = Some(text);
            }
        }
    }
}

/// Keeps `modes_seen` (pod UID -> its `istio.io/dataplane-mode` label) in step with the watch,
/// and has repair forget its skips when a pod's changes. A relist rebuilds it (`relisted`
/// collects the UIDs listed): deletes during a broken watch come as no event.
fn follow_mode_labels(
    event: &Result<watcher::Event<Pod>, watcher::Error>,
    modes_seen: &mut BTreeMap<String, Option<String>>,
    relisted: &mut BTreeSet<String>,
) {
    let uid_and_mode = |pod: &Pod| {
        let mode = pod.metadata.labels.as_ref().and_then(|l| {
            l.get(sidestep::policy::ambient_selectors::DATAPLANE_MODE)
                .cloned()
        });
        (pod.metadata.uid.clone().unwrap_or_default(), mode)
    };
    match event {
        Ok(watcher::Event::Init) => relisted.clear(),
        Ok(watcher::Event::InitDone) => modes_seen.retain(|uid, _| relisted.contains(uid)),
        Ok(watcher::Event::InitApply(pod) | watcher::Event::Apply(pod)) => {
            let (uid, mode) = uid_and_mode(pod);
            if matches!(event, Ok(watcher::Event::InitApply(_))) {
                relisted.insert(uid.clone());
            }
            if modes_seen
                .insert(uid, mode.clone())
                .is_some_and(|before| before != mode)
            {
                tracing::debug!(pod = ?pod.metadata.name, mode = ?mode, "pod's dataplane mode changed");
                super::repair::forget_skips();
            }
        }
        Ok(watcher::Event::Delete(pod)) => {
            modes_seen.remove(&uid_and_mode(pod).0);
        }
        Err(_) => {}
    }
}

/// Ambient mode: a namespace labelled `istio.io/dataplane-mode=ambient` moves its running pods
/// into the mesh, so every namespace change pokes a reconcile whose repair asks the plugin again
/// about every pod it left uncaptured (the plugin reads the namespace's labels itself), and the
/// plugin's ambient enrolment then reaches ztunnel. Namespaces are few and change rarely.
async fn watch_namespaces(agent: Arc<Agent>, client: kube::Client, poke: mpsc::Sender<()>) {
    let (reader, writer) = reflector::store::<Namespace>();
    let _ = agent.pod_watch.namespaces.set(reader);
    let mut stream = watcher(Api::<Namespace>::all(client), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .boxed();
    tracing::info!("watching namespaces (ambient: their labels pick pods)");
    let mut last_error = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::InitDone) => {
                agent
                    .pod_watch
                    .namespaces_synced
                    .store(true, Ordering::Release);
            }
            Ok(watcher::Event::Apply(ns) | watcher::Event::Delete(ns)) => {
                agent
                    .pod_watch
                    .namespace_events
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(namespace = ?ns.metadata.name, "namespace changed");
                super::repair::forget_skips();
                let _ = poke.try_send(());
            }
            Ok(_) => {}
            Err(e) => {
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "namespace watch (it retries with backoff)");
                }
                last_error = Some(text);
            }
        }
    }
}
