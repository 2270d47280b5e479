//! `cargo xtask fuzz`: build the libFuzzer targets in fuzz/ (its own workspace, nightly, ASan)
//! and run each for a bounded time, one after another, at the lowest CPU priority so that a
//! benchmark running alongside is not disturbed.
//!
//! New inputs go to fuzz/corpus-generated/<target>/ and crashes to fuzz/artifacts/<target>/
//! (both ignored by git); the hand-written seeds in fuzz/corpus/<target>/ are only read.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, Result, bail};

use crate::cmd::Cmd;
use crate::{build, paths};

/// Installed into the tools dir when no working cargo-fuzz is there.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Inputs longer than this are cut: the largest seed (a full CNI config) is about 2 KiB.
const MAX_LEN: u32 = 8192;

/// One input taking longer than this is reported as a hang.
const TIMEOUT_SECS: u32 = 10;

fn fuzz_dir() -> PathBuf {
    paths::workspace().join("fuzz")
}

fn cargo_fuzz() -> PathBuf {
    paths::tools_bin().join("cargo-fuzz")
}

pub fn run(seconds: u64, only: Option<&str>) -> Result<ExitCode> {
    if seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    let all = targets()?;
    let chosen: Vec<String> = match only {
        Some(t) if all.iter().any(|a| a == t) => vec![t.to_owned()],
        Some(t) => bail!("no fuzz target {t:?}; the targets are {}", all.join(", ")),
        None => all,
    };
    let host = nightly_host()?;
    ensure_cargo_fuzz()?;
    // The userspace crate embeds the BPF object; any build of it will do for fuzzing.
    let object = paths::bpf_object();
    let object = if object.is_file() {
        object
    } else {
        build::ebpf(false)?
    };
    build_targets(&host, &object, only)?;

    let bin_dir = fuzz_dir().join("target").join(&host).join("release");
    let mut reports = Vec::new();
    for target in &chosen {
        reports.push(run_target(&bin_dir, target, seconds)?);
    }
    println!("\nfuzz summary ({seconds} s per target):");
    for r in &reports {
        println!("  {r}");
    }
    let failed = reports.iter().any(|r| !r.clean());
    if failed {
        println!(
            "minimise a crash with `{} fuzz tmin --fuzz-dir fuzz TARGET ARTIFACT` and add it to \
             fuzz/corpus/TARGET/ as a regression seed",
            cargo_fuzz().display()
        );
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Every fuzz/fuzz_targets/*.rs, in name order.
fn targets() -> Result<Vec<String>> {
    let dir = fuzz_dir().join("fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".rs").map(str::to_owned)
        })
        .collect();
    names.sort();
    if names.is_empty() {
        bail!("no fuzz targets in {}", dir.display());
    }
    Ok(names)
}

/// Nightly's host triple: cargo-fuzz builds for it and puts the binaries under it.
fn nightly_host() -> Result<String> {
    let out = Cmd::new("rustc")
        .args(["+nightly", "-vV"])
        .clean_toolchain_env()
        .hint("install nightly: `rustup toolchain install nightly --profile minimal`")
        .read()?;
    out.lines()
        .find_map(|l| l.strip_prefix("host:"))
        .map(|h| h.trim().to_owned())
        .with_context(|| format!("no `host:` line in `rustc +nightly -vV` output:\n{out}"))
}

fn ensure_cargo_fuzz() -> Result<()> {
    let bin = cargo_fuzz();
    if bin.is_file() && works(&bin) {
        println!("cargo-fuzz: ok");
        return Ok(());
    }
    println!("cargo-fuzz: installing {CARGO_FUZZ_VERSION}");
    let mut cmd = Cmd::cargo()
        .args([
            "install",
            "cargo-fuzz",
            "--locked",
            "--version",
            CARGO_FUZZ_VERSION,
        ])
        .arg("--root")
        .arg(paths::tools_dir());
    if bin.is_file() {
        cmd = cmd.arg("--force");
    }
    cmd.hint("check network access and `cargo search cargo-fuzz`, then rerun `cargo xtask fuzz`")
        .run()
        .context("installing cargo-fuzz")?;
    if !works(&bin) {
        bail!(
            "{} was installed but `cargo-fuzz --version` fails",
            bin.display()
        );
    }
    Ok(())
}

fn works(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn build_targets(host: &str, object: &Path, only: Option<&str>) -> Result<()> {
    let mut cmd = Cmd::new("nice")
        .args([
            "-n",
            "19",
            "cargo",
            "+nightly",
            "fuzz",
            "build",
            "--fuzz-dir",
        ])
        .arg(fuzz_dir())
        .args(["--target", host]);
    if let Some(t) = only {
        cmd = cmd.arg(t);
    }
    cmd.current_dir(&paths::workspace())
        .env("SIDESTEP_BPF_OBJECT", object)
        .clean_toolchain_env()
        .prepend_path(&paths::tools_bin())
        .hint("fix the compile error above; `cargo xtask setup` if nightly itself is missing")
        .run()
        .context("building the fuzz targets")
}

/// The outcome of one target's run, from libFuzzer's output.
#[derive(Debug, Default, PartialEq)]
struct Report {
    target: String,
    execs: Option<u64>,
    execs_per_sec: Option<u64>,
    /// Units in libFuzzer's corpus at the end (`corp:` of the DONE line).
    corpus_units: Option<u64>,
    /// Files in corpus-generated/<target>/ afterwards.
    corpus_files: usize,
    artifacts: Vec<String>,
    /// The exit status, when it was not success.
    failure: Option<String>,
}

impl Report {
    fn clean(&self) -> bool {
        self.artifacts.is_empty() && self.failure.is_none()
    }

    /// Reads one line of libFuzzer's stderr.
    fn note(&mut self, line: &str) {
        let number = |s: &str| s.split_whitespace().next().and_then(|n| n.parse().ok());
        if let Some(n) = line.strip_prefix("stat::number_of_executed_units:") {
            self.execs = number(n);
        } else if let Some(n) = line.strip_prefix("stat::average_exec_per_sec:") {
            self.execs_per_sec = number(n);
        } else if let Some(rest) = line.strip_prefix("Done ") {
            // "Done 123 runs in 61 second(s)", printed before the stats.
            if self.execs.is_none() {
                self.execs = number(rest);
            }
        } else if let Some((_, path)) = line.split_once("Test unit written to ") {
            self.artifacts.push(path.trim().to_owned());
        }
        if line.contains("DONE ")
            && let Some((_, rest)) = line.split_once("corp: ")
        {
            self.corpus_units = rest.split('/').next().and_then(|n| n.trim().parse().ok());
        }
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let or_unknown = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |n| n.to_string());
        write!(
            f,
            "{:<18} execs {:>11} ({}/s)  corpus {} units, {} generated files  ",
            self.target,
            or_unknown(self.execs),
            or_unknown(self.execs_per_sec),
            or_unknown(self.corpus_units),
            self.corpus_files,
        )?;
        match (&self.artifacts[..], &self.failure) {
            ([], None) => f.write_str("no crashes"),
            ([], Some(status)) => write!(f, "FAILED ({status}), no artifact"),
            (a, _) => write!(f, "CRASH: {}", a.join(", ")),
        }
    }
}

/// Progress lines that would flood the terminal over a long run, and the dictionary libFuzzer
/// recommends at the end; they stay in the log.
fn is_progress(line: &str) -> bool {
    let progress = line.starts_with('#')
        && ["NEW ", "REDUCE ", "RELOAD "]
            .iter()
            .any(|k| line.contains(k));
    let new_function = line.trim_start().starts_with("NEW_FUNC[");
    let dictionary = line.starts_with('"') && line.contains("# Uses:");
    progress || new_function || dictionary
}

fn run_target(bin_dir: &Path, target: &str, seconds: u64) -> Result<Report> {
    let dir = fuzz_dir();
    let bin = bin_dir.join(target);
    let seeds = dir.join("corpus").join(target);
    let generated = dir.join("corpus-generated").join(target);
    let artifacts = dir.join("artifacts").join(target);
    let logs = dir.join("logs");
    for d in [&generated, &artifacts, &logs] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let log_path = logs.join(format!("{target}.log"));
    let mut log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;

    let mut cmd = Command::new("nice");
    cmd.args(["-n", "19"])
        .arg(&bin)
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .arg(format!("-max_len={MAX_LEN}"))
        .arg(format!("-timeout={TIMEOUT_SECS}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()));
    let dict = dir.join("dict").join(format!("{target}.dict"));
    if dict.is_file() {
        cmd.arg(format!("-dict={}", dict.display()));
    }
    // The first directory receives new inputs; the seeds are only read.
    cmd.arg(&generated).arg(&seeds);
    // As `cargo fuzz run` sets it: Rust's duplicate statics across crates are not ODR bugs.
    let asan = match std::env::var("ASAN_OPTIONS") {
        Ok(o) if !o.is_empty() => format!("{o}:detect_odr_violation=0"),
        _ => "detect_odr_violation=0".to_owned(),
    };
    cmd.env("ASAN_OPTIONS", asan)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    println!(
        "==> fuzz {target} for {seconds} s (nice -n 19; full log {})",
        log_path.display()
    );
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}; was it built?", bin.display()))?;
    let mut report = Report {
        target: target.to_owned(),
        ..Report::default()
    };
    let stderr = child.stderr.take().expect("stderr is piped");
    for line in BufReader::new(stderr).lines() {
        let line = line.context("reading the fuzzer's output")?;
        writeln!(log, "{line}").with_context(|| format!("writing {}", log_path.display()))?;
        report.note(&line);
        if !is_progress(&line) {
            println!("  {line}");
        }
    }
    let status = child.wait().context("waiting for the fuzzer")?;
    if !status.success() {
        report.failure = Some(status.to_string());
    }
    report.corpus_files = std::fs::read_dir(&generated).map_or(0, |d| d.count());
    println!("{report}");
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_output() {
        let mut r = Report::default();
        for line in [
            "#2\tINITED cov: 10 ft: 11 corp: 5/300b exec/s: 0 rss: 30Mb",
            "#1024\tNEW    cov: 12 ft: 13 corp: 6/310b lim: 40 exec/s: 512 rss: 31Mb",
            "#38983\tDONE   cov: 2049 ft: 9000 corp: 812/95Kb lim: 8192 exec/s: 2436 rss: 400Mb",
            "Done 38983 runs in 16 second(s)",
            "stat::number_of_executed_units: 38983",
            "stat::average_exec_per_sec:     2436",
        ] {
            r.note(line);
        }
        assert_eq!(r.execs, Some(38983));
        assert_eq!(r.execs_per_sec, Some(2436));
        assert_eq!(r.corpus_units, Some(812));
        assert!(r.clean());
        assert!(is_progress("#1024\tNEW    cov: 12"));
        assert!(!is_progress("#38983\tDONE   cov: 2049"));
        assert!(is_progress(r#""cniVersion" # Uses: 17"#));
        assert!(is_progress(
            "\tNEW_FUNC[1/2]: 0x55 in serde_json::de::parse"
        ));
    }

    #[test]
    fn notes_crash_artifacts() {
        let mut r = Report::default();
        r.note("artifact_prefix='/f/artifacts/x/'; Test unit written to /f/artifacts/x/crash-ab12");
        assert_eq!(r.artifacts, ["/f/artifacts/x/crash-ab12"]);
        assert!(!r.clean());
    }
}
