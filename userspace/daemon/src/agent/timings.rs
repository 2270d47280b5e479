//! The plugin's invocations for `/metrics`: counts and latency histograms by command and outcome,
//! from the timings file ([`sidestep::statedir::timings`], which owns its format, reading and
//! rotation), polled once a second and at each scrape. The counters cover the time since the
//! older of the two files began, and go back down (a counter reset, as Prometheus understands it)
//! only when a restarted agent finds a rotation happened.

use std::{path::Path, sync::Mutex};

use prometheus_client::{
    encoding::{EncodeLabel as _, EncodeLabelSet, LabelSetEncoder},
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};

use sidestep::statedir::timings::Tail;
pub use sidestep::statedir::timings::{FILE_NAME, LINE_LEN, ROTATE_AT, ROTATED_NAME, parse_line};

/// Bucket bounds in seconds: an ADD on an idle node takes milliseconds, one that waits for the
/// API server can take the plugin's whole retry budget.
pub const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The histogram's labels: by command and result only, so that its 15 series per pair do not
/// multiply by every error code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    command: String,
    result: String,
}

/// The counter's labels: [`OpLabels`] and, for a failure, `code`, the CNI error code the plugin
/// answered with (the spec's 1-99, sidestep's own from 100). A success has no `code` label, nor
/// has a failure an older plugin recorded without one; written by hand because the derive
/// would give those `code=""`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct CountLabels {
    op: OpLabels,
    code: Option<u32>,
}

impl EncodeLabelSet for CountLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder<'_>) -> std::fmt::Result {
        ("command", self.op.command.as_str()).encode(encoder.encode_label())?;
        ("result", self.op.result.as_str()).encode(encoder.encode_label())?;
        if let Some(code) = self.code {
            ("code", code.to_string()).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

type Durations = Family<OpLabels, Histogram, fn() -> Histogram>;

/// Counts and histograms of the plugin's invocations.
pub struct CniTimings {
    durations: Durations,
    operations: Family<CountLabels, Counter>,
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

impl CniTimings {
    fn observe(&self, lines: Vec<String>) {
        for l in lines {
            match parse_line(&l) {
                Some(i) => {
                    let op = OpLabels {
                        command: i.command.into(),
                        result: if i.ok { "ok" } else { "error" }.into(),
                    };
                    self.durations.get_or_create(&op).observe(i.seconds);
                    self.operations
                        .get_or_create(&CountLabels { op, code: i.code })
                        .inc();
                }
                None => {
                    self.malformed.inc();
                }
            }
        }
    }

    /// Counts what the plugin appended since the last poll. Never fails: a missing or
    /// unreadable file is simply not counted yet.
    pub fn poll(&self, state_dir: &Path) {
        let lines = self
            .tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .poll(state_dir);
        self.observe(lines);
    }

    pub fn register(&self, reg: &mut Registry) {
        reg.register(
            "sidestep_cni_operations",
            "Plugin invocations by command and result, and a failure's CNI error code, from its timing records",
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
    use std::{fs, io::Write as _};

    use super::*;

    /// A line as the plugin writes it: `outcome` is `ok`, `eCODE`, or an older plugin's `error`.
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
        let l = line("ADD", "e8", 70_000);
        append(d, FILE_NAME, &l[..10]);
        t.poll(d);
        append(d, FILE_NAME, &l[10..]);
        append(d, FILE_NAME, "garbage\n");
        t.poll(d);
        let out = text(&t);
        for want in [
            r#"sidestep_cni_operations_total{command="ADD",result="ok"} 1"#,
            r#"sidestep_cni_operations_total{command="ADD",result="error",code="8"} 1"#,
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
        append(d, ROTATED_NAME, &line("DEL", "e105", 10));
        append(d, FILE_NAME, &line("DEL", "e105", 10));
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
            out.contains(
                r#"sidestep_cni_operations_total{command="DEL",result="error",code="105"} 2"#
            ),
            "{out}"
        );
    }

    #[test]
    fn failures_are_counted_by_code_and_timed_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let t = CniTimings::default();
        t.poll(d);
        for outcome in ["e11", "e11", "e7", "e100", "error", "ok"] {
            append(d, FILE_NAME, &line("ADD", outcome, 1_000));
        }
        t.poll(d);
        let out = text(&t);
        for want in [
            r#"sidestep_cni_operations_total{command="ADD",result="error",code="11"} 2"#,
            r#"sidestep_cni_operations_total{command="ADD",result="error",code="7"} 1"#,
            r#"sidestep_cni_operations_total{command="ADD",result="error",code="100"} 1"#,
            // An older plugin's failure, and a success: no code.
            r#"sidestep_cni_operations_total{command="ADD",result="error"} 1"#,
            r#"sidestep_cni_operations_total{command="ADD",result="ok"} 1"#,
            // One histogram for all failures, whatever their code.
            r#"sidestep_cni_operation_duration_seconds_count{command="ADD",result="error"} 5"#,
            "sidestep_cni_timing_records_malformed_total 0",
        ] {
            assert!(out.contains(want), "no {want} in\n{out}");
        }
        assert!(
            !out.lines()
                .any(|l| l.starts_with("sidestep_cni_operation_duration") && l.contains("code=")),
            "{out}"
        );
        assert!(!out.contains("code=\"\""), "{out}");
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
