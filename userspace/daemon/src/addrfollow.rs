//! Following the addresses a pod netns gains and loses after its enrolment (SLAAC, DHCP, a
//! later CNI plugin, `ip addr add`).
//!
//! Istio decides "the pod calling itself" by `-o lo` and captures inbound with no `-d`, so both
//! hold for whatever addresses the netns has *now*. The data path reads them from
//! `SIDESTEP_ADDRS`: connect's local-destination test, and the tc hook's attribution of a SYN to
//! its pod. Enrolment writes the addresses it saw; an [`AddressFollower`] keeps the map in step
//! afterwards. It holds a NETLINK_ROUTE socket created inside the pod netns and subscribed to
//! its address and route notifications; each notification makes it read the netns's addresses
//! again (the notifications themselves are not trusted to be complete: the socket may overrun).
//! The same read keeps the source of captured connections in step (`SIDESTEP_SRC` for a family
//! the pod gained, `SIDESTEP_SRCR` for routes through interfaces attached after the ADD), and,
//! for a pod whose policy excludes interfaces, their entries and the routes `-o <nic>` follows
//! ([`sidestep::enroll::exclusion`]).
//!
//! What a follower writes to `SIDESTEP_ADDRS`, it owns: it never takes an address that another
//! live pod holds (as enrolment does not), and it removes only entries it added that still name
//! its pod. Entries it added outlive it only if it dies with them in place; they name a cookie
//! that no pod will have again (netns cookies are not reused), which the data path treats as
//! "not this pod", and `unenroll_cookie` (the agent's GC) removes them.
//!
//! The source entries are the pod's, not the follower's: it rewrites them whole from the netns
//! (enrolment's included) and leaves them in place when it stops; the pod's DEL removes them
//! (the routes flag makes it scan for routes no record names), and a sync that finds its pod
//! unenrolled after writing removes what it wrote.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::IpAddr,
    os::fd::{AsFd, BorrowedFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use sidestep::{
    enroll::{
        MAX_POD_ADDRESSES,
        exclusion::{self, ExclusionChanges},
        source::SourceChanges,
    },
    error::{MapsError, NetnsError},
    maps::PolicyMaps,
    netns::Netns,
    policy::{address_words, words_address},
};

/// `RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE`
/// (linux/rtnetlink.h): routes decide the source of a multi-homed pod's connections.
const SUBSCRIBED_GROUPS: u32 = 0x10 | 0x100 | 0x40 | 0x400;

/// The shortest time between two syncs of one pod. Root in a pod can add and remove addresses in
/// a loop; each change would make the follower read the whole netns again, on the one thread
/// that follows every pod of the node. Changes within the interval are read together at its end
/// (the pod's socket is not polled meanwhile: an overrun only means "changed").
pub const MIN_SYNC_INTERVAL: Duration = Duration::from_millis(100);

/// The most addresses the followers of a node register together, by default: a quarter of
/// `SIDESTEP_ADDRS`. [`MAX_POD_ADDRESSES`] bounds one pod, but 256 pods whose root floods their
/// netns would still fill the map that every pod of the node shares, and every later ADD on the
/// node would fail. Enrolment's entries (each pod's own addresses at its ADD) do not count: the
/// rest of the map stays theirs. An address past the budget fails closed, as one past the
/// pod's cap does.
pub const DEFAULT_LATE_ADDRESS_BUDGET: usize = sidestep_abi::capacity::ADDRESSES as usize / 4;

/// How soon a pod whose sync failed is read again, with or without another change.
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("cannot subscribe to the address changes of {path}: {source}")]
    Subscribe { path: PathBuf, source: io::Error },
    #[error("reading the address changes of {path}: {source}")]
    Receive { path: PathBuf, source: io::Error },
}

