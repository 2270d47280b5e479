//! Machine-wide counters per round: what the rest of the machine (the hypervisor, the disk, other
//! processes, the page allocator) took from a round, so that a slow round in every lane, direct
//! included, can be told apart from a slow lane.

use std::fs;

use anyhow::{Context, Result};

/// CPU time of every CPU together (`/proc/stat`'s `cpu` line), in clock ticks, the dirty page
/// cache from `/proc/meminfo`, and the allocator's stalls from `/proc/vmstat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineCounters {
    /// Time the hypervisor ran something else while this VM's CPUs wanted to run.
    pub steal: u64,
    /// Idle time with I/O outstanding.
    pub iowait: u64,
    /// Every non-idle tick (user, nice, system, irq, softirq, steal).
    pub busy: u64,
    /// Every tick.
    pub total: u64,
    /// Dirty + Writeback now, in KiB (a level, not a counter).
    pub dirty_kib: u64,
    /// Times an allocation stopped to reclaim or compact memory itself (`allocstall_*` +
    /// `compact_stall`): work done in the context of whoever allocated, a socket's or a
    /// conntrack entry's included, which a short stall in one lane's process would not show as
    /// a wait.
    pub memory_stalls: u64,
}

/// The `cpu` line of /proc/stat: (steal, iowait, busy, total) in ticks.
pub fn parse_stat(text: &str) -> Option<(u64, u64, u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is already
    // counted in user and nice.
    let [user, nice, system, idle, iowait, irq, softirq, steal] = *v.get(..8)? else {
        return None;
    };
    let busy = user + nice + system + irq + softirq + steal;
    Some((steal, iowait, busy, busy + idle + iowait))
}

/// `Dirty` + `Writeback` of /proc/meminfo, in KiB.
pub fn parse_meminfo_dirty(text: &str) -> Option<u64> {
    Some(meminfo_field(text, "Dirty:")? + meminfo_field(text, "Writeback:")?)
}

fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Direct reclaim stalls (`allocstall_<zone>`, one counter per zone) plus `compact_stall`, from
/// /proc/vmstat.
pub fn parse_vmstat_stalls(text: &str) -> Option<u64> {
    let mut seen = false;
    let sum = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(name, _)| name.starts_with("allocstall_") || *name == "compact_stall")
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .inspect(|_| seen = true)
        .sum();
    seen.then_some(sum)
}

impl MachineCounters {
    pub fn read() -> Result<Self> {
        let stat = fs::read_to_string("/proc/stat").context("read /proc/stat")?;
        let mem = fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
        let vmstat = fs::read_to_string("/proc/vmstat").context("read /proc/vmstat")?;
        let (steal, iowait, busy, total) =
            parse_stat(&stat).context("no cpu line in /proc/stat")?;
        Ok(Self {
            steal,
            iowait,
            busy,
            total,
            dirty_kib: parse_meminfo_dirty(&mem).context("no Dirty/Writeback in /proc/meminfo")?,
            memory_stalls: parse_vmstat_stalls(&vmstat)
                .context("no allocstall or compact_stall in /proc/vmstat")?,
        })
    }

    /// The growth since `earlier`; `dirty_kib` is this reading's level.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            steal: self.steal.saturating_sub(earlier.steal),
            iowait: self.iowait.saturating_sub(earlier.iowait),
            busy: self.busy.saturating_sub(earlier.busy),
            total: self.total.saturating_sub(earlier.total),
            dirty_kib: self.dirty_kib,
            memory_stalls: self.memory_stalls.saturating_sub(earlier.memory_stalls),
        }
    }

    /// Steal as per mille of all CPU time over the interval (0 for an empty interval).
    pub fn steal_permille(&self) -> u64 {
        (self.steal * 1000).checked_div(self.total).unwrap_or(0)
    }

    /// I/O wait as per mille of all CPU time over the interval.
    pub fn iowait_permille(&self) -> u64 {
        (self.iowait * 1000).checked_div(self.total).unwrap_or(0)
    }

    /// Idle (neither busy nor waiting on I/O) as per mille of all CPU time: with both CPUs given
    /// to the lane's load, idle time is time the load did not use.
    pub fn idle_permille(&self) -> u64 {
        (self.total.saturating_sub(self.busy + self.iowait) * 1000)
            .checked_div(self.total)
            .unwrap_or(0)
    }
}

/// None (logged) when a read fails.
pub fn read() -> Option<MachineCounters> {
    MachineCounters::read()
        .map_err(|e| eprintln!("bench: reading machine counters: {e:#}"))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_and_meminfo() {
        let stat = "cpu  100 5 50 800 20 1 4 30 0 0\ncpu0 50 2 25 400 10 0 2 15 0 0\nintr 1\n";
        assert_eq!(parse_stat(stat), Some((30, 20, 190, 1010)));
        assert_eq!(parse_stat("cpu0 1 2 3\n"), None);
        let mem = "MemTotal: 100 kB\nMemFree: 40 kB\nDirty:   12 kB\nWriteback:   3 kB\n";
        assert_eq!(parse_meminfo_dirty(mem), Some(15));
        let vmstat = "nr_free_pages 9\nallocstall_dma 0\nallocstall_normal 3\nallocstall_movable 7\ncompact_stall 5\ncompact_fail 4\n";
        assert_eq!(parse_vmstat_stalls(vmstat), Some(15));
        assert_eq!(parse_vmstat_stalls("nr_free_pages 9\n"), None);
        let a = MachineCounters {
            steal: 130,
            iowait: 20,
            busy: 700,
            total: 1000,
            dirty_kib: 9,
            memory_stalls: 12,
        };
        let d = a.since(MachineCounters {
            steal: 30,
            iowait: 10,
            busy: 200,
            total: 500,
            dirty_kib: 99,
            memory_stalls: 10,
        });
        assert_eq!((d.steal, d.total, d.dirty_kib), (100, 500, 9));
        assert_eq!(d.memory_stalls, 2);
        assert_eq!(d.steal_permille(), 200);
        assert_eq!(d.iowait_permille(), 20);
        assert_eq!(d.idle_permille(), 0);
        assert_eq!(MachineCounters::default().steal_permille(), 0);
    }
}
