//! Where things live. Everything is derived from the xtask manifest so the
//! tasks work from any current directory.

use std::path::{Path, PathBuf};

/// The workspace root: xtask sits one level below it.
pub fn workspace() -> PathBuf {
    // Baked in at compile time, so it is right even if a child cargo's
    // environment lacks CARGO_MANIFEST_DIR.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_owned()
}

/// Honour a user's CARGO_TARGET_DIR for the workspace build, because the
/// binaries and the BPF object must sit where cargo puts them.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => absolute(dir),
        _ => workspace().join("target"),
    }
}

/// Project-local tools (bpf-linker). SIDESTEP_TOOLS_DIR redirects it so the
/// install path can be exercised without deleting the real one.
pub fn tools_dir() -> PathBuf {
    match std::env::var_os("SIDESTEP_TOOLS_DIR") {
        Some(dir) if !dir.is_empty() => absolute(dir),
        _ => workspace().join(".tools"),
    }
}

/// Relative overrides mean "from where the user ran cargo", as cargo's own
/// CARGO_TARGET_DIR does.
fn absolute(dir: std::ffi::OsString) -> PathBuf {
    std::path::absolute(&dir).unwrap_or_else(|_| dir.into())
}

pub fn tools_bin() -> PathBuf {
    tools_dir().join("bin")
}

pub fn bpf_linker() -> PathBuf {
    tools_bin().join("bpf-linker")
}

/// The BPF crate is outside the workspace: it needs nightly and build-std.
pub fn ebpf_crate() -> PathBuf {
    workspace().join("ebpf/sidestep-ebpf")
}

/// The stable path userspace embeds via SIDESTEP_BPF_OBJECT.
pub fn bpf_object() -> PathBuf {
    target_dir().join("bpf/sidestep.bpf.o")
}

/// Where `cargo build` puts the workspace binaries for a profile.
pub fn bin_dir(release: bool) -> PathBuf {
    target_dir().join(if release { "release" } else { "debug" })
}
