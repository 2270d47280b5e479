//! `cargo xtask`: the one entry point for setting up, building, testing and
//! demonstrating sidestep, so CI and a fresh machine take the same path.

mod archdoc;
mod build;
mod cmd;
mod e2e;
mod fuzz;
mod linker;
mod modgraph;
mod packages;
mod paths;
mod setup;
mod tasks;
mod vm;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(bin_name = "cargo xtask", about = "Build, test and demo sidestep")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need; fast when all is present.
    Setup {
        /// Also install clippy and rustfmt on stable.
        #[arg(long)]
        dev: bool,
    },
    /// Build the BPF programs into target/bpf/sidestep.bpf.o.
    BuildEbpf {
        /// Use the dev profile of the BPF crate instead of release.
        #[arg(long)]
        debug: bool,
    },
    /// Build the BPF programs, then the workspace that embeds them.
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Set up, build and run the whole test suite on the host's kernel (needs root), then the
    /// capture suite on Linux 6.1 and 6.12 in VMs; with --kernel, only a suite of test binaries
    /// as root inside a VM per kernel (qemu; no KVM needed on the host).
    Test {
        /// Also run clippy with -D warnings before the tests.
        #[arg(long)]
        lint: bool,
        /// Kernels to boot, one VM each, in turn: 6.1, 6.12, all (both), or a comma list.
        /// Fetched into .tools/kernels on first use.
        #[arg(long, value_name = "LIST")]
        kernel: Option<String>,
        /// With --kernel: `capture` (outbound, inbound, parity, cni_chain, tc_netlink, validation,
        /// verdict_log, parity_ambient, ambient, skmsg_bulk, bypass, source_route, reroute, dns, ...) or `full`
        /// (every test binary of sidestep-tests but bench, and the unit tests).
        #[arg(
            long,
            requires = "kernel",
            conflicts_with = "only",
            default_value = "capture"
        )]
        suite: vm::Suite,
        /// With --kernel: run these test binaries instead of a suite (target names, e.g.
        /// outbound,tc_netlink; unit tests are `sidestep[lib]` and the like).
        #[arg(long, requires = "kernel", value_delimiter = ',', value_name = "NAME")]
        only: Vec<String>,
        /// Stop each VM after this long (90s, 40m, 1h); exit code 124.
        #[arg(long, default_value = vm::DEFAULT_TIMEOUT, value_parser = vm::parse_duration)]
        timeout: Duration,
        /// Only the host's kernel: skip the capture suite that a plain `test` also runs on
        /// Linux 6.1 and 6.12 in VMs.
        #[arg(long, conflicts_with = "kernel")]
        host_only: bool,
        /// Passed to `cargo test` after `--`; add another `--` for the test binaries. With
        /// --kernel: passed to every test binary (e.g. a test name filter).
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Boot a kernel in a VM (qemu) with the host's root shared read-only and a tmpfs overlay,
    /// and run a command there as root, from the current directory. Exit code: the command's;
    /// 124 on timeout; 125 when the VM dies without reporting one.
    Vm {
        /// 6.1 or 6.12 (fetched into .tools/kernels on first use), or another unpacked package
        /// under .tools/kernels.
        #[arg(long)]
        kernel: String,
        /// Stop the VM after this long (90s, 40m, 1h).
        #[arg(long, default_value = vm::DEFAULT_TIMEOUT, value_parser = vm::parse_duration)]
        timeout: Duration,
        /// The command and its arguments (default: `uname -a; cat /proc/version`). The console
        /// is not a terminal, so an interactive shell gets no input.
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// Set up, build and run `sidestep demo`.
    Demo,
    /// Set up, build with --release and run the benchmark test.
    Bench {
        /// Short runs, for checking that the benchmark works.
        #[arg(long)]
        quick: bool,
        /// Run the whole suite this many times in one invocation; docs/BENCHMARKS.md then gives
        /// each headline figure per run and its range (and a full run updates the README's
        /// sentence about it).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        repeat: u32,
        /// Only this mode (`cni`: ADD/DEL against the iptables install; `scale`: 1, 100 and
        /// 1,000 pods; `ambient`: one unmodified ztunnel, SIDESTEP_ZTUNNEL, under istio-cni's
        /// iptables and sidestep); it rewrites its own section of docs/BENCHMARKS.md. Default:
        /// everything but ambient.
        #[arg(value_parser = ["cni", "scale", "ambient"])]
        mode: Option<String>,
    },
    /// A real Kubernetes node on this machine with sidestep installed by kubectl, and the
    /// scenarios run against it; or `e2e build`, `e2e up` (leave a node running), `e2e down`.
    E2e(e2e::E2eArgs),
    /// Build the fuzz targets (nightly) and run each in turn for a bounded time, at nice 19.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Run only this target (a file name in fuzz/fuzz_targets/, without .rs).
        target: Option<String>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse().task) {
        Ok(code) => code,
        Err(e) => {
            // Not `{:?}`: with RUST_BACKTRACE=1, which cargo users often
            // set, it buries the fix under a backtrace of xtask itself.
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(task: Task) -> Result<ExitCode> {
    match task {
        Task::Setup { dev } => setup::full(dev)?,
        Task::BuildEbpf { debug } => {
            build::ebpf(debug)?;
        }
        Task::Build { release } => {
            build::workspace(release)?;
        }
        Task::Test {
            lint,
            kernel: Some(kernels),
            suite,
            only,
            timeout,
            cargo_args,
            ..
        } => return vm::test(&kernels, suite, &only, lint, timeout, &cargo_args),
        Task::Test {
            lint,
            host_only,
            timeout,
            cargo_args,
            ..
        } => {
            let host = tasks::test(lint, &cargo_args)?;
            // A selection of tests (cargo arguments) is a developer's quick loop: host only.
            if host_only || !cargo_args.is_empty() {
                println!(
                    "real node and kernel matrix: not run ({}); `cargo xtask test` alone runs `cargo xtask e2e` and the capture suite on 6.1 and 6.12 too",
                    if host_only {
                        "--host-only"
                    } else {
                        "tests were selected"
                    }
                );
                return Ok(host);
            }
            // Run even when the host suite failed: CI shows every result.
            let node = e2e::test_run();
            let kernels = vm::test("all", vm::Suite::Capture, &[], false, timeout, &[])?;
            return Ok([host, node, kernels]
                .into_iter()
                .find(|code| *code != ExitCode::SUCCESS)
                .unwrap_or(ExitCode::SUCCESS));
        }
        Task::Vm {
            kernel,
            timeout,
            command,
        } => return vm::run(&kernel, timeout, &command),
        Task::Demo => return tasks::demo(),
        Task::Bench {
            quick,
            repeat,
            mode,
        } => return tasks::bench(quick, repeat, mode.as_deref()),
        Task::Fuzz { seconds, target } => return fuzz::run(seconds, target.as_deref()),
        Task::E2e(task) => e2e::run(task)?,
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Task, clap::Error> {
        Cli::try_parse_from(["cargo xtask"].iter().chain(args)).map(|c| c.task)
    }

    #[test]
    fn vm_options_need_a_kernel() {
        assert!(parse(&["test", "--only", "outbound"]).is_err());
        assert!(parse(&["test", "--suite", "full"]).is_err());
        assert!(parse(&["test", "--kernel", "6.1", "--host-only"]).is_err());
        assert!(parse(&["test", "--kernel", "6.1", "--suite", "full", "--only", "x"]).is_err());
        let Ok(Task::Test {
            kernel: None,
            cargo_args,
            ..
        }) = parse(&["test", "--", "-p", "sidestep"])
        else {
            panic!("plain test");
        };
        assert_eq!(cargo_args, ["-p", "sidestep"]);
        let Ok(Task::Test {
            kernel: Some(k),
            only,
            timeout,
            cargo_args,
            ..
        }) = parse(&["test", "--kernel", "all", "--only", "a,b", "--", "filter"])
        else {
            panic!("kernel test");
        };
        assert_eq!((k.as_str(), only.len()), ("all", 2));
        assert_eq!(timeout, Duration::from_secs(2400));
        assert_eq!(cargo_args, ["filter"]);
    }
}
