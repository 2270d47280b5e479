//! Spawning processes inside a pod's network namespace and the test cgroup.
//!
//! The child joins the cgroup and the netns between fork and exec, with file descriptors opened
//! by the parent: `write("0")` on `<cgroup>/cgroup.procs`, then `setns(CLONE_NEWNET)`, then it
//! drops privileges (`setgroups([])`, `setgid`, `setuid`). Unlike `ip netns exec` this remounts
//! nothing, so `/sys/fs/cgroup` and `/sys/fs/bpf` stay the host's.

use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sched::CpuSet;

use crate::env::TestEnv;
use crate::util::{tail, wait_exit};

/// PATH given to spawned processes; the environment is otherwise cleared.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Set this variable to print every process's output when its guard drops (by default only
/// while panicking).
pub const LOGS_ENV: &str = "SIDESTEP_TEST_LOGS";
/// Variables passed through from the test's environment when set.
const PASS_ENV: &[&str] = &["RUST_LOG", "RUST_BACKTRACE"];

/// What to run, and as whom.
#[derive(Clone, Copy, Debug)]
pub struct Spawn<'a> {
    /// Program and arguments; the program is looked up in a standard PATH.
    pub argv: &'a [&'a str],
    pub uid: u32,
    pub gid: u32,
    /// Extra environment variables (the environment is cleared otherwise).
    pub env: &'a [(&'a str, &'a str)],
    /// Move the process into the test cgroup (the default). `false` leaves it in the test
    /// runner's cgroup, outside anything the test attaches.
    pub in_cgroup: bool,
    /// CPUs the process (and every thread it makes) may run on; None: the runner's own set.
    pub cpus: Option<CpuSet>,
}

impl Default for Spawn<'_> {
    fn default() -> Self {
        Self {
            argv: &[],
            uid: 0,
            gid: 0,
            env: &[],
            in_cgroup: true,
            cpus: None,
        }
    }
}

impl<'a> Spawn<'a> {
    /// Runs `argv` as root, in the test cgroup.
    pub fn new(argv: &'a [&'a str]) -> Self {
        Self {
            argv,
            ..Self::default()
        }
    }

    /// Runs as `uid` with primary group `gid` and no supplementary groups.
    pub fn user(self, uid: u32, gid: u32) -> Self {
        Self { uid, gid, ..self }
    }

    pub fn env(self, env: &'a [(&'a str, &'a str)]) -> Self {
        Self { env, ..self }
    }

    /// Pins the process to `cpus` from before exec, so that threads it starts early inherit it.
    pub fn cpus(self, cpus: Option<CpuSet>) -> Self {
        Self { cpus, ..self }
    }

    pub fn outside_cgroup(self) -> Self {
        Self {
            in_cgroup: false,
            ..self
        }
    }
}

/// A running process that is SIGKILLed and reaped on drop. Its stdout and stderr go to files in
/// the env's scratch directory; when the test panics (or `SIDESTEP_TEST_LOGS` is set), the guard
/// prints their tails.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    label: String,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    status: Option<ExitStatus>,
}

