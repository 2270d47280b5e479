//! Running the table: the topology's addresses, each set's options for Istio and the matching
//! sidestep enrol flags, and one probe connect per scenario with what both ends saw. The same
//! code serves both implementations, so any difference in the outcomes is theirs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Pod, Spawn, TestEnv,
    istio_iptables::{IstioCapture, Mode},
    parity::{Listeners, Names, Outcome, outcome},
};

use crate::ifaces::Ifaces;
use crate::table::{Dst, Fam, Intended, Set, Src, TABLE, sets};
use crate::{APP_UID, CONNECT_TIMEOUT_MS, OTHER_UID, PROXY_UID, probe};

pub(super) struct Topology {
    pub(super) s: std::sync::Arc<Pod>,
    pub(super) p: std::sync::Arc<Pod>,
    pub(super) gw4: Ipv4Addr,
    pub(super) gw6: Ipv6Addr,
    pub(super) s6: Ipv6Addr,
    pub(super) p6: Ipv6Addr,
    /// net1, pod Q, link-local and late addresses.
    pub(super) x: Ifaces,
    pub(super) names: Names,
}

impl Topology {
    pub(super) fn set_name(set: Set) -> &'static str {
        match set {
            Set::Defaults => "defaults",
            Set::V4First => "v4-first/--no-ipv6",
            Set::V4FirstSidestepV6 => "v4-first/ss-ipv6",
            Set::ExcludeOutPorts => "exclOutPorts=8080",
            Set::ExcludeOutCidr => "exclOutIPRanges=P",
            Set::IncludeOutCidr => "inclOutIPRanges=P",
            Set::IncludeOutPorts => "inclOutPorts=80",
            Set::IncludeInPorts => "inclInPorts=8080",
            Set::IncludeInPortsExcluded => "inclIn=8080,9090/excl=9090",
            Set::ExcludeInPorts => "exclInPorts=9090",
            Set::InboundOff => "inclInPorts=\"\"",
            Set::Dns => "dnsCapture",
            Set::Tproxy => "interceptionMode=TPROXY",
            Set::ExcludeIfaces => "excludeInterfaces=net1",
            Set::ExcludeIfacesTproxy => "excludeInterfaces=net1/TPROXY",
            Set::LateAddrs => "defaults, addrs after enrol",
            Set::TwoAttachments => "defaults, CNI ADD eth0+net1",
            Set::Net1Deleted => "defaults, CNI DEL net1",
        }
    }

    /// istio-iptables' options for the set (istio-cni's view of the annotations).
    pub(super) fn istio(&self, set: Set) -> IstioCapture {
        let p_ranges = format!("{}/32,{}/128", self.p.ipv4, self.p6);
        let base = IstioCapture {
            ipv6: true,
            ..IstioCapture::default()
        };
        match set {
            Set::Defaults | Set::LateAddrs | Set::TwoAttachments | Set::Net1Deleted => base,
            Set::V4First | Set::V4FirstSidestepV6 => IstioCapture {
                ipv6: false,
                ..base
            },
            Set::ExcludeOutPorts => IstioCapture {
                exclude_outbound_ports: "8080".into(),
                ..base
            },
            Set::ExcludeOutCidr => IstioCapture {
                exclude_outbound_ip_ranges: p_ranges,
                ..base
            },
            Set::IncludeOutCidr => IstioCapture {
                include_outbound_ip_ranges: p_ranges,
                ..base
            },
            Set::IncludeOutPorts => IstioCapture {
                include_outbound_ip_ranges: String::new(),
                include_outbound_ports: "80".into(),
                ..base
            },
            Set::IncludeInPorts => IstioCapture {
                include_inbound_ports: "8080".into(),
                ..base
            },
            Set::IncludeInPortsExcluded => IstioCapture {
                include_inbound_ports: "8080,9090".into(),
                exclude_inbound_ports: "9090".into(),
                ..base
            },
            Set::ExcludeInPorts => IstioCapture {
                exclude_inbound_ports: "9090".into(),
                ..base
            },
            Set::InboundOff => IstioCapture {
                include_inbound_ports: String::new(),
                ..base
            },
            Set::Dns => IstioCapture {
                dns_capture: true,
                ..base
            },
            Set::Tproxy => IstioCapture {
                mode: Mode::Tproxy,
                ..base
            },
            Set::ExcludeIfaces => IstioCapture {
                exclude_interfaces: "net1".into(),
                ..base
            },
            Set::ExcludeIfacesTproxy => IstioCapture {
                exclude_interfaces: "net1".into(),
                mode: Mode::Tproxy,
                ..base
            },
        }
    }

    fn dest(&self, from: Src, to: Dst, fam: Fam, port: u16) -> Result<SocketAddr> {
        let x = &self.x;
        // A link-local destination, with the scope its client gives: its own interface.
        let scoped = |ip: Ipv6Addr, scope: u32| -> Result<SocketAddr> {
            anyhow::ensure!(fam == Fam::V6, "a link-local destination is IPv6 only");
            Ok(SocketAddr::V6(SocketAddrV6::new(ip, port, 0, scope)))
        };
        let (v4, v6): (Ipv4Addr, Option<Ipv6Addr>) = match to {
            Dst::SelfIp => (self.s.ipv4, Some(self.s6)),
            Dst::Lo1 => (Ipv4Addr::LOCALHOST, Some(Ipv6Addr::LOCALHOST)),
            Dst::Lo2 => (Ipv4Addr::new(127, 0, 0, 2), None),
            Dst::Passthrough => (Ipv4Addr::new(127, 0, 0, 6), Some("::6".parse()?)),
            Dst::Peer => (self.p.ipv4, Some(self.p6)),
            Dst::Node => (self.gw4, Some(self.gw6)),
            Dst::SelfNet1 => (x.n4, Some(x.n6)),
            Dst::SelfLate => (x.late4, Some(x.late6)),
            Dst::Net1Peer => (x.q.ipv4, Some(x.q6)),
            Dst::SelfLl => {
                let scope = match from {
                    Src::OtherPod => x.p_eth0,
                    Src::Net1Pod | Src::Node => anyhow::bail!("S's eth0 is not on that link"),
                    _ => x.s_eth0,
                };
                return scoped(x.ll, scope);
            }
            Dst::PeerLl => {
                anyhow::ensure!(from != Src::OtherPod, "P's own link-local");
                return scoped(x.p_ll, x.s_eth0);
            }
            Dst::SelfNet1Ll => {
                let scope = match from {
                    Src::Net1Pod => x.q_eth0,
                    Src::OtherPod | Src::Node => anyhow::bail!("S's net1 is not on that link"),
                    _ => x.s_net1,
                };
                return scoped(x.ll1, scope);
            }
        };
        let ip = match fam {
            Fam::V4 => IpAddr::V4(v4),
            Fam::V6 => IpAddr::V6(v6.context("no IPv6 form of this destination")?),
            Fam::Mapped => IpAddr::V6(v4.to_ipv6_mapped()),
        };
        Ok(SocketAddr::new(ip, port))
    }
}

