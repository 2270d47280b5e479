//! Which CPU each of a lane's processes runs on. Without pinning, the scheduler places the load
//! generator, two sidecars and the servers anew in every run, and a run where wrk lands beside
//! the busiest sidecar is a different experiment from one where it does not: part of the
//! round-to-round spread. Every lane gets the same layout.
//!
//! Default with two CPUs or more: the client pod (load generator and client sidecar) on the
//! first, the server pod (server sidecar, nginx, sockperf, iperf3) on the second, as if the two
//! pods were on two nodes. Each capture's costs then land on a CPU that is busy: the outbound
//! hook runs in the app's connect(2) and the REDIRECT in its output path, both on the client's
//! CPU. Alone on its CPU, a load generator could absorb a client-side cost in idle time and the
//! rates would not show it. `SIDESTEP_BENCH_CPUS` overrides the layout.

use std::fmt;

use anyhow::{Context, Result, bail, ensure};
use nix::sched::CpuSet;

/// `load generator,client sidecar,server sidecar,servers` as indices into the CPUs the runner may
/// use, e.g. `0,1,1,1` for the load generator alone; `none` to pin nothing.
pub const CPUS_ENV: &str = "SIDESTEP_BENCH_CPUS";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    LoadGen,
    ClientSidecar,
    ServerSidecar,
    /// nginx, sockperf server and iperf3 server.
    Server,
}

impl Role {
    const ALL: [Role; 4] = [
        Role::LoadGen,
        Role::ClientSidecar,
        Role::ServerSidecar,
        Role::Server,
    ];

    fn label(self) -> &'static str {
        match self {
            Role::LoadGen => "load generator (wrk, sockperf, iperf3 client)",
            Role::ClientSidecar => "client sidecar",
            Role::ServerSidecar => "server sidecar",
            Role::Server => "servers (nginx, sockperf, iperf3)",
        }
    }
}

/// The CPU of each [`Role`], or why nothing is pinned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpuLayout {
    /// CPU ids (as the kernel numbers them), in [`Role::ALL`] order.
    Pinned([usize; 4]),
    Unpinned(String),
}

impl CpuLayout {
    /// From the CPUs this process may run on and `SIDESTEP_BENCH_CPUS`.
    pub fn from_env() -> Result<Self> {
        let allowed = allowed_cpus()?;
        let spec = std::env::var(CPUS_ENV).ok();
        Self::plan(&allowed, spec.as_deref())
    }

    /// The layout for `allowed` CPUs and an optional override.
    pub fn plan(allowed: &[usize], spec: Option<&str>) -> Result<Self> {
        let spec = spec.map(str::trim).filter(|s| !s.is_empty());
        if spec == Some("none") {
            return Ok(Self::Unpinned(format!("not pinned ({CPUS_ENV}=none)")));
        }
        let idx: [usize; 4] = match spec {
            Some(s) => {
                let v = s
                    .split(',')
                    .map(|x| x.trim().parse::<usize>())
                    .collect::<Result<Vec<_>, _>>()
                    .with_context(|| format!("{CPUS_ENV}={s:?}: want four CPU indices"))?;
                v.try_into().map_err(|v: Vec<usize>| {
                    anyhow::anyhow!("{CPUS_ENV}={s:?}: want four CPU indices, got {}", v.len())
                })?
            }
            None if allowed.len() < 2 => {
                return Ok(Self::Unpinned(format!(
                    "not pinned: the runner may use {} CPU, and a layout needs two",
                    allowed.len()
                )));
            }
            None => [0, 0, 1, 1],
        };
        let mut cpus = [0; 4];
        for (c, i) in cpus.iter_mut().zip(idx) {
            ensure!(
                i < allowed.len(),
                "{CPUS_ENV}: index {i}, but the runner may use only {} CPUs ({allowed:?})",
                allowed.len()
            );
            *c = allowed[i];
        }
        Ok(Self::Pinned(cpus))
    }

    /// The affinity for a process of `role`; None when unpinned.
    pub fn set(&self, role: Role) -> Option<CpuSet> {
        let Self::Pinned(cpus) = self else {
            return None;
        };
        let i = Role::ALL.iter().position(|r| *r == role)?;
        let mut set = CpuSet::new();
        set.set(cpus[i]).ok()?;
        Some(set)
    }
}

impl fmt::Display for CpuLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unpinned(why) => f.write_str(why),
            Self::Pinned(cpus) => {
                let parts: Vec<String> = Role::ALL
                    .iter()
                    .zip(cpus)
                    .map(|(r, c)| format!("{} on CPU {c}", r.label()))
                    .collect();
                write!(f, "every lane: {}", parts.join(", "))
            }
        }
    }
}

/// The CPUs in this process's affinity mask, in order.
fn allowed_cpus() -> Result<Vec<usize>> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .context("sched_getaffinity")?;
    let v: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    if v.is_empty() {
        bail!("sched_getaffinity returned no CPU");
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        assert_eq!(
            CpuLayout::plan(&[0, 1], None).unwrap(),
            CpuLayout::Pinned([0, 0, 1, 1])
        );
        // Indices map onto the allowed CPUs, which need not start at 0.
        assert_eq!(
            CpuLayout::plan(&[2, 5, 7], Some("0,1,1,2")).unwrap(),
            CpuLayout::Pinned([2, 5, 5, 7])
        );
        let one = CpuLayout::plan(&[3], None).unwrap();
        assert!(matches!(one, CpuLayout::Unpinned(_)));
        assert_eq!(one.set(Role::LoadGen), None);
        assert!(matches!(
            CpuLayout::plan(&[0, 1], Some("none")).unwrap(),
            CpuLayout::Unpinned(_)
        ));
        assert!(CpuLayout::plan(&[0, 1], Some("0,1,2,1")).is_err());
        assert!(CpuLayout::plan(&[0, 1], Some("0,1")).is_err());
        let l = CpuLayout::plan(&[0, 1], None).unwrap();
        let s = l.set(Role::ServerSidecar).unwrap();
        assert!(s.is_set(1).unwrap() && !s.is_set(0).unwrap());
        assert!(l.to_string().contains("client sidecar on CPU 0"));
    }
}
