//! Booting one VM: pick the accelerator and the memory, run qemu, stream the guest console to
//! our stdout as it arrives, enforce the time limits and turn the result into an exit code.

use std::collections::VecDeque;
use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::kernel::Kernel;
use crate::cmd;

/// What the VM asks for; less when the host is short (see `memory_mib`).
const MEM_MIB: u64 = 2048;
/// Left to the host (and the builds running beside us) when memory is short.
const HOST_RESERVE_MIB: u64 = 1024;
const MIN_MEM_MIB: u64 = 512;
const CPUS: u32 = 2;
/// Console lines kept for the report when the guest dies without an exit status.
const TAIL: usize = 30;
/// Boot to the command takes 4-21 s under TCG (loaded host, all modules preloaded) and ~2 s
/// under KVM; past these the boot hangs, and the run is stopped rather than waiting out the
/// whole timeout (under KVM, retried with TCG).
const BOOT_LIMIT_TCG: Duration = Duration::from_secs(300);
const BOOT_LIMIT_KVM: Duration = Duration::from_secs(60);

/// Exit codes in the style of `timeout(1)`.
pub const CODE_TIMEOUT: i32 = 124;
pub const CODE_VM_FAILED: i32 = 125;

const STATUS_PREFIX: &str = "sidestep-vm: exit status ";
const COMMAND_STARTED: &str = "running the command";

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

pub struct Outcome {
    /// The command's exit status, or 124/125 (see the module's caller).
    pub code: i32,
    pub accel: Accel,
    pub wall: Duration,
    /// Console lines starting with `== `: what the test script reports per binary.
    pub markers: Vec<String>,
}

/// Boot `kernel` with `initrd` (a file) and wait for the command, at most `timeout`.
/// `scratch` is a private directory for the accelerator probe.
pub fn run(kernel: &Kernel, initrd: &Path, timeout: Duration, scratch: &Path) -> Result<Outcome> {
    let mem = memory_mib();
    let start = Instant::now();
    let (accel, why) = choose_accel(scratch);
    println!(
        "vm: kernel {} ({}), {accel} ({why}), {CPUS} CPUs, {mem} MiB, timeout {}",
        kernel.name,
        kernel.release,
        super::human(timeout)
    );
    let mut attempt = boot(kernel, initrd, accel, mem, timeout)?;
    if let Boot::NeverStarted(reason) = &attempt
        && accel == Accel::Kvm
    {
        println!("vm: kvm did not reach the command ({reason}); booting again with tcg");
        KVM_NEVER_STARTED.store(true, std::sync::atomic::Ordering::Relaxed);
        let left = timeout.saturating_sub(start.elapsed());
        attempt = boot(kernel, initrd, Accel::Tcg, mem, left)?;
    }
    let (code, accel, markers) = match attempt {
        Boot::Finished {
            code,
            accel,
            markers,
        } => (code, accel, markers),
        Boot::NeverStarted(reason) => {
            eprintln!("vm: the guest never started the command: {reason}");
            (CODE_VM_FAILED, Accel::Tcg, Vec::new())
        }
    };
    Ok(Outcome {
        code,
        accel,
        wall: start.elapsed(),
        markers,
    })
}

enum Boot {
    Finished {
        code: i32,
        accel: Accel,
        markers: Vec<String>,
    },
    /// qemu ended, or the boot limit passed, before the guest reached the command.
    NeverStarted(String),
}

/// `nice`'s arguments: qemu's command line as the prototype ran it, at a lower priority so
/// that builds beside it stay responsive.
fn qemu_args(kernel: &Kernel, initrd: &Path, accel: Accel, mem: u64) -> Vec<String> {
    let mut append =
        "console=ttyS0 panic=-1 rdinit=/init 8250.nr_uarts=1 mitigations=off sysrq_always_enabled"
            .to_owned();
    if std::env::var_os("SIDESTEP_VM_VERBOSE").is_none_or(|v| v.is_empty() || v == "0") {
        append.push_str(" quiet loglevel=4");
    }
    let accel_arg = match accel {
        Accel::Tcg => "tcg,thread=multi",
        Accel::Kvm => "kvm",
    };
    let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let mut args = words("-n 10 qemu-system-x86_64 -accel");
    args.push(accel_arg.to_owned());
    args.extend(words(&format!("-cpu max -smp {CPUS} -m {mem}M")));
    args.extend(words(
        "-nodefaults -no-user-config -display none -monitor none",
    ));
    // With panic=-1 a guest panic ends qemu instead of rebooting.
    args.extend(words(
        "-no-reboot -chardev stdio,id=con,signal=on -serial chardev:con",
    ));
    args.push("-kernel".into());
    args.push(kernel.vmlinux.to_string_lossy().into_owned());
    args.push("-initrd".into());
    args.push(initrd.to_string_lossy().into_owned());
    args.push("-append".into());
    args.push(append);
    // multidevs=remap: no inode collisions when / spans several host filesystems.
    args.extend(words(
        "-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
    ));
    args.extend(words("-device isa-debug-exit,iobase=0xf4,iosize=0x01"));
    args
}

