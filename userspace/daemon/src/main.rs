//! The `sidestep` command line: its flags and commands live in [`sidestep_daemon::cli`].

use std::process::ExitCode;

use clap::Parser as _;
use sidestep_daemon::agent;
use sidestep_daemon::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The agent sets up its own logging, from its settings.
    if !matches!(cli.command, Command::Agent(_)) {
        agent::init_logging(
            cli.log_level.as_deref().unwrap_or("info"),
            agent::settings::LogFormat::Text,
        );
    }
    match sidestep_daemon::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sidestep: {e:#}");
            ExitCode::FAILURE
        }
    }
}
