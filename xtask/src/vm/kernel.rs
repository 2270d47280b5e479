//! The guest kernels: Debian's generic amd64 image packages, unpacked (never installed) under
//! `<tools>/kernels/<release>`, with `<tools>/kernels/<name>` a symlink to the release that
//! `<name>` resolved to when it was fetched.
//!
//! A kernel directory is trusted once it exists under its final name: a fetch unpacks, runs
//! depmod and extracts vmlinux in a temporary directory and renames it into place last, so an
//! interrupted fetch leaves only a `.fetch-*` directory, which the next fetch deletes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::cmd::{self, Cmd};
use crate::{packages, paths};

/// The kernels `--kernel` can fetch, and the meta package whose Depends names the current
/// versioned image. Resolved, not hard-coded: old ABI numbers leave the archive. The generic
/// flavour, because the cloud one is built without 9p.
const FETCHABLE: &[(&str, &str)] = &[
    ("6.1", "linux-image-amd64"),
    ("6.12", "linux-image-6.12-amd64"),
];

/// What `--kernel all` means.
const ALL: &[&str] = &["6.1", "6.12"];

/// Written last by kmod's depmod; its presence means the whole index set is there.
const DEPMOD_LAST: &str = "modules.devname";

pub struct Kernel {
    /// As given to `--kernel`: `6.1`.
    pub name: String,
    /// The unpacked package, symlinks resolved.
    pub root: PathBuf,
    /// `uname -r` in the guest: `6.1.0-57-amd64`.
    pub release: String,
    /// The uncompressed ELF image, booted through its PVH entry.
    pub vmlinux: PathBuf,
}

pub fn kernels_dir() -> PathBuf {
    paths::tools_dir().join("kernels")
}

/// `6.1`, `6.12,6.1`, `all`: in order, without duplicates.
pub fn parse_list(list: &str) -> Result<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let expanded: Vec<&str> = if name == "all" {
            ALL.to_vec()
        } else {
            vec![name]
        };
        for n in expanded {
            if !names.iter().any(|have| have == n) {
                names.push(n.to_owned());
            }
        }
    }
    if names.is_empty() {
        bail!(
            "--kernel needs a kernel: {}, all, or a comma list",
            fetchable_names()
        );
    }
    Ok(names)
}

