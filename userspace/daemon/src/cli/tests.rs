use clap::{CommandFactory as _, Parser as _};

use super::{Cli, Command, Output, UNINSTALL_FLAGS};

fn subcommand(name: &str) -> clap::Command {
    let mut cli = Cli::command();
    cli.build();
    cli.find_subcommand(name)
        .cloned()
        .unwrap_or_else(|| panic!("no subcommand {name}"))
}

/// Every flag of every subcommand says what it does in `--help`.
#[test]
fn every_flag_has_help() {
    let mut missing = Vec::new();
    let cli = Cli::command();
    let mut commands = vec![cli.clone()];
    commands.extend(cli.get_subcommands().cloned());
    for c in &commands {
        for a in c.get_arguments() {
            if a.get_help().is_none() && !matches!(a.get_id().as_str(), "help" | "version") {
                missing.push(format!("{} --{}", c.get_name(), a.get_id()));
            }
        }
    }
    assert!(missing.is_empty(), "flags without help: {missing:?}");
}

/// `uninstall --help` lists its own flags and the global ones, nothing of the agent's else.
#[test]
fn uninstall_help_lists_only_its_own_flags() {
    let uninstall = subcommand("uninstall");
    let shown: Vec<&str> = uninstall
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .map(|a| a.get_id().as_str())
        .filter(|id| !matches!(*id, "help" | "log_level" | "output"))
        .collect();
    let mut want = UNINSTALL_FLAGS.to_vec();
    want.sort_unstable();
    let mut got = shown.clone();
    got.sort_unstable();
    assert_eq!(got, want);
    let help = uninstall.clone().render_help().to_string();
    assert!(
        help.contains("--force") && help.contains("--state-dir"),
        "{help}"
    );
    assert!(
        !help.contains("--listen") && !help.contains("--repair-mode"),
        "agent-only flags in uninstall --help:\n{help}"
    );
}

/// The hidden ones still parse: a preStop may pass the agent's whole set.
#[test]
fn uninstall_still_takes_the_agents_other_flags() {
    let cli = Cli::try_parse_from([
        "sidestep",
        "uninstall",
        "--listen",
        "127.0.0.1:9964",
        "--force",
    ])
    .expect("parses");
    assert!(matches!(
        cli.command,
        Command::Uninstall { force: true, .. }
    ));
}

#[test]
fn output_is_global_and_status_keeps_its_json_flag() {
    for argv in [
        &["sidestep", "-o", "json", "status"][..],
        &["sidestep", "status", "-o", "json"],
        &["sidestep", "check", "--pre", "--output", "json"],
        &["sidestep", "unload", "-o", "json"],
    ] {
        let cli = Cli::try_parse_from(argv).expect("parses");
        assert_eq!(cli.output, Output::Json, "{argv:?}");
    }
    let cli = Cli::try_parse_from(["sidestep", "status", "--json"]).expect("parses");
    assert!(matches!(cli.command, Command::Status { json: true, .. }));
    assert!(Cli::try_parse_from(["sidestep", "status", "-o", "yaml"]).is_err());
}

#[test]
fn the_agent_refuses_json_output() {
    let cli = Cli::try_parse_from(["sidestep", "-o", "json", "agent"]).expect("parses");
    let err = super::run(cli).expect_err("refused").to_string();
    assert!(err.contains("log-format"), "{err}");
}
