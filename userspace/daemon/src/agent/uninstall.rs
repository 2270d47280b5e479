//! `sidestep uninstall`: takes away everything the agent put on the node without leaving a
//! running pod uncaptured. istio-cni leaves a running pod's rules in its netns; sidestep's capture
//! lives in programs every pod shares, so removing them would leave every meshed pod without its
//! proxy at once (no mTLS, no AuthorizationPolicy), and nothing would say so.
//!
//! The default is a **drain**. The conflist entry goes first, so no new pod is enrolled. Then:
//! - the programs, pins and records stay while any pod is enrolled: those pods keep their capture
//!   until they are deleted;
//! - the plugin binary (and its kubeconfig) stay while any pod that existed when the drain began
//!   is still alive, captured or not: a runtime that runs DEL with the chain it cached at ADD
//!   calls the plugin, and a missing binary leaves the pod stuck in Terminating;
//! - once neither holds, everything goes, in an order that keeps the node usable: binary,
//!   kubeconfig, every pin (each link detached), the records.
//!
//! The pods alive when the drain began are kept by netns cookie in `<state_dir>/draining`, so a
//! drain survives the agent's restarts. While `uninstall-requested` is set, the agent runs the
//! same step at each reconcile (collecting dead pods' enrolments, as always), so the drain
//! finishes by itself once the last pod is gone. `--force` removes everything at once and says how
//! many enrolled pods it leaves uncaptured.

use std::{collections::BTreeSet, fs, io, path::PathBuf};

use super::{
    conflist::{self, ConfError},
    install::{self, InstallError},
    reconcile,
    settings::{CniMode, DEFAULT_STANDALONE_NAME, Settings},
};
use sidestep::{
    error::LoadError,
    loader,
    statedir::{StateDir, StateError},
};

/// How `uninstall` treats pods that are still captured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Keep what running pods need; remove it after the last of them is gone.
    Drain,
    /// Remove everything now, leaving enrolled pods uncaptured.
    Force,
}

/// The file under the state directory that names the pods alive when the drain began.
const DRAIN_FILE: &str = "draining";

/// What still holds a drain back.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Draining {
    /// Pods still enrolled: they keep their capture.
    pub enrolled: usize,
    /// Pods alive when the drain began and alive still: their DEL may still call the plugin.
    pub old_chain: usize,
}

impl Draining {
    pub fn done(&self) -> bool {
        self.enrolled == 0 && self.old_chain == 0
    }
}