/// What one [`AddressFollower::sync`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Synced {
    pub added: Vec<IpAddr>,
    pub removed: Vec<IpAddr>,
    /// Addresses of the netns that another live pod holds in the map (left to it).
    pub held_by_others: Vec<(IpAddr, u64)>,
    /// Addresses of the netns beyond [`MAX_POD_ADDRESSES`] or the node's budget, not written.
    pub left_out: usize,
    /// Of those, the ones the pod's cap had room for and the node's budget did not.
    pub over_budget: usize,
    /// What was left out (addresses or source routes) differs from the sync before: a warning
    /// is due once per change, not at every sync of a flooded pod that churns.
    pub left_out_changed: bool,
    /// The netns is not enrolled (any more, or not yet): nothing of it is in the map.
    pub unenrolled: bool,
    /// The source its captured connections leave from ([`sidestep::enroll::source::follow`]).
    pub source: SourceChanges,
    /// Its excluded interfaces and their routes ([`sidestep::enroll::exclusion::follow`]).
    pub exclusion: ExclusionChanges,
}

impl Synced {
    pub fn changed(&self) -> bool {
        !self.added.is_empty()
            || !self.removed.is_empty()
            || self.source.changed()
            || self.exclusion.changed()
    }
}

/// What one sync left out of the maps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct LeftOut {
    addresses: usize,
    /// Of those, the ones over the node's budget.
    over_budget: usize,
    source_routes: usize,
    /// The pod's route count when it is past the exclusion routes' cap.
    exclusion_routes: Option<usize>,
}

/// One pod netns's address subscription, and the map entries it added.
pub struct AddressFollower {
    netns: Netns,
    cookie: u64,
    socket: Socket,
    added: BTreeSet<[u32; 4]>,
    /// When the next sync may run: [`MIN_SYNC_INTERVAL`] after the last one ended, or
    /// [`RETRY_AFTER_ERROR`] after one that failed; `None` before the first.
    next_sync: Option<Instant>,
    /// Notifications arrived that no sync has read yet.
    pending: bool,
    /// What the last sync left out, so a warning is given once per change.
    left_out: LeftOut,
    /// The interfaces the pod's policy excludes (`excludeInterfaces`).
    excluded: Vec<String>,
}

impl AddressFollower {
    /// Subscribes to the address changes of the netns at `path`. The socket lives in that netns
    /// and keeps it alive until the follower is dropped.
    pub fn open(path: &Path) -> Result<Self, FollowError> {
        let netns = Netns::open(path)?;
        let cookie = netns.cookie()?;
        let socket = netns
            .run(|| {
                let mut socket = Socket::new(NETLINK_ROUTE)?;
                socket.bind(&SocketAddr::new(0, SUBSCRIBED_GROUPS))?;
                socket.set_non_blocking(true)?;
                Ok(socket)
            })
            .map_err(|e| match e {
                NetnsError::Enter { path, source } if source.raw_os_error().is_some() => {
                    FollowError::Subscribe { path, source }
                }
                other => other.into(),
            })?;
        Ok(Self {
            netns,
            cookie,
            socket,
            added: BTreeSet::new(),
            next_sync: None,
            pending: false,
            left_out: LeftOut::default(),
            excluded: Vec::new(),
        })
    }

    pub fn cookie(&self) -> u64 {
        self.cookie
    }

    pub fn path(&self) -> &Path {
        self.netns.path()
    }

    /// The subscription socket, readable when the netns's addresses changed.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    /// Reads and discards the pending notifications. Returns whether there were any; an overrun
    /// (ENOBUFS: notifications were lost) counts as a change.
    pub fn drain(&mut self) -> Result<bool, FollowError> {
        let mut buf = vec![0u8; 16384];
        let mut any = false;
        loop {
            match self.socket.recv(&mut &mut buf[..], 0) {
                Ok(0) => return Ok(any),
                Ok(_) => any = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(any),
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => any = true,
                Err(source) => {
                    return Err(FollowError::Receive {
                        path: self.path().to_path_buf(),
                        source,
                    });
                }
            }
        }
    }

