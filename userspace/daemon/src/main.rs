//! The `sidestep` command line.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use sidestep::{
    enroll, loader,
    pins::DEFAULT_PIN_ROOT,
    policy::{self, InterceptionMode, Policy},
    status,
};
use sidestep_daemon::agent::{self, AgentArgs, Settings};

#[derive(Parser)]
#[command(
    name = "sidestep",
    version,
    about = "eBPF traffic redirection to a mesh sidecar"
)]
struct Cli {
    /// Log filter, e.g. info or sidestep=debug [default: info].
    #[arg(long, global = true, env = "SIDESTEP_LOG")]
    log_level: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
        #[arg(long, default_value_t = sidestep_daemon::addrfollow::DEFAULT_LATE_ADDRESS_BUDGET)]
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
        #[arg(long, default_value = sidestep_daemon::zds::DEFAULT_SOCKET)]
        socket: PathBuf,
        /// `UID,NAMESPACE,NAME,SERVICE_ACCOUNT,NETNS` (repeatable): the identity ztunnel gives
        /// the workload, and its netns.
        #[arg(long = "workload", required = true, value_parser = sidestep_daemon::zds::Workload::parse)]
        workloads: Vec<sidestep_daemon::zds::Workload>,
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
        /// JSON instead of text (the same as `-o json`).
        #[arg(long)]
        json: bool,
        /// text, or json.
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Whether this node can run sidestep (--pre, before an install) or does (node health):
    /// kernel, BTF, cgroup2, bpffs, the CNI directories and conflist, then the programs and the
    /// pod map. Each line ✔ or ✖ with a hint and a link to the docs; exit code 1 when one
    /// failed. Takes the agent's settings (in the agent's pod: no flags needed).
    Check {
        /// Before an install: only what the node must offer.
        #[arg(long)]
        pre: bool,
        /// text, or json (one object: every item, and whether all passed).
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        settings: Box<AgentArgs>,
    },
    /// The node agent (DaemonSet): load or adopt, install the CNI plugin and its config, keep
    /// them in place, reconcile pods, serve /healthz, /readyz and /metrics. SIGTERM leaves
    /// everything in place.
    Agent(Box<AgentArgs>),
    /// Remove what the agent installed, as a drain: the conflist entry at once (no new pod is
    /// enrolled); the programs, pins, plugin binary and records once no enrolled pod, and no pod
    /// from before the drain, is left. Takes the agent's settings.
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

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

/// Policy flags; each overrides the same field of `--policy FILE`, and both default to Istio's.
#[derive(Args, Default)]
struct PolicyArgs {
    /// JSON policy file (camelCase fields, Istio-style lists).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// The proxy's UID: its outbound traffic is never captured [default: 1337].
    #[arg(long)]
    proxy_uid: Option<u32>,
    /// The proxy's GID: its outbound traffic is never captured [default: 1337].
    #[arg(long)]
    proxy_gid: Option<u32>,
    /// The proxy's outbound listener (loopback) [default: 15001].
    #[arg(long)]
    outbound_port: Option<u16>,
    /// The proxy's inbound listener [default: 15006].
    #[arg(long)]
    inbound_port: Option<u16>,
    /// The DNS listener captured DNS goes to, with --dns-capture [default: 15053].
    #[arg(long)]
    dns_port: Option<u16>,
    /// REDIRECT or TPROXY.
    #[arg(long)]
    interception_mode: Option<InterceptionMode>,
    /// Comma-separated CIDRs, or `*`.
    #[arg(long)]
    include_outbound_ip_ranges: Option<String>,
    /// Comma-separated CIDRs never captured outbound.
    #[arg(long)]
    exclude_outbound_ip_ranges: Option<String>,
    /// Comma-separated ports captured outbound even to excluded ranges.
    #[arg(long)]
    include_outbound_ports: Option<String>,
    /// Comma-separated ports never captured outbound.
    #[arg(long)]
    exclude_outbound_ports: Option<String>,
    /// Comma-separated ports, or `*`.
    #[arg(long)]
    include_inbound_ports: Option<String>,
    /// Comma-separated ports never captured inbound.
    #[arg(long)]
    exclude_inbound_ports: Option<String>,
    /// Capture the pod's DNS (port 53) to the DNS listener, as Istio's DNS capture does.
    #[arg(long)]
    dns_capture: bool,
    /// Leave IPv6 outbound uncaptured (istio-iptables' behaviour for pods without IPv6).
    #[arg(long)]
    no_ipv6: bool,
    /// App <-> proxy data on loopback goes socket to socket (sk_msg).
    #[arg(long)]
    sk_msg: bool,
    /// Log each verdict for this pod (read them with `sidestep debug --follow`).
    #[arg(long)]
    debug: bool,
    /// Where inbound capture hooks in: `sk_lookup` (the per-netns listener lookup only) or `tc`
    /// (tc ingress per interface). Default: `sk_lookup`, or `tc` where the proxy listens already
    /// or the netns is enrolled with `tc`, as the CNI plugin decides.
    #[arg(long)]
    inbound_hook: Option<policy::InboundHook>,
    /// Istio ambient mode: istio-cni's in-pod rules, to an unmodified ztunnel that opens its
    /// listeners in the pod's netns and marks its own sockets (`--dns-capture` for its DNS
    /// proxy, `--include-inbound-ports ""` for `ambient.istio.io/bypass-inbound-capture`).
    #[arg(long)]
    ambient: bool,
    /// The pod's own address (repeatable), for hairpin detection.
    #[arg(long = "pod-ip")]
    pod_ips: Vec<std::net::IpAddr>,
}

impl PolicyArgs {
    /// The policy, and whether the operator chose its inbound hook (the flag or the file's
    /// `inboundHook`); without a choice the enrolment picks one ([`enroll::hook`]).
    fn resolve(self) -> anyhow::Result<(Policy, bool)> {
        let mut hook_chosen = self.inbound_hook.is_some();
        let mut p = match &self.policy {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading policy file {}", path.display()))?;
                let value: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("parsing policy file {}", path.display()))?;
                hook_chosen |= value.get("inboundHook").is_some();
                serde_json::from_value(value)
                    .with_context(|| format!("parsing policy file {}", path.display()))?
            }
            None if self.ambient => Policy::istio_ambient(false, false),
            None => Policy::default(),
        };
        if self.ambient {
            p.ambient = true;
            p.hairpin = false;
        }
        p.proxy_uid = self.proxy_uid.unwrap_or(p.proxy_uid);
        p.proxy_gid = self.proxy_gid.unwrap_or(p.proxy_gid);
        p.outbound_port = self.outbound_port.unwrap_or(p.outbound_port);
        p.inbound_port = self.inbound_port.unwrap_or(p.inbound_port);
        p.dns_port = self.dns_port.unwrap_or(p.dns_port);
        p.interception_mode = self.interception_mode.unwrap_or(p.interception_mode);
        if let Some(v) = &self.include_outbound_ip_ranges {
            p.include_outbound_ip_ranges =
                policy::parse_cidr_set("--include-outbound-ip-ranges", v)?;
        }
        if let Some(v) = &self.exclude_outbound_ip_ranges {
            p.exclude_outbound_ip_ranges =
                policy::parse_cidr_set("--exclude-outbound-ip-ranges", v)?;
        }
        if let Some(v) = &self.include_outbound_ports {
            p.include_outbound_ports = policy::parse_port_set("--include-outbound-ports", v)?;
        }
        if let Some(v) = &self.exclude_outbound_ports {
            p.exclude_outbound_ports = policy::parse_port_set("--exclude-outbound-ports", v)?;
        }
        if let Some(v) = &self.include_inbound_ports {
            p.include_inbound_ports = policy::parse_port_set("--include-inbound-ports", v)?;
        }
        if let Some(v) = &self.exclude_inbound_ports {
            p.exclude_inbound_ports = policy::parse_port_set("--exclude-inbound-ports", v)?;
        }
        p.dns_capture |= self.dns_capture;
        p.sk_msg |= self.sk_msg;
        p.debug |= self.debug;
        p.inbound_hook = self.inbound_hook.unwrap_or(p.inbound_hook);
        if self.no_ipv6 {
            p.capture_ipv6 = false;
        }
        p.pod_ips.extend(self.pod_ips);
        p.validate()?;
        Ok((p, hook_chosen))
    }
}

