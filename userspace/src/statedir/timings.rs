//! The invocation timings: one fixed-size line per plugin invocation, appended to
//! `<state_dir>/timings`, read and rotated by the agent for `/metrics` (ADD and DEL counts and
//! latency histograms). Both sides use this module, so they cannot disagree on the format.
//!
//! ```text
//! ADD    ok                  1234\n   command (6), outcome (5), microseconds (18), 32 bytes
//! ADD    e8                   870\n   a failure: `e` and its CNI error code
//! ```
//!
//! The outcome is `ok`, or `e` and the CNI error code the plugin answered with (the spec's 1-99,
//! sidestep's own from 100), for `/metrics`' `code` label. `error` (no code) is what plugins
//! before the code wrote, and a code too long for the field; both still parse.
//!
//! Why a file and not a socket to the agent: an append never blocks and does not need the agent
//! to be up, so invocations made while the agent restarts are counted when it is back. A single
//! `write(2)` of 32 bytes on an `O_APPEND` descriptor lands whole, so concurrent plugins never
//! interleave. The plugin stops appending past [`MAX_BYTES`], so the file stays bounded even with
//! no agent at all; nothing in [`append`] can fail or slow the CNI call, and a line is written
//! only when the state directory exists (the agent creates it; after `sidestep uninstall` a DEL
//! leaves nothing behind).
//!
//! The agent reads the file from where it stopped ([`Tail`]). Past [`ROTATE_AT`] it renames it to
//! `timings.1` and keeps reading the renamed file for a few more polls, for plugins that opened it
//! just before the rename. At start it reads `timings.1` and `timings` whole, so invocations made
//! while the agent was down (or restarting) are counted.

use std::{
    fs::{self, DirBuilder, File, OpenOptions},
    io::{Read as _, Write as _},
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    time::Duration,
};

/// The file under the state directory, and its rotated predecessor.
pub const FILE_NAME: &str = "timings";
pub const ROTATED_NAME: &str = "timings.1";
/// Length of one line, newline included.
pub const LINE_LEN: usize = 32;
/// Past this size (half a million invocations the agent never read) the plugin drops lines.
pub const MAX_BYTES: u64 = 16 << 20;
/// The agent rotates the file past this size (32768 invocations).
pub const ROTATE_AT: u64 = 1 << 20;
/// How many polls a rotated file is still read for.
const DRAIN_POLLS: u8 = 5;

/// The line for one invocation of `command` (`ADD`, `DEL`, ...): `error` is the CNI error code
/// it failed with, `None` when it succeeded.
pub fn line(command: &str, error: Option<u32>, elapsed: Duration) -> String {
    let micros = u64::try_from(elapsed.as_micros())
        .unwrap_or(u64::MAX)
        .min(999_999_999_999_999_999);
    let outcome = match error {
        None => "ok".to_owned(),
        // The field holds 5 characters: a code past 4 digits is counted without it.
        Some(code) if code <= MAX_CODE => format!("e{code}"),
        Some(_) => "error".to_owned(),
    };
    format!("{command:<6} {outcome:<5} {micros:>18}\n")
}

/// The largest error code a line carries.
pub const MAX_CODE: u32 = 9999;

/// Appends an invocation's line; never fails, never blocks on anything but the local file.
pub fn append(state_dir: &Path, command: &str, error: Option<u32>, elapsed: Duration) {
    if !state_dir.is_dir() {
        return;
    }
    let Ok(mut f) = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(state_dir.join(FILE_NAME))
    else {
        return;
    };
    if f.metadata().is_ok_and(|m| m.len() >= MAX_BYTES) {
        return;
    }
    // One write call: a short write would split the line, and a retry could interleave.
    let _ = f.write(line(command, error, elapsed).as_bytes());
}

/// One line, read back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Invocation<'a> {
    pub command: &'a str,
    pub ok: bool,
    /// The CNI error code of a failure; `None` for a success, and for a failure written
    /// without one (an older plugin).
    pub code: Option<u32>,
    pub seconds: f64,
}

/// Parses one line.
pub fn parse_line(line: &str) -> Option<Invocation<'_>> {
    let mut f = line.split_whitespace();
    let (command, outcome, micros) = (f.next()?, f.next()?, f.next()?);
    if f.next().is_some() || !matches!(command, "ADD" | "DEL" | "CHECK" | "GC" | "STATUS") {
        return None;
    }
    let (ok, code) = match outcome {
        "ok" => (true, None),
        "error" => (false, None),
        _ => {
            let digits = outcome.strip_prefix('e')?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            (false, Some(digits.parse().ok()?))
        }
    };
    let micros: u64 = micros.parse().ok()?;
    Some(Invocation {
        command,
        ok,
        code,
        seconds: micros as f64 / 1e6,
    })
}

struct Reader {
    file: File,
    inode: u64,
    partial: Vec<u8>,
}

