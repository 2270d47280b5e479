//! The load generators (wrk, sockperf, iperf3), run as the app UID inside a lane's client pod
//! and cgroup, and the parsers of their output.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::Config;
use super::cpus::Role;
use super::topology::{APP_UID, HTTP_PORT, IPERF_PORT, Lane, SOCKPERF_PORT};
use crate::process::Spawn;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Workload {
    /// wrk, keep-alive connections.
    KeepAlive,
    /// wrk with `Connection: close`: one TCP connection per request.
    NewConn,
    /// sockperf ping-pong over one TCP connection.
    PingPong,
    /// iperf3, one stream.
    Bulk,
}

impl Workload {
    pub const ALL: [Workload; 4] = [
        Workload::KeepAlive,
        Workload::NewConn,
        Workload::PingPong,
        Workload::Bulk,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Workload::KeepAlive => "HTTP keep-alive",
            Workload::NewConn => "new connection per request",
            Workload::PingPong => "TCP ping-pong",
            Workload::Bulk => "bulk TCP",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct WrkResult {
    /// Requests/s (with `Connection: close`, also connections/s).
    pub rate: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub requests: u64,
    /// connect + read + write + timeout socket errors.
    pub errors: u64,
    pub non_2xx: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SockperfResult {
    pub p50_us: f64,
    pub p99_us: f64,
    pub observations: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Wrk(WrkResult),
    Sockperf(SockperfResult),
    /// Gbit/s at the receiver.
    Iperf(f64),
}

/// Runs workload `w` for `secs` seconds on `lane`.
pub fn run(lane: &Lane<'_>, w: Workload, cfg: &Config, secs: u32) -> Result<Outcome> {
    match w {
        Workload::KeepAlive => wrk(lane, cfg.keepalive_conns, false, secs).map(Outcome::Wrk),
        Workload::NewConn => wrk(lane, cfg.close_conns, true, secs).map(Outcome::Wrk),
        Workload::PingPong => sockperf(lane, secs).map(Outcome::Sockperf),
        Workload::Bulk => iperf3(lane, secs).map(Outcome::Iperf),
    }
}

/// Runs `argv` as the app in the lane's client pod; fails on a non-zero exit.
fn run_app(lane: &Lane<'_>, argv: &[&str], secs: u32) -> Result<String> {
    let timeout = Duration::from_secs(u64::from(secs) + 20);
    let out = lane.client.run_with(
        lane.env,
        Spawn::new(argv)
            .user(APP_UID, APP_UID)
            .cpus(lane.cpus.set(Role::LoadGen)),
        timeout,
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "`{}` exited {}: {}{}",
            argv.join(" "),
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(stdout)
}

/// wrk's command line: one thread, `conns` connections for `secs`, latency percentiles, and
/// `Connection: close` when `close` (one TCP connection per request).
pub fn wrk_args(url: &str, conns: u32, close: bool, secs: u32) -> Vec<String> {
    let mut argv: Vec<String> = [
        "wrk".to_owned(),
        "-t1".into(),
        "-c".into(),
        conns.to_string(),
        "-d".into(),
        format!("{secs}s"),
        "--timeout".into(),
        "5s".into(),
        "--latency".into(),
    ]
    .into();
    if close {
        argv.extend(["-H".to_owned(), "Connection: close".into()]);
    }
    argv.push(url.to_owned());
    argv
}

fn wrk(lane: &Lane<'_>, conns: u32, close: bool, secs: u32) -> Result<WrkResult> {
    let u = format!("http://{}/", lane.target(HTTP_PORT));
    let args = wrk_args(&u, conns, close, secs);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_app(lane, &argv, secs)?;
    let r = parse_wrk(&out).with_context(|| format!("wrk output:\n{out}"))?;
    if r.requests == 0 {
        bail!("wrk completed no request:\n{out}");
    }
    Ok(r)
}

fn sockperf(lane: &Lane<'_>, secs: u32) -> Result<SockperfResult> {
    let t = lane.target(SOCKPERF_PORT);
    let ip = t.ip().to_string();
    let port = t.port().to_string();
    let s = secs.to_string();
    let out = run_app(
        lane,
        &[
            "sockperf",
            "ping-pong",
            "--tcp",
            "-i",
            &ip,
            "-p",
            &port,
            "-t",
            &s,
            "--full-rtt",
        ],
        secs,
    )?;
    parse_sockperf(&out).with_context(|| format!("sockperf output:\n{out}"))
}

fn iperf3(lane: &Lane<'_>, secs: u32) -> Result<f64> {
    let t = lane.target(IPERF_PORT);
    let ip = t.ip().to_string();
    let port = t.port().to_string();
    let s = secs.to_string();
    let out = run_app(
        lane,
        &[
            "iperf3",
            "-c",
            &ip,
            "-p",
            &port,
            "-t",
            &s,
            "-J",
            "--connect-timeout",
            "5000",
        ],
        secs,
    )?;
    parse_iperf3(&out)
}

/// A wrk duration (`812.00us`, `1.23ms`, `2.00s`, `1.00m`) in microseconds.
pub fn parse_wrk_duration(s: &str) -> Result<f64> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1e6)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60e6)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600e6)
    } else {
        bail!("unknown wrk duration {s:?}");
    };
    Ok(num
        .parse::<f64>()
        .with_context(|| format!("wrk duration {s:?}"))?
        * mult)
}

