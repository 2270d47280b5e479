//! The bypass tests' fixture: the enrolled client, the recording proxy and server, and reading
//! back which of them saw an attempt. Every test asks the same question (captured, or around the
//! proxy?), so the bookkeeping for it lives here once.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    ChildGuard, Node, NodeOptions, Pod, Spawn, TestEnv, sidestep::Loaded, wait_listening,
};

use crate::{APP_UID, PORT, PROXY_UID, probe};

/// Every JSON line of a process's output.
pub(super) fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The last JSON line of a probe's stdout.
pub(super) fn last_json(out: &std::process::Output) -> Result<Value> {
    json_lines(&String::from_utf8_lossy(&out.stdout))
        .pop()
        .with_context(|| {
            format!(
                "no JSON from the probe ({}): stdout {:?}, stderr {:?}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

pub(super) fn ip_of(addr: &Value) -> Result<IpAddr> {
    let text = addr.as_str().context("address is not a string")?;
    Ok(text
        .parse::<SocketAddr>()
        .with_context(|| format!("bad address {text:?}"))?
        .ip())
}

/// The recording proxy's listeners: Istio's outbound and inbound ports, both families.
const PROXY_LISTEN: &str = "127.0.0.1:15001,[::1]:15001,0.0.0.0:15006,[::]:15006";

/// `probe proxy LISTEN - --no-forward --v6only` as `uid` in `pod`, once it listens: it prints one
/// line per accepted connection (peer, local address, SO_ORIGINAL_DST answers).
pub(super) fn recorder(env: &TestEnv, pod: &Pod, listen: &str, uid: u32) -> Result<ChildGuard> {
    let mut child = pod.spawn(
        env,
        Spawn::new(&[probe(), "proxy", listen, "-", "--no-forward", "--v6only"]).user(uid, uid),
    )?;
    let want: Vec<SocketAddr> = listen
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    wait_listening(&mut child, &want, Duration::from_secs(10))?;
    Ok(child)
}

/// Where each listener's report stood before an attempt.
#[derive(Clone, Copy)]
pub(super) struct Mark {
    proxy: usize,
    server: usize,
}

/// Field order is drop order: processes first, then unload, the node (CNI DEL), the env.
pub(super) struct Fixture {
    proxy: ChildGuard,
    server_tcp: ChildGuard,
    pub(super) loaded: Loaded,
    pub(super) client: Arc<Pod>,
    pub(super) server: Arc<Pod>,
    // Read by source_route.rs, which shares this fixture; bypass.rs itself does not.
    #[allow(dead_code)]
    pub(super) node: Node,
    pub(super) env: TestEnv,
}

impl Fixture {
    /// A dual-stack node, the client enrolled with `enroll` flags, both recorders listening.
    pub(super) fn new(name: &str, enroll: &[&str]) -> Result<Self> {
        let env = TestEnv::new(name)?;
        let node = Node::new(&env, NodeOptions::dual_stack())?;
        let client = node.add_pod("client")?;
        let server = node.add_pod("server")?;
        let loaded = Loaded::load(&env)?;
        loaded.enroll(&client, enroll)?;
        let proxy = recorder(&env, &client, PROXY_LISTEN, PROXY_UID)?;
        let server_tcp = recorder(
            &env,
            &server,
            &format!("0.0.0.0:{PORT},[::]:{PORT}"),
            APP_UID,
        )?;
        Ok(Self {
            proxy,
            server_tcp,
            loaded,
            client,
            server,
            node,
            env,
        })
    }

    /// Replaces the proxy's recorder with a fresh one (its report starts empty).
    pub(super) fn start_proxy(&mut self) -> Result<()> {
        self.proxy.kill()?;
        self.proxy = recorder(&self.env, &self.client, PROXY_LISTEN, PROXY_UID)?;
        Ok(())
    }

    pub(super) fn server_v4(&self) -> String {
        SocketAddr::new(self.server.ipv4.into(), PORT).to_string()
    }

    pub(super) fn server_v6(&self) -> Result<String> {
        let v6 = self.server.ipv6.context("dual-stack server has no IPv6")?;
        Ok(SocketAddr::new(v6.into(), PORT).to_string())
    }

    pub(super) fn client_v6(&self) -> Result<IpAddr> {
        Ok(self
            .client
            .ipv6
            .context("dual-stack client has no IPv6")?
            .into())
    }

    pub(super) fn mark(&self) -> Mark {
        Mark {
            proxy: json_lines(&self.proxy.stdout()).len(),
            server: json_lines(&self.server_tcp.stdout()).len(),
        }
    }

    /// Runs `spec` in the client pod and the test cgroup; returns its output.
    pub(super) fn run(&self, spec: Spawn<'_>) -> Result<std::process::Output> {
        self.client
            .run_with(&self.env, spec, Duration::from_secs(30))
    }

    /// `probe ARGS` as the app's UID in the client pod; its last JSON line.
    pub(super) fn app(&self, args: &[&str]) -> Result<Value> {
        let mut argv = vec![probe()];
        argv.extend_from_slice(args);
        last_json(&self.run(Spawn::new(&argv).user(APP_UID, APP_UID))?)
    }

    /// Waits for the connection made since `m` and returns (proxy lines, server lines).
    pub(super) fn new_lines(&self, m: Mark) -> (Vec<Value>, Vec<Value>) {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let proxy: Vec<Value> = json_lines(&self.proxy.stdout())
                .into_iter()
                .skip(m.proxy)
                .collect();
            let server: Vec<Value> = json_lines(&self.server_tcp.stdout())
                .into_iter()
                .skip(m.server)
                .collect();
            if !proxy.is_empty() || !server.is_empty() || Instant::now() >= deadline {
                return (proxy, server);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Exactly one connection since `m`, and it reached the proxy with `orig` as its original
    /// destination (SO_ORIGINAL_DST for IPv4, IP6T_SO_ORIGINAL_DST for IPv6). Returns the proxy's
    /// report line.
    pub(super) fn captured(&self, what: &str, m: Mark, orig: &str) -> Result<Value> {
        let (proxy, server) = self.new_lines(m);
        ensure!(
            server.is_empty(),
            "{what}: went around the proxy to the server: {server:?}"
        );
        ensure!(
            proxy.len() == 1,
            "{what}: the proxy saw {} connections: {proxy:?}",
            proxy.len()
        );
        let line = proxy[0].clone();
        ensure!(
            line["orig_v4"]["addr"] == orig || line["orig_v6"]["addr"] == orig,
            "{what}: original destination is not {orig}: {line}"
        );
        eprintln!("bypass: {what}: captured, proxy saw {line}");
        Ok(line)
    }

    /// Exactly one connection since `m`, and it reached the server directly from `from`.
    pub(super) fn direct(&self, what: &str, m: Mark, from: IpAddr) -> Result<Value> {
        let (proxy, server) = self.new_lines(m);
        ensure!(proxy.is_empty(), "{what}: was captured: {proxy:?}");
        ensure!(
            server.len() == 1,
            "{what}: the server saw {} connections: {server:?}",
            server.len()
        );
        let line = server[0].clone();
        ensure!(
            ip_of(&line["peer"])? == from,
            "{what}: the server saw it from {} instead of {from}",
            line["peer"]
        );
        eprintln!("bypass: {what}: not captured (Istio's boundary), server saw {line}");
        Ok(line)
    }

    /// Nothing reached either listener since `m`.
    pub(super) fn nowhere(&self, what: &str, m: Mark) -> Result<()> {
        std::thread::sleep(Duration::from_millis(200));
        let (proxy, server) = self.new_lines(m);
        ensure!(
            proxy.is_empty() && server.is_empty(),
            "{what}: a connection got through: proxy {proxy:?}, server {server:?}"
        );
        Ok(())
    }
}

/// A `probe connect-sock` answer that connected and read the recorder's "probe" reply.
pub(super) fn connected(what: &str, v: &Value) -> Result<()> {
    ensure!(v["reply"] == "probe", "{what}: {v}");
    Ok(())
}

pub(super) fn failed_with(what: &str, v: &Value, errno: i64) -> Result<()> {
    ensure!(v["errno"] == errno, "{what}: wanted errno {errno}: {v}");
    eprintln!("bypass: {what}: refused by the kernel: {v}");
    Ok(())
}
