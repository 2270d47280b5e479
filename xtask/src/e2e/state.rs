//! What `up` did to the host, written to `<dir>/state.json` before each step that changes
//! something, so `down` (in a later process, or `up` cleaning up after itself) undoes exactly
//! that even when `up` died halfway.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

const FILE: &str = "state.json";

#[derive(Serialize, Deserialize, Default)]
pub struct State {
    /// The scratch directory.
    pub dir: PathBuf,
    /// The node's cgroup, relative to each hierarchy's root: below xtask's own cgroup, never a
    /// hierarchy's root.
    pub cgroup: String,
    /// Cgroup directories that `up` created (the node's subtree and any missing ancestors),
    /// parents first.
    pub cgroups_created: Vec<PathBuf>,
    /// Host sysctls as they were before `up`, to write back.
    pub sysctls: Vec<(String, String)>,
    /// KUBE-*/CNI-* iptables chains that existed before `up`: only newer ones are the node's.
    pub chains_before: BTreeSet<String>,
    /// Host directories outside the scratch directory that did not exist before `up`;
    /// kubelet and containerd create them at hard-coded paths.
    pub host_dirs_absent_before: Vec<PathBuf>,
    /// /sys/fs/bpf was a private mount that `up` made shared, for the agent's HostToContainer
    /// bpffs volume; `down` makes it private again.
    #[serde(default)]
    pub bpffs_made_shared: bool,
    /// Daemon name -> pid, in start order.
    pub daemons: Vec<(String, i32)>,
    pub ports: BTreeMap<String, u16>,
}

impl State {
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(FILE)
    }

    pub fn save(&self) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        let path = Self::path(&self.dir);
        let partial = path.with_extension("json.partial");
        fs::write(&partial, text)?;
        fs::rename(&partial, &path).with_context(|| format!("writing {}", path.display()))
    }

    pub fn load(dir: &Path) -> Result<Option<State>> {
        let path = Self::path(dir);
        if !path.exists() {
            return Ok(None);
        }
        let text = fs::read_to_string(&path)?;
        Ok(Some(
            serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?,
        ))
    }

    pub fn port(&self, name: &str) -> u16 {
        self.ports.get(name).copied().unwrap_or(0)
    }
}
