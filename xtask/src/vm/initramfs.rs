//! The per-run initramfs: static busybox, the modules that mount the host's root over 9p, the
//! two init stages, and the command with its environment. The command travels in the archive,
//! not on the kernel command line, which is limited to 2 KB and would need its own quoting.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use super::kernel::Kernel;
use crate::cmd::{self, Cmd};

/// Stage 1, PID 1 in the initramfs: loads the 9p stack, mounts the host's `/` read-only under
/// a tmpfs overlay and switches into it.
const INIT: &str = include_str!("init.sh");
/// Stage 2, PID 1 on the overlay: the mounts a node has, then the command.
const STAGE2: &str = include_str!("stage2.sh");

/// What stage 1 loads before it can mount the root, dependencies first. Later modules autoload
/// through the host's modprobe, reading the package's modules through /lib/modules.
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// busybox-static: the initramfs has no libraries.
const BUSYBOX: &str = "/bin/busybox";

/// The archive for `kernel`, running `cmd` (a POSIX sh script) with `env` (sh assignments).
pub fn build(kernel: &Kernel, cmd: &str, env: &str) -> Result<Vec<u8>> {
    let busybox = std::fs::read(BUSYBOX).with_context(|| {
        format!("reading {BUSYBOX}; it comes with busybox-static: `apt-get install busybox-static`")
    })?;
    let modules = boot_modules(kernel)?;
    let preload = std::env::var("SIDESTEP_VM_MODULES").unwrap_or_default();
    let preload = preload.split_whitespace().collect::<Vec<_>>().join(" ");
    let conf = format!(
        "KVER={} KROOT={} RUN_MODS={}\n",
        cmd::quote(&kernel.release),
        cmd::quote(&kernel.root.to_string_lossy()),
        cmd::quote(&preload),
    );

    let mut cpio = Cpio::default();
    for dir in [
        "bin", "dev", "proc", "sys", "lower", "upper", "newroot", "mods",
    ] {
        cpio.dir(dir);
    }
    cpio.file("bin/busybox", 0o755, &busybox);
    // Debian kernels do not mount devtmpfs by themselves: without this node init has no stdio.
    cpio.char_dev("dev/console", 0o600, 5, 1);
    let mut order = String::new();
    for (name, bytes) in &modules {
        cpio.file(&format!("mods/{name}"), 0o644, bytes);
        order.push_str(name);
        order.push('\n');
    }
    cpio.file("mods/order", 0o644, order.as_bytes());
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("stage2", 0o644, STAGE2.as_bytes());
    cpio.file("cmd", 0o644, cmd.as_bytes());
    cpio.file("env", 0o644, env.as_bytes());
    cpio.file("conf", 0o644, conf.as_bytes());
    Ok(cpio.finish())
}

/// The boot modules with their dependencies, in load order, decompressed: busybox's insmod
/// reads neither xz nor zstd. One modprobe per module: it takes further names as parameters.
fn boot_modules(kernel: &Kernel) -> Result<Vec<(String, Vec<u8>)>> {
    let mut modules: Vec<(String, Vec<u8>)> = Vec::new();
    for module in BOOT_MODULES {
        let out = Cmd::new("modprobe")
            .arg("-d")
            .arg(&kernel.root)
            .args(["-S", &kernel.release, "--show-depends", module])
            .hint("modprobe comes with kmod; a missing modules.dep means depmod never ran")
            .read()?;
        // "insmod PATH [params]" per module to load, "builtin NAME" for built-in ones.
        for path in out.lines().filter_map(|l| l.strip_prefix("insmod ")) {
            let path = Path::new(path.split_whitespace().next().unwrap_or_default());
            let file = path.file_name().unwrap_or_default().to_string_lossy();
            let (name, tool) = match file.rsplit_once('.') {
                Some((name, "xz")) => (name.to_owned(), Some("xz")),
                Some((name, "zst")) => (name.to_owned(), Some("zstd")),
                _ => (file.clone().into_owned(), None),
            };
            // Shared dependencies appear once per module that needs them.
            if modules.iter().any(|(have, _)| *have == name) {
                continue;
            }
            let bytes = match tool {
                Some(tool) => decompress(tool, path)?,
                None => {
                    std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
                }
            };
            modules.push((name, bytes));
        }
    }
    Ok(modules)
}

