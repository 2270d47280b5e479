//! `cargo xtask e2e`: build, bring the node up, install sidestep with kubectl, run the
//! scenarios, and tear everything down, also when something fails.

use std::path::Path;

use anyhow::{Result, bail};

use super::install::{self, Binaries, OverlayOptions};
use super::scenarios::{self, Report};
use super::state::State;
use super::{Phases, host, node, teardown};
use crate::{paths, tasks};

/// How `cargo xtask e2e` runs; the default is what `cargo xtask test` runs.
#[derive(Default)]
pub struct Options {
    /// The negative control (`--without-sidestep`).
    pub without_sidestep: bool,
    /// Leave the node up (`--keep`).
    pub keep: bool,
    /// Start this daemon with a flag it rejects (`--fail`).
    pub fail: Option<String>,
}

pub fn whole(dir: &Path, options: &Options) -> Result<()> {
    let Options {
        without_sidestep,
        keep,
        ..
    } = *options;
    sweep_dead_run(dir)?;
    let mut phases = Phases::default();
    let bins = phases.time("build sidestep", binaries)?;
    let node = node::start(dir, options.fail.as_deref(), &mut phases)?;
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
    outcome?;
    down?;
    versions?;
    let failed = report.failed();
    if without_sidestep {
        // Without sidestep in the chain the injected call must go around the sidecars; any
        // other failure alone would prove nothing about capture.
        if !report.check_failed(scenarios::INJECTED_CALL) {
            bail!(
                "negative control: `{}` passed without sidestep in the chain",
                scenarios::INJECTED_CALL
            );
        }
        println!(
            "negative control: {failed} check(s) failed without sidestep, the injected call among them, as they must"
        );
        return Ok(());
    }
    if failed > 0 {
        bail!("{failed} e2e scenario(s) failed");
    }
    Ok(())
}

/// `cargo xtask e2e up`: the node, and unless `bare` sidestep installed on it (as the whole run
/// installs it, without the startup taint), left running for a user to try.
pub fn up(dir: &Path, fail: Option<&str>, bare: bool) -> Result<()> {
    if bare {
        return node::up(dir, fail);
    }
    let mut phases = Phases::default();
    let bins = phases.time("build sidestep", binaries)?;
    let node = node::start(dir, fail, &mut phases)?;
    let installed = (|| {
        phases.time("images", || install::images(&node, &bins))?;
        let overlay = install::write_overlay(&node, OverlayOptions::default())?;
        phases.time("install (kubectl apply -k)", || {
            install::apply(&node, &overlay)?;
            install::wait_agent_ready(&node, std::time::Duration::from_secs(120))
        })?;
        Ok::<_, anyhow::Error>(overlay)
    })();
    let overlay = match installed {
        Ok(overlay) => overlay,
        Err(e) => {
            drop(node);
            eprintln!("\ninstalling sidestep failed; tearing the node down");
            if let Err(down) = teardown::down(dir) {
                eprintln!("teardown after the failure also failed: {down:#}");
            }
            return Err(e);
        }
    };
    node.built.print_versions()?;
    phases.print("e2e up: wall time per phase");
    println!(
        "\nnode {} is Ready with sidestep installed from {} (images {}, {}, {});\n\
         it keeps running until `cargo xtask e2e down`",
        super::config::NODE_NAME,
        overlay.display(),
        install::AGENT_IMAGE,
        install::APP_IMAGE,
        install::PROXY_IMAGE,
    );
    println!("  export KUBECONFIG={}", node.kubectl.kubeconfig.display());
    println!("  {} get pods -A", node.kubectl.bin.display());
    Ok(())
}

/// The workspace built (as `cargo xtask test` builds it) and the binaries the images take.
fn binaries() -> Result<Binaries> {
    let (_object, plugin) = tasks::prepare(false)?;
    // prepare() built the workspace: the agent and the probe are in the bin dir.
    Ok(Binaries {
        sidestep: paths::bin_dir(false).join("sidestep"),
        plugin,
        probe: paths::bin_dir(false).join("probe"),
    })
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
    // Installed as an operator running Istio in both modes would, with the startup gate.
    let overlay = install::write_overlay(
        node,
        OverlayOptions {
            without_sidestep,
            ambient: true,
            readiness_taint: true,
        },
    )?;
    scenarios::taint_node(node)?;
    phases.time("install (kubectl apply -k)", || {
        install::apply(node, &overlay)?;
        // Made at once, while the agent starts: the taint must hold it back.
        scenarios::create_gated_pod(node)?;
        install::wait_agent_ready(node, std::time::Duration::from_secs(120))
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