fn boot(kernel: &Kernel, initrd: &Path, accel: Accel, mem: u64, timeout: Duration) -> Result<Boot> {
    let args = qemu_args(kernel, initrd, accel, mem);
    let shown: Vec<String> = args.iter().map(|a| cmd::quote(a)).collect();
    println!("==> nice {}", shown.join(" "));

    let mut command = Command::new("nice");
    command
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    die_with_parent(&mut command);
    let mut child = command
        .spawn()
        .context("starting qemu-system-x86_64 (from qemu-system-x86)")?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        loop {
            let mut line = Vec::new();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if tx.send(line).is_err() => break,
                Ok(_) => {}
            }
        }
    });

    let start = Instant::now();
    let deadline = start + timeout;
    let boot_deadline = start
        + match accel {
            Accel::Tcg => BOOT_LIMIT_TCG,
            Accel::Kvm => BOOT_LIMIT_KVM,
        };
    let mut console = Console::default();
    let stdout = std::io::stdout();
    loop {
        let limit = if console.started {
            deadline
        } else {
            deadline.min(boot_deadline)
        };
        match rx.recv_timeout(limit.saturating_duration_since(Instant::now())) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let line = text.trim_end_matches(['\n', '\r']);
                let mut out = stdout.lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
                console.note(line);
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                kill(&mut child);
                if !console.started && Instant::now() < deadline {
                    let why = format!(
                        "no command after {} s of boot",
                        (boot_deadline - start).as_secs()
                    );
                    console.report_tail(&why);
                    return Ok(Boot::NeverStarted(why));
                }
                console.report_tail(&format!("timeout after {}", super::human(timeout)));
                return Ok(Boot::Finished {
                    code: CODE_TIMEOUT,
                    accel,
                    markers: console.markers,
                });
            }
        }
    }
    let status = child.wait().context("waiting for qemu")?;
    if !console.started && console.status.is_none() {
        let why = format!("qemu ended ({status}) before the guest ran the command");
        console.report_tail(&why);
        return Ok(Boot::NeverStarted(why));
    }
    let code = exit_code(console.status, status, &console);
    Ok(Boot::Finished {
        code,
        accel,
        markers: console.markers,
    })
}

/// The console line first: it carries the exact status. isa-debug-exit alone maps odd qemu
/// statuses s >= 3 to (s-3)/2 (capped at 126); a poweroff, panic or qemu error gives no code.
/// A zero is never taken from the port alone: success needs the guest's own report.
fn exit_code(line: Option<i32>, status: ExitStatus, console: &Console) -> i32 {
    let port = status
        .code()
        .filter(|s| *s >= 3 && s % 2 == 1)
        .map(|s| (s - 3) / 2);
    match (line, port) {
        (Some(code), _) => code,
        (None, Some(code)) if code != 0 => {
            console.report_tail(&format!(
                "no exit status line on the console; isa-debug-exit says {code}"
            ));
            code
        }
        _ => {
            console.report_tail(&format!(
                "the VM ended without reporting an exit status (qemu: {status})"
            ));
            CODE_VM_FAILED
        }
    }
}

#[derive(Default)]
struct Console {
    started: bool,
    status: Option<i32>,
    markers: Vec<String>,
    tail: VecDeque<String>,
}

impl Console {
    fn note(&mut self, line: &str) {
        if line.starts_with("sidestep-vm: ") && line.contains(COMMAND_STARTED) {
            self.started = true;
        }
        if let Some(rest) = line.strip_prefix(STATUS_PREFIX) {
            self.status = rest.split_whitespace().next().and_then(|n| n.parse().ok());
        }
        if line.starts_with("== ") {
            self.markers.push(line.to_owned());
        }
        if self.tail.len() == TAIL {
            self.tail.pop_front();
        }
        self.tail.push_back(line.to_owned());
    }

