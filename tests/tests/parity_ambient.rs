//! The ambient parity table: the same differential method as tests/tests/parity.rs, with
//! istio-cni's in-pod ambient ruleset as the oracle (`istio_ambient::AmbientCapture`, applied
//! with iptables-legacy-restore and its policy route inside the pod netns) against sidestep's
//! `--ambient` enrolment, once per inbound hook.
//!
//! ztunnel is a probe listening on 15001/15006/15008/15053 inside the subject pod S, as root with
//! IP_TRANSPARENT, as the real one opens its listeners in each ambient pod's netns; its own
//! connections carry ztunnel's mark (0x539). One row has ztunnel deliver an inbound connection to
//! S's app from the client's own address (its default when it may), which needs the way back:
//! the app's replies must reach ztunnel's transparent socket, not leave the pod.
//!
//! A process on the node stands for kubelet probing S. istio-cni's node agent SNATs such
//! connections (`-m owner --socket-exists`, in the node's nat POSTROUTING) to 169.254.7.127,
//! which S's rules pass; the node here is the machine's own netns, where the test adds no nat
//! rule, so in the oracle's run the node's socket takes that source itself (bound to it, on the
//! test's bridge): the packets S sees are the ones the SNAT would give it. sidestep installs
//! nothing on the node; it records the node's own socket (`ambient::node_socket_record`). The
//! app then sees the node's address, not 169.254.7.127: the one intended difference
//! (`acceptable`).
//!
//! Needs root; skips otherwise.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv,
    istio_ambient::{self, AmbientCapture},
    parity::{Listeners, Names, Oracle, Outcome, outcome, print_uncaptured, render_table},
    sidestep::Loaded,
    skip_unless_root,
};

const HOOKS: [&str; 2] = ["sk_lookup", "tc"];
const APP_UID: u32 = 1000;
/// ztunnel's `PACKET_MARK`.
const ZTUNNEL_MARK: &str = "1337";
const NODE_PORT: u16 = 18094;
const CONNECT_TIMEOUT_MS: &str = "2000";

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Src {
    /// S's app.
    App,
    /// ztunnel's own socket in S (marked).
    Ztunnel,
    /// ztunnel delivering to S's app from P's address (marked, transparent).
    ZtunnelFromClient,
    /// The app of the other pod P.
    OtherPod,
    /// A process on the node (kubelet).
    Node,
}

