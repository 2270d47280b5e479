//! The `sidestep` command line: its flags (`Cli`), and `run`, which does what they ask and prints
//! the result as text or, with `-o json`, as JSON.

mod policy_args;
mod streams;
#[cfg(test)]
mod tests;

use std::fmt::Display;
use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use serde::Serialize;
use serde_json::json;
use sidestep::{enroll, loader, pins::DEFAULT_PIN_ROOT, policy, status};

use crate::agent::{self, AgentArgs, Settings};
use crate::check;
pub use policy_args::PolicyArgs;

#[derive(Parser)]
#[command(
    name = "sidestep",
    version,
    about = "eBPF traffic redirection to a mesh sidecar"
)]
pub struct Cli {
    /// Log filter, e.g. info or sidestep=debug [default: info].
    #[arg(long, global = true, env = "SIDESTEP_LOG")]
    pub log_level: Option<String>,
    /// text, or json: one object per command, or one per line for the commands that follow
    /// events (`debug --follow`, `follow-addresses`, `ztunnel-serve`). The agent logs instead
    /// (its log-format setting).
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Output::Text)]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Load, attach and pin the programs, then exit; capture continues without this process.
    Load {
        /// cgroup2 directory to attach at (the cgroup2 root on a node).
        #[arg(long)]
        cgroup: Option<PathBuf>,
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// Capacity of the pod map (only when the maps are first created).
        #[arg(long)]
        pod_capacity: Option<u32>,
        /// Load this BPF object instead of the embedded one (measuring a program change
        /// without rebuilding sidestep).
        #[arg(long, env = "SIDESTEP_BPF_OBJECT_FILE", hide = true)]
        bpf_object: Option<PathBuf>,
    },
    /// Detach every program and remove every pin.
    Unload {
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
    },
    /// Enrol a pod network namespace.
    Enroll {
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// The pod's netns, e.g. /run/netns/NAME or /proc/PID/ns/net.
        #[arg(long)]
        netns: PathBuf,
        /// Interface for inbound capture (repeatable); every non-loopback one by default.
        #[arg(long = "interface")]
        interfaces: Vec<String>,
        #[command(flatten)]
        policy: Box<PolicyArgs>,
    },
    /// Remove a pod network namespace from the data path.
    Unenroll {
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// The pod's netns, e.g. /run/netns/NAME or /proc/PID/ns/net.
        #[arg(long)]
        netns: PathBuf,
    },
    /// Follow the addresses and routes enrolled netns gain and lose after enrolment (SLAAC, DHCP,
    /// a later plugin or Multus network), so that they are captured as the pod's own and captured
    /// connections leave from the address REDIRECT would give; runs until SIGTERM. The agent does
    /// this for every pod the CNI plugin enrolled; this is for netns enrolled by hand.
    FollowAddresses {
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// An enrolled netns to follow (repeatable).
        #[arg(long = "netns", required = true)]
        netns: Vec<PathBuf>,
        /// The most addresses gained after enrolment registered for all of them together.
        #[arg(long, default_value_t = crate::addrfollow::DEFAULT_LATE_ADDRESS_BUDGET)]
        late_address_budget: usize,
    },
    /// Turn a pod's verdict log on (or off with --off), and/or print the verdicts of every pod
    /// whose log is on (--follow, until interrupted). The annotation `sidestep.io/debug: "true"`
    /// is the lasting form for Kubernetes pods; the agent forwards their lines to its log.
    Debug {
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// An enrolled netns whose log to turn on.
        #[arg(long, required_unless_present = "follow")]
        netns: Option<PathBuf>,
        /// Turn the log of --netns off instead.
        #[arg(long, requires = "netns")]
        off: bool,
        /// Print one line per verdict, `netns <cookie>: <what happened>`.
        #[arg(long)]
        follow: bool,
    },
    /// Serve ZDS to ztunnel (Istio ambient) for netns enrolled by hand with `enroll --ambient`,
    /// until SIGTERM: ztunnel connects to --socket and opens its listeners in each --workload's
    /// netns. The agent (`--ambient`) does this for the pods the CNI plugin enrols.
    ZtunnelServe {
        /// Where to listen (ztunnel's INPOD_UDS).
        #[arg(long, default_value = crate::zds::DEFAULT_SOCKET)]
        socket: PathBuf,
        /// `UID,NAMESPACE,NAME,SERVICE_ACCOUNT,NETNS` (repeatable): the identity ztunnel gives
        /// the workload, and its netns.
        #[arg(long = "workload", required = true, value_parser = crate::zds::Workload::parse)]
        workloads: Vec<crate::zds::Workload>,
    },
    /// Show programs, attachments, enrolled pods and counters.
    Status {
        /// Where the programs and maps are pinned.
        #[arg(long, default_value = DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// The plugin's state directory: its records name each pod (`namespace/name`).
        #[arg(long, default_value = "/var/run/sidestep/cni")]
        state_dir: PathBuf,
        /// Only this pod (`namespace/name`).
        #[arg(long)]
        pod: Option<String>,
        /// The same as `-o json` (kept for scripts written before `-o`).
        #[arg(long, hide = true)]
        json: bool,
    },
    /// Whether this node can run sidestep (--pre, before an install) or does (node health):
    /// kernel, BTF, cgroup2, bpffs, the CNI directories and conflist, then the programs and the
    /// pod map. Each line ✔ or ✖ with a hint and a link to the docs; exit code 1 when one
    /// failed. Takes the agent's settings (in the agent's pod: no flags needed).
    Check {
        /// Before an install: only what the node must offer.
        #[arg(long)]
        pre: bool,
        #[command(flatten)]
        settings: Box<AgentArgs>,
    },
    /// The node agent (DaemonSet): load or adopt, install the CNI plugin and its config, keep
    /// them in place, reconcile pods, serve /healthz, /readyz and /metrics. SIGTERM leaves
    /// everything in place.
    Agent(Box<AgentArgs>),
    /// Remove what the agent installed, as a drain: the conflist entry at once (no new pod is
    /// enrolled); the programs, pins, plugin binary and records once no enrolled pod, and no pod
    /// from before the drain, is left. Takes the agent's settings (the agent's other flags are
    /// accepted, for a preStop that passes them all, and hidden from this help).
    #[command(mut_args = hide_unless_uninstall_flag)]
    Uninstall {
        /// Do nothing unless the setting uninstall-requested is true (for a DaemonSet preStop).
        #[arg(long)]
        if_requested: bool,
        /// Remove everything now, leaving every enrolled pod uncaptured (the count is printed).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        settings: Box<AgentArgs>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

impl Output {
    /// One result: the text as it is, or the object, pretty-printed.
    fn result(self, text: impl Display, object: impl Serialize) -> anyhow::Result<()> {
        match self {
            Self::Text => print!("{text}"),
            Self::Json => println!("{}", serde_json::to_string_pretty(&object)?),
        }
        Ok(())
    }

    /// One event of a stream: a line of text, or one object on one line, flushed at once so a
    /// reader sees it while the command runs on.
    fn event(self, text: impl Display, object: impl Serialize) -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        match self {
            Self::Text => writeln!(out, "{text}")?,
            Self::Json => writeln!(out, "{}", serde_json::to_string(&object)?)?,
        }
        out.flush()?;
        Ok(())
    }
}

