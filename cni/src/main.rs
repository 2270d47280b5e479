//! The `sidestep-cni` binary: environment and stdin in, a CNI result or error on stdout.

use std::{io::Read, process::ExitCode};

use anyhow::Context as _;
use sidestep_cni::{logging, plugin, spec::CniError, spec::code};

fn main() -> ExitCode {
    // As the reference plugins do (skel's "about"): run by hand, with no command, say what this
    // is instead of waiting for a config on stdin.
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    if command.is_empty() || std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        eprintln!("{}", plugin::about());
        return ExitCode::SUCCESS;
    }
    let mut stdin = Vec::new();
    // VERSION needs no input, and a terminal would block it.
    let is_version = std::env::var("CNI_COMMAND").is_ok_and(|c| c == "VERSION");
    let read = if is_version && std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        Ok(0)
    } else {
        std::io::stdin()
            .read_to_end(&mut stdin)
            .context("reading stdin")
    };
    let (level, file) = logging::peek(&stdin);
    let invocation = logging::agent::Invocation::from_env(&|k| std::env::var(k).ok());
    let agent = logging::agent::Sender::connect(&logging::peek_state_dir(&stdin), invocation);
    logging::init(level.as_deref(), file.as_deref(), agent);
    let outcome = match read {
        Ok(_) => plugin::run(&|k| std::env::var(k).ok(), &stdin, &plugin::Node),
        Err(e) => plugin::Outcome {
            stdout: Some(CniError::new(code::IO_FAILURE, format!("{e:#}")).to_json(None)),
            success: false,
        },
    };
    if let Some(out) = outcome.stdout {
        println!("{out}");
    }
    if outcome.success {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