fn fetchable_names() -> String {
    FETCHABLE
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The kernel called `name`, fetched first if this machine has none under that name. A name
/// that is not fetchable still works when someone unpacked a package under it by hand.
pub fn ensure(name: &str) -> Result<Kernel> {
    let link = kernels_dir().join(name);
    if link.exists() {
        let root = std::fs::canonicalize(&link)
            .with_context(|| format!("resolving {}", link.display()))?;
        return prepare(name, &root);
    }
    let Some((_, meta)) = FETCHABLE.iter().find(|(n, _)| *n == name) else {
        bail!(
            "no kernel {name:?}: the fetchable ones are {} (or all); any other name must be an \
             unpacked linux-image package at {}",
            fetchable_names(),
            link.display()
        );
    };
    fetch(name, meta)
}

/// Check an unpacked kernel and finish what an older tool may have left lazy (the prototype
/// script ran depmod and extracted vmlinux on first use). Each step is atomic by itself.
fn prepare(name: &str, root: &Path) -> Result<Kernel> {
    link_usr_lib(root)?;
    let release = release_of(root)?;
    let modules = root.join("lib/modules").join(&release);
    if !modules.join(DEPMOD_LAST).is_file() {
        depmod(root, &release)?;
    }
    let vmlinux = root.join("boot").join(format!("vmlinux-{release}"));
    if !vmlinux.is_file() {
        extract_vmlinux(
            &root.join("boot").join(format!("vmlinuz-{release}")),
            &vmlinux,
        )?;
    }
    Ok(Kernel {
        name: name.to_owned(),
        root: root.to_owned(),
        release,
        vmlinux,
    })
}

fn fetch(name: &str, meta: &str) -> Result<Kernel> {
    let dir = kernels_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let package = resolve(meta)?;
    let release = package
        .strip_prefix("linux-image-")
        .with_context(|| format!("{meta} depends on {package}, not a linux-image-* package"))?
        .to_owned();
    let root = dir.join(&release);
    if !root.exists() {
        remove_stale_fetches(&dir);
        println!("kernel {name}: fetching {package}");
        let tmp = TempDir(dir.join(format!(".fetch-{release}-{}", std::process::id())));
        std::fs::create_dir(&tmp.0).with_context(|| format!("creating {}", tmp.0.display()))?;
        unpack(&package, &release, &tmp.0)?;
        std::fs::rename(tmp.0.join("root"), &root)
            .with_context(|| format!("renaming the unpacked kernel to {}", root.display()))?;
    }
    // Replace the symlink atomically too: a reader sees the old target or the new one.
    let tmp_link = dir.join(format!(".{name}.link-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp_link);
    std::os::unix::fs::symlink(&release, &tmp_link)
        .with_context(|| format!("creating {}", tmp_link.display()))?;
    std::fs::rename(&tmp_link, dir.join(name))
        .with_context(|| format!("linking {} to {release}", dir.join(name).display()))?;
    prepare(name, &root)
}

/// Download, unpack, index and extract into `tmp/root`; the .deb is deleted once unpacked.
fn unpack(package: &str, release: &str, tmp: &Path) -> Result<()> {
    let mut download = Cmd::new("apt-get");
    if cmd::is_root() {
        // Otherwise apt warns that the root-owned directory is not writable by its sandbox user.
        download = download.args(["-o", "APT::Sandbox::User=root"]);
    }
    download
        .args(["download", package])
        .current_dir(tmp)
        .hint("check network access; `apt-cache policy PACKAGE` shows where apt would get it")
        .run()
        .context("downloading the kernel package")?;
    let deb = std::fs::read_dir(tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", tmp.display()))?;
    let root = tmp.join("root");
    Cmd::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&root)
        .hint("the download may be truncated; rerun to fetch it again")
        .run()?;
    std::fs::remove_file(&deb).with_context(|| format!("deleting {}", deb.display()))?;
    link_usr_lib(&root)?;
    let found = release_of(&root)?;
    if found != release {
        bail!("{package} holds modules for {found}, expected {release}");
    }
    depmod(&root, release)?;
    let boot = root.join("boot");
    extract_vmlinux(
        &boot.join(format!("vmlinuz-{release}")),
        &boot.join(format!("vmlinux-{release}")),
    )
}

/// The versioned image package a meta package points at today.
fn resolve(meta: &str) -> Result<String> {
    let depends = || Cmd::new("apt-cache").args(["depends", meta]).read();
    if let Some(package) = depends().ok().as_deref().and_then(image_dependency) {
        return Ok(package);
    }
    // A fresh machine's package lists may not have the package yet.
    if !cmd::is_root() {
        bail!(
            "apt does not know {meta}\n  fix: run `apt-get update` as root, then rerun (or rerun as root)"
        );
    }
    packages::apt_update()?;
    let out = depends()?;
    image_dependency(&out).with_context(|| {
        format!("`apt-cache depends {meta}` names no linux-image-* package:\n{out}")
    })
}

/// `  Depends: linux-image-6.1.0-57-amd64` from `apt-cache depends`.
fn image_dependency(out: &str) -> Option<String> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-"))
        .map(str::to_owned)
}

/// Packages from trixie on keep their modules in usr/lib/modules; kmod's `-d ROOT` and the
/// guest's module link look in ROOT/lib/modules.
fn link_usr_lib(root: &Path) -> Result<()> {
    let lib = root.join("lib");
    if root.join("usr/lib/modules").is_dir() && lib.symlink_metadata().is_err() {
        std::os::unix::fs::symlink("usr/lib", &lib)
            .with_context(|| format!("creating {}", lib.display()))?;
    }
    Ok(())
}

/// The one directory under lib/modules.
fn release_of(root: &Path) -> Result<String> {
    let modules = root.join("lib/modules");
    let mut releases: Vec<String> = std::fs::read_dir(&modules)
        .with_context(|| {
            format!(
                "no unpacked kernel at {}: {} is missing",
                root.display(),
                modules.display()
            )
        })?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    match releases.len() {
        1 => Ok(releases.remove(0)),
        0 => bail!("{} is empty", modules.display()),
        _ => bail!(
            "{} holds several releases: {}",
            modules.display(),
            releases.join(" ")
        ),
    }
}

/// The package ships no modules.dep; the guest's modprobe and the initramfs need it.
fn depmod(root: &Path, release: &str) -> Result<()> {
    Cmd::new("depmod")
        .arg("-b")
        .arg(root)
        .arg(release)
        .hint("depmod comes with kmod: `apt-get install kmod`")
        .run()
        .context("indexing the kernel's modules")
}

/// Deletes the directory when dropped, so a failed fetch cleans up after itself.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `.fetch-<release>-<pid>` directories whose process is gone: a fetch killed before its
/// guard ran. Another live fetch's directory is left alone.
fn remove_stale_fetches(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(".fetch-")
            .and_then(|rest| rest.rsplit('-').next())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            println!("kernels: deleting {name}, left by an interrupted fetch");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];

/// The bzImage decompresses itself in the guest, which takes 3-7 s under TCG; qemu boots the
/// ELF inside it through its PVH note instead. The payload is the first xz or zstd stream that
/// decompresses to a complete ELF. The decompressors fail on the bytes after the stream, so
/// their status means nothing; the ELF check is what decides.
fn extract_vmlinux(vmlinuz: &Path, vmlinux: &Path) -> Result<()> {
    let image = std::fs::read(vmlinuz).with_context(|| format!("reading {}", vmlinuz.display()))?;
    let mut streams: Vec<(usize, &str)> = Vec::new();
    for (magic, tool) in [(XZ_MAGIC, "xz"), (ZSTD_MAGIC, "zstd")] {
        streams.extend(
            image
                .windows(magic.len())
                .enumerate()
                .filter(|(_, w)| *w == magic)
                .map(|(at, _)| (at, tool))
                .take(4),
        );
    }
    streams.sort();
    for (at, tool) in streams {
        let elf = decompress(tool, &image[at..])?;
        if complete_elf(&elf) {
            let tmp = vmlinux.with_extension("tmp");
            std::fs::write(&tmp, &elf).with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, vmlinux)
                .with_context(|| format!("renaming to {}", vmlinux.display()))?;
            println!(
                "vmlinux: {} ({} MB, {tool} at {at})",
                vmlinux.display(),
                elf.len() >> 20
            );
            return Ok(());
        }
    }
    bail!(
        "no xz or zstd stream in {} decompresses to a complete ELF vmlinux",
        vmlinuz.display()
    )
}

/// `xz -dc` or `zstd -qdc` of `input`, whatever its exit status.
fn decompress(tool: &str, input: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new(tool)
        .args(if tool == "xz" {
            ["-dc", "-q"]
        } else {
            ["-qdc", "-"]
        })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {tool}; it comes with the xz-utils/zstd packages"))?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let out = std::thread::scope(|s| {
        // The decompressor stops reading at the end of its stream: a broken pipe is expected.
        s.spawn(move || {
            let _ = stdin.write_all(input);
        });
        child.wait_with_output()
    })
    .with_context(|| format!("running {tool}"))?;
    Ok(out.stdout)
}

