//! Images without a registry: a hand-written OCI image layout, packed as a tar archive, which
//! `ctr images import` takes under the name in its `io.containerd.image.name` annotation.
//!
//! Each image is one layer assembled here from files of this machine: the project's binaries
//! (stripped) and Debian's (with the shared libraries `ldd` names), so nothing is pulled.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::cmd::Cmd;

/// The sandbox image, named as containerd's `pinned_images.sandbox` and pods name it.
pub fn pause_image() -> String {
    format!(
        "localhost/sidestep/pause:{}",
        super::components::PAUSE_VERSION
    )
}

/// One image: files copied from this machine, plus its runtime config.
pub struct ImageSpec {
    /// `localhost/...:tag`, as pods and the kustomize overlay name it.
    pub name: String,
    /// (file on this machine, absolute path in the image). ELF files are stripped, and a
    /// dynamic one brings the libraries `ldd` lists, at the same paths.
    pub files: Vec<(PathBuf, String)>,
    /// (link in the image, target), e.g. busybox applets.
    pub symlinks: Vec<(String, String)>,
    /// Empty directories the runtime or the program writes into.
    pub dirs: Vec<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `uid:gid`; pods may override it with their securityContext.
    pub user: String,
}

/// An OCI archive of `spec`, written under `work`; returns its path.
pub fn archive(work: &Path, spec: &ImageSpec) -> Result<PathBuf> {
    let stem = spec
        .name
        .rsplit('/')
        .next()
        .unwrap_or(&spec.name)
        .replace(':', "-");
    let layout = work.join(format!("{stem}.oci"));
    let rootfs = work.join(format!("{stem}.rootfs"));
    let blobs = layout.join("blobs/sha256");
    for d in [&layout, &rootfs] {
        if d.exists() {
            fs::remove_dir_all(d)?;
        }
    }
    fs::create_dir_all(&blobs)?;
    fs::create_dir_all(&rootfs)?;
    assemble_rootfs(&rootfs, spec).with_context(|| format!("assembling image {}", spec.name))?;

    // Uncompressed and reproducible: sorted, owned by root, dated at the epoch.
    let layer = work.join(format!("{stem}.layer.tar"));
    Cmd::new("tar")
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=@0",
        ])
        .arg("-cf")
        .arg(&layer)
        .arg("-C")
        .arg(&rootfs)
        .args(top_level_entries(&rootfs)?)
        .read()?;
    let layer_blob = add_blob(&blobs, &fs::read(&layer)?)?;
    fs::remove_file(&layer)?;
    fs::remove_dir_all(&rootfs)?;

    let mut runtime = serde_json::json!({"Entrypoint": spec.entrypoint, "User": spec.user});
    if !spec.cmd.is_empty() {
        runtime["Cmd"] = serde_json::json!(spec.cmd);
    }
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": [layer_blob.digest]},
    });
    let config_blob = add_blob(&blobs, config.to_string().as_bytes())?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_blob.descriptor("application/vnd.oci.image.config.v1+json"),
        "layers": [layer_blob.descriptor("application/vnd.oci.image.layer.v1.tar")],
    });
    let manifest_blob = add_blob(&blobs, manifest.to_string().as_bytes())?;
    let mut manifest_descriptor =
        manifest_blob.descriptor("application/vnd.oci.image.manifest.v1+json");
    let tag = spec.name.rsplit_once(':').map_or("latest", |(_, t)| t);
    manifest_descriptor["annotations"] = serde_json::json!({
        "io.containerd.image.name": spec.name,
        "org.opencontainers.image.ref.name": tag,
    });
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [manifest_descriptor],
    });
    fs::write(layout.join("index.json"), index.to_string())?;
    fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;

    let archive = work.join(format!("{stem}.oci.tar"));
    Cmd::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(&layout)
        .args(["oci-layout", "index.json", "blobs"])
        .read()?;
    fs::remove_dir_all(&layout)?;
    Ok(archive)
}

