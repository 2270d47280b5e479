//! Typed handles on the pinned maps, opened by path. The CNI plugin, the CLI and the agent all
//! reach the data path through this one type.

use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData, MapError, PerCpuHashMap, PerCpuValues, lpm_trie::LpmTrie};
use sidestep_abi::{
    CidrKey, Counters, OrigDst, PodPolicy, PodSource, PortKey, RerouteIf, RerouteIfKey, TupleKey,
    map_names, program_names,
};

use crate::pins::PinLayout;

pub type PodMap = HashMap<MapData, u64, PodPolicy>;
pub type PortMap = HashMap<MapData, PortKey, u8>;
pub type CidrMap = LpmTrie<MapData, CidrKey, u8>;
pub type CounterMap = PerCpuHashMap<MapData, u64, Counters>;
pub type AddressMap = HashMap<MapData, [u32; 4], u64>;
pub type InterfaceMap = HashMap<MapData, sidestep_abi::InterfaceKey, u8>;
pub type RerouteIfMap = HashMap<MapData, RerouteIfKey, RerouteIf>;
pub type SourceMap = HashMap<MapData, u64, PodSource>;
pub type SourceRouteMap = LpmTrie<MapData, CidrKey, [u32; 4]>;
/// LRU hash; aya's HashMap handle reads and deletes it like a plain hash.
pub type RerouteNatMap = HashMap<MapData, TupleKey, OrigDst>;

pub struct PolicyMaps {
    pub pods: PodMap,
    pub ports: PortMap,
    pub cidrs: CidrMap,
    pub counters: CounterMap,
    pub addresses: AddressMap,
    pub interfaces: InterfaceMap,
    pub reroute_ifaces: RerouteIfMap,
    pub reroute_nat: RerouteNatMap,
    pub sources: SourceMap,
    pub source_routes: SourceRouteMap,
    pub pod_capacity: u32,
    /// The maps above as the kernel described them when they were opened (see [`MapIdentity`]).
    opened: Vec<Opened>,
    layout: PinLayout,
}

/// What the kernel said of a map when it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Opened {
    name: &'static str,
    /// 0 (no id) never equals a live map's id, so a map whose info cannot be read counts as
    /// replaced: the caller then does its work again rather than trust it.
    id: u32,
    max_entries: u32,
}

/// A pinned map, and what its info said when it was opened.
fn open(layout: &PinLayout, name: &'static str) -> Result<(Map, Opened), MapsError> {
    let path = layout.map(name);
    if !path.exists() {
        return Err(MapsError::NotLoaded(layout.root().to_path_buf()));
    }
    let data = MapData::from_pin(&path).map_err(|source| MapsError::Open {
        path: path.clone(),
        source,
    })?;
    let (id, max_entries) = data.info().map_or_else(
        |e| {
            tracing::warn!(map = name, error = %e, "cannot read the map's info");
            (0, 0)
        },
        |i| (i.id(), i.max_entries()),
    );
    let map = Map::from_map_data(data).map_err(|source| MapsError::Open { path, source })?;
    Ok((
        map,
        Opened {
            name,
            id,
            max_entries,
        },
    ))
}

fn typed<T: TryFrom<Map, Error = MapError>>(
    layout: &PinLayout,
    name: &'static str,
    opened: &mut Vec<Opened>,
) -> Result<T, MapsError> {
    let (map, info) = open(layout, name)?;
    opened.push(info);
    T::try_from(map).map_err(|source| MapsError::Access { map: name, source })
}

/// The programs per-pod links run: an enrolment attaches them, so a reload that replaced one
/// between the attach and its own sweep of the links would leave the pod on the old one.
const PER_POD_PROGRAMS: [&str; 4] = [
    program_names::TC_INGRESS,
    program_names::SK_LOOKUP,
    program_names::REROUTE_INGRESS,
    program_names::REROUTE_EGRESS,
];

