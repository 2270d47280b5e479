//! `cargo xtask bench ambient`: Istio ambient's data path through one unmodified ztunnel
//! (`SIDESTEP_ZTUNNEL`), captured in both pods by istio-cni's in-pod iptables rules and by
//! `sidestep enroll --ambient`, in one interleaved run.
//!
//! Topology: a client pod (wrk), a server pod (nginx) and a ztunnel pod on the test bridge;
//! `sidestep ztunnel-serve` hands ztunnel both pods over ZDS, and ztunnel carries every request
//! over HBONE (mTLS from its test CA) between its two in-pod proxies. Each switch of lane stops
//! ztunnel, swaps the capture underneath, and starts it again, so each lane's ztunnel opens its
//! listeners after its capture is in place (as after an ADD).

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::measure::{WrkResult, parse_wrk, wrk_args};
use super::topology::APP_UID;
use crate::{
    ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv, istio_ambient::AmbientCapture, nginx,
    parity::Oracle, sidestep::Loaded,
};

const HTTP_PORT: u16 = 80;
const NAMESPACE: &str = "bench";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmbientLane {
    Iptables,
    Sidestep,
}

impl AmbientLane {
    pub const ALL: [AmbientLane; 2] = [AmbientLane::Iptables, AmbientLane::Sidestep];

    pub fn label(self) -> &'static str {
        match self {
            AmbientLane::Iptables => "ambient, istio-cni iptables",
            AmbientLane::Sidestep => "ambient, sidestep",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmbientWorkload {
    KeepAlive,
    NewConn,
}

impl AmbientWorkload {
    pub const ALL: [AmbientWorkload; 2] = [AmbientWorkload::KeepAlive, AmbientWorkload::NewConn];

    pub fn label(self) -> &'static str {
        match self {
            AmbientWorkload::KeepAlive => "HTTP keep-alive",
            AmbientWorkload::NewConn => "new connection per request",
        }
    }
}

/// Every run's wrk result, by lane and workload, in round order.
pub struct AmbientBench {
    pub rounds: usize,
    pub secs: u32,
    pub conns: u32,
    /// `(lane, workload, result)`.
    pub runs: Vec<(AmbientLane, AmbientWorkload, WrkResult)>,
    /// What the ztunnel binary says it is.
    pub ztunnel: String,
}

impl AmbientBench {
    pub fn results(&self, lane: AmbientLane, w: AmbientWorkload) -> Vec<&WrkResult> {
        self.runs
            .iter()
            .filter(|(l, x, _)| *l == lane && *x == w)
            .map(|(_, _, r)| r)
            .collect()
    }
}

struct Mesh<'a> {
    env: &'a TestEnv,
    loaded: &'a Loaded,
    client: std::sync::Arc<Pod>,
    server: std::sync::Arc<Pod>,
    zpod: std::sync::Arc<Pod>,
    oracles: [Oracle; 2],
    ztunnel_bin: String,
    uds: String,
    xds: String,
}

