//! What the churn tests count: entries of the per-pod maps, per-pod link pins, state
//! records, sidestep's BPF objects and links, and this process's file descriptors.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// Every per-pod map, and the pending original destinations.
pub const MAPS: [&str; 5] = [
    "SIDESTEP_POD",
    "SIDESTEP_PORTS",
    "SIDESTEP_CIDRS",
    "SIDESTEP_ADDRS",
    "SIDESTEP_STATS",
];

pub use sidestep_tests::faults::bpftool as bpftool_json;

pub fn map_entries(pin_root: &Path, map: &str) -> Result<usize> {
    let path = pin_root.join("maps").join(map).display().to_string();
    Ok(bpftool_json(&["map", "dump", "pinned", &path])?
        .as_array()
        .map_or(0, Vec::len))
}

/// Files below `dir` (recursively), plus directories other than `dir` itself.
pub fn tree_entries(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() { 1 + tree_entries(&p) } else { 1 }
        })
        .sum()
}

pub fn open_fds() -> Result<usize> {
    Ok(std::fs::read_dir("/proc/self/fd")?.count())
}

/// sidestep's BPF objects on the machine: id -> pinned paths, for programs named `sidestep_*` and
/// maps named `SIDESTEP_*`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Objects {
    pub progs: BTreeMap<u64, Vec<String>>,
    pub maps: BTreeMap<u64, Vec<String>>,
}

pub fn objects() -> Result<Objects> {
    let collect = |kind: &str, prefix: &str| -> Result<BTreeMap<u64, Vec<String>>> {
        let mut out = BTreeMap::new();
        for o in bpftool_json(&[kind, "show", "-f"])?
            .as_array()
            .into_iter()
            .flatten()
        {
            if !o["name"].as_str().is_some_and(|n| n.starts_with(prefix)) {
                continue;
            }
            let pins = o["pinned"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str().map(String::from))
                .collect();
            out.insert(o["id"].as_u64().context("object id")?, pins);
        }
        Ok(out)
    };
    Ok(Objects {
        progs: collect("prog", "sidestep_")?,
        maps: collect("map", "SIDESTEP_")?,
    })
}

/// Everything that must come back to where it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    pub maps: BTreeMap<&'static str, usize>,
    /// Per-pod link pins: entries under <pin_root>/links/tc (cookie directories and link pins)
    /// and links/sklookup (one per pod netns).
    pub pod_link_pins: usize,
    /// Entries under the plugin's state_dir, but for the invocation log (`timings`), which
    /// every call appends to.
    pub records: usize,
    /// BPF links (any kind) running one of this pin root's programs.
    pub links: usize,
    /// sidestep programs and maps pinned under this pin root.
    pub own_progs: BTreeSet<u64>,
    pub own_maps: BTreeSet<u64>,
}

pub struct Sandbox {
    pub pin_root: PathBuf,
    pub state_dir: PathBuf,
}

impl Sandbox {
    pub fn state(&self) -> Result<State> {
        let mut maps = BTreeMap::new();
        for m in MAPS {
            maps.insert(m, map_entries(&self.pin_root, m)?);
        }
        let objs = objects()?;
        let root = format!("{}/", self.pin_root.display());
        let own = |m: &BTreeMap<u64, Vec<String>>| -> BTreeSet<u64> {
            m.iter()
                .filter(|(_, pins)| pins.iter().any(|p| p.starts_with(&root)))
                .map(|(id, _)| *id)
                .collect()
        };
        let own_progs = own(&objs.progs);
        let links = bpftool_json(&["link", "show"])?
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| {
                l["prog_id"]
                    .as_u64()
                    .is_some_and(|id| own_progs.contains(&id))
            })
            .count();
        Ok(State {
            maps,
            pod_link_pins: tree_entries(&self.pin_root.join("links/tc"))
                + tree_entries(&self.pin_root.join("links/sklookup")),
            records: tree_entries(&self.state_dir)
                - usize::from(self.state_dir.join("timings").is_file()),
            links,
            own_progs,
            own_maps: own(&objs.maps),
        })
    }

    /// Waits (objects are freed after an RCU grace period) until the state is `start` again.
    pub fn expect_state(&self, what: &str, start: &State) -> Result<State> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = self.state()?;
            if now == *start {
                return Ok(now);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{what}: state did not return to the start:\n start {start:?}\n   now {now:?}"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// sidestep objects that nobody pinned and that did not exist before: leaks (objects of other
/// test processes are pinned under their own roots once their load finishes, so retry a while).
pub fn expect_no_new_unpinned(before: &Objects) -> Result<Objects> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = objects()?;
        let fresh = |all: &BTreeMap<u64, Vec<String>>, old: &BTreeMap<u64, Vec<String>>| {
            all.iter()
                .filter(|(id, pins)| pins.is_empty() && !old.contains_key(id))
                .map(|(id, _)| *id)
                .collect::<Vec<_>>()
        };
        let (p, m) = (
            fresh(&now.progs, &before.progs),
            fresh(&now.maps, &before.maps),
        );
        if p.is_empty() && m.is_empty() {
            return Ok(now);
        }
        if Instant::now() >= deadline {
            bail!("unpinned sidestep objects appeared: programs {p:?}, maps {m:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The objects pinned under pin roots (first three path components below /sys/fs/bpf) other
/// than ours, as (root, kind, id). Ids and not only roots: an agent that upgrades in place
/// pins new programs under the root it already had.
pub fn foreign_roots(o: &Objects, ours: &Path) -> BTreeSet<(String, &'static str, u64)> {
    let ours = ours.display().to_string();
    let pinned = |kind: &'static str, m: &BTreeMap<u64, Vec<String>>| {
        m.iter()
            .flat_map(|(id, pins)| pins.iter().map(move |p| (kind, *id, p)))
            .filter_map(|(kind, id, p)| {
                let root: String = p.split('/').take(5).collect::<Vec<_>>().join("/");
                (root != ours).then_some((root, kind, id))
            })
            .collect::<Vec<_>>()
    };
    pinned("prog", &o.progs)
        .into_iter()
        .chain(pinned("map", &o.maps))
        .collect()
}