/// A 64-bit little-endian ELF whose program and section headers, and every segment they
/// describe, lie inside the file: a truncated decompression fails this.
pub(super) fn complete_elf(b: &[u8]) -> bool {
    let u16_at = |o: usize| {
        b.get(o..o + 2)
            .map(|s| u16::from_le_bytes([s[0], s[1]]) as u64)
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
    };
    if !b.starts_with(b"\x7fELF\x02\x01") {
        return false;
    }
    let len = b.len() as u64;
    let (Some(phoff), Some(shoff), Some(phent), Some(phnum), Some(shent), Some(shnum)) = (
        u64_at(0x20),
        u64_at(0x28),
        u16_at(0x36),
        u16_at(0x38),
        u16_at(0x3a),
        u16_at(0x3c),
    ) else {
        return false;
    };
    let within = |off: u64, size: u64| off.checked_add(size).is_some_and(|end| end <= len);
    if phnum == 0 || !within(phoff, phent * phnum) || !within(shoff, shent * shnum) {
        return false;
    }
    (0..phnum).all(|i| {
        let ph = (phoff + i * phent) as usize;
        matches!((u64_at(ph + 8), u64_at(ph + 32)), (Some(off), Some(size)) if within(off, size))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_image_dependency() {
        let out = "linux-image-amd64\n  Depends: linux-image-6.1.0-57-amd64\n";
        assert_eq!(
            image_dependency(out).as_deref(),
            Some("linux-image-6.1.0-57-amd64")
        );
        assert_eq!(image_dependency("linux-image-amd64\n"), None);
    }

    #[test]
    fn expands_kernel_lists() {
        assert_eq!(parse_list("all").unwrap(), ["6.1", "6.12"]);
        assert_eq!(parse_list("6.12, 6.1,6.12").unwrap(), ["6.12", "6.1"]);
        assert!(parse_list(" , ").is_err());
    }

    #[test]
    fn rejects_truncated_elf() {
        let mut elf = vec![0u8; 0x40 + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes()); // phoff
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes()); // phentsize
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes()); // phnum
        elf[0x40 + 32..0x40 + 40].copy_from_slice(&16u64.to_le_bytes()); // p_filesz
        assert!(complete_elf(&elf));
        elf[0x40 + 8..0x40 + 16].copy_from_slice(&1000u64.to_le_bytes()); // p_offset past the end
        assert!(!complete_elf(&elf));
        assert!(!complete_elf(b"\x7fELF"));
    }
}
