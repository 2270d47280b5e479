//! Each invocation's duration and outcome, for the agent's `/metrics` (ADD and DEL counts and
//! latency histograms).
//!
//! The plugin appends one fixed-size line per invocation to `<state_dir>/timings`:
//!
//! ```text
//! ADD    ok                  1234\n   command (6), outcome (5), microseconds (18), 32 bytes
//! ```
//!
//! Why a file and not a socket to the agent: an append never blocks and does not need the agent
//! to be up, so invocations made while the agent restarts are counted when it is back. A single
//! `write(2)` of 32 bytes on an `O_APPEND` descriptor lands whole, so concurrent plugins never
//! interleave. The agent reads the file from where it stopped and rotates it (`timings` ->
//! `timings.1`); the plugin stops appending past [`MAX_BYTES`], so the file stays bounded even
//! with no agent at all.
//!
//! Nothing here can fail or slow the CNI call: every error is ignored, and the line is written
//! only when the state directory exists (the agent creates it; after `sidestep uninstall` a DEL
//! leaves nothing behind). The agent's reader is `sidestep::agent::metrics` and must agree on
//! this format.

use std::{
    fs::OpenOptions, io::Write as _, os::unix::fs::OpenOptionsExt as _, path::Path, time::Duration,
};

use crate::spec::Command;

/// The file under the state directory.
pub const FILE_NAME: &str = "timings";
/// Length of one line, newline included.
pub const LINE_LEN: usize = 32;
/// Past this size (half a million invocations the agent never read) lines are dropped.
pub const MAX_BYTES: u64 = 16 << 20;

/// The line for one invocation.
pub fn line(command: Command, ok: bool, elapsed: Duration) -> String {
    let micros = u64::try_from(elapsed.as_micros())
        .unwrap_or(u64::MAX)
        .min(999_999_999_999_999_999);
    let outcome = if ok { "ok" } else { "error" };
    format!("{:<6} {outcome:<5} {micros:>18}\n", command.as_str())
}

/// Appends the invocation's line; never fails, never blocks on anything but the local file.
pub fn record(state_dir: &Path, command: Command, ok: bool, elapsed: Duration) {
    if command == Command::Version || !state_dir.is_dir() {
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
    let _ = f.write(line(command, ok, elapsed).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_have_a_fixed_size() {
        for (c, ok, d) in [
            (Command::Add, true, Duration::from_micros(1)),
            (Command::Status, false, Duration::from_secs(3600)),
            (Command::Del, true, Duration::MAX),
        ] {
            let l = line(c, ok, d);
            assert_eq!(l.len(), LINE_LEN, "{l:?}");
            assert!(l.ends_with('\n'));
        }
        assert_eq!(
            line(Command::Add, true, Duration::from_micros(1234)),
            "ADD    ok                  1234\n"
        );
    }

    #[test]
    fn appends_only_into_an_existing_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("missing");
        record(&gone, Command::Add, true, Duration::from_millis(3));
        assert!(!gone.exists());
        record(dir.path(), Command::Add, true, Duration::from_millis(3));
        record(dir.path(), Command::Del, false, Duration::from_millis(4));
        record(dir.path(), Command::Version, true, Duration::from_millis(4));
        let text = std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap();
        assert_eq!(text.len(), 2 * LINE_LEN);
        assert!(text.starts_with("ADD    ok                  3000\n"));
        assert!(text.ends_with("DEL    error               4000\n"));
    }
}
