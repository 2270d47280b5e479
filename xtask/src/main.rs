//! `cargo xtask`: the one entry point for setting up, building, testing and
//! demonstrating sidestep, so CI and a fresh machine take the same path.

mod build;
mod cmd;
mod fuzz;
mod linker;
mod packages;
mod paths;
mod setup;
mod tasks;

use std::process::ExitCode;

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
    /// Set up, build and run the whole test suite (needs root).
    Test {
        /// Also run clippy with -D warnings before the tests.
        #[arg(long)]
        lint: bool,
        /// Passed to `cargo test` after `--`; add another `--` for the test binaries.
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Set up, build and run `sidestep demo`.
    Demo,
    /// Set up, build with --release and run the benchmark test.
    Bench {
        /// Short runs, for checking that the benchmark works.
        #[arg(long)]
        quick: bool,
        /// Only this mode (`cni`: ADD/DEL against the iptables install; `scale`: 1, 100 and
        /// 1,000 pods); it rewrites its own section of docs/BENCHMARKS.md. Default: everything.
        #[arg(value_parser = ["cni", "scale"])]
        mode: Option<String>,
    },
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
        Task::Test { lint, cargo_args } => return tasks::test(lint, &cargo_args),
        Task::Demo => return tasks::demo(),
        Task::Bench { quick, mode } => return tasks::bench(quick, mode.as_deref()),
        Task::Fuzz { seconds, target } => return fuzz::run(seconds, target.as_deref()),
    }
    Ok(ExitCode::SUCCESS)
}
