//! `cargo xtask e2e`: one real Kubernetes node on this machine (issue 36).
//!
//! The components are built from the Go module proxy into a cache outside the checkout
//! (`components`), and `up` starts them from a scratch directory with everything they write
//! kept inside it (`node`), so `down` (`teardown`) can prove that nothing is left.

mod components;
mod config;
mod host;
mod images;
mod install;
mod kubectl;
mod node;
mod pki;
mod run;
mod scenarios;
mod state;
mod teardown;
mod tools;

pub use tools::{helm, promtool};

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

/// `cargo xtask e2e [TASK]`: without a task, the whole run.
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct E2eArgs {
    #[command(subcommand)]
    task: Option<E2eTask>,
    /// Scratch directory for the whole run; must not exist yet.
    #[arg(long, default_value = DEFAULT_DIR)]
    dir: PathBuf,
    /// The negative control: install sidestep with its plugin chained into a conflist that
    /// containerd does not read (and repair off). The capture scenarios must then fail.
    #[arg(long)]
    without_sidestep: bool,
    /// Leave the node up after the scenarios, for a look (`cargo xtask e2e down` removes it).
    #[arg(long)]
    keep: bool,
    /// Start this daemon with a flag it rejects, to see the failure path (as `up --fail`).
    #[arg(long, value_name = "DAEMON", value_parser = clap::builder::PossibleValuesParser::new(node::DAEMONS))]
    fail: Option<String>,
}

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
    /// containerd, kubelet) from a scratch directory, install sidestep on it with kubectl, and
    /// leave it running.
    Up {
        /// Scratch directory; must not exist yet.
        #[arg(long, default_value = DEFAULT_DIR)]
        dir: PathBuf,
        /// Start this daemon (etcd, kube-apiserver, ..., kubelet) with a flag it rejects, to
        /// see the failure path: the daemon named with its log's tail, then a full teardown.
        #[arg(long, value_name = "DAEMON", value_parser = clap::builder::PossibleValuesParser::new(node::DAEMONS))]
        fail: Option<String>,
        /// Only the node: do not build the images and install sidestep on it.
        #[arg(long)]
        bare: bool,
    },
    /// Stop the node and remove everything it made; nothing to do when no node is up.
    Down {
        #[arg(long, default_value = DEFAULT_DIR)]
        dir: PathBuf,
    },
}

pub fn run(args: E2eArgs) -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("e2e needs root: it starts kubelet and containerd and manages cgroups");
    }
    let Some(task) = args.task else {
        return run::whole(
            &args.dir,
            &run::Options {
                without_sidestep: args.without_sidestep,
                keep: args.keep,
                fail: args.fail,
            },
        );
    };
    match task {
        E2eTask::Build { separate } => {
            let built = components::build_all()?;
            if separate {
                components::build_kubernetes_separately()?;
            }
            built.print_versions()?;
            Ok(())
        }
        E2eTask::Up { dir, fail, bare } => run::up(&dir, fail.as_deref(), bare),
        E2eTask::Down { dir } => teardown::down(&dir),
    }
}

/// `cargo xtask e2e` as part of `cargo xtask test`: its result as an exit code, so the
/// kernel matrix still runs after a failure.
pub fn test_run() -> std::process::ExitCode {
    println!("\n=== real node: cargo xtask e2e");
    if !crate::cmd::is_root() {
        eprintln!("e2e needs root: it starts kubelet and containerd and manages cgroups");
        return std::process::ExitCode::FAILURE;
    }
    match run::whole(std::path::Path::new(DEFAULT_DIR), &run::Options::default()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("e2e failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
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
