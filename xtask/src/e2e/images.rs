//! Images without a registry: a hand-written OCI image layout, packed as a tar archive, which
//! `ctr images import` takes under the name in its `io.containerd.image.name` annotation.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::cmd::Cmd;

/// The sandbox image, named as containerd's `pinned_images.sandbox` and pods name it.
pub fn pause_image() -> String {
    format!(
        "localhost/sidestep/pause:{}",
        super::components::PAUSE_VERSION
    )
}

/// An OCI archive of a one-layer image holding `binary` as `/<entry>`, run as `user`.
pub fn single_binary_archive(
    work: &Path,
    name: &str,
    binary: &Path,
    entry: &str,
    user: &str,
) -> Result<PathBuf> {
    let layout = work.join(format!("{}.oci", entry));
    let rootfs = work.join(format!("{}.rootfs", entry));
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs)?;
    fs::create_dir_all(&rootfs)?;
    fs::copy(binary, rootfs.join(entry))
        .with_context(|| format!("copying {}", binary.display()))?;

    // Uncompressed and reproducible: sorted, owned by root, dated at the epoch.
    let layer = work.join(format!("{entry}.layer.tar"));
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
        .arg(entry)
        .read()?;
    let layer_blob = add_blob(&blobs, &fs::read(&layer)?)?;
    fs::remove_file(&layer)?;
    fs::remove_dir_all(&rootfs)?;

    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [format!("/{entry}")], "User": user},
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
    let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
    manifest_descriptor["annotations"] = serde_json::json!({
        "io.containerd.image.name": name,
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

    let archive = work.join(format!("{entry}.oci.tar"));
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