impl Src {
    fn name(self) -> &'static str {
        match self {
            Src::App => "app",
            Src::Ztunnel => "ztunnel",
            Src::ZtunnelFromClient => "ztunnel@P",
            Src::OtherPod => "pod P",
            Src::Node => "node",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dst {
    SelfIp,
    Lo1,
    Lo2,
    Peer,
    Node,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Set {
    /// Istio's defaults (`ambient.dnsCapture` on).
    Defaults,
    /// `ambient.istio.io/dns-capture: "false"`.
    NoDns,
    /// `ambient.istio.io/bypass-inbound-capture: "true"`.
    BypassInbound,
}

impl Set {
    fn name(self) -> &'static str {
        match self {
            Set::Defaults => "defaults",
            Set::NoDns => "dns-capture=false",
            Set::BypassInbound => "bypass-inbound",
        }
    }

    fn istio(self) -> AmbientCapture {
        AmbientCapture {
            dns: self != Set::NoDns,
            bypass_inbound: self == Set::BypassInbound,
            ipv6: true,
        }
    }

    fn sidestep_flags(self, hook: &'static str) -> Vec<&'static str> {
        let mut f = vec!["--ambient", "--inbound-hook", hook];
        if self != Set::NoDns {
            f.push("--dns-capture");
        }
        if self == Set::BypassInbound {
            f.extend(["--include-inbound-ports", ""]);
        }
        f
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fam {
    V4,
    V6,
    Mapped,
}

struct Row {
    set: Set,
    from: Src,
    to: Dst,
    port: u16,
    fams: &'static [Fam],
    /// Inbound through sk_assign: the accepted socket's local address is the original
    /// destination, where REDIRECT gives pod-ip:15006.
    sk_assign: bool,
}

const fn row(set: Set, from: Src, to: Dst, port: u16, fams: &'static [Fam]) -> Row {
    Row {
        set,
        from,
        to,
        port,
        fams,
        sk_assign: false,
    }
}

const fn sk_assign(r: Row) -> Row {
    Row {
        sk_assign: true,
        ..r
    }
}

const V4: &[Fam] = &[Fam::V4];
const BOTH: &[Fam] = &[Fam::V4, Fam::V6];
const ALL3: &[Fam] = &[Fam::V4, Fam::V6, Fam::Mapped];

/// Each row names the rule of istio-cni's in-pod chains it exercises.
#[rustfmt::skip]
const TABLE: &[Row] = {
    use Dst::{Lo1, Lo2, Peer, SelfIp};
    use Set::*;
    use Src::{App, OtherPod, Ztunnel, ZtunnelFromClient};
    &[
        // nat OUTPUT 6: every TCP destination off the pod, any port, to ztunnel's 15001.
        row(Defaults, App, Peer, 80, ALL3),
        row(Defaults, App, Peer, 15008, V4),
        row(Defaults, App, Dst::Node, NODE_PORT, BOTH),
        // 5: the pod calling itself over lo (not 127.0.0.1) is accepted; 127.0.0.1 ends the chain.
        row(Defaults, App, Lo1, 8080, BOTH),
        row(Defaults, App, Lo2, 8080, V4),
        row(Defaults, App, SelfIp, 8080, BOTH),
        // ztunnel's own sockets (mark 0x539) are never captured.
        row(Defaults, Ztunnel, Peer, 80, BOTH),
        row(Defaults, Ztunnel, Peer, 15008, V4),
        row(Defaults, Ztunnel, SelfIp, 8080, BOTH),
        // ztunnel to its app from the client's address: connmark 0x111 and table 100 bring the
        // replies back.
        row(Defaults, ZtunnelFromClient, SelfIp, 8080, BOTH),
        // 2-3: DNS over TCP to anything but 127.0.0.1 (the pod's own address too) to 15053.
        row(Defaults, App, Peer, 53, BOTH),
        row(Defaults, App, Lo1, 53, V4),
        row(Defaults, App, Lo2, 53, V4),
        row(Defaults, App, SelfIp, 53, V4),
        row(Defaults, Ztunnel, Peer, 53, V4),
        // nat PREROUTING: every inbound TCP port but 15008 to 15006.
        sk_assign(row(Defaults, OtherPod, SelfIp, 8080, BOTH)),
        row(Defaults, OtherPod, SelfIp, 15008, BOTH),
        sk_assign(row(Defaults, OtherPod, SelfIp, 15020, V4)),
        sk_assign(row(Defaults, OtherPod, SelfIp, 15001, V4)),
        sk_assign(row(Defaults, OtherPod, SelfIp, 53, V4)),
        // The node's nat POSTROUTING SNAT (--socket-exists) and PREROUTING's -s 169.254.7.127
        // ACCEPT: the node's own connections (kubelet's probes) reach the app.
        row(Defaults, Src::Node, SelfIp, 8080, ALL3),
        row(Defaults, Src::Node, SelfIp, 15020, V4),
        // Without DNS capture port 53 is outbound like any other.
        row(NoDns, App, Peer, 53, BOTH),
        row(NoDns, App, SelfIp, 53, V4),
        row(NoDns, App, Peer, 80, V4),
        // Ingress mode: no inbound capture; outbound and the connmark path stay.
        row(BypassInbound, OtherPod, SelfIp, 8080, BOTH),
        row(BypassInbound, App, Peer, 80, V4),
        row(BypassInbound, ZtunnelFromClient, SelfIp, 8080, V4),
    ]
};

struct Topology {
    s: std::sync::Arc<Pod>,
    p: std::sync::Arc<Pod>,
    s6: Ipv6Addr,
    p6: Ipv6Addr,
    gw4: Ipv4Addr,
    gw6: Ipv6Addr,
    names: Names,
    /// The oracle's run: the node's sockets take the source istio-cni's node SNAT gives them.
    node_snat: bool,
    /// That source (`istio_ambient::PROBE_SNAT_V4/V6`).
    snat4: Ipv4Addr,
    snat6: Ipv6Addr,
}

struct Scenario {
    set: Set,
    from: Src,
    dst: SocketAddr,
    fam: Fam,
    sk_assign: bool,
}

/// What both ends saw, and the client address the accepting side saw.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    outcome: Outcome,
    peer: String,
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.peer.is_empty() {
            write!(f, "{}", self.outcome)
        } else {
            write!(f, "{} from={}", self.outcome, self.peer)
        }
    }
}

impl Topology {
    fn dest(&self, to: Dst, fam: Fam, port: u16) -> Result<SocketAddr> {
        let (v4, v6) = match to {
            Dst::SelfIp => (self.s.ipv4, Some(self.s6)),
            Dst::Lo1 => (Ipv4Addr::LOCALHOST, Some(Ipv6Addr::LOCALHOST)),
            Dst::Lo2 => (Ipv4Addr::new(127, 0, 0, 2), None),
            Dst::Peer => (self.p.ipv4, Some(self.p6)),
            Dst::Node => (self.gw4, Some(self.gw6)),
        };
        let ip = match fam {
            Fam::V4 => IpAddr::V4(v4),
            Fam::V6 => IpAddr::V6(v6.context("no IPv6 form")?),
            Fam::Mapped => IpAddr::V6(v4.to_ipv6_mapped()),
        };
        Ok(SocketAddr::new(ip, port))
    }

    fn run_one(&self, env: &TestEnv, listeners: &mut Listeners, sc: &Scenario) -> Result<Seen> {
        let stale = listeners.take(Duration::ZERO)?;
        ensure!(stale.is_empty(), "late connections: {stale:?}");
        let target = sc.dst.to_string();
        let spoofed = match sc.fam {
            Fam::V4 => SocketAddr::new(self.p.ipv4.into(), 0),
            _ => SocketAddr::new(self.p6.into(), 0),
        }
        .to_string();
        let snat = match sc.fam {
            Fam::V4 => SocketAddr::new(self.snat4.into(), 0),
            Fam::Mapped => SocketAddr::new(self.snat4.to_ipv6_mapped().into(), 0),
            Fam::V6 => SocketAddr::new(self.snat6.into(), 0),
        }
        .to_string();
        let mut argv = vec![
            probe(),
            "connect",
            &target,
            "--timeout-ms",
            CONNECT_TIMEOUT_MS,
        ];
        match sc.from {
            Src::Ztunnel => argv.extend(["--mark", ZTUNNEL_MARK]),
            Src::ZtunnelFromClient => {
                argv.extend(["--mark", ZTUNNEL_MARK, "--transparent", "--bind", &spoofed]);
            }
            Src::Node if self.node_snat => argv.extend(["--bind", &snat]),
            _ => {}
        }
        let spec = Spawn::new(&argv);
        let spec = if sc.from == Src::App {
            spec.user(APP_UID, APP_UID)
        } else {
            spec
        };
        let timeout = Duration::from_secs(10);
        let out = match sc.from {
            Src::OtherPod => self.p.run_with(env, spec, timeout)?,
            Src::Node => env.run(spec, timeout)?,
            _ => self.s.run_with(env, spec, timeout)?,
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let client: Value = serde_json::from_str(text.trim()).with_context(|| {
            format!(
                "probe connect printed {text:?} (stderr {:?})",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        let wait = if client["errno"].is_null() {
            Duration::from_secs(2)
        } else {
            Duration::ZERO
        };
        let accepted = listeners.take(wait)?;
        let peer = match (sc.from, accepted.first()) {
            // Only where the client address is the point of the row.
            (Src::ZtunnelFromClient, Some(a)) => {
                let addr: SocketAddr = a.line["peer"]
                    .as_str()
                    .and_then(|p| p.parse().ok())
                    .context("listener reported no peer")?;
                self.names.ip(addr.ip())
            }
            _ => String::new(),
        };
        Ok(Seen {
            outcome: outcome(&self.names, &client, &accepted)?,
            peer,
        })
    }

    fn collect(
        &self,
        env: &TestEnv,
        listeners: &mut Listeners,
        all: &[Scenario],
        mut configure: impl FnMut(Set, &mut Listeners) -> Result<()>,
    ) -> Result<Vec<Seen>> {
        let mut out: Vec<Option<Seen>> = vec![None; all.len()];
        for set in [Set::Defaults, Set::NoDns, Set::BypassInbound] {
            configure(set, listeners)?;
            for (i, sc) in all.iter().enumerate().filter(|(_, s)| s.set == set) {
                let seen = self.run_one(env, listeners, sc).with_context(|| {
                    format!(
                        "[{}] {} -> {}",
                        set.name(),
                        sc.from.name(),
                        self.names.addr(sc.dst)
                    )
                })?;
                out[i] = Some(seen);
            }
        }
        out.into_iter()
            .map(|o| o.context("scenario without outcome"))
            .collect()
    }
}

/// Whether the accepting listener is in S, where sidestep answers SO_ORIGINAL_DST itself.
fn in_subject(o: &Outcome) -> bool {
    ["15001", "15006", "15008", "15053"].contains(&o.accepted.as_str())
        || o.accepted.starts_with("S:")
}

/// The outcomes that count as the oracle's: its own, or as sidestep reports it (ENOENT for
/// SO_ORIGINAL_DST on a connection it did not redirect, where conntrack, on in the pod under
/// Istio's rules, answers the socket's own address: rule G of tests/tests/parity.rs); for an
/// sk_assign row, with the original destination as the local address.
fn acceptable(sc: &Scenario, oracle: &Seen) -> [Seen; 2] {
    let mut exact = oracle.outcome.clone();
    let mut g = oracle.outcome.clone();
    if in_subject(&g) {
        let local = g.local.clone();
        for v in [&mut g.orig_v4, &mut g.orig_v6] {
            if *v == local {
                *v = "ENOENT".into();
            }
        }
    }
    if sc.sk_assign {
        for o in [&mut exact, &mut g] {
            o.local = if sc.fam == Fam::V6 {
                o.orig_v6.clone()
            } else {
                o.orig_v4.clone()
            };
        }
    }
    if sc.from == Src::Node {
        // The intended difference: the app sees the node's address, not the SNAT address.
        for o in [&mut exact, &mut g] {
            o.source = o.source.replace("SNAT4", "GW4").replace("SNAT6", "GW6");
        }
    }
    [exact, g].map(|outcome| Seen {
        outcome,
        peer: oracle.peer.clone(),
    })
}

#[test]
fn parity_with_istio_ambient() -> Result<()> {
    if skip_unless_root("parity_with_istio_ambient") {
        return Ok(());
    }
    let started = Instant::now();
    sidestep_tests::parity::load_conntrack();
    let env = TestEnv::new("parity-ambient")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let s = node.add_pod("subject")?;
    let p = node.add_pod("peer")?;
    let netns_paths = [s.netns_path.clone(), p.netns_path.clone()];
    let mut topo = Topology {
        s6: s.ipv6.context("dual-stack pod without IPv6")?,
        p6: p.ipv6.context("dual-stack pod without IPv6")?,
        gw4: node.gateway_v4(),
        gw6: node.gateway_v6().context("dual-stack node without IPv6")?,
        s: s.clone(),
        p: p.clone(),
        names: Names::default(),
        node_snat: false,
        snat4: istio_ambient::PROBE_SNAT_V4.parse()?,
        snat6: istio_ambient::PROBE_SNAT_V6.parse()?,
    };
    for (ip, name) in [
        (IpAddr::from(topo.s.ipv4), "S4"),
        (topo.s6.into(), "S6"),
        (topo.p.ipv4.into(), "P4"),
        (topo.p6.into(), "P6"),
        (topo.gw4.into(), "GW4"),
        (topo.gw6.into(), "GW6"),
        (topo.snat4.into(), "SNAT4"),
        (topo.snat6.into(), "SNAT6"),
    ] {
        topo.names.add(ip, name);
    }
    let mut all = Vec::new();
    for r in TABLE {
        for fam in r.fams {
            all.push(Scenario {
                set: r.set,
                from: r.from,
                dst: topo.dest(r.to, *fam, r.port)?,
                fam: *fam,
                sk_assign: r.sk_assign,
            });
        }
    }

    let wild = sidestep_tests::parity::wildcard;
    let mut listeners = Listeners::default();
    // ztunnel's in-pod listeners: root, transparent (it delivers from client addresses).
    let start_ztunnel = |listeners: &mut Listeners| {
        listeners.start_ztunnel(
            &env,
            probe(),
            Some(&s),
            &wild(&[15001, 15006, 15008, 15053]),
            |p| p.to_string(),
        )
    };
    let mut ztunnel = start_ztunnel(&mut listeners)?;
    listeners.start(
        &env,
        probe(),
        Some(&s),
        0,
        0,
        &wild(&[53, 8080, 15020]),
        |p| format!("S:{p}"),
    )?;
    listeners.start(
        &env,
        probe(),
        Some(&p),
        0,
        0,
        &wild(&[53, 80, 8080, 15008]),
        |p| format!("P:{p}"),
    )?;
    listeners.start(
        &env,
        probe(),
        None,
        0,
        0,
        &[
            SocketAddr::new(topo.gw4.into(), NODE_PORT),
            SocketAddr::new(topo.gw6.into(), NODE_PORT),
        ],
        |p| format!("node:{p}"),
    )?;
    let setup = started.elapsed();

    let t = Instant::now();
    let mut by_hook = Vec::new();
    for hook in HOOKS {
        let loaded = Loaded::load(&env)?;
        let outcomes = topo.collect(&env, &mut listeners, &all, |set, listeners| {
            loaded.enroll(&s, &set.sidestep_flags(hook))?;
            // As ztunnel opens its listeners once the agent hands it the netns, after the ADD:
            // sk_lookup knows a listener from its listen(2) under the loaded programs.
            if hook == "sk_lookup" {
                listeners.stop(ztunnel);
                ztunnel = start_ztunnel(listeners)?;
            }
            Ok(())
        });
        let outcomes = outcomes.with_context(|| format!("inbound hook {hook}"))?;
        loaded.unload()?;
        by_hook.push(outcomes);
    }
    let sidestep_time = t.elapsed();

    let t = Instant::now();
    // istio-cni's node SNAT, as the packets S sees: the node's sockets take its source, which
    // lives on the test's bridge (and goes with it).
    node.add_bridge_address(ipnet::IpNet::from(IpAddr::from(topo.snat4)))?;
    node.add_bridge_address(ipnet::IpNet::from(IpAddr::from(topo.snat6)))?;
    topo.node_snat = true;
    let mut rules = Oracle::new(&s);
    let oracle = topo.collect(&env, &mut listeners, &all, |set, _| {
        let cap = set.istio();
        let v6 = if cap.ipv6 {
            cap.iptables_restore(true)
        } else {
            String::new()
        };
        rules.apply_rules(&cap.iptables_restore(false), &v6, &cap.route_commands())
    });
    let oracle = match oracle {
        Ok(o) => o,
        Err(e) => bail!("{e:#}\nrules at the failure:\n{}", rules.dump()),
    };
    rules.clear()?;
    ensure!(rules.is_clear()?, "rules left:\n{}", rules.dump());
    let oracle_time = t.elapsed();

    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut matched = [0usize; HOOKS.len()];
    for (i, sc) in all.iter().enumerate() {
        let want = acceptable(sc, &oracle[i]);
        let mut row = vec![
            (i + 1).to_string(),
            sc.set.name().to_owned(),
            format!("{} -> {}", sc.from.name(), topo.names.addr(sc.dst)),
            oracle[i].to_string(),
        ];
        let mut verdicts = Vec::new();
        for (h, outcomes) in by_hook.iter().enumerate() {
            row.push(if h > 0 && outcomes[i] == by_hook[0][i] {
                "=".to_owned()
            } else {
                outcomes[i].to_string()
            });
            if want.contains(&outcomes[i]) {
                matched[h] += 1;
            } else {
                verdicts.push(format!("MISMATCH {} (want {})", HOOKS[h], want[1]));
                if !failures.contains(&(i + 1)) {
                    failures.push(i + 1);
                }
            }
        }
        row.push(if verdicts.is_empty() {
            "match".to_owned()
        } else {
            verdicts.join("; ")
        });
        rows.push(row);
    }
    let mut text = String::from(
        "\nAmbient parity: istio-cni's in-pod rules (oracle) vs sidestep --ambient\n\
         sn = getsockname at the accepting listener, od4/od6 = SO_ORIGINAL_DST, pn = getpeername \
         at the client, from = the client address the listener saw; `=`: as with sk_lookup\n",
    );
    text.push_str(&render_table(
        &[
            "#",
            "set",
            "connection",
            "oracle (istio-cni ambient)",
            "sidestep (sk_lookup)",
            "sidestep (tc)",
            "result",
        ],
        &rows,
    ));
    for (h, m) in matched.iter().enumerate() {
        text.push_str(&format!(
            "{}: {} scenarios, {} as the oracle (after sidestep's SO_ORIGINAL_DST answer and sk_assign's local address)\n",
            HOOKS[h],
            all.len(),
            m
        ));
    }
    text.push_str(&format!(
        "time: setup {setup:.1?}, sidestep {sidestep_time:.1?}, oracle {oracle_time:.1?}\n"
    ));
    print_uncaptured(&text);

    drop(listeners);
    drop(rules);
    drop((s, p, topo));
    drop(node);
    for path in &netns_paths {
        ensure!(!path.exists(), "netns {} left behind", path.display());
    }
    ensure!(all.len() >= 30, "only {} scenarios", all.len());
    ensure!(
        failures.is_empty(),
        "scenarios {failures:?} differ (see the table)"
    );
    Ok(())
}
