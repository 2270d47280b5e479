//! A thin wrapper over `std::process::Command` that echoes what it runs and
//! turns failures into errors that say which command failed and how to fix it.

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use anyhow::{Context, Result, bail};

/// Variables that `cargo run`, cargo build scripts and the rustup proxy put
/// into our environment. Passed on, they would pin a child cargo to the
/// toolchain, target dir or flags of the outer invocation: `RUSTUP_TOOLCHAIN`
/// beats `cargo +nightly`, and `CARGO_TARGET_DIR` moves the BPF object.
const LEAKED_VARS: &[&str] = &[
    "RUSTUP_TOOLCHAIN",
    "RUSTUP_TOOLCHAIN_SOURCE",
    "CARGO",
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_BUILD_RUSTC",
    "CARGO_BUILD_RUSTC_WRAPPER",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_ENCODED_RUSTDOCFLAGS",
    "CARGO_MAKEFLAGS",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "RUSTC",
    "RUSTDOC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
];

/// Prefixes of per-package variables cargo sets for the running binary.
const LEAKED_PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_CFG_", "CARGO_FEATURE_"];

/// Whether `key` is one of the variables the outer cargo or rustup set for xtask itself, rather
/// than one the user chose.
pub fn is_leaked_var(key: &str) -> bool {
    LEAKED_VARS.contains(&key) || LEAKED_PREFIXES.iter().any(|p| key.starts_with(p))
}

pub struct Cmd {
    inner: Command,
    program: String,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    dir: Option<PathBuf>,
    hint: Option<String>,
}

