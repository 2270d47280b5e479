//! The benchmark topology: one node (bridge), and per mode a client pod and a server pod made
//! by the real CNI plugins. Every server pod runs nginx (:80), a sockperf server (:11111) and an
//! iperf3 server (:5201); every pod but the direct lane's has a HAProxy sidecar.
//!
//! Each mode has its own pods, so all of them are set up once and the rounds interleave them
//! without reconfiguring anything between runs. The sidestep lane's processes run in a second
//! test env, the only cgroup sidestep's programs are attached to; the other lanes run in a
//! cgroup with nothing attached, so the baselines pay no BPF cost at all.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use super::Mode;
use super::cpus::{CpuLayout, Role as CpuRole};
use super::haproxy_cfg::{self, ExplicitPort, Role};
use crate::env::TestEnv;
use crate::istio_iptables::IstioCapture;
use crate::net::{http_get, url, wait_listening};
use crate::netns;
use crate::nginx;
use crate::node::{Node, NodeOptions};
use crate::pod::Pod;
use crate::process::{ChildGuard, Spawn};
use crate::sidestep::Loaded;
use crate::util::cmd;

/// UID of the load generators and the test servers: not the proxy, so it is captured.
pub const APP_UID: u32 = 1000;
pub const HTTP_PORT: u16 = 80;
pub const SOCKPERF_PORT: u16 = 11111;
pub const IPERF_PORT: u16 = 5201;
/// The explicit-proxy mode's frontends, one per server port.
pub const EXPLICIT: [ExplicitPort; 3] = [
    ExplicitPort {
        explicit: 15080,
        app: HTTP_PORT,
    },
    ExplicitPort {
        explicit: 15111,
        app: SOCKPERF_PORT,
    },
    ExplicitPort {
        explicit: 15201,
        app: IPERF_PORT,
    },
];

/// One mode's client and server pods with everything running in them.
pub struct Lane<'e> {
    pub mode: Mode,
    /// The env whose cgroup this lane's processes run in.
    pub env: &'e TestEnv,
    pub client: Arc<Pod>,
    pub server: Arc<Pod>,
    /// The CPU layout its processes were started with; the load generators use it too.
    pub cpus: CpuLayout,
    procs: Vec<ChildGuard>,
    /// (client, server) HAProxy, None in the direct lane.
    sidecar_pids: Option<(u32, u32)>,
    nginx: nginx::Server,
}

impl Lane<'_> {
    /// Where the client app connects for the server's `app_port`: the server pod itself, or in
    /// the explicit mode the client sidecar's explicit frontend on loopback.
    pub fn target(&self, app_port: u16) -> SocketAddr {
        match self.mode {
            Mode::Explicit => {
                let e = EXPLICIT
                    .iter()
                    .find(|p| p.app == app_port)
                    .expect("explicit frontend for every server port");
                SocketAddr::from(([127, 0, 0, 1], e.explicit))
            }
            _ => SocketAddr::from((self.server.ipv4, app_port)),
        }
    }

    /// The client and the server sidecar's pids; None in the direct lane.
    pub fn sidecar_pids(&self) -> Option<(u32, u32)> {
        self.sidecar_pids
    }

    /// Fails if one of the lane's long-running processes has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        for p in &mut self.procs {
            p.ensure_running()?;
        }
        self.nginx.child().ensure_running()
    }
}

/// Field order is drop order: processes, then `sidestep unload`, then the node (CNI DEL and
/// the pods' netns, which takes the iptables rules with them).
pub struct Topology<'e> {
    pub lanes: Vec<Lane<'e>>,
    /// A diagnostic second sidestep lane whose server pod keeps no TIME_WAIT sockets
    /// (`net.ipv4.tcp_max_tw_buckets=0` in its netns). Only the new-connection workload runs
    /// on it; it is not one of the modes.
    pub tw_control: Lane<'e>,
    pub cpus: CpuLayout,
    pub loaded: Loaded,
    pub node: Node,
}

impl<'e> Topology<'e> {
    /// `env` holds the node and the baseline lanes; sidestep is loaded into `ss_env` and the
    /// sidestep lane runs there.
    pub fn build(env: &'e TestEnv, ss_env: &'e TestEnv) -> Result<Self> {
        // Locals drop in reverse order, so on an error the lanes go first, then the programs,
        // then the node.
        let cpus = CpuLayout::from_env().context("the benchmark's CPU layout")?;
        eprintln!("bench: CPU layout: {cpus}");
        let node = Node::new(env, NodeOptions::ipv4_only())?;
        let loaded = Loaded::load(ss_env)?;
        let mut lanes = Vec::new();
        for mode in Mode::ALL {
            let lane_env = if matches!(mode, Mode::Sidestep | Mode::SidestepTc | Mode::SkMsg) {
                ss_env
            } else {
                env
            };
            let lane = Self::make_lane(&node, &loaded, lane_env, &cpus, mode, mode.slug(), None)
                .with_context(|| format!("setting up the {} lane", mode.label()))?;
            lanes.push(lane);
        }
        let tw_control = Self::make_lane(
            &node,
            &loaded,
            ss_env,
            &cpus,
            Mode::Sidestep,
            "twctl",
            Some(("net.ipv4.tcp_max_tw_buckets", "0")),
        )
        .context("setting up the TIME_WAIT control lane")?;
        Ok(Self {
            lanes,
            tw_control,
            cpus,
            loaded,
            node,
        })
    }

