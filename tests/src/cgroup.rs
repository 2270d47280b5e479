//! cgroup2 helpers: find the mount, create a child cgroup, kill everything in it, remove it.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::util::poll;

/// How long [`Cgroup::kill_all`] waits for the cgroup to empty.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// The cgroup2 mount point, read from `/proc/self/mountinfo`.
///
/// Hybrid hosts mount it at `/sys/fs/cgroup/unified`, unified ones at `/sys/fs/cgroup`; this
/// never guesses.
pub fn cgroup2_mount() -> Result<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    parse_cgroup2_mount(&info).context("no cgroup2 mount in /proc/self/mountinfo")
}

fn parse_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // "<id> <parent> <maj:min> <root> <mount point> <opts> [optional...] - <fstype> <src> <super>"
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        pre.split_whitespace()
            .nth(4)
            .map(|p| PathBuf::from(unescape_mountinfo(p)))
    })
}

/// Undoes the octal escapes (`\040` for a space, ...) that the kernel uses in mountinfo.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A cgroup2 directory owned by the test. Dropping it kills every process in its subtree and
/// removes it (child cgroups included). Errors in `Drop` are logged, never panicked on.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    /// Creates a new cgroup directory; it must not exist yet.
    pub fn create(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        fs::create_dir(&path).with_context(|| format!("mkdir cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    /// Adopts an existing cgroup directory (for cleaning up leftovers).
    pub(crate) fn adopt(path: PathBuf) -> Self {
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pids listed in this cgroup's own `cgroup.procs` (not its children's).
    pub fn procs(&self) -> Result<Vec<i32>> {
        read_procs(&self.path)
    }

    /// Kills every process in the subtree and waits until it is empty.
    ///
    /// Uses `cgroup.kill` (Linux 5.14+) when present, otherwise SIGKILLs each pid, repeatedly,
    /// so that processes forked meanwhile die too.
    pub fn kill_all(&self) -> Result<()> {
        if !self.path.exists() {
            return Ok(());
        }
        let kill_file = self.path.join("cgroup.kill");
        let has_kill = kill_file.exists();
        if has_kill {
            fs::write(&kill_file, "1").with_context(|| format!("write {}", kill_file.display()))?;
        }
        poll(
            &format!("cgroup {} to empty", self.path.display()),
            KILL_TIMEOUT,
            Duration::from_millis(10),
            || {
                let pids = subtree_procs(&self.path)?;
                if pids.is_empty() {
                    return Ok(Some(()));
                }
                if !has_kill {
                    for pid in pids {
                        // ESRCH: it is already gone, which is what we want.
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
                Ok(None)
            },
        )
    }

    /// Kills everything and removes the directory and its child cgroups.
    pub fn remove(&self) -> Result<()> {
        self.kill_all()?;
        remove_tree(&self.path)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!(
                "sidestep-tests: cleaning up cgroup {}: {e:#}",
                self.path.display()
            );
        }
    }
}

fn read_procs(dir: &Path) -> Result<Vec<i32>> {
    let p = dir.join("cgroup.procs");
    let s = match fs::read_to_string(&p) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("read {}", p.display())),
    };
    Ok(s.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

fn child_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("read_dir {}", dir.display())),
    };
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            out.push(entry.path());
        }
    }
    Ok(out)
}

fn subtree_procs(dir: &Path) -> Result<Vec<i32>> {
    let mut pids = read_procs(dir)?;
    for child in child_dirs(dir)? {
        pids.extend(subtree_procs(&child)?);
    }
    Ok(pids)
}

/// rmdir depth-first. A cgroup whose last process just exited can report EBUSY for a moment.
fn remove_tree(dir: &Path) -> Result<()> {
    for child in child_dirs(dir)? {
        remove_tree(&child)?;
    }
    let mut last = None;
    for _ in 0..100 {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).with_context(|| format!("rmdir {}", dir.display())),
        }
    }
    match last {
        Some(e) => Err(e).with_context(|| format!("rmdir {} (still busy)", dir.display())),
        None => bail!("rmdir {}: gave up", dir.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_hybrid_and_unified_mounts() {
        let hybrid = "30 24 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                      41 30 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let odd = "41 30 0:38 / /run/my\\040cg rw - cgroup2 none rw\n";
        assert_eq!(parse_cgroup2_mount(odd), Some(PathBuf::from("/run/my cg")));
        assert_eq!(
            parse_cgroup2_mount("1 2 0:1 / / rw - ext4 /dev/sda rw\n"),
            None
        );
    }
}
