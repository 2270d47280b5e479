//! Tasks that run what was built: tests, demo, benchmarks. Their exit code is
//! the child's, so CI sees the real result.

use std::path::PathBuf;
use std::process::{ExitCode, ExitStatus};

use anyhow::{Context, Result, bail};

use crate::cmd;
use crate::{build, e2e, paths, setup};

pub fn test(lint: bool, cargo_args: &[String]) -> Result<ExitCode> {
    // Checked first: without root, setup and a full build would be wasted.
    if !cmd::is_root() {
        bail!(
            "the root tests need root: they create network namespaces and cgroups and attach BPF programs\n  \
             fix: rerun as root, e.g. `sudo -E env PATH=\"$PATH\" cargo xtask test`"
        );
    }
    // Only the host suite runs the operator's tools (the VMs run the capture suite), so they are
    // built here rather than in prepare(), and first: a Go failure shows before a long build.
    let helm = e2e::helm().context("building helm for tests/tests/helm_chart.rs")?;
    let promtool = e2e::promtool().context("building promtool for tests/tests/monitoring.rs")?;
    let (object, plugin) = prepare(lint)?;
    let mut cargo = build::workspace_cargo(&object)
        .env("SIDESTEP_BIN_DIR", paths::bin_dir(false))
        .env("SIDESTEP_CNI_BIN", &plugin)
        .env("SIDESTEP_HELM", &helm)
        .env("SIDESTEP_PROMTOOL", &promtool)
        .arg("test");
    // cargo lets --workspace override -p, so `test -- -p foo` would
    // silently run everything.
    if !selects_package(cargo_args) {
        cargo = cargo.arg("--workspace");
    }
    let status = cargo.args(cargo_args).status()?;
    Ok(exit_code(status))
}

/// What every test run needs, on the host or in a VM: setup, the workspace with its BPF
/// object, the static CNI plugin, and with `lint` a clippy pass. Returns the object and the
/// plugin.
pub fn prepare(lint: bool) -> Result<(PathBuf, PathBuf)> {
    setup::full(lint)?;
    let object = build::workspace(false)?;
    let plugin = build::static_plugin(&object, false)?;
    if lint {
        build::workspace_cargo(&object)
            .args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ])
            .hint("fix the lints above, or run without --lint")
            .run()
            .context("linting the workspace")?;
    }
    Ok((object, plugin))
}

pub fn demo() -> Result<ExitCode> {
    setup::full(false)?;
    let object = build::workspace(false)?;
    let plugin = build::static_plugin(&object, false)?;
    // The demo drives a local node with the test topology, so it lives in the tests crate.
    let status = build::workspace_cargo(&object)
        .env("SIDESTEP_BIN_DIR", paths::bin_dir(false))
        .env("SIDESTEP_CNI_BIN", &plugin)
        .args([
            "run",
            "--quiet",
            "-p",
            "sidestep-tests",
            "--bin",
            "sidestep-demo",
        ])
        .status()?;
    Ok(exit_code(status))
}

pub fn bench(quick: bool, repeat: u32, mode: Option<&str>) -> Result<ExitCode> {
    if repeat > 1 && mode.is_some() {
        bail!(
            "--repeat is for the whole suite; a single mode (`bench {}`) runs once",
            mode.unwrap_or_default()
        );
    }
    setup::full(false)?;
    let object = build::workspace(true)?;
    let plugin = build::static_plugin(&object, true)?;
    let mut cargo = build::workspace_cargo(&object)
        .env("SIDESTEP_BIN_DIR", paths::bin_dir(true))
        .env("SIDESTEP_CNI_BIN", &plugin);
    if quick {
        cargo = cargo.env("SIDESTEP_BENCH_QUICK", "1");
    }
    if let Some(mode) = mode {
        cargo = cargo.env("SIDESTEP_BENCH_MODE", mode);
    }
    cargo = cargo.env("SIDESTEP_BENCH_REPEAT", repeat.to_string());
    let status = cargo
        .args([
            "test",
            "--release",
            "-p",
            "sidestep-tests",
            "--test",
            "bench",
        ])
        .args(["--", "--ignored", "--nocapture"])
        .status()?;
    Ok(exit_code(status))
}

/// Whether cargo's own arguments (before a `--` for the test binaries)
/// already pick packages.
fn selects_package(cargo_args: &[String]) -> bool {
    cargo_args.iter().take_while(|a| *a != "--").any(|a| {
        a == "-p" || a == "--package" || a.starts_with("--package=") || a.starts_with("-p")
    })
}

/// A child killed by a signal has no code; report it the way a shell does.
fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