    /// `server_sysctl` is set in the server pod before anything runs there.
    fn make_lane(
        node: &Node,
        loaded: &Loaded,
        env: &'e TestEnv,
        cpus: &CpuLayout,
        mode: Mode,
        name: &str,
        server_sysctl: Option<(&str, &str)>,
    ) -> Result<Lane<'e>> {
        let client = node.add_pod(&format!("{name}-client"))?;
        let server = node.add_pod(&format!("{name}-server"))?;
        if let Some((k, v)) = server_sysctl {
            netns::set_sysctl(&server.netns_path, k, v)?;
        }
        match mode {
            Mode::Iptables => {
                let rules = env
                    .tmp_dir()
                    .join(format!("istio-v4-{}.rules", env.next_seq()));
                std::fs::write(&rules, IstioCapture::default().iptables_restore_v4())?;
                for pod in [&client, &server] {
                    iptables_restore(&pod.netns_path, &rules)
                        .with_context(|| format!("istio rules in pod {}", pod.name))?;
                }
            }
            Mode::Nftables => {
                let ruleset = crate::istio_nftables::default_sidecar(false);
                for pod in [&client, &server] {
                    let mut c = Command::new("nft");
                    c.args(["-f", "-"]);
                    super::cni::timed(c, ruleset.as_bytes(), Some(&pod.netns_path))
                        .with_context(|| format!("istio nftables in pod {}", pod.name))?;
                }
            }
            // Enrolled before anything listens in the pods, so the default hook is sk_lookup, as
            // for a pod the CNI plugin enrols.
            Mode::Sidestep => {
                loaded.enroll(&client, &[])?;
                loaded.enroll(&server, &[])?;
            }
            Mode::SidestepTc => {
                loaded.enroll(&client, &["--inbound-hook", "tc"])?;
                loaded.enroll(&server, &["--inbound-hook", "tc"])?;
            }
            Mode::SkMsg => {
                loaded.enroll(&client, &["--sk-msg"])?;
                loaded.enroll(&server, &["--sk-msg"])?;
            }
            Mode::Direct | Mode::Explicit => {}
        }
        let web = nginx::Server::start_on(
            env,
            &server,
            HTTP_PORT,
            cpus.set(CpuRole::Server),
            nginx::Logging::ErrorsOnly,
        )?;
        let ip = server.ipv4.to_string();
        let mut procs = Vec::new();
        let sp_port = SOCKPERF_PORT.to_string();
        let mut sp = server.spawn(
            env,
            Spawn::new(&["sockperf", "server", "--tcp", "-i", &ip, "-p", &sp_port])
                .user(APP_UID, APP_UID)
                .cpus(cpus.set(CpuRole::Server)),
        )?;
        wait_listening(
            &mut sp,
            &[SocketAddr::from((server.ipv4, SOCKPERF_PORT))],
            Duration::from_secs(10),
        )?;
        procs.push(sp);
        let ip_port = IPERF_PORT.to_string();
        let mut ip3 = server.spawn(
            env,
            Spawn::new(&["iperf3", "-s", "-p", &ip_port, "-B", &ip])
                .user(APP_UID, APP_UID)
                .cpus(cpus.set(CpuRole::Server)),
        )?;
        wait_listening(
            &mut ip3,
            &[SocketAddr::from((server.ipv4, IPERF_PORT))],
            Duration::from_secs(10),
        )?;
        procs.push(ip3);
        let mut sidecar_pids = None;
        if mode != Mode::Direct {
            let server_sidecar = haproxy_cfg::start(
                env,
                &server,
                Role::Server { own: server.ipv4 },
                &EXPLICIT,
                cpus.set(CpuRole::ServerSidecar),
            )?;
            let client_sidecar = haproxy_cfg::start(
                env,
                &client,
                Role::Client {
                    server: server.ipv4,
                },
                &EXPLICIT,
                cpus.set(CpuRole::ClientSidecar),
            )?;
            sidecar_pids = Some((client_sidecar.pid(), server_sidecar.pid()));
            procs.extend([server_sidecar, client_sidecar]);
        }
        let lane = Lane {
            mode,
            env,
            client,
            server,
            cpus: cpus.clone(),
            procs,
            sidecar_pids,
            nginx: web,
        };
        // One request end to end proves the path before anything is measured.
        let t = lane.target(HTTP_PORT);
        let body = http_get(env, &lane.client, APP_UID, &url(t.ip(), t.port(), "/"))
            .with_context(|| format!("GET through the {} path", mode.label()))?;
        ensure!(
            body == nginx::body_for(&lane.server.name),
            "{} path answered {body:?}",
            mode.label()
        );
        Ok(lane)
    }

    pub fn lane(&self, mode: Mode) -> &Lane<'e> {
        self.lanes
            .iter()
            .find(|l| l.mode == mode)
            .expect("a lane per mode")
    }

    /// After the warm-up: the iptables lane's REDIRECT rules and the sidestep lane's programs
    /// really redirected its traffic, both ways.
    pub fn check_capture(&self) -> Result<()> {
        let ipt = self.lane(Mode::Iptables);
        let out = nat_chain_packets(&ipt.client.netns_name, "ISTIO_REDIRECT")?;
        let inb = nat_chain_packets(&ipt.server.netns_name, "ISTIO_IN_REDIRECT")?;
        ensure!(
            out > 0 && inb > 0,
            "iptables lane: ISTIO_REDIRECT matched {out} packets, ISTIO_IN_REDIRECT {inb}"
        );
        let ss = self.lane(Mode::Sidestep);
        let c = self
            .loaded
            .counters(ss.client.netns_cookie()?)?
            .context("sidestep client pod not enrolled")?;
        let s = self
            .loaded
            .counters(ss.server.netns_cookie()?)?
            .context("sidestep server pod not enrolled")?;
        let out = c["redirected_outbound"].as_u64().unwrap_or(0);
        let inb = s["redirected_inbound"].as_u64().unwrap_or(0);
        ensure!(
            out > 0 && inb > 0,
            "sidestep lane: {out} outbound and {inb} inbound redirects"
        );
        let sk = self.lane(Mode::SkMsg);
        let c = self
            .loaded
            .counters(sk.client.netns_cookie()?)?
            .context("sk_msg client pod not enrolled")?;
        let redirected = c["sk_msg_redirects"].as_u64().unwrap_or(0);
        ensure!(
            redirected > 0,
            "sk_msg lane: no message went socket to socket"
        );
        eprintln!(
            "bench: capture checked (iptables and sidestep lanes redirected both ways after the warm-up)"
        );
        Ok(())
    }

    /// Every lane's long-running processes are still up.
    pub fn ensure_running(&mut self) -> Result<()> {
        for l in &mut self.lanes {
            l.ensure_running()
                .with_context(|| format!("{} lane", l.mode.label()))?;
        }
        self.tw_control
            .ensure_running()
            .context("TIME_WAIT control lane")
    }
}