impl std::fmt::Display for Draining {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "draining: {} enrolled pods keep their capture; {} pods from before the drain may \
             still call the plugin at DEL",
            self.enrolled, self.old_chain
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error("removing the CNI configuration entry: {0}")]
    Conf(#[from] ConfError),
    #[error(transparent)]
    Install(#[from] InstallError),
    #[error("removing the programs: {0}")]
    Unload(#[from] LoadError),
    #[error("removing the plugin's records: {0}")]
    State(#[from] StateError),
    #[error("the drain's list of pods {path}: {source}")]
    Drain { path: PathBuf, source: io::Error },
}

/// What was removed, for the operator.
#[derive(Debug, Default, serde::Serialize)]
pub struct Removed {
    pub conf_files: Vec<PathBuf>,
    pub binary: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub pin_root: Option<PathBuf>,
    pub records: usize,
    /// A drain still under way: what it waits for (nothing but the conflist entry removed).
    pub draining: Option<Draining>,
    /// `--force`: the enrolled pods it left uncaptured.
    pub left_uncaptured: Option<usize>,
}

impl std::fmt::Display for Removed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[PathBuf]| {
            v.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let opt = |p: &Option<PathBuf>| {
            p.as_ref()
                .map_or("nothing".into(), |p| p.display().to_string())
        };
        writeln!(
            f,
            "sidestep entry removed from: {}",
            if self.conf_files.is_empty() {
                "no file (none had it)".into()
            } else {
                list(&self.conf_files)
            }
        )?;
        if let Some(d) = &self.draining {
            writeln!(f, "{d}")?;
            return writeln!(
                f,
                "programs, pins, plugin binary and records stay until those pods are gone; the \
                 agent finishes the drain while uninstall-requested is set (or run `sidestep \
                 uninstall` again; --force removes them now)"
            );
        }
        if let Some(n) = self.left_uncaptured {
            writeln!(f, "--force: {n} enrolled pods left UNCAPTURED")?;
        }
        writeln!(f, "plugin binary removed: {}", opt(&self.binary))?;
        writeln!(f, "kubeconfig removed: {}", opt(&self.kubeconfig))?;
        writeln!(
            f,
            "programs detached and pins removed: {}",
            opt(&self.pin_root)
        )?;
        writeln!(f, "plugin records removed: {}", self.records)
    }
}

pub fn uninstall(s: &Settings, mode: Mode) -> Result<Removed, UninstallError> {
    let standalone = (s.cni_mode == CniMode::Standalone).then(|| {
        s.cni_conf_name
            .as_deref()
            .unwrap_or(DEFAULT_STANDALONE_NAME)
    });
    let mut removed = Removed {
        conf_files: conflist::remove_everywhere(&s.cni_conf_dir, s.plugin_type(), standalone)?,
        ..Removed::default()
    };
    match mode {
        Mode::Force => {
            removed.left_uncaptured = Some(sidestep::maps::enrolled_cookies(&s.pin_root).len());
        }
        Mode::Drain => {
            let draining = drain_step(s)?;
            if !draining.done() {
                removed.draining = Some(draining);
                return Ok(removed);
            }
        }
    }
    remove_installed(s, &mut removed)?;
    Ok(removed)
}

/// One step of a drain: collects the enrolments of pods that are gone (the reconcile's GC, with
/// no repair and no re-enrolment), then counts what still holds the drain back. The pods alive
/// at the first step are written down then.
pub fn drain_step(s: &Settings) -> Result<Draining, UninstallError> {
    let quiet = Settings {
        repair: false,
        ..s.clone()
    };
    let report = reconcile::reconcile(
        &quiet,
        &serde_json::Value::Null,
        None,
        reconcile::Recreated::default(),
        None,
    );
    let enrolled = sidestep::maps::enrolled_cookies(&s.pin_root);
    let live: BTreeSet<u64> = report
        .unenrolled
        .iter()
        .map(|l| l.cookie)
        .chain(enrolled.iter().copied())
        .collect();
    let file = s.state_dir.join(DRAIN_FILE);
    let old_chain: BTreeSet<u64> = match fs::read_to_string(&file) {
        Ok(text) => text.lines().filter_map(|l| l.trim().parse().ok()).collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => live.clone(),
        Err(source) => return Err(UninstallError::Drain { path: file, source }),
    };
    // Without the binary no DEL can call the plugin, whatever pods are left.
    let still: BTreeSet<u64> = if s.installed_binary().exists() {
        old_chain.intersection(&live).copied().collect()
    } else {
        BTreeSet::new()
    };
    let draining = Draining {
        enrolled: enrolled.len(),
        old_chain: still.len(),
    };
    if !draining.done() {
        let text: String = still.iter().map(|c| format!("{c}\n")).collect();
        fs::create_dir_all(&s.state_dir)
            .and_then(|()| fs::write(&file, text))
            .map_err(|source| UninstallError::Drain {
                path: file.clone(),
                source,
            })?;
    }
    Ok(draining)
}

/// Forgets a drain that was called off (`uninstall-requested` set back to false): pods created
/// after it would be missing from its list, so a later drain starts a list of its own.
pub fn forget_drain(s: &Settings) {
    match fs::remove_file(s.state_dir.join(DRAIN_FILE)) {
        Ok(()) => tracing::info!("uninstall no longer requested: the drain is called off"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(error = %e, "cannot remove the drain's list of pods"),
    }
}

/// Everything but the conflist entry: the binary, the kubeconfig, every pin (each link
/// detached) and the state directory's contents.
fn remove_installed(s: &Settings, removed: &mut Removed) -> Result<(), UninstallError> {
    let bin = s.installed_binary();
    if install::remove_file(&bin)? {
        removed.binary = Some(bin);
    }
    let kc = s.kubeconfig_path();
    if install::remove_file(&kc)? {
        removed.kubeconfig = Some(kc);
    }
    if s.pin_root.exists() {
        loader::unload(&s.pin_root)?;
        removed.pin_root = Some(s.pin_root.clone());
    }
    let file = s.state_dir.join(DRAIN_FILE);
    match fs::remove_file(&file) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(UninstallError::Drain {
                path: file,
                source: e,
            });
        }
        _ => {}
    }
    // The records, markers, temporary files, timings and index, then the directory if
    // nothing else is in it.
    removed.records = StateDir::new(&s.state_dir).remove_all()?;
    Ok(())
}
