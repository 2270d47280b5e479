//! Driving the real `sidestep` binary from tests: load into the test's cgroup and pin root,
//! enrol pods, read status, and unload on drop.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::{env::TestEnv, pod::Pod};

/// Where the workspace's binaries are: `SIDESTEP_BIN_DIR` (set by `cargo xtask test`) or
/// `target/debug`.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("SIDESTEP_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug"))
}

/// The CNI plugin: `SIDESTEP_CNI_BIN` (xtask points it at the statically linked build that
/// ships, see `xtask::build::static_plugin`), else the workspace build beside `sidestep`.
pub fn cni_bin() -> PathBuf {
    std::env::var_os("SIDESTEP_CNI_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("sidestep-cni"))
}

/// The program interpreter (dynamic loader) an ELF executable names, `None` for a static one.
pub fn elf_interpreter(path: &Path) -> Result<Option<String>> {
    const PT_INTERP: u32 = 3;
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let u16_at = |o: usize| {
        b.get(o..o + 2)
            .map(|s| u16::from_le_bytes([s[0], s[1]]) as usize)
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")) as usize)
    };
    ensure!(
        b.starts_with(b"\x7fELF\x02\x01"),
        "{} is not a 64-bit little-endian ELF file",
        path.display()
    );
    let (phoff, phentsize, phnum) = (
        u64_at(0x20).context("e_phoff")?,
        u16_at(0x36).context("e_phentsize")?,
        u16_at(0x38).context("e_phnum")?,
    );
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        let p_type = b
            .get(ph..ph + 4)
            .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
            .context("program header")?;
        if p_type == PT_INTERP {
            let (off, size) = (
                u64_at(ph + 8).context("p_offset")?,
                u64_at(ph + 32).context("p_filesz")?,
            );
            let name = b.get(off..off + size).context("interpreter name")?;
            return Ok(Some(
                String::from_utf8_lossy(name)
                    .trim_end_matches('\0')
                    .to_owned(),
            ));
        }
    }
    Ok(None)
}

pub fn sidestep_bin() -> PathBuf {
    bin_dir().join("sidestep")
}

/// Runs `sidestep ARGS`; fails with its stderr when it exits non-zero.
/// `sidestep ARGS`, whatever its exit status.
pub fn sidestep_unchecked(args: &[&str]) -> Result<Output> {
    Command::new(sidestep_bin())
        .args(args)
        .output()
        .with_context(|| format!("running {} {args:?}", sidestep_bin().display()))
}

pub fn sidestep(args: &[&str]) -> Result<Output> {
    let out = Command::new(sidestep_bin())
        .args(args)
        .output()
        .with_context(|| format!("running {} {args:?}", sidestep_bin().display()))?;
    if !out.status.success() {
        bail!(
            "sidestep {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// sidestep loaded into the test's cgroup and pin root; unloaded on drop.
pub struct Loaded {
    pin_root: PathBuf,
}

impl Loaded {
    pub fn load(env: &TestEnv) -> Result<Self> {
        let pin_root = env.pin_root().to_path_buf();
        sidestep(&[
            "load",
            "--cgroup",
            &env.cgroup_path().display().to_string(),
            "--pin-root",
            &pin_root.display().to_string(),
        ])?;
        Ok(Self { pin_root })
    }

    pub fn pin_root(&self) -> &Path {
        &self.pin_root
    }

    fn root_arg(&self) -> String {
        self.pin_root.display().to_string()
    }

    /// Enrols `pod` with its own IPs plus `extra` policy flags.
    pub fn enroll(&self, pod: &Pod, extra: &[&str]) -> Result<()> {
        let netns = pod.netns_path.display().to_string();
        let root = self.root_arg();
        let ips: Vec<String> = pod.ips().iter().map(ToString::to_string).collect();
        let mut args = vec!["enroll", "--pin-root", &root, "--netns", &netns];
        for ip in &ips {
            args.extend(["--pod-ip", ip.as_str()]);
        }
        args.extend(extra);
        sidestep(&args).map(drop)
    }

    pub fn unenroll(&self, pod: &Pod) -> Result<()> {
        let netns = pod.netns_path.display().to_string();
        sidestep(&[
            "unenroll",
            "--pin-root",
            &self.root_arg(),
            "--netns",
            &netns,
        ])
        .map(drop)
    }

    pub fn status(&self) -> Result<Value> {
        let out = sidestep(&["status", "--json", "--pin-root", &self.root_arg()])?;
        serde_json::from_slice(&out.stdout).context("parsing sidestep status --json")
    }

    /// The counters of the pod with this netns cookie, or None when it is not enrolled.
    pub fn counters(&self, cookie: u64) -> Result<Option<Value>> {
        let status = self.status()?;
        Ok(status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["netns_cookie"].as_u64() == Some(cookie))
            .map(|p| p["counters"].clone()))
    }

    pub fn unload(self) -> Result<()> {
        let root = self.root_arg();
        std::mem::forget(self);
        sidestep(&["unload", "--pin-root", &root]).map(drop)
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        if let Err(e) = sidestep(&["unload", "--pin-root", &self.root_arg()]) {
            eprintln!("sidestep unload in drop: {e:#}");
        }
    }
}

/// A CNI plugin directory for the test, where the sidestep-cni binary answers to its `type`,
/// `sidestep`, as the agent installs it on a node.
pub fn cni_plugin_dir(env: &TestEnv) -> Result<PathBuf> {
    let dir = env.tmp_dir().join("cni-bin");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let bin = cni_bin();
    if !bin.is_file() {
        bail!(
            "{} is missing: run `cargo build --workspace`",
            bin.display()
        );
    }
    let link = dir.join("sidestep");
    if !link.exists() {
        std::os::unix::fs::symlink(&bin, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(dir)
}

/// The plugins chained after `bridge` on a node: portmap, then sidestep-cni with pod annotations
/// from the runtime. Callers add fields to the second entry as they need.
pub fn cni_chain(pin_root: &Path, state_dir: &Path) -> Vec<Value> {
    vec![
        serde_json::json!({"type": "portmap", "capabilities": {"portMappings": true}, "snat": false}),
        serde_json::json!({
            "type": "sidestep",
            "pin_root": pin_root,
            "state_dir": state_dir,
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        }),
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn elf_interpreter_names_the_dynamic_loader() {
        let sh = super::elf_interpreter(std::path::Path::new("/bin/sh")).unwrap();
        assert!(sh.is_some_and(|i| i.contains("ld-linux")), "/bin/sh");
        assert!(super::elf_interpreter(std::path::Path::new("/etc/hostname")).is_err());
    }
}