    /// Makes `SIDESTEP_ADDRS` hold every address the netns has now (lo's aside: the programs
    /// know loopback themselves), for this pod, up to [`MAX_POD_ADDRESSES`] of them, and drops
    /// the entries this follower added for addresses the netns no longer has. (Enrolment's entries
    /// for addresses since gone stay until the DEL: one pod holds at most twice the cap.) The
    /// follower holds at most `budget_left` entries it added: the node's budget less what the
    /// other followers hold.
    pub fn sync(
        &mut self,
        maps: &mut PolicyMaps,
        budget_left: usize,
    ) -> Result<Synced, FollowError> {
        self.pending = false;
        let mut synced = Synced::default();
        if !maps.is_enrolled(self.cookie)? {
            synced.removed = self.release(maps)?;
            synced.unenrolled = true;
            // Nothing of it counts against the budget now; a freed budget must not wake it.
            self.left_out = Default::default();
            return Ok(synced);
        }
        // Entries the map no longer gives this pod (the maps were recreated, a re-enrolment
        // rewrote them) are not this follower's to count against the node's budget.
        let cookie = self.cookie;
        self.added
            .retain(|words| maps.addresses.get(words, 0).ok() == Some(cookie));
        // Routes too for a pod that excludes interfaces: `-o <nic>` follows them.
        let facts = sidestep::enroll::facts::read(&self.netns, !self.excluded.is_empty())?;
        let now: BTreeSet<[u32; 4]> = facts
            .addresses
            .iter()
            .map(|(_, ip)| address_words(ip))
            .collect();
        // Removals first: the room they free counts toward this sync's additions.
        let gone: Vec<[u32; 4]> = self.added.difference(&now).copied().collect();
        for words in gone {
            if self.remove_own(maps, &words)? {
                synced.removed.push(words_address(&words));
            }
            self.added.remove(&words);
        }
        let mut new = Vec::new();
        let mut held = 0;
        for words in &now {
            match maps.addresses.get(words, 0) {
                Ok(owner) if owner == self.cookie => held += 1,
                Ok(owner) if maps.is_enrolled(owner)? => {
                    synced.held_by_others.push((words_address(words), owner));
                }
                _ => new.push(*words),
            }
        }
        let pod_room = MAX_POD_ADDRESSES.saturating_sub(held);
        let node_room = budget_left.saturating_sub(self.added.len());
        let room = pod_room.min(node_room);
        synced.left_out = new.len().saturating_sub(room);
        synced.over_budget = new.len().min(pod_room).saturating_sub(room);
        new.truncate(room);
        for words in &new {
            maps.addresses.insert(words, self.cookie, 0).map_err(|e| {
                sidestep::maps::classify(sidestep_abi::map_names::POD_ADDRESSES, 0, e)
            })?;
            self.added.insert(*words);
            synced.added.push(words_address(words));
        }
        // Each step whatever the other's outcome: a failed source step must not leave an
        // excluded interface's routes as they were.
        let source = sidestep::enroll::source::follow(maps, self.cookie, &facts);
        let exclusion = if self.excluded.is_empty() {
            Ok(ExclusionChanges::default())
        } else {
            exclusion::follow(maps, self.cookie, &facts, &self.excluded)
        };
        synced.source = source?;
        synced.exclusion = exclusion?;
        let left_out = LeftOut {
            addresses: synced.left_out,
            over_budget: synced.over_budget,
            source_routes: synced.source.routes_left_out,
            exclusion_routes: synced.exclusion.routes_over_cap,
        };
        synced.left_out_changed = std::mem::replace(&mut self.left_out, left_out) != left_out;
        Ok(synced)
    }

    /// Removes every entry this follower added that still names its pod.
    pub fn release(&mut self, maps: &mut PolicyMaps) -> Result<Vec<IpAddr>, FollowError> {
        let mut removed = Vec::new();
        for words in std::mem::take(&mut self.added) {
            if self.remove_own(maps, &words)? {
                removed.push(words_address(&words));
            }
        }
        Ok(removed)
    }

