//! `cargo xtask e2e`: build, bring the node up, install sidestep with kubectl, run the
//! scenarios, and tear everything down, also when something fails.

use std::path::Path;

use anyhow::{Result, bail};

use super::install::{self, Binaries, OverlayOptions};
use super::scenarios::{self, Report};
use super::state::State;
use super::{Phases, host, node, teardown};
use crate::{paths, tasks};

pub fn whole(dir: &Path, without_sidestep: bool, keep: bool) -> Result<()> {
    sweep_dead_run(dir)?;
    let mut phases = Phases::default();
    let bins = phases.time("build sidestep", || {
        let (_object, plugin) = tasks::prepare(false)?;
        // prepare() built the workspace: the agent and the probe are in the bin dir.
        Ok(Binaries {
            sidestep: paths::bin_dir(false).join("sidestep"),
            plugin,
            probe: paths::bin_dir(false).join("probe"),
        })
    })?;
    let node = node::start(dir, None, &mut phases)?;
    let mut report = Report::default();
    let outcome = install_and_run(&node, &bins, without_sidestep, &mut phases, &mut report);
    let versions = node.built.print_versions();
    drop(node);
    let down = if keep {
        println!(
            "\nthe node stays up (--keep): cargo xtask e2e down --dir {}",
            dir.display()
        );
        Ok(())
    } else {
        phases.time("teardown", || teardown::down(dir))
    };
    report.print();
    phases.print("e2e: wall time per phase");
    versions?;
    outcome?;
    down?;
    let failed = report.failed();
    match (failed, without_sidestep) {
        (0, false) => Ok(()),
        (0, true) => bail!("negative control: every scenario passed without sidestep in the chain"),
        (n, false) => bail!("{n} e2e scenario(s) failed"),
        (n, true) => {
            println!("negative control: {n} scenario(s) failed without sidestep, as they must");
            Ok(())
        }
    }
}

fn install_and_run(
    node: &node::Running,
    bins: &Binaries,
    without_sidestep: bool,
    phases: &mut Phases,
    report: &mut Report,
) -> Result<()> {
    phases.time("images", || install::images(node, bins))?;
    phases.time("pods before the agent", || scenarios::before_install(node))?;
    let overlay = install::write_overlay(
        node,
        OverlayOptions {
            without_sidestep,
            ..Default::default()
        },
    )?;
    phases.time("install (kubectl apply -k)", || {
        install::apply(node, &overlay)
    })?;
    phases.time("scenarios", || {
        scenarios::run_all(node, report);
        Ok(())
    })
}

/// A node left by a run that died (its daemons are gone) is torn down first, as the test
/// suite sweeps what dead runs left; a node whose daemons still run is someone's `up`.
fn sweep_dead_run(dir: &Path) -> Result<()> {
    let Some(state) = State::load(dir)? else {
        return Ok(());
    };
    if state.daemons.iter().any(|(_, pid)| host::alive(*pid)) {
        bail!(
            "a node is up in {} (its daemons run)\n  fix: cargo xtask e2e down --dir {0}",
            dir.display()
        );
    }
    println!(
        "a dead run left a node in {}: tearing it down first",
        dir.display()
    );
    teardown::down(dir)
}