/// The sidestep enrol flags equivalent to istio's options. Excluded interfaces have no flag of
/// their own: they go in a policy file written to `dir`.
pub(super) fn sidestep_flags(
    c: &IstioCapture,
    capture_ipv6: bool,
    dir: &Path,
) -> Result<Vec<String>> {
    let mut f: Vec<String> = Vec::new();
    if !c.exclude_interfaces.is_empty() {
        let path = dir.join("parity-policy.json");
        let nics: Vec<&str> = c.exclude_interfaces.split(',').map(str::trim).collect();
        std::fs::write(
            &path,
            serde_json::json!({ "excludeInterfaces": nics }).to_string(),
        )?;
        f.push("--policy".into());
        f.push(path.display().to_string());
    }
    let mut opt = |name: &str, v: &str| {
        f.push(name.to_owned());
        f.push(v.to_owned());
    };
    opt("--proxy-uid", &c.proxy_uid.to_string());
    opt("--proxy-gid", &c.proxy_gid.to_string());
    opt(
        "--include-outbound-ip-ranges",
        &c.include_outbound_ip_ranges,
    );
    opt(
        "--exclude-outbound-ip-ranges",
        &c.exclude_outbound_ip_ranges,
    );
    opt("--include-outbound-ports", &c.include_outbound_ports);
    opt("--exclude-outbound-ports", &c.exclude_outbound_ports);
    opt("--include-inbound-ports", &c.include_inbound_ports);
    opt("--exclude-inbound-ports", &c.exclude_inbound_ports);
    if c.dns_capture {
        f.push("--dns-capture".into());
    }
    if c.mode == Mode::Tproxy {
        f.push("--interception-mode".into());
        f.push("TPROXY".into());
    }
    if !capture_ipv6 {
        f.push("--no-ipv6".into());
    }
    Ok(f)
}

