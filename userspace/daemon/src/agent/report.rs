//! What one reconcile found and did, and how it failed: shared by the reconcile, repair and
//! the metrics, so none of them imports another for its types.

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
