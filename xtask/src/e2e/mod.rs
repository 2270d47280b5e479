//! `cargo xtask e2e`: one real Kubernetes node on this machine (issue 36).
//!
//! The components are built from the Go module proxy into a cache outside the checkout
//! (`components`), and `up` starts them from a scratch directory with everything they write
//! kept inside it (`node`), so `down` (`teardown`) can prove that nothing is left.

mod components;
mod config;
mod host;
mod images;
mod node;
mod pki;
mod state;
mod teardown;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Subcommand;

/// Kubernetes release built from the `k8s.io/kubernetes` module; its staging modules are
/// published as `v0.<minor>.<patch>`.
pub const KUBERNETES_VERSION: &str = "v1.37.2";
/// etcd 3.6: Debian's 3.4 is older than Kubernetes 1.37 supports.
pub const ETCD_VERSION: &str = "v3.6.16";
/// containerd 2.3: Kubernetes 1.36+ needs 2.2+ (containerd's RELEASES.md).
pub const CONTAINERD_VERSION: &str = "v2.3.7";

/// The default scratch directory; `down` finds the node through the state file in it.
const DEFAULT_DIR: &str = "/tmp/sidestep-e2e";

#[derive(Subcommand)]
pub enum E2eTask {
    /// Build (or find in the cache) Kubernetes, etcd, containerd and the pause binary.
    Build {
        /// Also build the five Kubernetes commands as separate binaries, to compare with the
        /// one multi-call binary that `up` uses (a measurement; `up` never needs it).
        #[arg(long)]
        separate: bool,
    },
    /// Bring up one node (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
    /// containerd, kubelet) from a scratch directory and leave it running.
    Up {
        /// Scratch directory; must not exist yet.
        #[arg(long, default_value = DEFAULT_DIR)]
        dir: PathBuf,
        /// Start this daemon (etcd, kube-apiserver, ..., kubelet) with a flag it rejects, to
        /// see the failure path: the daemon named with its log's tail, then a full teardown.
        #[arg(long, value_name = "DAEMON", value_parser = clap::builder::PossibleValuesParser::new(node::DAEMONS))]
        fail: Option<String>,
    },
    /// Stop the node and remove everything it made; nothing to do when no node is up.
    Down {
        #[arg(long, default_value = DEFAULT_DIR)]
        dir: PathBuf,
    },
}

pub fn run(task: E2eTask) -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("e2e needs root: it starts kubelet and containerd and manages cgroups");
    }
    match task {
        E2eTask::Build { separate } => {
            let built = components::build_all()?;
            if separate {
                components::build_kubernetes_separately()?;
            }
            built.print_versions()?;
            Ok(())
        }
        E2eTask::Up { dir, fail } => node::up(&dir, fail.as_deref()),
        E2eTask::Down { dir } => teardown::down(&dir),
    }
}

/// Wall time of each phase, printed as a table at the end of `up` and `down`.
#[derive(Default)]
pub struct Phases {
    done: Vec<(String, f64)>,
}

impl Phases {
    /// Run `f` as phase `name`, print and record how long it took.
    pub fn time<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        println!("--- {name}");
        let result = f();
        let secs = start.elapsed().as_secs_f64();
        println!(
            "--- {name}: {secs:.1} s{}",
            if result.is_err() { " (failed)" } else { "" }
        );
        self.done.push((name.to_owned(), secs));
        result
    }

    pub fn print(&self, title: &str) {
        println!("\n{title}");
        for (name, secs) in &self.done {
            println!("  {name:<28} {secs:>7.1} s");
        }
        let total: f64 = self.done.iter().map(|(_, s)| s).sum();
        println!("  {:<28} {total:>7.1} s", "total");
    }
}