impl Reader {
    fn open(path: &Path) -> Option<Self> {
        let file = File::open(path).ok()?;
        let inode = file.metadata().ok()?.ino();
        Some(Self {
            file,
            inode,
            partial: Vec::new(),
        })
    }

    /// The complete lines written since the last read.
    fn lines(&mut self) -> Vec<String> {
        let _ = self.file.read_to_end(&mut self.partial);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(end + 1);
        let done = std::mem::replace(&mut self.partial, rest);
        String::from_utf8_lossy(&done)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

/// The agent's position in the timings files.
#[derive(Default)]
pub struct Tail {
    started: bool,
    current: Option<Reader>,
    draining: Vec<(Reader, u8)>,
}

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tail").finish_non_exhaustive()
    }
}

impl Tail {
    /// The complete lines the plugin appended since the last poll. Never fails: a missing or
    /// unreadable file is simply read later.
    pub fn poll(&mut self, state_dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let path: PathBuf = state_dir.join(FILE_NAME);
        let rotated = state_dir.join(ROTATED_NAME);
        if !self.started {
            self.started = true;
            // The plugin writes only into an existing state directory (so that nothing comes
            // back after an uninstall); the agent makes sure it exists from the start.
            if !state_dir.exists()
                && let Err(e) = DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(state_dir)
            {
                tracing::warn!(dir = %state_dir.display(), error = %e, "cannot create the state directory");
            }
            if let Some(mut r) = Reader::open(&rotated) {
                out.extend(r.lines());
            }
        }
        for (mut r, left) in std::mem::take(&mut self.draining) {
            out.extend(r.lines());
            if left > 1 {
                self.draining.push((r, left - 1));
            }
        }
        // Someone else moved or removed the file (an uninstall, or another agent): start over
        // on the new one after reading what the old one still holds.
        let on_disk = fs::metadata(&path).ok().map(|m| m.ino());
        if let Some(r) = self.current.take_if(|r| on_disk != Some(r.inode)) {
            self.draining.push((r, DRAIN_POLLS));
        }
        if self.current.is_none() {
            self.current = Reader::open(&path);
        }
        let Some(r) = self.current.as_mut() else {
            return out;
        };
        out.extend(r.lines());
        let size = r.file.metadata().map(|m| m.len()).unwrap_or(0);
        if size >= ROTATE_AT {
            match fs::rename(&path, &rotated) {
                Ok(()) => {
                    if let Some(r) = self.current.take() {
                        self.draining.push((r, DRAIN_POLLS));
                    }
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot rotate the plugin's timings")
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_have_a_fixed_size_and_parse_back() {
        for (c, error, d) in [
            ("ADD", None, Duration::from_micros(1)),
            ("STATUS", Some(50), Duration::from_secs(3600)),
            ("DEL", None, Duration::MAX),
            ("CHECK", Some(MAX_CODE), Duration::ZERO),
        ] {
            let l = line(c, error, d);
            assert_eq!(l.len(), LINE_LEN, "{l:?}");
            assert!(l.ends_with('\n'));
            let i = parse_line(&l).unwrap();
            assert_eq!((i.command, i.ok, i.code), (c, error.is_none(), error));
        }
        assert_eq!(
            line("ADD", None, Duration::from_micros(1234)),
            "ADD    ok                  1234\n"
        );
        assert_eq!(
            line("ADD", Some(8), Duration::from_micros(870)),
            "ADD    e8                   870\n"
        );
        // Past the field: still a failure, without its code.
        let long = line("ADD", Some(MAX_CODE + 1), Duration::from_micros(1));
        assert_eq!(long.len(), LINE_LEN);
        let i = parse_line(&long).unwrap();
        assert_eq!((i.ok, i.code), (false, None));
        // What plugins before the code wrote.
        let old = parse_line("DEL    error               4000\n").unwrap();
        assert_eq!((old.command, old.ok, old.code), ("DEL", false, None));
        for bad in ["garbage", "ADD e 1", "ADD ex7 1", "ADD e-1 1", "ADD fail 1"] {
            assert_eq!(parse_line(bad), None, "{bad}");
        }
    }

    #[test]
    fn appends_only_into_an_existing_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("missing");
        append(&gone, "ADD", None, Duration::from_millis(3));
        assert!(!gone.exists());
        append(dir.path(), "ADD", None, Duration::from_millis(3));
        append(dir.path(), "DEL", Some(105), Duration::from_millis(4));
        let text = std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap();
        assert_eq!(text.len(), 2 * LINE_LEN);
        assert!(text.starts_with("ADD    ok                  3000\n"));
        assert!(text.ends_with("DEL    e105                4000\n"));
        let mut tail = Tail::default();
        assert_eq!(tail.poll(dir.path()).len(), 2);
        assert_eq!(tail.poll(dir.path()).len(), 0);
    }
}
