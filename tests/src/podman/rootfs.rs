//! The containers' root filesystem: busybox-static plus the host's HAProxy and curl with the
//! shared libraries they need, so that no image is pulled.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::{APPLETS, which};

/// Builds a rootfs with busybox and the host's haproxy and curl, each with the shared libraries `ldd`
/// names, plus the directories and files runc and podman mount over.
pub(super) fn build_rootfs(root: &Path) -> Result<()> {
    for d in [
        "bin",
        "usr/sbin",
        "etc/sidestep",
        "proc",
        "sys",
        "dev",
        "run",
        "tmp",
        "var/tmp",
    ] {
        fs::create_dir_all(root.join(d)).with_context(|| format!("mkdir rootfs/{d}"))?;
    }
    for d in ["tmp", "var/tmp"] {
        fs::set_permissions(root.join(d), fs::Permissions::from_mode(0o1777))?;
    }
    let busybox = which("busybox").context("busybox not found (package busybox-static)")?;
    copy_with_libs(&busybox, &root.join("bin/busybox"), root)?;
    for applet in APPLETS {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))
            .with_context(|| format!("link applet {applet}"))?;
    }
    let haproxy = which("haproxy").context("haproxy not found (package haproxy)")?;
    copy_with_libs(&haproxy, &root.join("usr/sbin/haproxy"), root)?;
    let curl = which("curl").context("curl not found")?;
    copy_with_libs(&curl, &root.join("bin/curl"), root)?;
    fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/:/bin/sh\napp:x:1000:1000:app:/:/bin/sh\nproxy:x:1337:1337:proxy:/:/bin/sh\n",
    )?;
    fs::write(
        root.join("etc/group"),
        "root:x:0:\napp:x:1000:\nproxy:x:1337:\n",
    )?;
    for f in ["etc/hosts", "etc/resolv.conf", "etc/hostname"] {
        fs::write(root.join(f), "")?;
    }
    Ok(())
}

/// Copies `bin` to `dest` and every library `ldd` lists for it to the same path under `root`.
fn copy_with_libs(bin: &Path, dest: &Path, root: &Path) -> Result<()> {
    fs::copy(bin, dest).with_context(|| format!("copy {}", bin.display()))?;
    let out = Command::new("ldd").arg(bin).output().context("run ldd")?;
    // A static binary: ldd exits non-zero with "not a dynamic executable".
    if !out.status.success() {
        return Ok(());
    }
    for lib in ldd_paths(&String::from_utf8_lossy(&out.stdout)) {
        let rel = lib.strip_prefix("/").unwrap_or(&lib);
        let to = root.join(rel);
        if to.exists() {
            continue;
        }
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::copy(&lib, &to).with_context(|| format!("copy {}", lib.display()))?;
    }
    Ok(())
}

/// The absolute library paths in `ldd` output.
pub(super) fn ldd_paths(out: &str) -> Vec<PathBuf> {
    out.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rhs)) => rhs.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ldd_output() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2e)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f2e)\n\
                   \tlibmissing.so => not found\n";
        assert_eq!(
            ldd_paths(out),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
    }
}