    /// When the next sync may run. Counted from the end of the last sync: a pod whose netns
    /// takes long to read is read less often, not back to back.
    fn due(&self) -> Option<Instant> {
        self.next_sync
    }

    /// A follower that never synced (its first sync found no maps) is due at once.
    fn is_due(&self, now: Instant) -> bool {
        is_due(self.next_sync, now)
    }

    fn remove_own(&self, maps: &mut PolicyMaps, words: &[u32; 4]) -> Result<bool, FollowError> {
        if maps.addresses.get(words, 0).ok() != Some(self.cookie) {
            return Ok(false);
        }
        match maps.addresses.remove(words) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => {
                Err(sidestep::maps::classify(sidestep_abi::map_names::POD_ADDRESSES, 0, e).into())
            }
        }
    }
}

/// Something a [`follow`] loop did, for its caller to log or count.
pub enum FollowEvent<'a> {
    Started(&'a AddressFollower),
    Synced(&'a AddressFollower, &'a Synced),
    Stopped {
        path: &'a Path,
        removed: usize,
    },
    Failed {
        path: &'a Path,
        error: &'a FollowError,
    },
}

/// Follows the netns that `wanted` names, each with the interfaces its pod's policy excludes,
/// re-asked every `refresh` (a follower starts for each new path and stops, releasing its
/// entries, for each path no longer named), until `keep_going` says no. All followers together
/// register at most `budget` addresses. Blocks the calling thread; the agent runs it on a thread
/// of its own.
pub fn follow(
    pin_root: &Path,
    refresh: Duration,
    budget: usize,
    mut wanted: impl FnMut() -> BTreeMap<PathBuf, Vec<String>>,
    mut keep_going: impl FnMut() -> bool,
    mut on: impl FnMut(FollowEvent<'_>),
) {
    let mut followers: BTreeMap<PathBuf, AddressFollower> = BTreeMap::new();
    // Paths that failed to open: retried at the next refresh, reported once.
    let mut failed: BTreeSet<PathBuf> = BTreeSet::new();
    while keep_going() {
        let want = wanted();
        let maps = PolicyMaps::open(pin_root);
        let mut maps = match maps {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::debug!(error = %e, "address follower: maps not open");
                None
            }
        };
        let stale: Vec<PathBuf> = followers
            .keys()
            .filter(|p| !want.contains_key(*p))
            .cloned()
            .collect();
        for path in stale {
            let Some(mut f) = followers.remove(&path) else {
                continue;
            };
            let removed = maps
                .as_mut()
                .and_then(|m| f.release(m).ok())
                .map_or(0, |r| r.len());
            on(FollowEvent::Stopped {
                path: &path,
                removed,
            });
        }
        failed.retain(|p| want.contains_key(p));
        for (path, excluded) in want {
            if let Some(f) = followers.get_mut(&path) {
                // A later attachment's ADD may have changed the policy.
                if f.excluded != excluded {
                    f.excluded = excluded;
                    f.pending = true;
                }
                continue;
            }
            match AddressFollower::open(&path) {
                Ok(mut f) => {
                    failed.remove(&path);
                    f.excluded = excluded;
                    on(FollowEvent::Started(&f));
                    // What changed between enrolment and now.
                    let others = registered(&followers);
                    sync_one(
                        &mut f,
                        maps.as_mut(),
                        budget.saturating_sub(others),
                        &mut on,
                    );
                    followers.insert(path, f);
                }
                Err(error) => {
                    if failed.insert(path.clone()) {
                        on(FollowEvent::Failed {
                            path: &path,
                            error: &error,
                        });
                    }
                }
            }
        }
        // Without the maps nothing can sync: wait for the next refresh rather than spin.
        let now = Instant::now();
        let wait = followers
            .values()
            .filter(|f| f.pending && maps.is_some())
            .map(|f| {
                f.due()
                    .map_or(Duration::ZERO, |due| due.saturating_duration_since(now))
            })
            .fold(refresh, Duration::min);
        for path in wait_readable(&followers, wait) {
            let Some(f) = followers.get_mut(&path) else {
                continue;
            };
            match f.drain() {
                Ok(any) => f.pending |= any,
                Err(error) => on(FollowEvent::Failed {
                    path: &path,
                    error: &error,
                }),
            }
        }
        let now = Instant::now();
        let mut total = registered(&followers);
        if total < budget {
            // Room freed (a pod lost addresses, or went): a pod left over the budget takes its
            // share without waiting for a change of its own.
            for f in followers
                .values_mut()
                .filter(|f| f.left_out.over_budget > 0)
            {
                f.pending = true;
            }
        }
        for f in followers.values_mut() {
            if f.pending && f.is_due(now) {
                let others = total - f.added.len();
                sync_one(f, maps.as_mut(), budget.saturating_sub(others), &mut on);
                total = others + f.added.len();
            }
        }
    }
    if let Ok(mut maps) = PolicyMaps::open(pin_root) {
        for f in followers.values_mut() {
            let _ = f.release(&mut maps);
        }
    }
}

