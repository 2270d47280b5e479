//! The differential table's pieces: one policy in both forms (sidestep's flags and policy file,
//! istio-iptables' options), observing one connection (or one crafted SYN) from the VM, rule G,
//! and the rows where sidestep differs on purpose, so the test itself reads as the table.

use std::{
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use sidestep_tests::{
    Pod, TestEnv,
    istio_iptables::IstioCapture,
    parity::{Listeners, Names, Outcome, outcome},
};

use crate::IFACE;
use crate::vm::{VM4, VM6, Vm};

/// A policy file naming the re-routed interface (the CLI has no flag for it).
pub(super) fn reroute_policy(env: &TestEnv, ifaces: &[&str]) -> Result<PathBuf> {
    let path = env
        .tmp_dir()
        .join(format!("reroute-{}.json", ifaces.join("-")));
    std::fs::write(
        &path,
        serde_json::json!({ "rerouteVirtualInterfaces": ifaces }).to_string(),
    )?;
    Ok(path)
}

/// One policy of the table, in both forms.
pub(super) struct Case {
    pub(super) name: &'static str,
    pub(super) include: String,
    pub(super) exclude: String,
    pub(super) exclude_ports: String,
    /// Destinations the VM connects to.
    pub(super) targets: Vec<SocketAddr>,
    /// Crafted packets the VM sends, after the targets.
    pub(super) crafted: Vec<Crafted>,
}

/// How the VM reaches a destination other than with a plain connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Craft {
    /// A connection whose every segment carries an IPv6 Hop-by-Hop header.
    HopOpts,
    /// The same with a Destination Options header.
    DstOpts,
    /// One SYN in two IP fragments from a raw socket: IPv4's first carries 8 bytes of the TCP
    /// header, IPv6's a Fragment header in front of the whole fixed TCP header (see
    /// `probe frag-syn`).
    FragSyn,
    /// One SYN in an Ethernet frame behind this many 802.1Q tags of VLAN 0 (`probe vlan-syn`):
    /// the kernel strips one tag before tc and the rest after it, then routes the IP packet.
    VlanSyn(u8),
    /// The same behind an 802.1ad (QinQ service) tag and an 802.1Q tag, both VLAN 0.
    QinQSyn,
}

/// A row sidestep answers differently from Istio on purpose; its exact outcome is asserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Intended {
    /// A tc program cannot reassemble: a fragmented TCP packet that Istio's rules would
    /// REDIRECT (conntrack defragments before nat) is dropped, never forwarded around the proxy.
    FragmentsDropped,
    /// A frame behind more VLAN 0 tags than the tc parser pops (four) is dropped; the kernel
    /// strips any number, and Istio's rules then REDIRECT the packet.
    DeepTagsDropped,
}

impl Intended {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Intended::FragmentsDropped => "fragments dropped (fail closed), Istio reassembles",
            Intended::DeepTagsDropped => {
                "over four VLAN 0 tags dropped (fail closed), the kernel strips them for Istio"
            }
        }
    }

    /// sidestep's exact outcome for the row.
    pub(super) fn outcome(self) -> Seen {
        match self {
            Intended::FragmentsDropped | Intended::DeepTagsDropped => Seen::Packet(Delivery {
                reply: "none".into(),
                at_destination: 0,
            }),
        }
    }
}

pub(super) struct Crafted {
    pub(super) how: Craft,
    pub(super) to: SocketAddr,
    pub(super) intended: Option<Intended>,
}

pub(super) const fn crafted(how: Craft, to: SocketAddr) -> Crafted {
    Crafted {
        how,
        to,
        intended: None,
    }
}

pub(super) const fn mark(c: Crafted, why: Intended) -> Crafted {
    Crafted {
        intended: Some(why),
        ..c
    }
}

impl Crafted {
    /// The table's "VM connects to" cell.
    pub(super) fn label(&self, names: &Names) -> String {
        let how = match self.how {
            Craft::HopOpts => "+hop-by-hop",
            Craft::DstOpts => "+dest-opts",
            Craft::FragSyn => "fragmented SYN",
            Craft::QinQSyn => "SYN behind 802.1ad + 802.1Q VLAN 0 tags",
            Craft::VlanSyn(n) => {
                return format!("{} SYN behind {n} VLAN 0 tags", names.addr(self.to));
            }
        };
        format!("{} {how}", names.addr(self.to))
    }
}

/// What became of a crafted SYN that no socket of the VM owns: what came back to the VM from
/// the destination it was sent to, and how many TCP segments reached the destination's stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Delivery {
    /// `syn-ack` (someone answered in the destination's name), `rst`, or `none`.
    pub(super) reply: String,
    /// Growth of the destination pod's `Tcp: InSegs` (every TCP segment its stack received,
    /// whatever the socket lookup found, after reassembly).
    pub(super) at_destination: u64,
}

/// One row's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seen {
    Conn(Outcome),
    Packet(Delivery),
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Seen::Conn(o) => o.fmt(f),
            Seen::Packet(d) => write!(
                f,
                "VM got {}; destination got {} TCP",
                d.reply, d.at_destination
            ),
        }
    }
}

/// The destination pod's `Tcp: InSegs` (one counter for IPv4 and IPv6).
fn tcp_in_segs(pod: &Pod) -> Result<u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", &pod.netns_name, "cat", "/proc/net/snmp"])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(names), Some(values)) = (tcp.next(), tcp.next()) else {
        bail!("no Tcp lines in {}'s /proc/net/snmp: {text}", pod.name);
    };
    let i = names
        .split_whitespace()
        .position(|n| n == "InSegs")
        .context("no InSegs")?;
    Ok(values
        .split_whitespace()
        .nth(i)
        .context("no InSegs value")?
        .parse()?)
}

