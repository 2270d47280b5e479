//! [`TestEnv`]: one test's private cgroup, pin root and scratch directory.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::cgroup::{Cgroup, cgroup2_mount};
use crate::process::{self, ChildGuard, Spawn};
use crate::sweep;

/// Where bpffs is (or will be) mounted; pin roots of tests live right below it.
pub const BPFFS: &str = "/sys/fs/bpf";

/// Mounts bpffs at [`BPFFS`] unless it is there, as a node's boot does (systemd's
/// sys-fs-bpf.mount). For tests whose agent runs in a mount namespace of its own: it mounts bpffs
/// only where the mount is the host's, and its pins must be where the test looks.
pub fn ensure_host_bpffs() -> Result<()> {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let is_bpffs =
        || nix::sys::statfs::statfs(BPFFS).is_ok_and(|s| s.filesystem_type().0 == BPF_FS_MAGIC);
    if !is_bpffs() {
        let mounted = nix::mount::mount(
            Some("bpffs"),
            BPFFS,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            Some("mode=0700"),
        );
        // A failure counts only when no bpffs is there: another test may have mounted it.
        if let Err(e) = mounted
            && !is_bpffs()
        {
            bail!("mount -t bpf bpffs {BPFFS}: {e}");
        }
    }
    Ok(())
}

/// Set this variable to keep scratch directories (configs, process logs) after the test.
pub const KEEP_ENV: &str = "SIDESTEP_TEST_KEEP";

/// Per-process counter that makes ids unique among the tests of one binary.
static COUNTER: AtomicU32 = AtomicU32::new(0);

pub(crate) fn next_counter() -> u32 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// The leaf of a test's cgroup that holds its processes.
const PROCESS_LEAF: &str = "procs";

/// One test's sandbox on the host.
///
/// - id: `<name>-<pid>-<counter>`, unique among live processes;
/// - a child cgroup `<cgroup2 mount>/sidestep-test-<id>`, where the test attaches its cgroup
///   programs (never the root: see MACHINE.md), and its leaf `procs`, where spawned processes
///   go. The leaf keeps the test's own cgroup free of processes, so that podman may enable
///   controllers in it on a pure cgroup v2 host (the kernel refuses a cgroup with processes);
/// - a pin root path `/sys/fs/bpf/sidestep-test-<id>` (not created here);
/// - a scratch directory (mode 0755, so that proxies running as UID 1337 can read configs).
///
/// Dropping it kills every process left in the cgroup, removes the pin root recursively if it
/// exists, removes the cgroup, then the scratch directory (kept when `SIDESTEP_TEST_KEEP` is
/// set). Create it first in a test, so that it
/// is dropped last, after the [`crate::Node`] and the process guards.
///
/// The first `TestEnv` of a process also removes what dead test processes left behind (see
/// [`sweep::sweep_stale`]).
#[derive(Debug)]
pub struct TestEnv {
    id: String,
    pin_root: PathBuf,
    // Field order is drop order: the cgroup goes before the scratch directory.
    cgroup: Cgroup,
    tmp: tempfile::TempDir,
    seq: AtomicU32,
}

impl TestEnv {
    /// Creates the sandbox. `name` is made of ASCII letters, digits, `_` and `-`.
    pub fn new(name: &str) -> Result<Self> {
        if name.is_empty()
            || name.len() > 32
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            bail!("bad test env name {name:?}: use 1-32 of [A-Za-z0-9_-]");
        }
        sweep::sweep_once();
        let id = format!("{name}-{}-{}", std::process::id(), next_counter());
        let cgroup = Cgroup::create(cgroup2_mount()?.join(format!("sidestep-test-{id}")))?;
        let procs = cgroup.path().join(PROCESS_LEAF);
        fs::create_dir(&procs).with_context(|| format!("mkdir cgroup {}", procs.display()))?;
        let pin_root = Path::new(BPFFS).join(format!("sidestep-test-{id}"));
        let tmp = tempfile::Builder::new()
            .prefix(&format!("sidestep-test-{id}-"))
            .tempdir()
            .context("create scratch dir")?;
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755))
            .context("chmod scratch dir")?;
        Ok(Self {
            id,
            pin_root,
            cgroup,
            tmp,
            seq: AtomicU32::new(0),
        })
    }

    /// `<name>-<pid>-<counter>`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The test's cgroup2 directory: attach cgroup programs here.
    pub fn cgroup_path(&self) -> &Path {
        self.cgroup.path()
    }

    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Opens the process leaf's `cgroup.procs` (see the type's doc), for a spawned child to
    /// join before it execs.
    pub fn open_process_leaf(&self) -> Result<fs::File> {
        let p = self.cgroup.path().join(PROCESS_LEAF).join("cgroup.procs");
        fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .with_context(|| format!("open {}", p.display()))
    }

    /// `/sys/fs/bpf/sidestep-test-<id>`; it is not created.
    pub fn pin_root(&self) -> &Path {
        &self.pin_root
    }

    /// Scratch directory, removed on drop. World-readable.
    pub fn tmp_dir(&self) -> &Path {
        self.tmp.path()
    }

    /// A fresh number for naming files in the scratch directory.
    pub fn next_seq(&self) -> u32 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Spawns a process in the host network namespace (inside the test cgroup unless
    /// `spec.in_cgroup` is false).
    pub fn spawn(&self, spec: Spawn<'_>) -> Result<ChildGuard> {
        process::spawn(self, None, &spec, false)
    }

    /// Runs a process in the host network namespace to completion, killing it after `timeout`.
    pub fn run(&self, spec: Spawn<'_>, timeout: Duration) -> Result<Output> {
        process::run(self, None, &spec, timeout)
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if let Err(e) = self.cgroup.kill_all() {
            eprintln!("sidestep-tests: killing processes of {}: {e:#}", self.id);
        }
        if let Err(e) = remove_pin_root(&self.pin_root) {
            eprintln!(
                "sidestep-tests: removing {}: {e:#}",
                self.pin_root.display()
            );
        }
        // The cgroup and the scratch directory are removed by their own Drop.
    }
}

/// Removes a pin directory recursively (pins are unlinked like files; nothing is unmounted).
pub(crate) fn remove_pin_root(p: &Path) -> Result<()> {
    match fs::symlink_metadata(p) {
        Ok(_) => fs::remove_dir_all(p).with_context(|| format!("rm -r {}", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("stat {}", p.display())),
    }
}