/// The addresses the followers registered, all together (what the node's budget counts).
fn registered(followers: &BTreeMap<PathBuf, AddressFollower>) -> usize {
    followers.values().map(|f| f.added.len()).sum()
}

fn sync_one(
    f: &mut AddressFollower,
    maps: Option<&mut PolicyMaps>,
    budget_left: usize,
    on: &mut impl FnMut(FollowEvent<'_>),
) {
    let Some(maps) = maps else {
        return;
    };
    let result = f.sync(maps, budget_left);
    let now = Instant::now();
    match result {
        Ok(synced) => {
            f.next_sync = Some(now + MIN_SYNC_INTERVAL);
            on(FollowEvent::Synced(f, &synced));
        }
        Err(error) => {
            // Read again even without another change: what failed may be half written.
            f.next_sync = Some(now + RETRY_AFTER_ERROR);
            f.pending = true;
            on(FollowEvent::Failed {
                path: f.path(),
                error: &error,
            });
        }
    }
}

/// The followers whose socket is readable within `timeout`.
fn wait_readable(
    followers: &BTreeMap<PathBuf, AddressFollower>,
    timeout: Duration,
) -> Vec<PathBuf> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    if followers.is_empty() {
        std::thread::sleep(timeout);
        return Vec::new();
    }
    // A follower with a sync pending is not polled: it would wake this loop until its sync.
    let polled: Vec<(&PathBuf, &AddressFollower)> =
        followers.iter().filter(|(_, f)| !f.pending).collect();
    if polled.is_empty() {
        std::thread::sleep(timeout);
        return Vec::new();
    }
    let mut fds: Vec<PollFd<'_>> = polled
        .iter()
        .map(|(_, f)| PollFd::new(f.fd(), PollFlags::POLLIN))
        .collect();
    // Rounded up: poll counts whole milliseconds, and a timeout cut short wakes the loop before
    // the sync it waits for is due.
    let timeout = Duration::from_millis(timeout.as_micros().div_ceil(1000) as u64);
    let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    if !matches!(poll(&mut fds, timeout), Ok(n) if n > 0) {
        return Vec::new();
    }
    polled
        .iter()
        .zip(&fds)
        .filter(|(_, p)| p.revents().is_some_and(|r| !r.is_empty()))
        .map(|((path, _), _)| (*path).clone())
        .collect()
}

fn is_due(next_sync: Option<Instant>, now: Instant) -> bool {
    next_sync.is_none_or(|at| at <= now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_is_due_at_its_time_or_at_once_without_one() {
        let now = Instant::now();
        let next = now + MIN_SYNC_INTERVAL;
        assert!(is_due(None, now));
        assert!(!is_due(Some(next), now));
        assert!(!is_due(Some(next), now + MIN_SYNC_INTERVAL / 2));
        assert!(is_due(Some(next), next));
    }
}