impl Cmd {
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        let program = program.as_ref();
        Self {
            inner: Command::new(program),
            program: program.to_string_lossy().into_owned(),
            args: Vec::new(),
            envs: Vec::new(),
            dir: None,
            hint: None,
        }
    }

    /// The cargo that runs us, so `cargo +1.95.0 xtask build` builds the
    /// workspace with 1.95.0 too.
    pub fn cargo() -> Self {
        let mut cmd = Self::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        // Echo `cargo`, not the toolchain's full path: shorter, and the same
        // toolchain when pasted in the directory we run in.
        cmd.program = "cargo".into();
        cmd
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        let arg = arg.as_ref();
        self.args.push(arg.to_string_lossy().into_owned());
        self.inner.arg(arg);
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for arg in args {
            self = self.arg(arg);
        }
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Self {
        let value = value.as_ref();
        self.envs
            .push((key.to_owned(), value.to_string_lossy().into_owned()));
        self.inner.env(key, value);
        self
    }

    pub fn current_dir(mut self, dir: &Path) -> Self {
        self.dir = Some(dir.to_owned());
        self.inner.current_dir(dir);
        self
    }

    /// What to tell the user when the command fails.
    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// Strip what the outer cargo/rustup leaked, so a child cargo chooses its
    /// toolchain from `+toolchain` or rust-toolchain.toml alone.
    pub fn clean_toolchain_env(mut self) -> Self {
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if is_leaked_var(&key) {
                self.inner.env_remove(key.as_ref());
            }
        }
        // `cargo run` prepends the outer toolchain's lib dir; the loader
        // searches it before a nightly binary's own RUNPATH.
        if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
            let kept: Vec<PathBuf> = std::env::split_paths(&paths)
                .filter(|p| !p.components().any(|c| c.as_os_str() == "toolchains"))
                .filter(|p| !p.starts_with(crate::paths::target_dir()))
                .collect();
            if kept.is_empty() {
                self.inner.env_remove("LD_LIBRARY_PATH");
            } else if let Ok(joined) = std::env::join_paths(kept) {
                self.inner.env("LD_LIBRARY_PATH", joined);
            }
        }
        self
    }

    /// Put `dir` first on PATH, e.g. so cargo finds our bpf-linker.
    pub fn prepend_path(mut self, dir: &Path) -> Self {
        let old = std::env::var_os("PATH").unwrap_or_default();
        let mut paths = vec![dir.to_owned()];
        paths.extend(std::env::split_paths(&old));
        let joined = std::env::join_paths(paths).unwrap_or_else(|_| OsString::from(&old));
        // Set on `inner` only: the echoed line stays short and copy-pastable
        // once the user adds the tools dir to their own PATH.
        self.inner.env("PATH", joined);
        self
    }

    fn display(&self) -> String {
        let mut line = String::new();
        if let Some(dir) = &self.dir {
            let _ = write!(line, "(cd {}) ", dir.display());
        }
        for (k, v) in &self.envs {
            let _ = write!(line, "{k}={} ", quote(v));
        }
        line.push_str(&quote(&self.program));
        for a in &self.args {
            line.push(' ');
            line.push_str(&quote(a));
        }
        line
    }

    fn failure(&self, what: String) -> anyhow::Error {
        let mut msg = format!("`{}` {what}", self.display());
        if let Some(hint) = &self.hint {
            let _ = write!(msg, "\n  fix: {hint}");
        }
        anyhow::anyhow!(msg)
    }

    /// Echo, run with inherited stdio, and return the exit status as is, for
    /// callers that propagate it (cargo test, the demo).
    pub fn status(mut self) -> Result<ExitStatus> {
        println!("==> {}", self.display());
        match self.inner.status() {
            Ok(status) => Ok(status),
            Err(e) => Err(self.failure(format!("could not start: {e}"))),
        }
    }

    /// Echo, run, and fail unless it exits 0.
    pub fn run(self) -> Result<()> {
        println!("==> {}", self.display());
        self.run_quiet()
    }

    /// Like `run` without the echo, for commands whose effect the caller
    /// already reported.
    pub fn run_quiet(mut self) -> Result<()> {
        let status = match self.inner.status() {
            Ok(status) => status,
            Err(e) => return Err(self.failure(format!("could not start: {e}"))),
        };
        if !status.success() {
            bail!(self.failure(format!("failed ({status})")));
        }
        Ok(())
    }

    /// Echo, run with stderr shown (cargo's progress and errors), and return stdout, for
    /// machine-readable output of a long command; fail unless it exits 0.
    pub fn capture(mut self) -> Result<String> {
        println!("==> {}", self.display());
        self.inner
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let out = match self.inner.output() {
            Ok(out) => out,
            Err(e) => return Err(self.failure(format!("could not start: {e}"))),
        };
        if !out.status.success() {
            bail!(self.failure(format!("failed ({})", out.status)));
        }
        String::from_utf8(out.stdout)
            .with_context(|| format!("`{}` printed non-UTF-8", self.display()))
    }

    /// Capture stdout of a probe. Probes are not echoed: they change nothing,
    /// and `setup` runs a couple of dozen of them on every invocation.
    pub fn read(mut self) -> Result<String> {
        self.inner.stdin(Stdio::null()).stderr(Stdio::piped());
        let out = match self.inner.output() {
            Ok(out) => out,
            Err(e) => return Err(self.failure(format!("could not start: {e}"))),
        };
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            bail!(self.failure(format!("failed ({}): {}", out.status, stderr.trim())));
        }
        String::from_utf8(out.stdout)
            .with_context(|| format!("`{}` printed non-UTF-8", self.display()))
    }
}

/// Quote for a POSIX shell only when needed, so echoed lines can be pasted
/// (and generated scripts read as plainly).
pub fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=+:,@%".contains(c));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Does `program` resolve on PATH?
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

/// Effective UID 0? Read from /proc rather than pulling in libc for one call.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let uids = s.lines().find_map(|l| l.strip_prefix("Uid:"))?.to_owned();
            // Fields: real, effective, saved, filesystem.
            uids.split_whitespace().nth(1).map(|e| e == "0")
        })
        .unwrap_or(false)
}