/// Sum of the packet counters of a nat chain's rules, inside netns `name`.
fn nat_chain_packets(name: &str, chain: &str) -> Result<u64> {
    let out = cmd(&[
        "ip",
        "netns",
        "exec",
        name,
        "iptables-legacy",
        "-w",
        "5",
        "-t",
        "nat",
        "-L",
        chain,
        "-n",
        "-v",
        "-x",
    ])?;
    Ok(parse_chain_packets(&out))
}

pub(crate) fn parse_chain_packets(listing: &str) -> u64 {
    listing
        .lines()
        .skip(2)
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// setns(2) into a network namespace; for `pre_exec`.
fn setns_net(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain system call on an integer fd and a flag; no memory is passed.
    if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `iptables-legacy-restore --noflush -w 5 <input>` inside the netns at `netns` (the
/// child joins it between fork and exec, as istio-cni's does, with no `ip netns exec` mount
/// work) and returns the wall time from spawn to exit.
pub fn iptables_restore(netns: &Path, input: &Path) -> Result<Duration> {
    let ns = File::open(netns).with_context(|| format!("open {}", netns.display()))?;
    let fd = ns.as_raw_fd();
    let mut c = Command::new("iptables-legacy-restore");
    c.args(["--noflush", "-w", "5"])
        .arg(input)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: the hook runs in the forked child before exec and only calls setns(2), which is
    // async-signal-safe, on `fd`, which stays open in the parent until `output` returns.
    unsafe {
        c.pre_exec(move || setns_net(fd));
    }
    let t = Instant::now();
    let out = c.output().context("running iptables-legacy-restore")?;
    let took = t.elapsed();
    drop(ns);
    if !out.status.success() {
        bail!(
            "iptables-legacy-restore in {} failed ({}): {}",
            netns.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(took)
}

/// An address for a throwaway interface: the last host address of the node's subnet, which
/// host-local never hands out before the others.
pub fn spare_address(node: &Node) -> (Ipv4Addr, u8) {
    let net = node.subnet_v4();
    (
        Ipv4Addr::from(u32::from(net.broadcast()) - 1),
        net.prefix_len(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_counters() {
        let l = "Chain ISTIO_REDIRECT (2 references)\n    pkts      bytes target     prot opt in     out     source               destination\n      12      720 REDIRECT   6    --  *      *       0.0.0.0/0            0.0.0.0/0            redir ports 15001\n       3      180 REDIRECT   6    --  *      *       0.0.0.0/0            0.0.0.0/0\n";
        assert_eq!(parse_chain_packets(l), 15);
        assert_eq!(
            parse_chain_packets("Chain X (0 references)\n pkts bytes\n"),
            0
        );
    }
}