fn uninstall(
    args: &AgentArgs,
    if_requested: bool,
    force: bool,
    log_level: Option<&str>,
) -> anyhow::Result<()> {
    let settings = Settings::resolve(args, log_level)?;
    if if_requested && !settings.uninstall_requested {
        println!("sidestep uninstall: uninstall-requested is not set; nothing removed");
        return Ok(());
    }
    let mode = if force {
        agent::uninstall::Mode::Force
    } else {
        agent::uninstall::Mode::Drain
    };
    print!("{}", agent::uninstall::uninstall(&settings, mode)?);
    Ok(())
}

fn check(
    args: &AgentArgs,
    pre: bool,
    output: Output,
    log_level: Option<&str>,
) -> anyhow::Result<()> {
    let settings = Settings::resolve(args, log_level)?;
    let mode = if pre {
        sidestep_daemon::check::Mode::Pre
    } else {
        sidestep_daemon::check::Mode::Node
    };
    let items = sidestep_daemon::check::run(&settings, mode);
    let passed = sidestep_daemon::check::passed(&items);
    match output {
        Output::Text => print!("{}", sidestep_daemon::check::render(&items)),
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"passed": passed, "items": items}))?
        ),
    }
    anyhow::ensure!(passed, "some checks failed");
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let log_level = cli.log_level.as_deref();
    match cli.command {
        Command::Agent(args) => agent::main(&args, log_level)?,
        Command::Check {
            pre,
            output,
            settings,
        } => check(&settings, pre, output, log_level)?,
        Command::Uninstall {
            if_requested,
            force,
            settings,
        } => uninstall(&settings, if_requested, force, log_level)?,
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
            println!(
                "sidestep {}: attached at {}, pinned under {}",
                match outcome {
                    loader::LoadOutcome::Fresh => "loaded",
                    loader::LoadOutcome::Upgraded => "upgraded",
                },
                cgroup.display(),
                pin_root.display()
            );
        }
        Command::Unload { pin_root } => {
            loader::unload(&pin_root)?;
            println!("sidestep unloaded from {}", pin_root.display());
        }
        Command::Enroll {
            pin_root,
            netns,
            interfaces,
            policy,
        } => {
            let (mut policy, hook_chosen) = policy.resolve()?;
            if !hook_chosen {
                let netns = sidestep::netns::Netns::open(&netns)?;
                policy.inbound_hook =
                    enroll::hook::default_hook(&pin_root, &netns, policy.inbound_port)
                        .unwrap_or_else(|because| {
                            println!("inbound through tc: {because}");
                            policy::InboundHook::Tc
                        });
            }
            let interfaces = (!interfaces.is_empty()).then_some(interfaces.as_slice());
            let enrolled = enroll::enroll(&pin_root, &netns, &policy, interfaces)?;
            println!(
                "enrolled {} (netns cookie {}, inbound on [{}])",
                netns.display(),
                enrolled.netns_cookie,
                enrolled.interfaces.join(",")
            );
        }
        Command::Unenroll { pin_root, netns } => {
            let was = enroll::unenroll(&pin_root, &netns)?;
            println!(
                "{} {}",
                if was {
                    "unenrolled"
                } else {
                    "was not enrolled:"
                },
                netns.display()
            );
        }
        Command::FollowAddresses {
            pin_root,
            netns,
            late_address_budget,
        } => follow_addresses(&pin_root, netns, late_address_budget),
        Command::ZtunnelServe { socket, workloads } => ztunnel_serve(&socket, workloads)?,
        Command::Debug {
            pin_root,
            netns,
            off,
            follow,
        } => {
            // Open the reader first, so that no verdict between the two steps is lost.
            let reader = follow
                .then(|| sidestep_daemon::verdictlog::VerdictReader::open(&pin_root))
                .transpose()?;
            if let Some(netns) = &netns {
                let cookie = sidestep_daemon::verdictlog::set_debug(&pin_root, netns, !off)?;
                let state = if off { "off" } else { "on" };
                println!(
                    "verdict log {state} for {} (netns cookie {cookie})",
                    netns.display()
                );
            }
            if let Some(mut reader) = reader {
                loop {
                    for line in reader.next_lines(std::time::Duration::from_millis(500)) {
                        println!("netns {}: {}", line.netns_cookie, line.describe());
                    }
                    std::io::Write::flush(&mut std::io::stdout())?;
                }
            }
        }
        Command::Status {
            pin_root,
            state_dir,
            pod,
            json,
            output,
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
            if json || output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", s.render());
            }
        }
    }
    Ok(())
}

