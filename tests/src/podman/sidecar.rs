//! An HAProxy sidecar container in a podman pod.

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};

use super::{Podman, PodmanPod};
use crate::haproxy::{self, SidecarConfig};
use crate::net::listening_sockets;
use crate::util::poll;

/// An HAProxy sidecar container (the config of [`haproxy::render_config`], IPv4 listeners)
/// running as the proxy UID in a podman pod.
#[derive(Debug)]
pub struct Sidecar {
    pub container: String,
    pub config: SidecarConfig,
}

impl Sidecar {
    /// Writes the config into the rootfs, checks it with the host's `haproxy -c`, runs
    /// `haproxy -db` as `cfg.uid:cfg.gid` in `pod`, and waits until it listens.
    pub fn start(podman: &Podman, pod: &PodmanPod, cfg: SidecarConfig) -> Result<Self> {
        let rel = format!("etc/sidestep/haproxy-{}.cfg", pod.name);
        let host_path = podman.rootfs.join(&rel);
        fs::write(&host_path, haproxy::render_config(&cfg, false))
            .with_context(|| format!("write {}", host_path.display()))?;
        fs::set_permissions(&host_path, fs::Permissions::from_mode(0o644))?;
        let check = Command::new("haproxy")
            .args(["-c", "-f"])
            .arg(&host_path)
            .output()
            .context("haproxy -c")?;
        ensure!(
            check.status.success(),
            "haproxy -c {}: {}{}",
            host_path.display(),
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let name = format!("{}-haproxy", pod.name);
        let in_ctr = format!("/{rel}");
        let container = podman.run_detached(
            pod,
            &name,
            cfg.uid,
            cfg.gid,
            &["/usr/sbin/haproxy", "-db", "-f", &in_ctr],
        )?;
        let want = [
            SocketAddr::from(([127, 0, 0, 1], cfg.outbound_port)),
            SocketAddr::from(([0, 0, 0, 0], cfg.inbound_port)),
        ];
        poll(
            "haproxy listeners in the podman pod",
            Duration::from_secs(10),
            Duration::from_millis(20),
            || {
                let pid = podman.pid(&container)?;
                let have = listening_sockets(pid)?;
                Ok(want.iter().all(|w| have.contains(w)).then_some(()))
            },
        )
        .with_context(|| {
            format!(
                "starting haproxy in podman pod {}; logs: {}",
                pod.name,
                podman.logs(&container).unwrap_or_default()
            )
        })?;
        Ok(Self {
            container,
            config: cfg,
        })
    }

    /// HAProxy's log so far (one line per connection; see [`haproxy::render_config`]).
    pub fn log(&self, podman: &Podman) -> String {
        podman.logs(&self.container).unwrap_or_default()
    }

    /// Waits until the log contains every needle.
    pub fn wait_log(&self, podman: &Podman, needles: &[&str], timeout: Duration) -> Result<()> {
        poll(
            "sidecar log lines",
            timeout,
            Duration::from_millis(50),
            || {
                let log = self.log(podman);
                Ok(needles.iter().all(|n| log.contains(n)).then_some(()))
            },
        )
        .with_context(|| {
            format!(
                "wanted {needles:?} in the sidecar log:\n{}",
                self.log(podman)
            )
        })
    }
}