fn decompress(tool: &str, path: &Path) -> Result<Vec<u8>> {
    let out = Command::new(tool)
        .arg("-dcq")
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {tool}; it comes with the xz-utils/zstd packages"))?;
    if !out.status.success() {
        bail!(
            "`{tool} -dcq {}` failed ({}): {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// `cd DIR || exit 126`, then `exec` the argv, quoted for POSIX sh.
pub fn exec_script(dir: &Path, argv: &[String]) -> String {
    let mut script = format!(
        "cd {} || exit 126\nexec",
        cmd::quote(&dir.to_string_lossy())
    );
    for arg in argv {
        script.push(' ');
        script.push_str(&cmd::quote(arg));
    }
    script.push('\n');
    script
}

/// The command's environment as sh assignments: a root shell's basics, the caller's RUST_*,
/// SIDESTEP_* and CARGO_* variables (minus those cargo set for xtask itself), then `extra`.
pub fn environment(extra: &[(&str, String)]) -> String {
    let host_path = std::env::var("PATH").unwrap_or_default();
    let mut vars: Vec<(String, String)> = vec![
        (
            "PATH".into(),
            format!("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{host_path}"),
        ),
        ("HOME".into(), "/root".into()),
        ("TERM".into(), "dumb".into()),
        ("LANG".into(), "C.UTF-8".into()),
        ("USER".into(), "root".into()),
    ];
    let mut forwarded: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| {
            ["RUST_", "SIDESTEP_", "CARGO_"]
                .iter()
                .any(|p| k.starts_with(p))
                && !cmd::is_leaked_var(k)
        })
        .collect();
    forwarded.sort();
    vars.extend(forwarded);
    vars.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let mut env = String::new();
    for (key, value) in vars {
        let name_ok = key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !key.starts_with(|c: char| c.is_ascii_digit());
        if name_ok {
            env.push_str(&format!("{key}={}\n", cmd::quote(&value)));
        }
    }
    env
}

/// A newc ("070701") cpio archive, the format the kernel unpacks as an initramfs.
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, 2, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, 1, (0, 0), data);
    }

    fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, 0o020_000 | perm, 1, (major, minor), &[]);
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let size = u32::try_from(data.len()).expect("initramfs members are under 4 GiB");
        let namesize = u32::try_from(name.len() + 1).expect("short name");
        // ino mode uid gid nlink mtime filesize devmajor devminor rdevmajor rdevminor namesize check
        let fields = [
            self.ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, namesize, 0,
        ];
        self.buf.extend_from_slice(b"070701");
        for field in fields {
            self.buf
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    /// Headers plus names, and file data, each start on a 4-byte boundary.
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[]);
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_newc() {
        let mut cpio = Cpio::default();
        cpio.dir("bin");
        cpio.file("bin/x", 0o755, b"hello");
        cpio.char_dev("dev/console", 0o600, 5, 1);
        let buf = cpio.finish();
        assert!(buf.len().is_multiple_of(4));
        // The file: header (110 bytes) + "bin/x\0" padded to 116, then 5 bytes padded to 8.
        let file = &buf[116..];
        assert!(file.starts_with(b"070701"));
        assert_eq!(&file[14..22], b"000081ed"); // mode
        assert_eq!(&file[54..62], b"00000005"); // filesize
        assert_eq!(&file[94..102], b"00000006"); // namesize
        assert_eq!(&file[110..116], b"bin/x\0");
        assert_eq!(&file[116..121], b"hello");
        let console = &file[124..];
        assert_eq!(&console[14..22], b"00002180"); // char device, 0600
        assert_eq!(&console[78..94], b"0000000500000001"); // rdev 5:1
        assert!(buf.windows(10).any(|w| w == b"TRAILER!!!"));
    }

    #[test]
    fn quotes_the_command() {
        let script = exec_script(
            Path::new("/w s"),
            &["sh".into(), "-c".into(), "exit 3".into()],
        );
        assert_eq!(script, "cd '/w s' || exit 126\nexec sh -c 'exit 3'\n");
    }
}