/// Hands the workloads to whichever ztunnel connects (each new connection gets them all in its
/// snapshot), and says when one is connected.
fn ztunnel_serve(
    socket: &std::path::Path,
    workloads: Vec<sidestep_daemon::zds::Workload>,
) -> anyhow::Result<()> {
    let server = sidestep_daemon::zds::ZdsServer::listen(socket)?;
    for w in workloads {
        // Without a ztunnel yet the workload waits for its snapshot.
        let _ = server.add(w);
    }
    println!(
        "serving {} workloads on {}",
        server.workloads().len(),
        socket.display()
    );
    let mut was = false;
    loop {
        let now = server.connected();
        if now != was {
            println!(
                "{}",
                if now {
                    "ztunnel connected"
                } else {
                    "ztunnel disconnected"
                }
            );
            was = now;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// One line on stdout per change, for scripts and tests to wait on.
fn follow_addresses(pin_root: &std::path::Path, netns: Vec<PathBuf>, budget: usize) {
    use sidestep_daemon::addrfollow::{self, FollowEvent};
    // No record here names a pod's excluded interfaces: only the agent follows those.
    let wanted: std::collections::BTreeMap<PathBuf, Vec<String>> =
        netns.into_iter().map(|n| (n, Vec::new())).collect();
    addrfollow::follow(
        pin_root,
        std::time::Duration::from_secs(1),
        budget,
        || wanted.clone(),
        || true,
        |event| match event {
            FollowEvent::Started(f) => println!(
                "following {} (netns cookie {})",
                f.path().display(),
                f.cookie()
            ),
            FollowEvent::Synced(f, s) => {
                if !s.added.is_empty() || !s.removed.is_empty() {
                    println!(
                        "{}: added {:?}, removed {:?}, {} left out ({} over the budget)",
                        f.path().display(),
                        s.added,
                        s.removed,
                        s.left_out,
                        s.over_budget
                    );
                }
                let source = &s.source;
                if source.changed() {
                    let written: Vec<String> = source
                        .routes_written
                        .iter()
                        .map(|r| format!("{}/{} from {}", r.destination, r.prefix_len, r.source))
                        .collect();
                    println!(
                        "{}: source gained {:?}, routes written {written:?}, {} removed, {} left out",
                        f.path().display(),
                        source.gained,
                        source.routes_removed,
                        source.routes_left_out
                    );
                }
                for (ip, owner) in &s.held_by_others {
                    tracing::warn!(%ip, owner, "address held by another pod; left to it");
                }
            }
            FollowEvent::Stopped { path, removed } => {
                println!("stopped following {} ({removed} removed)", path.display());
            }
            FollowEvent::Failed { path, error } => {
                tracing::warn!(netns = %path.display(), "{error}");
            }
        },
    );
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The agent sets up its own logging, from its settings.
    if !matches!(cli.command, Command::Agent(_)) {
        agent::init_logging(
            cli.log_level.as_deref().unwrap_or("info"),
            agent::settings::LogFormat::Text,
        );
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sidestep: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::Cli;

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
}