/// The settings `sidestep uninstall` uses: what names the installed files and pins, where the
/// plugin keeps its records, and how the drain finds the node's pods. `--help` shows only these.
pub const UNINSTALL_FLAGS: &[&str] = &[
    "config",
    "cni_bin_dir",
    "cni_conf_dir",
    "cni_conf_name",
    "cni_mode",
    "plugin_template",
    "plugin_json",
    "kubeconfig_name",
    "pin_root",
    "state_dir",
    "netns_dirs",
    "netns_prefix",
    "scan_proc",
    "proc_dir",
    "uninstall_requested",
    "if_requested",
    "force",
];

/// The agent's flags that `uninstall` takes but does not use: still accepted (a preStop or a
/// script may pass the agent's whole set, and their variables are read the same way), not shown.
fn hide_unless_uninstall_flag(arg: clap::Arg) -> clap::Arg {
    let own = UNINSTALL_FLAGS.contains(&arg.get_id().as_str());
    let global = matches!(arg.get_id().as_str(), "help" | "log_level" | "output");
    if own || global { arg } else { arg.hide(true) }
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    let log_level = cli.log_level.as_deref();
    let output = cli.output;
    match cli.command {
        Command::Agent(args) => {
            anyhow::ensure!(
                output == Output::Text,
                "the agent logs rather than prints: for JSON set its log-format setting (--log-format json)"
            );
            agent::main(&args, log_level)?;
        }
        Command::Check { pre, settings } => run_check(&settings, pre, output, log_level)?,
        Command::Uninstall {
            if_requested,
            force,
            settings,
        } => uninstall(&settings, if_requested, force, output, log_level)?,
        Command::Load {
            cgroup,
            pin_root,
            pod_capacity,
            bpf_object,
        } => {
            let cgroup = match cgroup {
                Some(c) => c,
                None => sidestep::mounts::node_cgroup2_root()?,
            };
            let object = bpf_object
                .map(|p| std::fs::read(&p).with_context(|| format!("--bpf-object {}", p.display())))
                .transpose()?;
            let outcome = loader::load(&loader::LoadOptions {
                cgroup: cgroup.clone(),
                pin_root: pin_root.clone(),
                pod_capacity,
                object,
                bpffs_mount: sidestep::mounts::BpffsMount::Anywhere,
            })?;
            let outcome = match outcome {
                loader::LoadOutcome::Fresh => "loaded",
                loader::LoadOutcome::Upgraded => "upgraded",
            };
            output.result(
                format_args!(
                    "sidestep {outcome}: attached at {}, pinned under {}\n",
                    cgroup.display(),
                    pin_root.display()
                ),
                json!({"outcome": outcome, "cgroup": cgroup, "pin_root": pin_root}),
            )?;
        }
        Command::Unload { pin_root } => {
            loader::unload(&pin_root)?;
            output.result(
                format_args!("sidestep unloaded from {}\n", pin_root.display()),
                json!({"outcome": "unloaded", "pin_root": pin_root}),
            )?;
        }
        Command::Enroll {
            pin_root,
            netns,
            interfaces,
            policy,
        } => {
            let (mut policy, hook_chosen) = policy.resolve()?;
            if !hook_chosen {
                let ns = sidestep::netns::Netns::open(&netns)?;
                policy.inbound_hook =
                    enroll::hook::default_hook(&pin_root, &ns, policy.inbound_port).unwrap_or_else(
                        |because| {
                            // On stderr: it explains the choice, and stdout may be JSON.
                            eprintln!("inbound through tc: {because}");
                            policy::InboundHook::Tc
                        },
                    );
            }
            let interfaces = (!interfaces.is_empty()).then_some(interfaces.as_slice());
            let enrolled = enroll::enroll(&pin_root, &netns, &policy, interfaces)?;
            output.result(
                format_args!(
                    "enrolled {} (netns cookie {}, inbound on [{}])\n",
                    netns.display(),
                    enrolled.netns_cookie,
                    enrolled.interfaces.join(",")
                ),
                json!({
                    "netns": netns, "netns_cookie": enrolled.netns_cookie,
                    "inbound_interfaces": enrolled.interfaces,
                    "inbound_hook": format!("{:?}", policy.inbound_hook).to_lowercase(),
                }),
            )?;
        }
        Command::Unenroll { pin_root, netns } => {
            let was = enroll::unenroll(&pin_root, &netns)?;
            output.result(
                format_args!(
                    "{} {}\n",
                    if was {
                        "unenrolled"
                    } else {
                        "was not enrolled:"
                    },
                    netns.display()
                ),
                json!({"netns": netns, "was_enrolled": was}),
            )?;
        }
        Command::FollowAddresses {
            pin_root,
            netns,
            late_address_budget,
        } => streams::follow_addresses(&pin_root, netns, late_address_budget, output),
        Command::ZtunnelServe { socket, workloads } => {
            streams::ztunnel_serve(&socket, workloads, output)?
        }
        Command::Debug {
            pin_root,
            netns,
            off,
            follow,
        } => {
            // Open the reader first, so that no verdict between the two steps is lost.
            let reader = follow
                .then(|| crate::verdictlog::VerdictReader::open(&pin_root))
                .transpose()?;
            if let Some(netns) = &netns {
                let cookie = crate::verdictlog::set_debug(&pin_root, netns, !off)?;
                let state = if off { "off" } else { "on" };
                output.event(
                    format_args!(
                        "verdict log {state} for {} (netns cookie {cookie})",
                        netns.display()
                    ),
                    json!({"netns": netns, "netns_cookie": cookie, "verdict_log": state}),
                )?;
            }
            if let Some(reader) = reader {
                streams::follow_verdicts(reader, output)?;
            }
        }
        Command::Status {
            pin_root,
            state_dir,
            pod,
            json,
        } => {
            // The pins are root-only: without access every pin would look absent, and "not
            // loaded" would be a lie.
            if let Err(e) = std::fs::read_dir(&pin_root)
                && e.kind() == std::io::ErrorKind::PermissionDenied
            {
                anyhow::bail!(
                    "cannot read the pin root {}: {e}; its pins are root-only, run `sidestep status` as root",
                    pin_root.display()
                );
            }
            let mut s = status::collect(&pin_root);
            status::name_pods(&mut s, &state_dir);
            if let Some(wanted) = &pod {
                status::only_pod(&mut s, wanted)?;
            }
            let output = if json { Output::Json } else { output };
            output.result(s.render(), &s)?;
        }
    }
    Ok(())
}

fn uninstall(
    args: &AgentArgs,
    if_requested: bool,
    force: bool,
    output: Output,
    log_level: Option<&str>,
) -> anyhow::Result<()> {
    let settings = Settings::resolve(args, log_level)?;
    if if_requested && !settings.uninstall_requested {
        return output.result(
            "sidestep uninstall: uninstall-requested is not set; nothing removed\n",
            json!({"requested": false}),
        );
    }
    let mode = if force {
        agent::uninstall::Mode::Force
    } else {
        agent::uninstall::Mode::Drain
    };
    let removed = agent::uninstall::uninstall(&settings, mode)?;
    output.result(&removed, &removed)
}

fn run_check(
    args: &AgentArgs,
    pre: bool,
    output: Output,
    log_level: Option<&str>,
) -> anyhow::Result<()> {
    let settings = Settings::resolve(args, log_level)?;
    let mode = if pre {
        check::Mode::Pre
    } else {
        check::Mode::Node
    };
    let items = check::run(&settings, mode);
    let passed = check::passed(&items);
    output.result(
        check::render(&items),
        json!({"passed": passed, "items": items}),
    )?;
    anyhow::ensure!(passed, "some checks failed");
    Ok(())
}
