//! sk_msg under bulk writes (issue 17 item 4, docs/research/skmsg-enomem.md): an app writes
//! as fast as it can to a proxy stand-in that reads nothing for seconds. Redirected messages
//! used to pile up on the proxy's socket without limit, until TCP's global memory limits failed
//! the writes with ENOMEM; now the app's socket switches to the TCP path for good once the
//! proxy holds more than max(its sk_rcvbuf, 4 MiB). Every byte must arrive in order, no write
//! may fail, the proxy's queue must stay near the cap, and ping-pong traffic must keep the
//! shortcut. Needs root; skips otherwise.
//!
//! In the kernel-matrix VMs (`SIDESTEP_IN_VM`) net.ipv4.tcp_mem is lowered, so the old
//! behaviour fails there with ENOMEM too; on the host (where tcp_mem is host-global and shared)
//! the queue bound is what fails it.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Pod, Spawn, TestEnv, scaled, sidestep::Loaded, skip_unless_root,
};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;
const MIB: u64 = 1 << 20;
/// Any address off the pod: connect4 sends it to the outbound port.
const DESTINATION: &str = "10.255.0.1:80";
const SINK: &str = "127.0.0.1:15001";
/// What the proxy's socket may hold: the 4 MiB cap, the message that crossed it, the TCP data
/// behind them, and per-page accounting. Measured: 4.5 MiB on 6.18 and 6.12, 6.1 MiB on 6.1
/// (TCG). The old program queued all of the stream (256 MiB here, ENOMEM past 64 MiB in VMs).
const QUEUE_BOUND: u64 = 12 * MIB;
const TCP_MEM: &str = "/proc/sys/net/ipv4/tcp_mem";

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

fn in_vm() -> bool {
    std::env::var_os("SIDESTEP_IN_VM").is_some_and(|v| !v.is_empty())
}

/// Lowers net.ipv4.tcp_mem (host-global!) and restores it on drop; only ever inside a VM.
struct TcpMem(String);

impl TcpMem {
    fn lower(pages: &str) -> Result<Self> {
        ensure!(in_vm(), "refusing to change net.ipv4.tcp_mem outside a VM");
        let old = std::fs::read_to_string(TCP_MEM)?;
        std::fs::write(TCP_MEM, pages)?;
        Ok(Self(old.trim().to_string()))
    }
}

impl Drop for TcpMem {
    fn drop(&mut self) {
        let _ = std::fs::write(TCP_MEM, &self.0);
    }
}

fn last_json(text: &str, key: &str) -> Result<Value> {
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v.get(key).is_some())
        .with_context(|| format!("no {key:?} line in {text:?}"))
}

fn sk_msg_counters(loaded: &Loaded, pod: &Pod) -> Result<(u64, u64)> {
    let c = loaded
        .counters(pod.netns_cookie()?)?
        .context("pod not enrolled")?;
    Ok((
        c["sk_msg_redirects"].as_u64().context("sk_msg_redirects")?,
        c["sk_msg_fallbacks"].as_u64().context("sk_msg_fallbacks")?,
    ))
}

#[test]
fn sk_msg_survives_bulk_writes_to_a_slow_proxy() -> Result<()> {
    if skip_unless_root("sk_msg_survives_bulk_writes_to_a_slow_proxy") {
        return Ok(());
    }
    let env = TestEnv::new("skmsg-bulk")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod("app")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&pod, &["--sk-msg"])?;
    // 16/32/64 MiB: the old program's queue passes them within a second.
    let _tcp_mem = in_vm()
        .then(|| TcpMem::lower("4096 8192 16384"))
        .transpose()?;
    // Under TCG every byte costs 20-50x; 128 MiB is still twice tcp_mem[2] there.
    let total = if in_vm() { 128 * MIB } else { 256 * MIB };

    // Bulk: the proxy reads nothing for 3 s (scaled) while the app writes.
    let sleep_ms = scaled(Duration::from_secs(3)).as_millis().to_string();
    let mut sink = pod.spawn(
        &env,
        Spawn::new(&[probe(), "slow-sink", SINK, "--sleep-ms", &sleep_ms])
            .user(PROXY_UID, PROXY_UID),
    )?;
    sink.wait_stdout(&["listening"], scaled(Duration::from_secs(5)))?;
    let total_arg = total.to_string();
    let out = pod.run_with(
        &env,
        Spawn::new(&[probe(), "bulk-write", DESTINATION, &total_arg]).user(APP_UID, APP_UID),
        scaled(Duration::from_secs(120)),
    )?;
    let writer = last_json(&String::from_utf8_lossy(&out.stdout), "written")?;
    sink.wait_timeout(scaled(Duration::from_secs(60)))?
        .context("the sink did not finish")?;
    let read = last_json(&sink.stdout(), "bytes")?;
    eprintln!("writer {writer}\nsink {read}");
    ensure!(
        writer["failed_writes"] == 0,
        "writes failed (errno {}): {writer}",
        writer["last_errno"]
    );
    ensure!(writer["written"] == total, "{writer}");
    ensure!(read["bytes"] == total, "the proxy got {read}");
    ensure!(read["bad_at"].is_null(), "bytes out of order: {read}");
    let max_rmem = read["max_rmem"].as_u64().context("max_rmem")?;
    ensure!(
        max_rmem <= QUEUE_BOUND,
        "the proxy's socket held {max_rmem} bytes (bound {QUEUE_BOUND})"
    );
    let (redirects, fallbacks) = sk_msg_counters(&loaded, &pod)?;
    ensure!(redirects > 0, "nothing was redirected before the switch");
    ensure!(fallbacks >= 1, "no fallback counted");

    // Ping-pong on a fresh connection: never backed up, so never switched.
    let mut echo = pod.spawn(
        &env,
        Spawn::new(&[probe(), "slow-sink", SINK, "--echo"]).user(PROXY_UID, PROXY_UID),
    )?;
    echo.wait_stdout(&["listening"], scaled(Duration::from_secs(5)))?;
    const ROUNDS: u64 = 300;
    let out = pod.run_with(
        &env,
        Spawn::new(&[
            probe(),
            "ping-pong",
            DESTINATION,
            &ROUNDS.to_string(),
            "4096",
        ])
        .user(APP_UID, APP_UID),
        scaled(Duration::from_secs(60)),
    )?;
    let pp = last_json(&String::from_utf8_lossy(&out.stdout), "rounds")?;
    ensure!(pp["ok"] == true, "{pp}");
    echo.wait_timeout(scaled(Duration::from_secs(10)))?;
    let (redirects_after, fallbacks_after) = sk_msg_counters(&loaded, &pod)?;
    let redirected = redirects_after - redirects;
    eprintln!(
        "ping-pong: {redirected} redirects, {} fallbacks",
        fallbacks_after - fallbacks
    );
    // Both directions of every round.
    ensure!(
        redirected >= 2 * ROUNDS,
        "ping-pong lost the shortcut: {redirected} redirects for {ROUNDS} rounds"
    );
    ensure!(
        fallbacks_after == fallbacks,
        "ping-pong switched to TCP ({} fallbacks)",
        fallbacks_after - fallbacks
    );
    Ok(())
}
