//! The original-destination load the churn and connection-path tests share: `probe origdst-echo`
//! as the pod's proxy on the outbound port, and `probe connect-many` as its app. The probe's path
//! is the caller's (`env!("CARGO_BIN_EXE_probe")` exists only in integration tests).

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::{ChildGuard, Pod, Spawn, TestEnv, wait_listening};

/// The proxy's outbound listener every test of this kind uses.
pub const OUTBOUND: &str = "127.0.0.1:15001";

/// Starts `probe origdst-echo` on [`OUTBOUND`] in `pod` as `uid`, and waits until it listens.
pub fn origdst_echo(env: &TestEnv, pod: &Pod, probe: &str, uid: u32) -> Result<ChildGuard> {
    let mut echo = pod.spawn(
        env,
        Spawn::new(&[probe, "origdst-echo", OUTBOUND]).user(uid, uid),
    )?;
    let listener: SocketAddr = OUTBOUND.parse()?;
    wait_listening(&mut echo, &[listener], Duration::from_secs(10))?;
    Ok(echo)
}

/// One `probe connect-many` run: `connections` short connections from 4 threads to `base`'s
/// port + i % 1000, each checked against origdst-echo's answer.
pub struct ConnectMany<'a> {
    pub probe: &'a str,
    pub uid: u32,
    pub base: String,
    pub connections: u64,
    /// Already scaled for emulation by the caller ([`crate::time_scale`]).
    pub deadline: Duration,
    /// An address to connect to first and hold open throughout (`--hold-first`).
    pub hold_first: Option<String>,
}

impl ConnectMany<'_> {
    /// Runs it in `pod` and returns the probe's JSON report.
    pub fn run(&self, env: &TestEnv, pod: &Pod) -> Result<Value> {
        let n = self.connections.to_string();
        let deadline_ms = self.deadline.as_millis().to_string();
        let mut argv = vec![
            self.probe,
            "connect-many",
            &self.base,
            &n,
            "--threads",
            "4",
            "--ports",
            "1000",
            "--deadline-ms",
            &deadline_ms,
        ];
        if let Some(held) = &self.hold_first {
            argv.extend(["--hold-first", held.as_str()]);
        }
        let out = pod.run_with(
            env,
            Spawn::new(&argv).user(self.uid, self.uid),
            self.deadline + Duration::from_secs(30),
        )?;
        serde_json::from_slice(&out.stdout).with_context(|| format!("connect-many said {out:?}"))
    }
}
