//! The plugin's invocations for `/metrics`: counts and latency histograms by command and outcome,
//! read from the fixed-size lines `sidestep-cni` appends to `<state_dir>/timings` (its
//! `timing` module writes them; the two must agree on the format below).
//!
//! ```text
//! ADD    ok                  1234\n   command (6), outcome (5), microseconds (18): 32 bytes
//! ```
//!
//! The agent reads the file from where it stopped, once a second and at each scrape. Past
//! [`ROTATE_AT`] it renames it to `timings.1` and keeps reading the renamed file for a few more
//! polls, for plugins that opened it just before the rename. At start it reads `timings.1` and
//! `timings` whole, so invocations made while the agent was down (or restarting) are counted;
//! the counters therefore cover the time since the older of the two files began, and go back
//! down (a counter reset, as Prometheus understands it) only when a restarted agent finds a
//! rotation happened.

use std::{
    fs::{self, DirBuilder, File},
    io::Read as _,
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _},
    path::{Path, PathBuf},
    sync::Mutex,
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};

/// The plugin's file under the state directory, and its rotated predecessor.
pub const FILE_NAME: &str = "timings";
pub const ROTATED_NAME: &str = "timings.1";
/// One line, newline included.
pub const LINE_LEN: usize = 32;
/// The agent rotates the file past this size (32768 invocations).
pub const ROTATE_AT: u64 = 1 << 20;
/// How many polls a rotated file is still read for.
const DRAIN_POLLS: u8 = 5;

/// Bucket bounds in seconds: an ADD on an idle node takes milliseconds, one that waits for the
/// API server can take the plugin's whole retry budget.
pub const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    command: String,
    result: String,
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

type Durations = Family<OpLabels, Histogram, fn() -> Histogram>;

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

#[derive(Default)]
struct Tail {
    started: bool,
    current: Option<Reader>,
    draining: Vec<(Reader, u8)>,
}

/// Counts and histograms of the plugin's invocations.
pub struct CniTimings {
    durations: Durations,
    operations: Family<OpLabels, Counter>,
    malformed: Counter,
    tail: Mutex<Tail>,
}

impl Default for CniTimings {
    fn default() -> Self {
        Self {
            durations: Family::new_with_constructor(histogram as fn() -> Histogram),
            operations: Family::default(),
            malformed: Counter::default(),
            tail: Mutex::new(Tail::default()),
        }
    }
}

impl std::fmt::Debug for CniTimings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CniTimings").finish_non_exhaustive()
    }
}

/// (command, outcome, seconds) of one line.
pub fn parse_line(line: &str) -> Option<(&str, &str, f64)> {
    let mut f = line.split_whitespace();
    let (command, outcome, micros) = (f.next()?, f.next()?, f.next()?);
    if f.next().is_some()
        || !matches!(command, "ADD" | "DEL" | "CHECK" | "GC" | "STATUS")
        || !matches!(outcome, "ok" | "error")
    {
        return None;
    }
    let micros: u64 = micros.parse().ok()?;
    Some((command, outcome, micros as f64 / 1e6))
}

impl CniTimings {
    fn observe(&self, lines: Vec<String>) {
        for l in lines {
            match parse_line(&l) {
                Some((command, result, secs)) => {
                    let labels = OpLabels {
                        command: command.into(),
                        result: result.into(),
                    };
                    self.durations.get_or_create(&labels).observe(secs);
                    self.operations.get_or_create(&labels).inc();
                }
                None => {
                    self.malformed.inc();
                }
            }
        }
    }