/// Runs one crafted row from the VM. `destination` is the pod that owns `c.to`.
pub(super) fn observe_crafted(
    vm: &Vm,
    names: &Names,
    listeners: &mut Listeners,
    destination: &Pod,
    c: &Crafted,
) -> Result<Seen> {
    let to = c.to.to_string();
    match c.how {
        Craft::HopOpts | Craft::DstOpts => {
            let opt = if c.how == Craft::HopOpts {
                "--hopopts"
            } else {
                "--dstopts"
            };
            let client = vm.probe(&["connect-ext", &to, opt])?;
            Ok(Seen::Conn(settle(names, listeners, &client)?))
        }
        Craft::FragSyn | Craft::VlanSyn(_) | Craft::QinQSyn => {
            let src = if c.to.is_ipv4() { VM4 } else { VM6 };
            let before = tcp_in_segs(destination)?;
            let (got, packets) = match c.how {
                Craft::VlanSyn(tags) => {
                    let tags = tags.to_string();
                    let mac = vm.gateway_mac.as_str();
                    let args = ["vlan-syn", "eth0", mac, src, &to, "--tags", &tags];
                    (vm.probe(&args)?, 1)
                }
                Craft::QinQSyn => {
                    let mac = vm.gateway_mac.as_str();
                    let args = ["vlan-syn", "eth0", mac, src, &to, "--outer-ad"];
                    (vm.probe(&args)?, 1)
                }
                _ => (vm.probe(&["frag-syn", src, &to, "--wait-ms", "1500"])?, 2),
            };
            ensure!(got["sent"].as_u64() == Some(packets), "{:?}: {got}", c.how);
            let reply = got["reply"].as_str().context("no reply field")?.to_owned();
            let at_destination = tcp_in_segs(destination)? - before;
            // The VM answers a SYN-ACK with a reset, so no handshake completes and no listener
            // may report one (it would be taken for the next row's).
            let accepted = listeners.take(Duration::from_millis(200))?;
            ensure!(
                accepted.is_empty(),
                "a listener accepted a crafted SYN: {accepted:?}"
            );
            Ok(Seen::Packet(Delivery {
                reply,
                at_destination,
            }))
        }
    }
}

pub(super) fn sidestep_args(c: &Case, policy_file: &Path) -> Vec<String> {
    vec![
        "--policy".into(),
        policy_file.display().to_string(),
        "--include-outbound-ip-ranges".into(),
        c.include.clone(),
        "--exclude-outbound-ip-ranges".into(),
        c.exclude.clone(),
        "--exclude-outbound-ports".into(),
        c.exclude_ports.clone(),
    ]
}

pub(super) fn istio_capture(c: &Case) -> IstioCapture {
    IstioCapture {
        include_outbound_ip_ranges: c.include.clone(),
        exclude_outbound_ip_ranges: c.exclude.clone(),
        exclude_outbound_ports: c.exclude_ports.clone(),
        reroute_virtual_interfaces: IFACE.into(),
        ipv6: true,
        ..Default::default()
    }
}

pub(super) fn observe(
    vm: &Vm,
    names: &Names,
    listeners: &mut Listeners,
    to: SocketAddr,
) -> Result<Outcome> {
    let client = vm.connect(to, false)?;
    settle(names, listeners, &client)
}

/// The outcome of a connect the VM made: what the listeners report about it.
fn settle(names: &Names, listeners: &mut Listeners, client: &serde_json::Value) -> Result<Outcome> {
    let wait = if client.get("errno").is_some() {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(3)
    };
    let accepted = listeners.take(wait)?;
    outcome(names, client, &accepted)
}

/// tests/tests/parity.rs's rule G: a connection nothing redirected gets its own local address from
/// SO_ORIGINAL_DST under Istio's rules (they turn conntrack on in the pod), ENOENT from sidestep.
pub(super) fn rule_g(istio: &Seen) -> Seen {
    let Seen::Conn(o) = istio else {
        return istio.clone();
    };
    let mut o = o.clone();
    if o.accepted != "15001" {
        let local = o.local.clone();
        for v in [&mut o.orig_v4, &mut o.orig_v6] {
            if *v == local {
                *v = "ENOENT".into();
            }
        }
    }
    Seen::Conn(o)
}

/// How a row's two outcomes compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Identical.
    Same,
    /// Identical under rule G.
    SameUnderG,
    /// A difference its `Intended` mark describes exactly.
    Intended(Intended),
    /// Anything else; with sidestep's outcome the mark promised, for a marked row.
    Mismatch(Option<Seen>),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Same => f.write_str("="),
            Verdict::SameUnderG => f.write_str("G"),
            Verdict::Intended(why) => write!(f, "intended: {}", why.reason()),
            Verdict::Mismatch(None) => f.write_str("DIFF"),
            Verdict::Mismatch(Some(want)) => write!(f, "DIFF (want {want})"),
        }
    }
}

pub(super) fn judge(istio: &Seen, ours: &Seen, intended: Option<Intended>) -> Verdict {
    match intended {
        // A mark must describe a real difference, and sidestep must do exactly what it says.
        Some(why) if *ours == why.outcome() && *istio != *ours => Verdict::Intended(why),
        Some(why) => Verdict::Mismatch(Some(why.outcome())),
        None if istio == ours => Verdict::Same,
        None if rule_g(istio) == *ours => Verdict::SameUnderG,
        None => Verdict::Mismatch(None),
    }
}