/// What an enrolment wrote to and attached: the kernel's ids of the maps behind their pins (the
/// [`PolicyMaps`] ones as they were opened, the rest of [`map_names::ALL`] when this was taken)
/// and of the programs per-pod links run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapIdentity {
    layout: PinLayout,
    maps: Vec<(&'static str, u32)>,
    programs: Vec<(&'static str, u32)>,
}

fn pinned_map_id(layout: &PinLayout, name: &str) -> Option<u32> {
    aya::maps::MapInfo::from_pin(layout.map(name))
        .ok()
        .map(|i| i.id())
}

fn pinned_program_id(layout: &PinLayout, name: &str) -> Option<u32> {
    aya::programs::ProgramInfo::from_pin(layout.program(name))
        .ok()
        .map(|i| i.id())
}

impl MapIdentity {
    /// Whether every pin still names the map or program it named then. A reload that recreated
    /// a map (new layout, or pins deleted behind the agent) pins a new one, and what was written
    /// to the old one no longer reaches the programs; a new program pinned means links made
    /// meanwhile may run the old one. A pin that cannot be read counts as changed.
    pub fn still_pinned(&self) -> bool {
        self.maps
            .iter()
            .all(|(name, id)| pinned_map_id(&self.layout, name) == Some(*id))
            && self
                .programs
                .iter()
                .all(|(name, id)| pinned_program_id(&self.layout, name) == Some(*id))
    }
}

impl PolicyMaps {
    pub fn open(pin_root: &Path) -> Result<Self, MapsError> {
        let layout = PinLayout::new(pin_root);
        let mut ids = Vec::with_capacity(8);
        let pods: PodMap = typed(&layout, map_names::POD_POLICY, &mut ids)?;
        let pod_capacity = ids[0].max_entries;
        Ok(Self {
            pods,
            ports: typed(&layout, map_names::PORT_RULES, &mut ids)?,
            cidrs: typed(&layout, map_names::CIDR_RULES, &mut ids)?,
            counters: typed(&layout, map_names::COUNTERS, &mut ids)?,
            addresses: typed(&layout, map_names::POD_ADDRESSES, &mut ids)?,
            interfaces: typed(&layout, map_names::INTERFACES, &mut ids)?,
            reroute_ifaces: typed(&layout, map_names::REROUTE_IFACES, &mut ids)?,
            reroute_nat: typed(&layout, map_names::REROUTE_NAT, &mut ids)?,
            sources: typed(&layout, map_names::SOURCE_ADDRESSES, &mut ids)?,
            source_routes: typed(&layout, map_names::SOURCE_ROUTES, &mut ids)?,
            pod_capacity,
            opened: ids,
            layout,
        })
    }

    /// Taken just before an enrolment: these handles' maps as opened, and the other maps and the
    /// per-pod programs as pinned now, to tell afterwards whether a reload came in between.
    pub fn identity(&self) -> MapIdentity {
        let mut maps: Vec<(&'static str, u32)> =
            self.opened.iter().map(|o| (o.name, o.id)).collect();
        for name in map_names::ALL {
            if !maps.iter().any(|(n, _)| *n == name) {
                maps.push((name, pinned_map_id(&self.layout, name).unwrap_or(0)));
            }
        }
        let programs = PER_POD_PROGRAMS
            .iter()
            .map(|&name| (name, pinned_program_id(&self.layout, name).unwrap_or(0)))
            .collect();
        MapIdentity {
            layout: self.layout.clone(),
            maps,
            programs,
        }
    }

    /// The pending original-destination hand-over map (`SIDESTEP_PEND`), opened on demand: only
    /// the unenrolment of a pod with re-routed interfaces sweeps it.
    pub fn pending(&self) -> Result<RerouteNatMap, MapsError> {
        typed(&self.layout, map_names::PENDING_ORIG_DST, &mut Vec::new())
    }

    /// The source addresses of a pod's captured connections (`SIDESTEP_SRC`), IPv4 first.
    pub fn source_addresses(&self, netns_cookie: u64) -> Vec<std::net::IpAddr> {
        let Ok(source) = self.sources.get(&netns_cookie, 0) else {
            return Vec::new();
        };
        [source.addr4, source.addr6]
            .iter()
            .filter(|w| **w != [0; 4])
            .map(crate::policy::words_address)
            .collect()
    }

    /// Every enrolled netns cookie with its policy.
    pub fn pods(&self) -> Vec<(u64, PodPolicy)> {
        self.pods.iter().filter_map(Result::ok).collect()
    }

    /// Every pod's ifindexes (inside the pod) of the interfaces whose inbound connections are
    /// captured, from one scan of the interface map (one per pod would cost pods x entries
    /// syscalls: minutes for `sidestep status` on a full node). For `status`, never for ADD or DEL.
    pub fn inbound_ifindexes_by_pod(&self) -> std::collections::HashMap<u64, Vec<u32>> {
        let mut by_pod: std::collections::HashMap<u64, Vec<u32>> = Default::default();
        for key in self.interfaces.keys().filter_map(Result::ok) {
            by_pod
                .entry(key.netns_cookie)
                .or_default()
                .push(key.ifindex);
        }
        for ifindexes in by_pod.values_mut() {
            ifindexes.sort_unstable();
        }
        by_pod
    }

    /// Whether the cookie has a pod entry.
    pub fn is_enrolled(&self, netns_cookie: u64) -> Result<bool, MapsError> {
        self.pod(netns_cookie).map(|p| p.is_some())
    }

    /// The cookie's pod entry, if it has one.
    pub fn pod(&self, netns_cookie: u64) -> Result<Option<sidestep_abi::PodPolicy>, MapsError> {
        match self.pods.get(&netns_cookie, 0) {
            Ok(pod) => Ok(Some(pod)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(MapsError::Access {
                map: map_names::POD_POLICY,
                source,
            }),
        }
    }

    /// Sets or clears a `flags` bit of an enrolled pod in place; false when the pod has no entry.
    /// A concurrent re-enrolment of the same pod may win: it writes its whole policy.
    pub fn set_pod_flag(
        &mut self,
        netns_cookie: u64,
        flag: u32,
        on: bool,
    ) -> Result<bool, MapsError> {
        let mut policy = match self.pods.get(&netns_cookie, 0) {
            Ok(p) => p,
            Err(MapError::KeyNotFound) => return Ok(false),
            Err(source) => {
                return Err(MapsError::Access {
                    map: map_names::POD_POLICY,
                    source,
                });
            }
        };
        if on {
            policy.flags |= flag;
        } else {
            policy.flags &= !flag;
        }
        // BPF_EXIST (2, uapi/linux/bpf.h): a pod unenrolled meanwhile is not brought back.
        const BPF_EXIST: u64 = 2;
        match self.pods.insert(netns_cookie, policy, BPF_EXIST) {
            Ok(()) => Ok(true),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(false)
            }
            Err(source) => Err(MapsError::Access {
                map: map_names::POD_POLICY,
                source,
            }),
        }
    }

    /// The pod's counters summed over CPUs; zero when the pod has none.
    pub fn counters(&self, netns_cookie: u64) -> Counters {
        let mut total = Counters::default();
        if let Ok(per_cpu) = self.counters.get(&netns_cookie, 0) {
            for c in per_cpu.iter() {
                total.add(c);
            }
        }
        total
    }

    /// A zeroed entry for a pod that has none; an existing one keeps its counts.
    pub fn ensure_counters(&mut self, netns_cookie: u64) -> Result<(), MapsError> {
        // BPF_NOEXIST.
        match self.insert_zeroed(netns_cookie, 1) {
            Err(MapsError::Access {
                source: MapError::SyscallError(e),
                ..
            }) if e.io_error.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other,
        }
    }

    pub fn zero_counters(&mut self, netns_cookie: u64) -> Result<(), MapsError> {
        self.insert_zeroed(netns_cookie, 0)
    }

    fn insert_zeroed(&mut self, netns_cookie: u64, flags: u64) -> Result<(), MapsError> {
        let cpus =
            aya::util::nr_cpus().map_err(|(what, e)| MapsError::Cpus(format!("{what}: {e}")))?;
        let values = PerCpuValues::try_from(vec![Counters::default(); cpus])
            .map_err(|e| MapsError::Cpus(e.to_string()))?;
        self.counters
            .insert(netns_cookie, values, flags)
            .map_err(|source| classify(map_names::COUNTERS, self.pod_capacity, source))
    }
}

/// Turns a full map's E2BIG into an error that says so.
pub fn classify(map: &'static str, capacity: u32, source: MapError) -> MapsError {
    if let MapError::SyscallError(e) = &source
        && e.io_error.raw_os_error() == Some(libc::E2BIG)
    {
        return MapsError::Full { map, capacity };
    }
    MapsError::Access { map, source }
}

/// Deleted, or already gone: `Ok(true)` / `Ok(false)`.
pub(crate) fn deleted(map: &'static str, result: Result<(), MapError>) -> Result<bool, MapsError> {
    match result {
        Ok(()) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        // aya reports a missing key on delete as the syscall's ENOENT.
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(false)
        }
        Err(e) => Err(classify(map, 0, e)),
    }
}

/// Keeps the first error of a sequence of deletions that goes on after one fails.
#[derive(Default)]
pub(crate) struct FirstError(Option<MapsError>);

impl FirstError {
    pub(crate) fn note<T>(&mut self, r: Result<T, MapsError>) {
        if let Err(e) = r
            && self.0.is_none()
        {
            self.0 = Some(e);
        }
    }

    pub(crate) fn into_result(self) -> Result<(), MapsError> {
        self.0.map_or(Ok(()), Err)
    }
}

/// The cookies in the pod map (empty when not loaded).
pub fn enrolled_cookies(pin_root: &Path) -> std::collections::BTreeSet<u64> {
    PolicyMaps::open(pin_root)
        .map(|m| m.pods().into_iter().map(|(c, _)| c).collect())
        .unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error(
        "sidestep is not loaded at {0}: run `sidestep load --cgroup DIR --pin-root {0}` (or start the agent) first"
    )]
    NotLoaded(PathBuf),
    #[error("cannot open pinned map {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("map {map}: {source}")]
    Access {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot size per-CPU values: {0}")]
    Cpus(String),
    #[error(
        "map {map} is full{}; unenrol pods or load with a larger capacity",
        entries_note(*capacity)
    )]
    Full {
        map: &'static str,
        /// Its max_entries, or 0 where the caller did not look it up.
        capacity: u32,
    },
    #[error(
        "pod address {address} is registered to another enrolled pod (netns cookie {owner}); \
         refusing to take it over (its DEL or the agent's GC releases it)"
    )]
    AddressOwned {
        address: std::net::IpAddr,
        owner: u64,
    },
}

fn entries_note(capacity: u32) -> String {
    if capacity == 0 {
        String::new()
    } else {
        format!(" ({capacity} entries)")
    }
}