    fn report_tail(&self, why: &str) {
        eprintln!("vm: {why}; the last {} console lines:", self.tail.len());
        for line in &self.tail {
            eprintln!("  | {line}");
        }
    }
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// qemu must not outlive us: if xtask is killed (a terminal's Ctrl-C reaches qemu itself, as
/// it shares our process group), the kernel sends it SIGKILL. `nice` execs qemu, which keeps
/// the setting.
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls prctl, which is
    // async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// 2 GiB, or what the host can spare with a reserve left: it was printed with the other VM
/// settings.
fn memory_mib() -> u64 {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib / 1024)
    });
    match available {
        Some(avail) if avail < MEM_MIB + HOST_RESERVE_MIB => {
            let mem = avail.saturating_sub(HOST_RESERVE_MIB).max(MIN_MEM_MIB);
            println!("vm: the host has only {avail} MiB available; giving the guest {mem} MiB");
            mem
        }
        _ => MEM_MIB,
    }
}

/// KVM when /dev/kvm opens and a tiny guest with the same `-cpu max` runs under it, else TCG.
/// Nested setups can open /dev/kvm and still fail (qemu aborting on an MSR, or a kernel that
/// never boots); the first is caught here, the second by the boot limit in `run`.
/// `SIDESTEP_VM_ACCEL=tcg` skips the probe.
/// Set once a KVM guest of this run never reached its command (a host whose /dev/kvm passes the
/// probe but cannot run a kernel): later VMs go straight to TCG instead of losing the boot limit
/// again.
static KVM_NEVER_STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn choose_accel(scratch: &Path) -> (Accel, String) {
    if std::env::var("SIDESTEP_VM_ACCEL").is_ok_and(|a| a == "tcg") {
        return (Accel::Tcg, "SIDESTEP_VM_ACCEL=tcg".into());
    }
    if KVM_NEVER_STARTED.load(std::sync::atomic::Ordering::Relaxed) {
        return (
            Accel::Tcg,
            "a kvm guest of this run never reached its command".into(),
        );
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return (Accel::Tcg, format!("/dev/kvm: {e}"));
    }
    match kvm_probe(scratch) {
        Ok(()) => (Accel::Kvm, "/dev/kvm works".into()),
        Err(e) => (Accel::Tcg, format!("/dev/kvm opens but {e}")),
    }
}

/// Runs a 64 KiB firmware whose reset vector writes 1 to isa-debug-exit (qemu then exits 3).
fn kvm_probe(scratch: &Path) -> Result<(), String> {
    let mut firmware = vec![0xf4u8; 0x10000]; // hlt
    // At the reset vector (the last 16 bytes): mov al, 1; out 0xf4, al; hlt
    firmware[0xfff0..0xfff5].copy_from_slice(&[0xb0, 0x01, 0xe6, 0xf4, 0xf4]);
    let path = scratch.join("kvm-probe.bin");
    std::fs::write(&path, &firmware).map_err(|e| format!("writing the probe: {e}"))?;
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args([
            "-accel",
            "kvm",
            "-cpu",
            "max",
            "-m",
            "16",
            "-nodefaults",
            "-no-user-config",
        ])
        .args([
            "-display", "none", "-monitor", "none", "-serial", "none", "-bios",
        ])
        .arg(&path)
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x01"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    die_with_parent(&mut command);
    let mut child = command
        .spawn()
        .map_err(|e| format!("qemu did not start: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.code() == Some(3) => return Ok(()),
            Ok(Some(status)) => return Err(format!("a probe guest failed under it ({status})")),
            Ok(None) if Instant::now() > deadline => {
                kill(&mut child);
                return Err("a probe guest hung under it".into());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for the probe: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn status(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    #[test]
    fn maps_exit_codes() {
        let console = Console::default();
        assert_eq!(exit_code(Some(3), status(9), &console), 3);
        assert_eq!(exit_code(Some(200), status(255), &console), 200);
        assert_eq!(exit_code(None, status(9), &console), 3);
        // A zero needs the console line; poweroff, panic and qemu errors have no code.
        assert_eq!(exit_code(None, status(3), &console), CODE_VM_FAILED);
        assert_eq!(exit_code(None, status(0), &console), CODE_VM_FAILED);
        assert_eq!(exit_code(None, status(1), &console), CODE_VM_FAILED);
        assert_eq!(
            exit_code(None, ExitStatus::from_raw(6), &console),
            CODE_VM_FAILED
        );
    }

    #[test]
    fn reads_the_console() {
        let mut console = Console::default();
        console.note("sidestep-vm: 4.1s since boot, running the command");
        console.note("== outbound on 6.1: ok (52 s)");
        console.note("sidestep-vm: exit status 101 (after 60.2s)");
        assert!(console.started);
        assert_eq!(console.status, Some(101));
        assert_eq!(console.markers, ["== outbound on 6.1: ok (52 s)"]);
    }
}
