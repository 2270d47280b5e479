//! What one reconcile found and did, and how it failed, and what the agent warns about:
//! shared by the reconcile, repair, the conflist and plugin-log watches and the metrics, so none
//! of them imports another for its types.

use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge};

use super::pods::{LiveNetns, Record};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("cannot unenrol netns cookie {cookie}: {source}")]
    Unenroll {
        cookie: u64,
        source: sidestep::error::EnrollError,
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
    /// Why the data path was reloaded in this reconcile, if it was.
    pub reloaded: Option<String>,
    pub live: usize,
    pub enrolled: usize,
    pub records: usize,
    pub failopen: usize,
    pub collected: Vec<Record>,
    pub unenrolled: Vec<LiveNetns>,
    pub repaired: Vec<LiveNetns>,
    /// Netns whose pod the plugin's ADD leaves uncaptured (repair in a cluster), with its reason.
    pub skipped: Vec<(LiveNetns, String)>,
    /// Pods repair deleted (`repair-mode: delete`) or labelled (`label`) instead of enrolling.
    pub deleted: Vec<LiveNetns>,
    pub labelled: Vec<LiveNetns>,
    pub errors: Vec<String>,
    /// While uninstall-requested is set: where the drain stands.
    pub draining: Option<String>,
}

/// The network the plugin runs in: (name, cniVersion) for the repair's config.
pub type Network = (String, String);

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct EntryType {
    r#type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct SkipReason {
    reason: String,
}

/// What the agent warns about, as metrics: the conflist's competing entries
/// ([`super::conflist::competing`]) and the pods the plugin's ADD left uncaptured
/// ([`super::plugin::log`]). Written where each is noticed, read at each scrape.
#[derive(Debug, Default)]
pub struct Warnings {
    competing: Family<EntryType, Gauge>,
    skipped: Family<SkipReason, Counter>,
}

impl Warnings {
    /// Entries of `plugin_type` in the conflist sidestep chains into.
    pub fn set_competing(&self, plugin_type: &str, count: usize) {
        self.competing
            .get_or_create(&EntryType {
                r#type: plugin_type.to_owned(),
            })
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// One more pod the plugin left uncaptured for `reason` (its fixed reason code).
    pub fn count_skipped(&self, reason: &str) {
        self.skipped
            .get_or_create(&SkipReason {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn register(&self, reg: &mut prometheus_client::registry::Registry) {
        reg.register(
            "sidestep_conflist_competing_entries",
            "Entries of another capturing CNI plugin (type) in the CNI configuration sidestep chains into: both would capture its pods",
            self.competing.clone(),
        );
        reg.register(
            "sidestep_cni_skipped_pods",
            "Pods the plugin's ADD left uncaptured, by reason (istio-init: Istio's iptables captures them), once per pod",
            self.skipped.clone(),
        );
    }
}