impl Mesh<'_> {
    fn pods(&self) -> [&Pod; 2] {
        [&self.client, &self.server]
    }

    /// Puts `lane`'s capture in place in both pods (ztunnel is stopped), then starts ztunnel
    /// and waits until a request goes through it.
    fn switch(&mut self, lane: AmbientLane) -> Result<ChildGuard> {
        match lane {
            AmbientLane::Iptables => {
                for p in self.pods() {
                    let _ = self.loaded.unenroll(p);
                }
                let cap = AmbientCapture {
                    ipv6: false,
                    ..AmbientCapture::default()
                };
                for o in &mut self.oracles {
                    o.apply_rules(&cap.iptables_restore(false), "", &cap.route_commands())?;
                }
            }
            AmbientLane::Sidestep => {
                for o in &mut self.oracles {
                    o.clear()?;
                }
                for p in self.pods() {
                    self.loaded.enroll(p, &["--ambient", "--dns-capture"])?;
                }
            }
        }
        let vars = [
            ("PROXY_MODE", "shared"),
            ("INPOD_UDS", self.uds.as_str()),
            ("FAKE_CA", "true"),
            ("XDS_ADDRESS", ""),
            ("LOCAL_XDS_PATH", self.xds.as_str()),
            ("NODE_NAME", "bench-node"),
            ("CLUSTER_ID", "Kubernetes"),
            ("RUST_LOG", "warn"),
        ];
        let z = self
            .zpod
            .spawn(self.env, Spawn::new(&[&self.ztunnel_bin]).env(&vars))?;
        // Ready when a request goes through: both in-pod proxies are up and HBONE works.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self
                .wrk(false, 1, 1)
                .is_ok_and(|r| r.requests > 0 && r.errors == 0)
            {
                return Ok(z);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{}: no request got through ztunnel within 30 s:\n{}{}",
                    lane.label(),
                    z.stdout(),
                    z.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn wrk(&self, close: bool, conns: u32, secs: u32) -> Result<WrkResult> {
        let url = format!("http://{}:{HTTP_PORT}/", self.server.ipv4);
        let args = wrk_args(&url, conns, close, secs);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.client.run_with(
            self.env,
            Spawn::new(&argv).user(APP_UID, APP_UID),
            Duration::from_secs(u64::from(secs) + 20),
        )?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        parse_wrk(&text).with_context(|| format!("wrk output:\n{text}"))
    }
}

/// Runs `rounds` interleaved rounds (the lane order alternates), each lane running both
/// workloads for `secs` seconds with `conns` connections.
pub fn run(
    env: &TestEnv,
    loaded: &Loaded,
    ztunnel_bin: &Path,
    rounds: usize,
    secs: u32,
    conns: u32,
) -> Result<AmbientBench> {
    let node = Node::new(env, NodeOptions::ipv4_only())?;
    let pod = |name: &str| {
        node.add_pod_with(
            name,
            crate::PodOptions {
                namespace: NAMESPACE.into(),
                ..Default::default()
            },
        )
    };
    let (client, server, zpod) = (pod("client")?, pod("server")?, pod("ztunnel")?);
    let _nginx = nginx::Server::start(env, &server, HTTP_PORT)?;
    let xds = env.tmp_dir().join("bench-ztunnel-xds.yaml");
    std::fs::write(
        &xds,
        crate::istio_ambient::ztunnel_local_xds(
            NAMESPACE,
            "bench-node",
            &[
                ("client", "default", client.ipv4),
                ("server", "default", server.ipv4),
            ],
        ),
    )?;
    let uds = env.tmp_dir().join("bench-ztunnel.sock");
    let workload = |p: &Pod| {
        format!(
            "uid-{0},{NAMESPACE},{0},default,{1}",
            p.name,
            p.netns_path.display()
        )
    };
    let (wc, ws) = (workload(&client), workload(&server));
    let bin = crate::sidestep::sidestep_bin();
    let uds_s = uds.display().to_string();
    let _zds = env.spawn(Spawn::new(&[
        bin.to_str().context("sidestep path")?,
        "ztunnel-serve",
        "--socket",
        &uds_s,
        "--workload",
        &wc,
        "--workload",
        &ws,
    ]))?;
    let version = std::process::Command::new(ztunnel_bin)
        .arg("version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let mut mesh = Mesh {
        env,
        loaded,
        oracles: [Oracle::new(&client), Oracle::new(&server)],
        client,
        server,
        zpod,
        ztunnel_bin: ztunnel_bin.display().to_string(),
        uds: uds_s,
        xds: xds.display().to_string(),
    };
    let mut runs = Vec::new();
    for round in 0..rounds {
        let mut order = AmbientLane::ALL;
        if round % 2 == 1 {
            order.reverse();
        }
        for lane in order {
            let mut z = mesh.switch(lane)?;
            for w in AmbientWorkload::ALL {
                let r = mesh.wrk(w == AmbientWorkload::NewConn, conns, secs)?;
                eprintln!(
                    "bench ambient: round {} {} {}: {:.0}/s p50 {:.0} us p99 {:.0} us, {} errors",
                    round + 1,
                    lane.label(),
                    w.label(),
                    r.rate,
                    r.p50_us,
                    r.p99_us,
                    r.errors
                );
                runs.push((lane, w, r));
            }
            z.terminate(Duration::from_secs(5))?;
        }
    }
    for o in &mut mesh.oracles {
        o.clear()?;
    }
    for p in mesh.pods() {
        let _ = loaded.unenroll(p);
    }
    Ok(AmbientBench {
        rounds,
        secs,
        conns,
        runs,
        ztunnel: version,
    })
}
