//! The test app server: nginx in the foreground as root, single process, everything under a
//! private prefix in the env's scratch directory.

use std::fs;
use std::net::{Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sched::CpuSet;

use crate::env::TestEnv;
use crate::net::wait_listening;
use crate::netns;
use crate::pod::Pod;
use crate::process::{ChildGuard, Spawn};

const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The body of `GET /` for a server in pod `pod`.
pub fn body_for(pod: &str) -> String {
    format!("hello from {pod}\n")
}

/// What nginx writes per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logging {
    /// One access-log line per request (the tests read it to see the peer a request came from)
    /// and `info` in error.log.
    PerRequest,
    /// No access log and only warnings: what the benchmark runs, so that no lane's figures
    /// include a `write()` to disk per request and the writeback it leaves (millions of lines
    /// over a full run), as HAProxy's benchmark config has no per-connection log either.
    ErrorsOnly,
}

/// Renders nginx.conf. `GET /` returns [`body_for`]; `GET /whoami` returns
/// `remote=<addr>:<port> local=<addr>:<port>` as the server's socket sees them.
pub fn render_config(prefix: &Path, pod: &str, port: u16, ipv6: bool, logging: Logging) -> String {
    let p = prefix.display();
    let (error_level, access_log) = match logging {
        Logging::PerRequest => ("info", format!("{p}/access.log peers")),
        Logging::ErrorsOnly => ("warn", "off".to_owned()),
    };
    let body = body_for(pod).replace('\n', "\\n");
    let listen6 = if ipv6 {
        format!("listen [::]:{port} ipv6only=on;")
    } else {
        String::new()
    };
    format!(
        r#"daemon off;
master_process off;
worker_processes 1;
pid {p}/nginx.pid;
error_log {p}/error.log {error_level};
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {p}/body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    log_format peers '$remote_addr:$remote_port -> $server_addr:$server_port "$request" $status';
    server {{
        listen 0.0.0.0:{port};
        {listen6}
        access_log {access_log};
        default_type text/plain;
        location = /whoami {{ return 200 "remote=$remote_addr:$remote_port local=$server_addr:$server_port\n"; }}
        location / {{ return 200 "{body}"; }}
    }}
}}
"#
    )
}

/// A running nginx in a pod; killed on drop.
#[derive(Debug)]
pub struct Server {
    child: ChildGuard,
    port: u16,
    body: String,
    prefix: PathBuf,
}

impl Server {
    /// Starts nginx in `pod` (and the test cgroup) on `0.0.0.0:<port>` and, when the pod has
    /// IPv6, `[::]:<port>` (ipv6only), after `nginx -t`; waits until both listen.
    pub fn start(env: &TestEnv, pod: &Pod, port: u16) -> Result<Self> {
        Self::start_on(env, pod, port, None, Logging::PerRequest)
    }

    /// As [`Server::start`], pinned to `cpus` (the benchmark's layout), logging as `logging`.
    pub fn start_on(
        env: &TestEnv,
        pod: &Pod,
        port: u16,
        cpus: Option<CpuSet>,
        logging: Logging,
    ) -> Result<Self> {
        let ipv6 = netns::ipv6_enabled(&pod.netns_path);
        let prefix = env
            .tmp_dir()
            .join(format!("nginx-{}-{port}-{}", pod.name, env.next_seq()));
        fs::create_dir_all(&prefix).context("nginx prefix")?;
        let conf = prefix.join("nginx.conf");
        fs::write(
            &conf,
            render_config(&prefix, &pod.name, port, ipv6, logging),
        )
        .context("nginx.conf")?;
        let prefix_s = prefix.to_str().context("non-UTF-8 temp path")?.to_owned();
        let conf_s = conf.to_str().context("non-UTF-8 temp path")?.to_owned();
        let errlog = format!("{prefix_s}/error.log");
        let argv = |test: bool| -> Vec<&str> {
            let mut v = vec!["nginx", "-p", &prefix_s, "-c", &conf_s, "-e", &errlog];
            if test {
                v.insert(1, "-t");
            }
            v
        };
        let check = env.run(
            Spawn::new(&argv(true)).outside_cgroup(),
            Duration::from_secs(10),
        )?;
        if !check.status.success() {
            bail!(
                "nginx -t {}: {}{}",
                conf.display(),
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            );
        }
        let mut child = pod.spawn(env, Spawn::new(&argv(false)).cpus(cpus))?;
        let mut want = vec![SocketAddr::from(([0, 0, 0, 0], port))];
        if ipv6 {
            want.push(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)));
        }
        wait_listening(&mut child, &want, START_TIMEOUT).with_context(|| {
            format!(
                "starting nginx in pod {}; error.log: {}",
                pod.name,
                fs::read_to_string(&errlog).unwrap_or_default()
            )
        })?;
        Ok(Self {
            child,
            port,
            body: body_for(&pod.name),
            prefix,
        })
    }

    /// The process id (in the host pid namespace).
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// What `GET /` returns.
    pub fn body(&self) -> &str {
        &self.body
    }

    /// One line per request: `remote:port -> local:port "request" status`.
    pub fn access_log(&self) -> String {
        fs::read_to_string(self.prefix.join("access.log")).unwrap_or_default()
    }

    pub fn error_log(&self) -> String {
        fs::read_to_string(self.prefix.join("error.log")).unwrap_or_default()
    }

    pub fn child(&mut self) -> &mut ChildGuard {
        &mut self.child
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_benchmark_config_writes_nothing_per_request() {
        let prefix = Path::new("/x");
        let tests = render_config(prefix, "p", 80, false, Logging::PerRequest);
        assert!(tests.contains("access_log /x/access.log peers;"), "{tests}");
        let bench = render_config(prefix, "p", 80, false, Logging::ErrorsOnly);
        assert!(!bench.contains("access.log"), "{bench}");
        assert!(bench.contains("error_log /x/error.log warn;"), "{bench}");
    }
}