impl ChildGuard {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The command line, for messages.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Everything written to stdout so far.
    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    /// The first `n` lines of stdout, each a JSON value, waiting up to `within` for them (a
    /// `probe proxy` reporting to `-` prints one per connection).
    pub fn stdout_json_lines(&self, n: usize, within: Duration) -> Result<Vec<serde_json::Value>> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let text = self.stdout();
            let lines: Vec<&str> = text.lines().collect();
            if lines.len() >= n {
                return lines[..n]
                    .iter()
                    .map(|l| {
                        serde_json::from_str(l)
                            .with_context(|| format!("{} printed {l:?}", self.label))
                    })
                    .collect();
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{} printed {} of {n} lines: {text:?}",
                self.label,
                lines.len()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Waits until stderr contains every needle (a log line written a moment after the event
    /// the caller saw, such as a proxy's line for a connection that just closed).
    pub fn wait_stderr(&self, needles: &[&str], timeout: Duration) -> Result<()> {
        self.wait_for("stderr", Self::stderr, needles, timeout)
    }

    /// Waits until stdout contains every needle.
    pub fn wait_stdout(&self, needles: &[&str], timeout: Duration) -> Result<()> {
        self.wait_for("stdout", Self::stdout, needles, timeout)
    }

    fn wait_for(
        &self,
        stream: &str,
        read: fn(&Self) -> String,
        needles: &[&str],
        timeout: Duration,
    ) -> Result<()> {
        crate::util::poll(
            &format!("lines on {stream}"),
            crate::scaled(timeout),
            Duration::from_millis(20),
            || {
                let text = read(self);
                Ok(needles.iter().all(|n| text.contains(n)).then_some(()))
            },
        )
        .with_context(|| {
            format!(
                "{}: wanted {needles:?} on {stream}:\n{}",
                self.label,
                read(self)
            )
        })
    }

    pub fn stdout_path(&self) -> &Path {
        &self.stdout_path
    }

    pub fn stderr_path(&self) -> &Path {
        &self.stderr_path
    }

    /// The exit status if the process has exited (it is reaped then).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait().context("waitpid")?;
        }
        Ok(self.status)
    }

    /// Fails, with the process's output, if it has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.try_wait()? {
            None => Ok(()),
            Some(st) => bail!(
                "`{}` exited ({st})\nstdout: {}\nstderr: {}",
                self.label,
                tail(&self.stdout(), 4000),
                tail(&self.stderr(), 4000)
            ),
        }
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        wait_exit(timeout, || self.try_wait())
    }

    /// SIGKILLs and reaps the process.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(st) = self.try_wait()? {
            return Ok(st);
        }
        // ESRCH cannot happen before the child is reaped; other errors show up in wait().
        let _ = self.child.kill();
        let st = self.child.wait().context("waitpid")?;
        self.status = Some(st);
        Ok(st)
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(st) = self.try_wait()? {
            return Ok(st);
        }
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        match self.wait_timeout(grace)? {
            Some(st) => Ok(st),
            None => self.kill(),
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            eprintln!("sidestep-tests: killing `{}`: {e:#}", self.label);
        }
        if std::thread::panicking() || std::env::var_os(LOGS_ENV).is_some() {
            eprintln!(
                "---- `{}` ({:?}) ----\nstdout:\n{}\nstderr:\n{}\n----",
                self.label,
                self.status,
                tail(&self.stdout(), 4000),
                tail(&self.stderr(), 4000)
            );
        }
    }
}

