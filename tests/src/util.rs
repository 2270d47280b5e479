//! Small helpers shared by the topology modules.

use std::io::{Read, Write};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::thread::JoinHandle;
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

/// How often a deadline loop looks at the child.
const EXIT_POLL: Duration = Duration::from_millis(5);

/// Calls `try_wait` until it reports an exit status or `timeout` passes (`Ok(None)` then).
pub(crate) fn wait_exit(
    timeout: Duration,
    mut try_wait: impl FnMut() -> Result<Option<ExitStatus>>,
) -> Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = try_wait()? {
            return Ok(Some(st));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(EXIT_POLL);
    }
}

/// Drains a pipe on its own thread, so that a child blocked on a full pipe cannot outlast the
/// deadline and the parent never has to pick which pipe to read first.
fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        // A read error ends the capture; what was read so far is still worth reporting.
        let _ = pipe.read_to_end(&mut v);
        v
    })
}

/// Runs `cmd` with stdout and stderr piped and `stdin` written to its stdin (null when `None`),
/// and waits at most `timeout`. `Ok(None)`: it did not exit in time and was killed and reaped.
pub(crate) fn output_within(
    cmd: &mut Command,
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> Result<Option<Output>> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("spawn {:?}", cmd.get_program()))?;
    let out_t = drain(child.stdout.take().context("stdout")?);
    let err_t = drain(child.stderr.take().context("stderr")?);
    if let Some(input) = stdin {
        // Written whole before waiting: the inputs here are small, and dropping the handle
        // closes the pipe so the child sees EOF.
        let written = child
            .stdin
            .take()
            .context("stdin")
            .and_then(|mut pipe| pipe.write_all(input).context("write child stdin"));
        if let Err(e) = written {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    }
    let Some(status) = wait_exit(timeout, || Ok(child.try_wait()?))? else {
        // ESRCH cannot happen before the child is reaped; the wait reaps it.
        let _ = child.kill();
        let _ = child.wait();
        return Ok(None);
    };
    // A detached grandchild that kept a copy of a pipe would hold these joins open; podman
    // hands conmon /dev/null, and CNI plugins leave nothing running.
    Ok(Some(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    }))
}