    /// Reads what the plugin appended since the last poll. Never fails: a missing or unreadable
    /// file is simply not counted yet.
    pub fn poll(&self, state_dir: &Path) {
        let mut t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let path: PathBuf = state_dir.join(FILE_NAME);
        let rotated = state_dir.join(ROTATED_NAME);
        if !t.started {
            t.started = true;
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
                self.observe(r.lines());
            }
        }
        let mut drained = Vec::new();
        for (mut r, left) in std::mem::take(&mut t.draining) {
            drained.extend(r.lines());
            if left > 1 {
                t.draining.push((r, left - 1));
            }
        }
        self.observe(drained);
        // Someone else moved or removed the file (an uninstall, or another agent): start over
        // on the new one after reading what the old one still holds.
        let on_disk = fs::metadata(&path).ok().map(|m| m.ino());
        if let Some(r) = t.current.take_if(|r| on_disk != Some(r.inode)) {
            t.draining.push((r, DRAIN_POLLS));
        }
        if t.current.is_none() {
            t.current = Reader::open(&path);
        }
        let Some(r) = t.current.as_mut() else {
            return;
        };
        let lines = r.lines();
        let size = r.file.metadata().map(|m| m.len()).unwrap_or(0);
        self.observe(lines);
        if size >= ROTATE_AT {
            match fs::rename(&path, &rotated) {
                Ok(()) => {
                    if let Some(r) = t.current.take() {
                        t.draining.push((r, DRAIN_POLLS));
                    }
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot rotate the plugin's timings")
                }
            }
        }
    }

    pub fn register(&self, reg: &mut Registry) {
        reg.register(
            "sidestep_cni_operations",
            "Plugin invocations by command and result, from its timing records",
            self.operations.clone(),
        );
        reg.register(
            "sidestep_cni_operation_duration_seconds",
            "Plugin invocation time by command and result (config parsed to result written)",
            self.durations.clone(),
        );
        reg.register(
            "sidestep_cni_timing_records_malformed",
            "Lines in the plugin's timing file that could not be read",
            self.malformed.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn line(cmd: &str, outcome: &str, micros: u64) -> String {
        let l = format!("{cmd:<6} {outcome:<5} {micros:>18}\n");
        assert_eq!(l.len(), LINE_LEN);
        l
    }

    fn append(dir: &Path, name: &str, text: &str) {
        fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(dir.join(name))
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }

    fn text(t: &CniTimings) -> String {
        let mut reg = Registry::default();
        t.register(&mut reg);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        out
    }

    #[test]
    fn counts_lines_across_partial_writes_and_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        append(d, ROTATED_NAME, &line("DEL", "ok", 2_000));
        append(d, FILE_NAME, &line("ADD", "ok", 3_000));
        let t = CniTimings::default();
        t.poll(d);
        // Half a line: not counted until its newline arrives.
        let l = line("ADD", "error", 70_000);
        append(d, FILE_NAME, &l[..10]);
        t.poll(d);
        append(d, FILE_NAME, &l[10..]);
        append(d, FILE_NAME, "garbage\n");
        t.poll(d);
        let out = text(&t);
        for want in [
            r#"sidestep_cni_operations_total{command="ADD",result="ok"} 1"#,
            r#"sidestep_cni_operations_total{command="ADD",result="error"} 1"#,
            r#"sidestep_cni_operations_total{command="DEL",result="ok"} 1"#,
            r#"sidestep_cni_operation_duration_seconds_bucket{le="0.005",command="ADD",result="ok"} 1"#,
            r#"sidestep_cni_operation_duration_seconds_bucket{le="0.05",command="ADD",result="error"} 0"#,
            r#"sidestep_cni_operation_duration_seconds_bucket{le="0.1",command="ADD",result="error"} 1"#,
            "sidestep_cni_timing_records_malformed_total 1",
        ] {
            assert!(out.contains(want), "no {want} in\n{out}");
        }

        // Rotation: the file grows past the bound, is renamed, and a writer that still had the
        // old file open is counted; new lines go to a new file.
        let big: String = (0..ROTATE_AT / LINE_LEN as u64)
            .map(|_| line("CHECK", "ok", 10))
            .collect();
        append(d, FILE_NAME, &big);
        t.poll(d);
        assert!(!d.join(FILE_NAME).exists());
        append(d, ROTATED_NAME, &line("DEL", "error", 10));
        append(d, FILE_NAME, &line("DEL", "error", 10));
        t.poll(d);
        let out = text(&t);
        let n = ROTATE_AT / LINE_LEN as u64;
        assert!(
            out.contains(&format!(
                r#"sidestep_cni_operations_total{{command="CHECK",result="ok"}} {n}"#
            )),
            "{out}"
        );
        assert!(
            out.contains(r#"sidestep_cni_operations_total{command="DEL",result="error"} 2"#),
            "{out}"
        );
    }

    #[test]
    fn creates_the_state_dir_only_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let t = CniTimings::default();
        t.poll(&state);
        assert!(state.is_dir());
        fs::remove_dir(&state).unwrap();
        t.poll(&state);
        assert!(!state.exists(), "an uninstall removed it; it stays removed");
    }
}