/// Starts `spec` in `netns` (None: the test process's own) and, unless `spec.in_cgroup` is
/// false, in the env's cgroup. With `die_with_parent` the child gets PR_SET_PDEATHSIG=SIGKILL;
/// that signal fires when the spawning *thread* exits, so it is only for blocking runs.
pub(crate) fn spawn(
    env: &TestEnv,
    netns: Option<&Path>,
    spec: &Spawn<'_>,
    die_with_parent: bool,
) -> Result<ChildGuard> {
    let (prog, args) = spec.argv.split_first().context("empty argv")?;
    let label = spec.argv.join(" ");
    let base = Path::new(prog)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = env.tmp_dir().join("proc");
    fs::create_dir_all(&dir).context("create log dir")?;
    let seq = env.next_seq();
    let stdout_path = dir.join(format!("{seq:03}-{base}.stdout"));
    let stderr_path = dir.join(format!("{seq:03}-{base}.stderr"));
    let out = File::create(&stdout_path).context("create stdout file")?;
    let err = File::create(&stderr_path).context("create stderr file")?;

    // Opened before fork; both are O_CLOEXEC, so they close at exec.
    let procs = spec
        .in_cgroup
        .then(|| env.open_process_leaf())
        .transpose()?;
    let ns = netns
        .map(|p| File::open(p).with_context(|| format!("open netns {}", p.display())))
        .transpose()?;
    let setup = ChildSetup {
        procs_fd: procs.as_ref().map(AsRawFd::as_raw_fd),
        netns_fd: ns.as_ref().map(AsRawFd::as_raw_fd),
        uid: spec.uid,
        gid: spec.gid,
        cpus: spec.cpus,
        parent: die_with_parent.then(std::process::id),
    };

    let mut cmd = Command::new(prog);
    cmd.args(args)
        .env_clear()
        .env("PATH", PATH)
        .env("HOME", "/")
        .env("LANG", "C")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    for k in PASS_ENV {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    for (k, v) in spec.env {
        cmd.env(k, v);
    }
    // SAFETY: the closure runs in the forked child before exec. `ChildSetup::apply` only makes
    // async-signal-safe system calls on plain integers and file descriptors that stay open in the
    // parent until `spawn` returns; it does not allocate or take locks.
    unsafe {
        cmd.pre_exec(move || setup.apply());
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("spawn `{label}` in {netns:?}"))?;
    drop(procs);
    drop(ns);
    Ok(ChildGuard {
        child,
        label,
        stdout_path,
        stderr_path,
        status: None,
    })
}

/// Runs `spec` to completion; kills it and fails (with its output) after `timeout` (scaled with
/// the machine's speed, [`crate::time_scale`]: a hung command, not a slow one, is the failure).
pub(crate) fn run(
    env: &TestEnv,
    netns: Option<&Path>,
    spec: &Spawn<'_>,
    timeout: Duration,
) -> Result<Output> {
    let timeout = crate::scaled(timeout);
    let mut g = spawn(env, netns, spec, true)?;
    let status = match g.wait_timeout(timeout)? {
        Some(st) => st,
        None => {
            g.kill()?;
            bail!(
                "`{}` did not finish in {timeout:?}\nstdout: {}\nstderr: {}",
                g.label,
                tail(&g.stdout(), 4000),
                tail(&g.stderr(), 4000)
            );
        }
    };
    Ok(Output {
        status,
        stdout: fs::read(&g.stdout_path).unwrap_or_default(),
        stderr: fs::read(&g.stderr_path).unwrap_or_default(),
    })
}

#[derive(Clone, Copy)]
struct ChildSetup {
    procs_fd: Option<RawFd>,
    netns_fd: Option<RawFd>,
    uid: u32,
    gid: u32,
    cpus: Option<CpuSet>,
    parent: Option<u32>,
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl ChildSetup {
    /// Runs in the child between fork and exec. The cgroup move comes first (it needs no
    /// privilege beyond the already open fd), then setns (needs CAP_SYS_ADMIN), then the
    /// credential drop. PDEATHSIG is set last because a credential change clears it.
    fn apply(self) -> io::Result<()> {
        if let Some(fd) = self.procs_fd {
            // SAFETY: `fd` is an open cgroup.procs descriptor and the buffer is a 1-byte static.
            let n = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
            if n != 1 {
                return Err(io::Error::last_os_error());
            }
        }
        if let Some(fd) = self.netns_fd {
            // SAFETY: `fd` is an open /run/netns/<name> descriptor.
            check(unsafe { libc::setns(fd, libc::CLONE_NEWNET) })?;
        }
        if let Some(set) = &self.cpus {
            // Before the credential drop: changing one's own affinity needs no privilege, but a
            // failure here should be reported as the spawn's, not hidden behind a later step.
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), set)
                .map_err(io::Error::from)?;
        }
        // SAFETY: a zero-length group list with a null pointer is valid for setgroups(2).
        check(unsafe { libc::setgroups(0, std::ptr::null()) })?;
        // SAFETY: plain system calls on integer arguments.
        check(unsafe { libc::setgid(self.gid) })?;
        // SAFETY: as above.
        check(unsafe { libc::setuid(self.uid) })?;
        if let Some(parent) = self.parent {
            // SAFETY: PR_SET_PDEATHSIG takes a signal number; the remaining args are ignored.
            check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })?;
            // SAFETY: getppid(2) cannot fail.
            if unsafe { libc::getppid() } as u32 != parent {
                // The parent died before PDEATHSIG was armed.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
        }
        Ok(())
    }
}
