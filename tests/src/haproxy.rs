//! The test sidecar: an unmodified HAProxy in `mode tcp` forwarding each accepted connection
//! to its original destination (SO_ORIGINAL_DST / IP6T_SO_ORIGINAL_DST), like Envoy's
//! original_dst cluster in an Istio sidecar.
//!
//! **IPv6 caveat.** HAProxy 2.6 asks `SO_ORIGINAL_DST` (SOL_IP) only for AF_INET sockets; for
//! AF_INET6 it takes the destination from getsockname(2) and never asks
//! `IP6T_SO_ORIGINAL_DST`. So IPv6 works where getsockname already returns the original
//! destination (a TPROXY-like `bpf_sk_assign` inbound, or a cgroup/getsockname6 hook), but not
//! behind an ip6tables REDIRECT or a plain connect6 rewrite. Envoy does ask
//! `IP6T_SO_ORIGINAL_DST`.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::env::TestEnv;
use crate::net::wait_listening;
use crate::netns;
use crate::pod::Pod;
use crate::process::{ChildGuard, Spawn};

/// How long to wait for the listeners.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Ports and identity of the sidecar; the defaults are Istio's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SidecarConfig {
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub uid: u32,
    pub gid: u32,
    /// TPROXY interception: the inbound backends connect to the app from the client's own
    /// address (`source 0.0.0.0 usesrc clientip`), not from 127.0.0.6, and HAProxy runs with
    /// CAP_NET_ADMIN for IP_TRANSPARENT, as a TPROXY sidecar must. HAProxy 2.6 cannot mark that
    /// socket (Envoy's original_src does); sidestep marks it.
    pub transparent: bool,
}

impl Default for SidecarConfig {
    fn default() -> Self {
        Self {
            outbound_port: 15001,
            inbound_port: 15006,
            uid: 1337,
            gid: 1337,
            transparent: false,
        }
    }
}

/// Renders haproxy.cfg.
///
/// - outbound: `127.0.0.1:<out>` and `[::1]:<out>` -> `server orig 0.0.0.0:0`, which sends each
///   connection to its original destination (HAProxy takes the family from that address);
/// - inbound: `0.0.0.0:<in>` and `[::]:<in>` (v6only), in two frontends so that each backend
///   binds Istio's inbound passthrough source of its family: 127.0.0.6 or ::6 (HAProxy 2.6
///   rejects `source ::6`, which it reads as address `:` port 6; it needs `[::6]:0`).
///
/// A connection whose original destination is the listener itself (nothing redirected it, or
/// the original-destination lookup failed) goes to `loop_guard`, a backend without servers:
/// it is logged (`be=loop_guard term=SC`) and closed with a FIN. Forwarding it would make
/// HAProxy connect to itself in a loop until maxconn; `tcp-request connection reject` would
/// log nothing and reset, which can surface as a failed connect(2).
pub fn render_config(cfg: &SidecarConfig, ipv6: bool) -> String {
    let SidecarConfig {
        outbound_port: out,
        inbound_port: inb,
        transparent,
        ..
    } = *cfg;
    let (source4, source6) = if transparent {
        ("0.0.0.0 usesrc clientip", "[::]:0 usesrc clientip")
    } else {
        ("127.0.0.6", "[::6]:0")
    };
    let mut s = format!(
        r#"# sidestep test sidecar. Foreground (-db), no chroot, no pidfile, no user switch:
# it is started as the proxy UID directly.
global
    maxconn 512
    nbthread 1
    log stderr format raw local0 info

defaults
    mode tcp
    log global
    log-format "%ft client=%ci:%cp dst=%fi:%fp be=%b server=%si:%sp up=%U down=%B term=%ts"
    timeout connect 5s
    timeout client 5s
    timeout server 5s

frontend outbound
    bind 127.0.0.1:{out}
"#
    );
    if ipv6 {
        s += &format!("    bind [::1]:{out} v6only\n");
    }
    s += &format!(
        r#"    use_backend loop_guard if {{ dst_port {out} }}
    default_backend outbound_orig

backend outbound_orig
    server orig 0.0.0.0:0

# No server: connections whose original destination is a sidecar port are logged and closed.
backend loop_guard

frontend inbound
    bind 0.0.0.0:{inb}
    use_backend loop_guard if {{ dst_port {inb} }}
    default_backend inbound_orig

backend inbound_orig
    server orig 0.0.0.0:0 source {source4}
"#
    );
    if ipv6 {
        s += &format!(
            r#"
frontend inbound6
    bind [::]:{inb} v6only
    use_backend loop_guard if {{ dst_port {inb} }}
    default_backend inbound_orig6

backend inbound_orig6
    server orig [::]:0 source {source6}
"#
        );
    }
    s
}

