//! `sidestep uninstall`: takes away everything the agent put on the node, in the order that keeps
//! the node usable throughout: the conflist entry first (no new ADD reaches the plugin), then the
//! binary, the kubeconfig, every pin (each link detached, so no program stays attached), and the
//! plugin's records. A pod deleted afterwards still gets a clean DEL: the runtime no longer calls
//! the plugin, and a plugin still called (from a cached config) finds nothing and succeeds.

use std::path::PathBuf;

use super::{
    conflist::{self, ConfError},
    install::{self, InstallError},
    settings::{CniMode, DEFAULT_STANDALONE_NAME, Settings},
};
use sidestep::{
    error::LoadError,
    loader,
    statedir::{StateDir, StateError},
};

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
}

/// What was removed, for the operator.
#[derive(Debug, Default)]
pub struct Removed {
    pub conf_files: Vec<PathBuf>,
    pub binary: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub pin_root: Option<PathBuf>,
    pub records: usize,
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

pub fn uninstall(s: &Settings) -> Result<Removed, UninstallError> {
    let standalone = (s.cni_mode == CniMode::Standalone).then(|| {
        s.cni_conf_name
            .as_deref()
            .unwrap_or(DEFAULT_STANDALONE_NAME)
    });
    let mut removed = Removed {
        conf_files: conflist::remove_everywhere(&s.cni_conf_dir, s.plugin_type(), standalone)?,
        ..Removed::default()
    };
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
    // The records, markers, temporary files, timings and index, then the directory if
    // nothing else is in it.
    removed.records = StateDir::new(&s.state_dir).remove_all()?;
    Ok(removed)
}
