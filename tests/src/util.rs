//! Small helpers shared by the topology modules.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Runs a host tool (in the test process's own namespaces) and returns its stdout.
///
/// Fails with the command line, exit status and stderr when it exits non-zero.
pub(crate) fn cmd(argv: &[&str]) -> Result<String> {
    let (prog, args) = argv.split_first().context("empty command line")?;
    let out = Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {prog}"))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `f` every `step` until it returns `Ok(Some(_))`, fails, or `timeout` passes.
pub(crate) fn poll<T>(
    what: &str,
    timeout: Duration,
    step: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(step);
    }
}

/// Whether a process with this pid exists (zombies included).
pub(crate) fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Last `max` bytes of a log, on a char boundary, for error messages.
pub(crate) fn tail(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}