fn assemble_rootfs(rootfs: &Path, spec: &ImageSpec) -> Result<()> {
    // runc mounts over these; /tmp is where programs expect to write.
    for d in ["proc", "sys", "dev", "etc", "tmp"]
        .into_iter()
        .chain(spec.dirs.iter().map(|d| d.trim_start_matches('/')))
    {
        fs::create_dir_all(rootfs.join(d))?;
    }
    // The runtime bind-mounts these files; with them absent it would create them.
    for f in ["etc/hosts", "etc/resolv.conf", "etc/hostname"] {
        fs::write(rootfs.join(f), "")?;
    }
    for (from, to) in &spec.files {
        let dest = in_image(rootfs, to);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent)?;
        }
        copy_stripped(from, &dest)?;
        for lib in shared_libraries(from)? {
            let dest = in_image(rootfs, &lib.display().to_string());
            if dest.exists() {
                continue;
            }
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent)?;
            }
            fs::copy(&lib, &dest).with_context(|| format!("copying {}", lib.display()))?;
        }
    }
    for (link, target) in &spec.symlinks {
        let at = in_image(rootfs, link);
        if let Some(parent) = at.parent() {
            fs::create_dir_all(parent)?;
        }
        std::os::unix::fs::symlink(target, &at)
            .with_context(|| format!("linking {link} -> {target}"))?;
    }
    Ok(())
}

fn in_image(rootfs: &Path, path: &str) -> PathBuf {
    rootfs.join(path.trim_start_matches('/'))
}

fn top_level_entries(rootfs: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(rootfs)? {
        names.push(entry?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// The debug build of the agent is about 240 MB, nearly all of it DWARF; stripped it is a
/// tenth of that, and the import is as much faster.
fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    if !from.is_file() {
        bail!("{} does not exist (build it first)", from.display());
    }
    Cmd::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(to)
        .arg(from)
        .read()
        .with_context(|| format!("strip {}", from.display()))?;
    Ok(())
}

/// The absolute library paths `ldd` gives for `binary`; none for a static one.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = std::process::Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    // A static binary: ldd exits non-zero with "not a dynamic executable".
    if !out.status.success() {
        return Ok(Vec::new());
    }
    Ok(ldd_paths(&String::from_utf8_lossy(&out.stdout)))
}

/// The absolute paths in `ldd` output (`lib => /path (addr)` and the bare loader line).
fn ldd_paths(out: &str) -> Vec<PathBuf> {
    out.lines()
        .filter_map(|l| {
            let path = match l.trim().split_once("=>") {
                Some((_, rhs)) => rhs.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

struct Blob {
    digest: String,
    size: usize,
}

impl Blob {
    fn descriptor(&self, media_type: &str) -> serde_json::Value {
        serde_json::json!({"mediaType": media_type, "digest": self.digest, "size": self.size})
    }
}

/// Store `bytes` under their sha256 (computed by coreutils' sha256sum: xtask has no hash crate).
fn add_blob(blobs: &Path, bytes: &[u8]) -> Result<Blob> {
    let staging = blobs.join("incoming");
    fs::write(&staging, bytes)?;
    let sum = Cmd::new("sha256sum").arg(&staging).read()?;
    let hex = sum
        .split_whitespace()
        .next()
        .context("sha256sum printed nothing")?
        .to_owned();
    fs::rename(&staging, blobs.join(&hex))?;
    Ok(Blob {
        digest: format!("sha256:{hex}"),
        size: bytes.len(),
    })
}

/// `ctr -n k8s.io images import`, into the CRI's namespace so kubelet sees the image.
pub fn import(ctr: &Path, socket: &Path, archive: &Path) -> Result<()> {
    Cmd::new(ctr)
        .arg("--address")
        .arg(socket)
        .args(["-n", "k8s.io", "images", "import", "--platform", "linux/amd64"])
        .arg(archive)
        .hint("see ctr's error above; the archive is an OCI layout written by xtask/src/e2e/images.rs")
        .read()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_library_paths() {
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