/// A running HAProxy sidecar in a pod; killed on drop.
#[derive(Debug)]
pub struct Sidecar {
    child: ChildGuard,
    config: SidecarConfig,
    config_path: PathBuf,
    ipv6: bool,
}

impl Sidecar {
    /// Writes and checks (`haproxy -c`) the config, starts `haproxy -db` as `cfg.uid`/`cfg.gid` in
    /// the pod and the test cgroup, and waits until all listeners are up. The IPv6 passthrough
    /// source `::6` on the pod's `lo` is the capture's to add (sidestep's enrolment, or
    /// istio-iptables), not the sidecar's: the tests show the product doing it.
    pub fn start(env: &TestEnv, pod: &Pod, cfg: SidecarConfig) -> Result<Self> {
        let ipv6 = netns::ipv6_enabled(&pod.netns_path);
        let path = env
            .tmp_dir()
            .join(format!("haproxy-{}-{}.cfg", pod.name, env.next_seq()));
        fs::write(&path, render_config(&cfg, ipv6))
            .with_context(|| format!("write {}", path.display()))?;
        let path_s = path.to_str().context("non-UTF-8 temp path")?;
        let check = env.run(
            Spawn::new(&["haproxy", "-c", "-f", path_s]).outside_cgroup(),
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
        let (uid, gid) = (cfg.uid.to_string(), cfg.gid.to_string());
        let transparent_argv = [
            "setpriv",
            "--reuid",
            &uid,
            "--regid",
            &gid,
            "--clear-groups",
            "--inh-caps",
            "+net_admin",
            "--ambient-caps",
            "+net_admin",
            "haproxy",
            "-db",
            "-f",
            path_s,
        ];
        let plain_argv = ["haproxy", "-db", "-f", path_s];
        let spawn = if cfg.transparent {
            Spawn::new(&transparent_argv)
        } else {
            Spawn::new(&plain_argv).user(cfg.uid, cfg.gid)
        };
        let mut child = pod.spawn(env, spawn)?;
        let mut want: Vec<SocketAddr> = vec![
            SocketAddr::from(([127, 0, 0, 1], cfg.outbound_port)),
            SocketAddr::from(([0, 0, 0, 0], cfg.inbound_port)),
        ];
        if ipv6 {
            want.push(SocketAddr::from((
                std::net::Ipv6Addr::LOCALHOST,
                cfg.outbound_port,
            )));
            want.push(SocketAddr::from((
                std::net::Ipv6Addr::UNSPECIFIED,
                cfg.inbound_port,
            )));
        }
        wait_listening(&mut child, &want, START_TIMEOUT)
            .with_context(|| format!("starting haproxy in pod {}", pod.name))?;
        Ok(Self {
            child,
            config: cfg,
            config_path: path,
            ipv6,
        })
    }

    /// The process id (in the host pid namespace).
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    pub fn config(&self) -> &SidecarConfig {
        &self.config
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Whether the IPv6 listeners were configured.
    pub fn ipv6(&self) -> bool {
        self.ipv6
    }

    /// HAProxy's log so far: one line per connection (see [`render_config`] for the format).
    pub fn log(&self) -> String {
        self.child.stderr()
    }

    /// Waits until the log contains every needle. HAProxy logs a connection when it ends, a
    /// moment after the client sees it close.
    pub fn wait_log(&self, needles: &[&str], timeout: Duration) -> Result<()> {
        self.child.wait_stderr(needles, timeout)
    }

    pub fn child(&mut self) -> &mut ChildGuard {
        &mut self.child
    }

    /// `127.0.0.1:<outbound_port>`.
    pub fn outbound_v4(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.config.outbound_port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_has_both_families() {
        let c = render_config(&SidecarConfig::default(), true);
        assert!(c.contains("bind [::1]:15001 v6only"));
        assert!(c.contains("source [::6]:0"));
        assert!(c.contains("use_backend loop_guard if { dst_port 15006 }"));
        let c4 = render_config(&SidecarConfig::default(), false);
        assert!(!c4.contains("::"));
        let t = SidecarConfig {
            transparent: true,
            ..Default::default()
        };
        let ct = render_config(&t, true);
        assert!(ct.contains("source 0.0.0.0 usesrc clientip"));
        assert!(ct.contains("source [::]:0 usesrc clientip"));
        assert!(!ct.contains("127.0.0.6"));
    }
}
