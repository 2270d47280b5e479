//! A process's scheduler accounting over a run (`/proc/<pid>/schedstat`), for the sidecars of the
//! new-connection rounds. A slow round whose client sidecar ran as much CPU as usual but in far
//! longer unbroken stretches did work it could not break off (in the kernel: its own connects
//! and the packets processed in its context), not waiting; the per-round table shows which.

use std::fs;

use anyhow::{Context, Result};

/// The three fields of `/proc/<pid>/schedstat`: time on the CPU, time runnable but waiting for
/// it (both ns), and the number of times it was put on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStat {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub timeslices: u64,
}

pub fn parse(text: &str) -> Option<SchedStat> {
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    let mut next = || fields.next()?.ok();
    Some(SchedStat {
        run_ns: next()?,
        wait_ns: next()?,
        timeslices: next()?,
    })
}

impl SchedStat {
    /// The main thread's accounting: the sidecars run one thread (`nbthread 1`).
    pub fn read(pid: u32) -> Result<Self> {
        let path = format!("/proc/{pid}/schedstat");
        let text = fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
        parse(&text).with_context(|| format!("{path}: {text:?}"))
    }

    pub fn since(self, earlier: Self) -> Self {
        Self {
            run_ns: self.run_ns.saturating_sub(earlier.run_ns),
            wait_ns: self.wait_ns.saturating_sub(earlier.wait_ns),
            timeslices: self.timeslices.saturating_sub(earlier.timeslices),
        }
    }

    /// Mean time on the CPU per timeslice, µs; None without a timeslice.
    pub fn us_per_timeslice(&self) -> Option<u64> {
        (self.run_ns / 1000).checked_div(self.timeslices)
    }

    pub fn run_ms(&self) -> u64 {
        self.run_ns / 1_000_000
    }

    /// Time runnable but not on a CPU, ms: what a saturated CPU costs a sidecar.
    pub fn wait_ms(&self) -> u64 {
        self.wait_ns / 1_000_000
    }
}

/// The client and the server sidecar of a lane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sidecars {
    pub client: SchedStat,
    pub server: SchedStat,
}

impl Sidecars {
    /// None (logged) when either read fails: a lane without sidecars, or one that exited.
    pub fn read(pids: Option<(u32, u32)>) -> Option<Self> {
        let (client, server) = pids?;
        match (SchedStat::read(client), SchedStat::read(server)) {
            (Ok(client), Ok(server)) => Some(Self { client, server }),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("bench: reading a sidecar's schedstat: {e:#}");
                None
            }
        }
    }

    pub fn since(self, earlier: Self) -> Self {
        Self {
            client: self.client.since(earlier.client),
            server: self.server.since(earlier.server),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_rates() {
        let s = parse("3000000000 200000 15000\n").unwrap();
        assert_eq!(
            s,
            SchedStat {
                run_ns: 3_000_000_000,
                wait_ns: 200_000,
                timeslices: 15_000
            }
        );
        assert_eq!(s.us_per_timeslice(), Some(200));
        assert_eq!(s.run_ms(), 3000);
        assert_eq!(parse("1 7999999 3").unwrap().wait_ms(), 7);
        assert_eq!(parse("1 2\n"), None);
        assert_eq!(parse("1 x 3\n"), None);
        let d = s.since(SchedStat {
            run_ns: 1_000_000_000,
            wait_ns: 0,
            timeslices: 14_000,
        });
        assert_eq!(d.us_per_timeslice(), Some(2000));
        assert_eq!(SchedStat::default().us_per_timeslice(), None);
    }
}