/// One expanded scenario.
#[derive(Clone)]
pub(super) struct Scenario {
    pub(super) set: Set,
    pub(super) from: Src,
    pub(super) dst: SocketAddr,
    pub(super) fam: Fam,
    pub(super) intended: Option<Intended>,
}

pub(super) fn scenarios(topo: &Topology) -> Result<Vec<Scenario>> {
    let mut out = Vec::new();
    for r in TABLE {
        for fam in r.fams {
            out.push(Scenario {
                set: r.set,
                from: r.from,
                dst: topo.dest(r.from, r.to, *fam, r.port)?,
                fam: *fam,
                intended: r.intended,
            });
        }
    }
    Ok(out)
}

/// Runs one connect as the scenario's source and collects what both ends saw.
fn run_one(
    env: &TestEnv,
    topo: &Topology,
    listeners: &mut Listeners,
    sc: &Scenario,
) -> Result<Outcome> {
    // Nothing may be left over from the previous scenario.
    let stale = listeners.take(Duration::ZERO)?;
    ensure!(stale.is_empty(), "late connections: {stale:?}");
    let target = sc.dst.to_string();
    let bind = match sc.fam {
        Fam::V4 => "127.0.0.6:0",
        Fam::V6 => "[::6]:0",
        Fam::Mapped => "[::ffff:127.0.0.6]:0",
    };
    let mut argv = vec![
        probe(),
        "connect",
        &target,
        "--timeout-ms",
        CONNECT_TIMEOUT_MS,
    ];
    if matches!(sc.from, Src::AppBound | Src::ProxyBound) {
        argv.extend(["--bind", bind]);
    }
    if sc.from == Src::AppDev {
        argv.extend(["--device", "net1"]);
    }
    let timeout = Duration::from_secs(10);
    let (uid, gid) = match sc.from {
        Src::Proxy | Src::ProxyBound => (PROXY_UID, PROXY_UID),
        Src::ProxyGid => (OTHER_UID, PROXY_UID),
        _ => (APP_UID, APP_UID),
    };
    let spec = Spawn::new(&argv).user(uid, gid);
    let out = match sc.from {
        Src::OtherPod => topo.p.run_with(env, spec, timeout)?,
        Src::Net1Pod => topo.x.q.run_with(env, spec, timeout)?,
        Src::Node => env.run(spec, timeout)?,
        _ => topo.s.run_with(env, spec, timeout)?,
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
    outcome(&topo.names, &client, &listeners.take(wait)?)
}

pub(super) fn collect(
    env: &TestEnv,
    topo: &Topology,
    listeners: &mut Listeners,
    all: &[Scenario],
    mut configure: impl FnMut(Set, &mut Listeners) -> Result<()>,
    mut late_added: impl FnMut(&[std::net::IpAddr]) -> Result<()>,
) -> Result<Vec<Outcome>> {
    let mut out = Vec::with_capacity(all.len());
    for set in sets() {
        configure(set, listeners)?;
        // Added after the enrolment (and after the oracle's rules, which do not care).
        if set == Set::LateAddrs {
            topo.x.add_late(&topo.s)?;
            late_added(&[topo.x.late4.into(), topo.x.late6.into()])?;
        }
        for sc in all.iter().filter(|s| s.set == set) {
            let o = run_one(env, topo, listeners, sc).with_context(|| {
                format!(
                    "[{}] {} -> {}",
                    Topology::set_name(set),
                    sc.from.name(),
                    topo.names.addr(sc.dst)
                )
            })?;
            out.push(o);
        }
        if set == Set::LateAddrs {
            topo.x.remove_late(&topo.s)?;
        }
    }
    // `out` follows sets() order; put it back in table order.
    let mut order: Vec<usize> = Vec::new();
    for set in sets() {
        order.extend((0..all.len()).filter(|i| all[*i].set == set));
    }
    let mut table = vec![None; all.len()];
    for (o, i) in out.into_iter().zip(order) {
        table[i] = Some(o);
    }
    table
        .into_iter()
        .map(|o| o.context("scenario without outcome"))
        .collect()
}
