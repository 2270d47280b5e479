//! bpf-linker, built against the nightly toolchain's own libLLVM.
//!
//! bpf-linker needs LLVM 21 or later and Debian ships at most 19, but every
//! nightly carries a shared libLLVM in its sysroot. Linking against that one
//! also guarantees the linker reads the bitcode rustc emits: both sides then
//! use the same LLVM.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::cmd::Cmd;
use crate::paths;

pub fn ensure() -> Result<()> {
    let bin = paths::bpf_linker();
    match probe(&bin) {
        Probe::Works => {
            println!("bpf-linker: ok");
            return Ok(());
        }
        Probe::Missing => {
            println!("bpf-linker: installing");
            install(false)?;
        }
        Probe::Broken => {
            // Usually only the libLLVM link is stale or absent (a tools dir
            // copied from elsewhere, or a nightly with the same LLVM
            // reinstalled); relinking is instant, rebuilding takes a minute.
            link_libllvm()?;
            if probe(&bin) == Probe::Works {
                println!("bpf-linker: ok (relinked libLLVM)");
                return Ok(());
            }
            println!("bpf-linker: installing (the existing binary does not run)");
            install(true)?;
        }
    }
    if probe(&bin) != Probe::Works {
        bail!(
            "{} was installed but `bpf-linker --version` fails\n  fix: remove {} and rerun `cargo xtask setup`",
            bin.display(),
            paths::tools_dir().display()
        );
    }
    Ok(())
}

#[derive(PartialEq)]
enum Probe {
    Works,
    Missing,
    Broken,
}

/// Running it, not just finding the file, catches a dangling libLLVM rpath.
fn probe(bin: &Path) -> Probe {
    if !bin.is_file() {
        return Probe::Missing;
    }
    let ran = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match ran {
        Ok(status) if status.success() => Probe::Works,
        _ => Probe::Broken,
    }
}

/// The prefix bpf-linker is built against: `<tools>/llvm/lib` holding links
/// to nightly's libLLVM. Returns nightly's LLVM major version and the prefix.
fn link_libllvm() -> Result<(u32, u32, PathBuf)> {
    let (major, minor) = llvm_version()?;
    let sysroot = Cmd::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .clean_toolchain_env()
        .read()?;
    let libdir = Path::new(sysroot.trim()).join("lib");
    let libllvm = find_libllvm(&libdir, major, minor)?;

    let prefix = paths::tools_dir().join("llvm");
    let prefix_lib = prefix.join("lib");
    std::fs::create_dir_all(&prefix_lib)
        .with_context(|| format!("creating {}", prefix_lib.display()))?;
    // llvm-sys links against `<LLVM_PREFIX>/lib/libLLVM.so`. The binary then
    // needs the library's versioned soname at run time and searches its
    // RUNPATH, which is this same dir, not the sysroot; so link both names.
    // Outside `cargo +nightly` nothing else puts the sysroot on the search
    // path.
    let soname = libllvm.file_name().expect("library has a file name");
    for name in [std::ffi::OsStr::new("libLLVM.so"), soname] {
        let link = prefix_lib.join(name);
        // Replace rather than trust an old link: it may point into a removed nightly.
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {} -> {}", link.display(), libllvm.display()))?;
    }
    Ok((major, minor, prefix))
}

fn install(force: bool) -> Result<()> {
    let (major, minor, prefix) = link_libllvm()?;
    let mut cmd = Cmd::cargo()
        .env("LLVM_PREFIX", &prefix)
        .arg("install")
        .arg("bpf-linker")
        .arg("--root")
        .arg(paths::tools_dir())
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{major}"));
    if force {
        cmd = cmd.arg("--force");
    }
    cmd.hint(format!(
        "bpf-linker must offer an `llvm-{major}` feature matching nightly's LLVM {major}.{minor}; \
         check network access and `cargo search bpf-linker`, then rerun `cargo xtask setup`"
    ))
    .run()
    .context("building bpf-linker")
}

/// Nightly's LLVM, from `rustc +nightly -vV` ("LLVM version: 22.1.4").
fn llvm_version() -> Result<(u32, u32)> {
    let out = Cmd::new("rustc")
        .args(["+nightly", "-vV"])
        .clean_toolchain_env()
        .hint("install nightly: `rustup toolchain install nightly --profile minimal`")
        .read()?;
    parse_llvm_version(&out).with_context(|| {
        format!("no `LLVM version: X.Y` line in `rustc +nightly -vV` output:\n{out}")
    })
}

fn parse_llvm_version(vv: &str) -> Option<(u32, u32)> {
    let version = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version:"))?
        .trim();
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Newer toolchains name it `libLLVM.so.22.1-rust-…`, older ones
/// `libLLVM-22-rust-….so`; the first is the real file, so prefer it.
fn find_libllvm(libdir: &Path, major: u32, minor: u32) -> Result<PathBuf> {
    let names: Vec<String> = std::fs::read_dir(libdir)
        .with_context(|| format!("listing {}", libdir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let versioned = format!("libLLVM.so.{major}.{minor}-rust-");
    let legacy = format!("libLLVM-{major}-rust-");
    let found = names
        .iter()
        .find(|n| n.starts_with(&versioned))
        .or_else(|| {
            names
                .iter()
                .find(|n| n.starts_with(&legacy) && n.ends_with(".so"))
        });
    match found {
        Some(name) => Ok(libdir.join(name)),
        None => bail!(
            "no {versioned}* or {legacy}*.so in {}\n  fix: reinstall nightly with \
             `rustup toolchain install nightly --force`; it ships libLLVM in its lib dir",
            libdir.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_llvm_version;

    #[test]
    fn parses_rustc_vv() {
        let vv = "rustc 1.97.0-nightly\nhost: x86_64-unknown-linux-gnu\nLLVM version: 22.1.4\n";
        assert_eq!(parse_llvm_version(vv), Some((22, 1)));
        assert_eq!(parse_llvm_version("rustc 1.0\n"), None);
    }
}