pub fn parse_wrk(out: &str) -> Result<WrkResult> {
    let mut rate = None;
    let mut p50 = None;
    let mut p99 = None;
    let mut requests = None;
    let mut errors = 0;
    let mut non_2xx = 0;
    for line in out.lines() {
        let l = line.trim();
        if let Some(v) = l.strip_prefix("Requests/sec:") {
            rate = Some(v.trim().parse::<f64>().context("Requests/sec")?);
        } else if let Some(v) = l.strip_prefix("50%") {
            p50 = Some(parse_wrk_duration(v)?);
        } else if let Some(v) = l.strip_prefix("99%") {
            p99 = Some(parse_wrk_duration(v)?);
        } else if let Some(v) = l.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            for part in v.split(',') {
                if let Some(n) = part.split_whitespace().nth(1) {
                    errors += n.parse::<u64>().unwrap_or(0);
                }
            }
        } else if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
            non_2xx = v.trim().parse().unwrap_or(0);
        } else if l.contains(" requests in ") {
            requests = l.split_whitespace().next().and_then(|n| n.parse().ok());
        }
    }
    Ok(WrkResult {
        rate: rate.context("no Requests/sec line")?,
        p50_us: p50.context("no 50% line (was --latency given?)")?,
        p99_us: p99.context("no 99% line")?,
        requests: requests.context("no `N requests in` line")?,
        errors,
        non_2xx,
    })
}

/// Removes ANSI colour sequences (sockperf colours some lines).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            if it.peek() == Some(&'[') {
                it.next();
                for c2 in it.by_ref() {
                    if c2.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

pub fn parse_sockperf(out: &str) -> Result<SockperfResult> {
    let out = strip_ansi(out);
    let mut p50 = None;
    let mut p99 = None;
    let mut obs = None;
    for line in out.lines() {
        if let Some(rest) = line.split("---> percentile ").nth(1) {
            let mut it = rest.split('=');
            let pct: f64 = it.next().unwrap_or("").trim().parse().unwrap_or(-1.0);
            let v: Option<f64> = it.next().and_then(|v| v.trim().parse().ok());
            if pct == 50.0 {
                p50 = v;
            } else if pct == 99.0 {
                p99 = v;
            }
        } else if let Some(rest) = line.split("Total ").nth(1)
            && rest.contains("observations")
        {
            obs = rest.split_whitespace().next().and_then(|n| n.parse().ok());
        }
    }
    let observations = obs.context("no `Total N observations` line")?;
    if observations == 0 {
        bail!("sockperf made no observation");
    }
    Ok(SockperfResult {
        p50_us: p50.context("no 50th percentile line")?,
        p99_us: p99.context("no 99th percentile line")?,
        observations,
    })
}

/// Receiver-side Gbit/s from `iperf3 -J`.
pub fn parse_iperf3(json: &str) -> Result<f64> {
    let v: Value = serde_json::from_str(json).with_context(|| format!("iperf3 JSON:\n{json}"))?;
    if let Some(e) = v["error"].as_str() {
        bail!("iperf3: {e}");
    }
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 JSON has no end.sum_received.bits_per_second")?;
    Ok(bps / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRK: &str = "Running 1s test @ http://10.0.0.2:80/
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.10ms    1.20ms  20.05ms   90.00%
    Req/Sec    20.12k     1.01k   22.00k    70.00%
  Latency Distribution
     50%    2.95ms
     75%    3.40ms
     90%    4.10ms
     99%  812.00us
  20123 requests in 1.00s, 4.01MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:  20100.50
Transfer/sec:      4.01MB
";

    #[test]
    fn wrk_output() {
        let r = parse_wrk(WRK).unwrap();
        assert_eq!(r.rate, 20100.5);
        assert_eq!(r.p50_us, 2950.0);
        assert_eq!(r.p99_us, 812.0);
        assert_eq!(r.requests, 20123);
        assert_eq!(r.errors, 3);
        assert_eq!(r.non_2xx, 4);
        assert_eq!(parse_wrk_duration("2.00s").unwrap(), 2e6);
        assert!(parse_wrk("garbage").is_err());
    }

    #[test]
    fn sockperf_output() {
        let out = "sockperf: \u{1b}[2;35m====> avg-rtt=42.138 (std-dev=49.999)\u{1b}[0m
sockperf: \u{1b}[2;35mTotal 13050 observations\u{1b}[0m; each percentile contains 130.50 observations
sockperf: ---> <MAX> observation = 2969.314
sockperf: ---> percentile 99.999 = 2969.314
sockperf: ---> percentile 99.000 =  109.752
sockperf: ---> percentile 90.000 =   79.618
sockperf: ---> percentile 50.000 =   16.464
sockperf: ---> <MIN> observation =   12.368
";
        let r = parse_sockperf(out).unwrap();
        assert_eq!(r.p50_us, 16.464);
        assert_eq!(r.p99_us, 109.752);
        assert_eq!(r.observations, 13050);
    }

    #[test]
    fn iperf3_output() {
        let j = r#"{"end":{"sum_received":{"bits_per_second":2.5e10}}}"#;
        assert_eq!(parse_iperf3(j).unwrap(), 25.0);
        assert!(parse_iperf3(r#"{"error":"unable to connect"}"#).is_err());
    }
}
