//! `cargo xtask setup`: make a fresh machine able to build and test sidestep.
//! Every step probes first, so a machine that has everything costs only a few
//! process spawns.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};

use crate::cmd::Cmd;
use crate::{linker, packages};

/// What a BPF build needs: nightly's rust-src for build-std, and bpf-linker.
/// Runs once per process: `test` does a full setup and then builds, and the
/// build would otherwise repeat the probes and their output.
pub fn toolchain() -> Result<()> {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    rust_src()?;
    linker::ensure()?;
    DONE.store(true, Ordering::Relaxed);
    Ok(())
}

/// The toolchain plus the Debian packages the tests drive, and with `dev`
/// the stable lint and format components.
pub fn full(dev: bool) -> Result<()> {
    toolchain()?;
    packages::ensure()?;
    if dev {
        stable_components(&["clippy", "rustfmt"])?;
    }
    Ok(())
}

fn installed_components(toolchain: &str) -> Result<Vec<String>> {
    let out = Cmd::new("rustup")
        .arg(format!("+{toolchain}"))
        .args(["component", "list", "--installed"])
        .clean_toolchain_env()
        .hint(format!(
            "install the toolchain: `rustup toolchain install {toolchain} --profile minimal`"
        ))
        .read()?;
    // Entries carry the host triple (`rust-std-x86_64-...`) except
    // target-independent ones such as rust-src; keep the bare name for both.
    Ok(out.lines().map(|l| l.trim().to_owned()).collect())
}

fn has_component(installed: &[String], name: &str) -> bool {
    let with_triple = format!("{name}-");
    installed
        .iter()
        .any(|c| c == name || c.starts_with(&with_triple))
}

/// `-Z build-std=core` compiles core from source for bpfel-unknown-none.
fn rust_src() -> Result<()> {
    let installed = installed_components("nightly")?;
    if has_component(&installed, "rust-src") {
        println!("rust-src (nightly): ok");
        return Ok(());
    }
    println!("rust-src (nightly): installing");
    Cmd::new("rustup")
        .args(["component", "add", "rust-src", "--toolchain", "nightly"])
        .clean_toolchain_env()
        .hint("check network access, then rerun `cargo xtask setup`")
        .run()
        .context("installing rust-src for nightly")
}

fn stable_components(names: &[&str]) -> Result<()> {
    let installed = installed_components("stable")?;
    for name in names {
        if has_component(&installed, name) {
            println!("{name} (stable): ok");
            continue;
        }
        println!("{name} (stable): installing");
        Cmd::new("rustup")
            .args(["component", "add", name, "--toolchain", "stable"])
            .clean_toolchain_env()
            .hint("check network access, then rerun `cargo xtask setup --dev`")
            .run()
            .with_context(|| format!("installing {name} for stable"))?;
    }
    Ok(())
}
