//! The benchmark's HAProxy sidecar. Same data path as [`crate::haproxy`] (mode tcp, outbound
//! `127.0.0.1:15001` to the original destination, inbound `0.0.0.0:15006` to the original
//! destination from `127.0.0.6`), plus explicit frontends with static backends for the
//! explicit-proxy mode, and tuned for load: no per-connection log, longer idle timeouts (the
//! iperf3 control connection is idle for the whole test), more connections.
//!
//! The explicit frontends are in every sidecar of every mode, so the proxies of modes 2-4 run
//! the same configuration; only mode 2's clients use them.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sched::CpuSet;

use crate::env::TestEnv;
use crate::net::wait_listening;
use crate::pod::Pod;
use crate::process::{ChildGuard, Spawn};

pub const PROXY_UID: u32 = 1337;
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PORT: u16 = 15006;

/// One explicit service: the client sidecar listens on `127.0.0.1:<explicit>` and sends to the
/// server sidecar's `<server ip>:<explicit>`, which sends to `<server ip>:<app>` from
/// 127.0.0.6, the same last hop as the captured inbound path.
#[derive(Clone, Copy, Debug)]
pub struct ExplicitPort {
    pub explicit: u16,
    pub app: u16,
}

/// Which side of the explicit path a sidecar plays.
#[derive(Clone, Copy, Debug)]
pub enum Role {
    /// Explicit frontends on loopback with a static backend at the server pod.
    Client { server: Ipv4Addr },
    /// Explicit frontends on all addresses with a static backend at the local app.
    Server { own: Ipv4Addr },
}

pub fn render(role: Role, ports: &[ExplicitPort]) -> String {
    let out = OUTBOUND_PORT;
    let inb = INBOUND_PORT;
    let mut s = format!(
        r#"# sidestep benchmark sidecar (see tests/src/bench/haproxy_cfg.rs).
global
    maxconn 8192
    nbthread 1

defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s

frontend outbound
    bind 127.0.0.1:{out}
    use_backend loop_guard if {{ dst_port {out} }}
    default_backend outbound_orig

backend outbound_orig
    server orig 0.0.0.0:0

backend loop_guard

frontend inbound
    bind 0.0.0.0:{inb}
    use_backend loop_guard if {{ dst_port {inb} }}
    default_backend inbound_orig

backend inbound_orig
    server orig 0.0.0.0:0 source 127.0.0.6
"#
    );
    for p in ports {
        let e = p.explicit;
        match role {
            Role::Client { server } => {
                s += &format!(
                    "\nfrontend explicit_{e}\n    bind 127.0.0.1:{e}\n    default_backend static_{e}\n\nbackend static_{e}\n    server s {server}:{e}\n"
                );
            }
            Role::Server { own } => {
                s += &format!(
                    "\nfrontend explicit_{e}\n    bind 0.0.0.0:{e}\n    default_backend static_{e}\n\nbackend static_{e}\n    server app {own}:{} source 127.0.0.6\n",
                    p.app
                );
            }
        }
    }
    s
}

/// Checks the config with `haproxy -c`, starts `haproxy -db` as the proxy UID/GID in `pod` and
/// `env`'s cgroup, and waits for every listener.
pub fn start(
    env: &TestEnv,
    pod: &Pod,
    role: Role,
    ports: &[ExplicitPort],
    cpus: Option<CpuSet>,
) -> Result<ChildGuard> {
    let path = env
        .tmp_dir()
        .join(format!("bench-haproxy-{}-{}.cfg", pod.name, env.next_seq()));
    fs::write(&path, render(role, ports)).with_context(|| format!("write {}", path.display()))?;
    let path_s = path.to_str().context("non-UTF-8 temp path")?;
    let check = env.run(
        Spawn::new(&["haproxy", "-c", "-q", "-f", path_s]).outside_cgroup(),
        Duration::from_secs(10),
    )?;
    if !check.status.success() {
        bail!(
            "haproxy -c {}: {}{}",
            path.display(),
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
    let mut child = pod.spawn(
        env,
        Spawn::new(&["haproxy", "-db", "-f", path_s])
            .user(PROXY_UID, PROXY_UID)
            .cpus(cpus),
    )?;
    let mut want = vec![
        SocketAddr::from(([127, 0, 0, 1], OUTBOUND_PORT)),
        SocketAddr::from(([0, 0, 0, 0], INBOUND_PORT)),
    ];
    for p in ports {
        want.push(match role {
            Role::Client { .. } => SocketAddr::from(([127, 0, 0, 1], p.explicit)),
            Role::Server { .. } => SocketAddr::from(([0, 0, 0, 0], p.explicit)),
        });
    }
    wait_listening(&mut child, &want, Duration::from_secs(10))
        .with_context(|| format!("starting the bench sidecar in pod {}", pod.name))?;
    Ok(child)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_frontends() {
        let ports = [ExplicitPort {
            explicit: 15080,
            app: 80,
        }];
        let c = render(
            Role::Client {
                server: Ipv4Addr::new(10, 1, 2, 3),
            },
            &ports,
        );
        assert!(c.contains("bind 127.0.0.1:15080"));
        assert!(c.contains("server s 10.1.2.3:15080"));
        assert!(c.contains("bind 127.0.0.1:15001"));
        let s = render(
            Role::Server {
                own: Ipv4Addr::new(10, 1, 2, 4),
            },
            &ports,
        );
        assert!(s.contains("bind 0.0.0.0:15080"));
        assert!(s.contains("server app 10.1.2.4:80 source 127.0.0.6"));
        assert!(!s.contains(" log "));
    }
}
