//! The data path as the operations see it. [`Pinned`] is the real one (the sidestep library on
//! the pins under `pin_root`); tests substitute a fake to exercise rollback and idempotence
//! without BPF.

use std::{
    cell::RefCell,
    path::{Path, PathBuf},
};

use sidestep::{
    enroll::{self, Enrolled, Recorded},
    error::{EnrollError, MapsError, NetnsError},
    maps::{MapIdentity, PolicyMaps},
    netns::Netns,
    pins::PinLayout,
    podlinks,
    policy::{InboundHook, Policy},
};

use crate::spec::{CniError, code, error::ToCniError};

/// What the pod map says about a cookie, compared with the policy we expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodEntry {
    Missing,
    Matches,
    Differs,
}

pub trait Dataplane {
    fn pin_root(&self) -> &Path;
    fn is_loaded(&self) -> bool;
    /// Opens the netns (refusing the host's) and reads its cookie.
    fn netns_cookie(&self, netns: &Path) -> Result<u64, NetnsError>;
    fn enroll(&self, netns: &Path, policy: &Policy, ifname: &str) -> Result<Enrolled, EnrollError>;
    /// Whether the maps the last [`Dataplane::enroll`] wrote are still the pinned ones: a reload
    /// that recreated one meanwhile took those writes with the old map.
    fn enrolment_current(&self) -> bool;
    /// Whether the cookie is in the pod map; `true` when that cannot be read (the answer decides
    /// only whether the index marks the cookie for the slow, always correct path).
    fn is_enrolled(&self, cookie: u64) -> bool;
    /// The inbound hook the cookie is enrolled with (another attachment's ADD), if it is.
    fn enrolled_hook(&self, cookie: u64) -> Option<InboundHook>;
    /// Removes a cookie's entries (found by scanning the maps) and tc links; `Ok(false)` when it
    /// had none. Succeeds when the programs are not loaded at all (there is nothing left to
    /// remove).
    fn unenroll(&self, cookie: u64) -> Result<bool, EnrollError>;
    /// [`Dataplane::unenroll`] of the keys a recorded enrolment wrote
    /// ([`enroll::unenroll_recorded`]), for a record that describes the whole enrolment.
    fn unenroll_recorded(&self, cookie: u64, recorded: &Recorded<'_>) -> Result<bool, EnrollError>;
    /// Removes one attachment of a pod that other attachments keep enrolled
    /// ([`enroll::unenroll_attachment`]).
    fn unenroll_attachment(
        &self,
        cookie: u64,
        ifname: &str,
        addresses: &[std::net::IpAddr],
        inbound_ifindexes: &[u32],
    ) -> Result<(), EnrollError>;
    /// Whether the pod map holds what enrolling `policy` wrote; `host_ids` are the proxy's IDs
    /// on the host when the netns has a user namespace of its own (`NetnsKeys::proxy_host_ids`).
    fn pod_entry(
        &self,
        cookie: u64,
        policy: &Policy,
        host_ids: Option<(u32, u32)>,
    ) -> Result<PodEntry, MapsError>;
    fn attached_interfaces(&self, cookie: u64) -> Vec<String>;
    /// Whether the pod's netns has its pinned sk_lookup link.
    fn has_sk_lookup(&self, cookie: u64) -> bool;
    /// Whether the pod's netns has its pinned identity link ([`sidestep::identity`]).
    fn has_identity(&self, cookie: u64) -> bool;
    /// Those of `addresses` that `SIDESTEP_ADDRS` does not map to `cookie` (all of them when
    /// the map cannot be read).
    fn missing_addresses(
        &self,
        cookie: u64,
        addresses: &[std::net::IpAddr],
    ) -> Vec<std::net::IpAddr>;
    /// The pod's pinned re-route links (`<ifname>:reroute-ingress`, `…:reroute-egress`).
    fn reroute_pins(&self, cookie: u64) -> Vec<String>;
    /// Whether a TCP socket in the netns already listens on `port`; an error when it cannot
    /// tell.
    fn listening(&self, netns: &Path, port: u16) -> Result<bool, NetnsError>;
    /// The addresses of the netns's first interface that has a global one (none: empty).
    fn addresses(&self, netns: &Path) -> Vec<std::net::IpAddr>;
}

pub struct Pinned {
    pin_root: PathBuf,
    /// The netns [`Dataplane::netns_cookie`] opened, kept for the enrolment that follows in the
    /// same ADD: opening it checks it is not the host's, and once is enough.
    opened: RefCell<Option<Netns>>,
    /// The maps [`Dataplane::is_enrolled`] opened, kept for that enrolment too.
    maps: RefCell<Option<PolicyMaps>>,
    /// The maps the last enrolment wrote, for [`Dataplane::enrolment_current`].
    enrolled_into: RefCell<Option<MapIdentity>>,
}

impl std::fmt::Debug for Pinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinned")
            .field("pin_root", &self.pin_root)
            .finish_non_exhaustive()
    }
}

impl Pinned {
    pub fn new(pin_root: impl Into<PathBuf>) -> Self {
        Self {
            pin_root: pin_root.into(),
            opened: RefCell::new(None),
            maps: RefCell::new(None),
            enrolled_into: RefCell::new(None),
        }
    }

    /// The netns at `path`, reused when it is the one opened last.
    fn open_netns(&self, path: &Path) -> Result<Netns, NetnsError> {
        match self.opened.borrow_mut().take() {
            Some(ns) if ns.path() == path => Ok(ns),
            _ => Netns::open(path),
        }
    }
}

impl Dataplane for Pinned {
    fn pin_root(&self) -> &Path {
        &self.pin_root
    }

    fn is_loaded(&self) -> bool {
        PinLayout::new(&self.pin_root).is_loaded()
    }

    fn netns_cookie(&self, netns: &Path) -> Result<u64, NetnsError> {
        let ns = self.open_netns(netns)?;
        let cookie = ns.cookie()?;
        *self.opened.borrow_mut() = Some(ns);
        Ok(cookie)
    }

    fn enroll(&self, netns: &Path, policy: &Policy, ifname: &str) -> Result<Enrolled, EnrollError> {
        // The same order of checks as enroll::enroll: policy, maps, then the netns.
        policy.validate()?;
        let maps = match self.maps.borrow_mut().take() {
            Some(m) => m,
            None => PolicyMaps::open(&self.pin_root)?,
        };
        let ns = self.open_netns(netns)?;
        *self.enrolled_into.borrow_mut() = Some(maps.identity());
        enroll::enroll_netns(
            &self.pin_root,
            maps,
            &ns,
            policy,
            Some(&[ifname.to_owned()]),
        )
    }

    fn enrolment_current(&self) -> bool {
        self.enrolled_into
            .borrow()
            .as_ref()
            .is_some_and(MapIdentity::still_pinned)
    }

    fn enrolled_hook(&self, cookie: u64) -> Option<InboundHook> {
        let maps = PolicyMaps::open(&self.pin_root).ok()?;
        InboundHook::of_pod_flags(maps.pods.get(&cookie, 0).ok()?.flags)
    }

    fn is_enrolled(&self, cookie: u64) -> bool {
        let Ok(maps) = PolicyMaps::open(&self.pin_root) else {
            return true;
        };
        let enrolled = maps.is_enrolled(cookie).unwrap_or_else(|e| {
            tracing::debug!("netns cookie {cookie}: {e}");
            true
        });
        *self.maps.borrow_mut() = Some(maps);
        enrolled
    }

    fn unenroll(&self, cookie: u64) -> Result<bool, EnrollError> {
        match self.open_for_unenrol(cookie)? {
            Some(mut maps) => {
                let was = enroll::unenroll_cookie(&mut maps, cookie)?;
                podlinks::detach_inbound(&PinLayout::new(&self.pin_root), cookie)?;
                Ok(was)
            }
            None => Ok(false),
        }
    }

    fn unenroll_recorded(&self, cookie: u64, recorded: &Recorded<'_>) -> Result<bool, EnrollError> {
        match self.open_for_unenrol(cookie)? {
            Some(mut maps) => {
                let was = enroll::unenroll_recorded(&mut maps, cookie, recorded)?;
                podlinks::detach_inbound(&PinLayout::new(&self.pin_root), cookie)?;
                Ok(was)
            }
            None => Ok(false),
        }
    }

    fn pod_entry(
        &self,
        cookie: u64,
        policy: &Policy,
        host_ids: Option<(u32, u32)>,
    ) -> Result<PodEntry, MapsError> {
        let maps = PolicyMaps::open(&self.pin_root)?;
        let want = enroll::NetnsKeys::with_host_ids(policy.to_map_entries(cookie).pod, host_ids);
        Ok(match maps.pods.get(&cookie, 0) {
            Ok(have) if have == want => PodEntry::Matches,
            Ok(_) => PodEntry::Differs,
            Err(_) => PodEntry::Missing,
        })
    }

    fn attached_interfaces(&self, cookie: u64) -> Vec<String> {
        podlinks::attached_interfaces(&PinLayout::new(&self.pin_root), cookie)
    }

    fn has_sk_lookup(&self, cookie: u64) -> bool {
        podlinks::has_sk_lookup(&PinLayout::new(&self.pin_root), cookie)
    }

    fn has_identity(&self, cookie: u64) -> bool {
        podlinks::has_identity(&PinLayout::new(&self.pin_root), cookie)
    }

    fn missing_addresses(
        &self,
        cookie: u64,
        addresses: &[std::net::IpAddr],
    ) -> Vec<std::net::IpAddr> {
        let Ok(maps) = PolicyMaps::open(&self.pin_root) else {
            return addresses.to_vec();
        };
        addresses
            .iter()
            .filter(|ip| {
                maps.addresses
                    .get(&sidestep::policy::address_words(ip), 0)
                    .map_or(true, |owner| owner != cookie)
            })
            .copied()
            .collect()
    }

    fn reroute_pins(&self, cookie: u64) -> Vec<String> {
        podlinks::reroute_pins(&PinLayout::new(&self.pin_root), cookie)
    }

    fn listening(&self, netns: &Path, port: u16) -> Result<bool, NetnsError> {
        let ns = self.open_netns(netns)?;
        let found = ns.run(|| sidestep::netns::tcp_listening_on(port));
        *self.opened.borrow_mut() = Some(ns);
        found
    }

    fn unenroll_attachment(
        &self,
        cookie: u64,
        ifname: &str,
        addresses: &[std::net::IpAddr],
        inbound_ifindexes: &[u32],
    ) -> Result<(), EnrollError> {
        match enroll::unenroll_attachment(
            &self.pin_root,
            cookie,
            ifname,
            addresses,
            inbound_ifindexes,
        ) {
            // Not loaded: nothing of it is in any map.
            Err(EnrollError::Maps(MapsError::NotLoaded(_))) => Ok(()),
            other => other,
        }
    }

    fn addresses(&self, netns: &Path) -> Vec<std::net::IpAddr> {
        sidestep::netns::addresses::addresses_at(netns)
            .map(|a| a.ips.into_iter().map(|(ip, _)| ip).collect())
            .unwrap_or_default()
    }
}

impl Pinned {
    /// The maps, or `None` when the programs are not loaded, after detaching the pod's links: a
    /// tc link pinned by an interrupted unload may outlive the maps.
    fn open_for_unenrol(&self, cookie: u64) -> Result<Option<PolicyMaps>, EnrollError> {
        match PolicyMaps::open(&self.pin_root) {
            // Also without a pod entry: a DEL killed after removing it left the pod's rules.
            Ok(maps) => Ok(Some(maps)),
            Err(MapsError::NotLoaded(_)) => {
                podlinks::detach_inbound(&PinLayout::new(&self.pin_root), cookie)?;
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// How the library's errors reach the runtime. `pin_root` goes into "not loaded" messages so
/// the operator sees where the plugin looked.
pub fn enroll_error(e: &EnrollError) -> CniError {
    match e {
        EnrollError::Netns(n) => netns_error(n),
        EnrollError::Maps(MapsError::NotLoaded(root)) => not_loaded(root),
        EnrollError::Policy(p) => CniError::new(code::INVALID_CONFIG, p.to_string()),
        // The other pod's DEL, or the agent's GC of a dead one, releases the address.
        EnrollError::Maps(owned @ MapsError::AddressOwned { .. }) => CniError::new(
            code::TRY_AGAIN_LATER,
            format!("cannot enrol the pod: {owned}"),
        ),
        other => CniError::new(
            code::ENROLL_FAILED,
            format!("cannot enrol the pod: {other}"),
        ),
    }
}

pub fn netns_error(e: &NetnsError) -> CniError {
    CniError::new(code::INVALID_NETNS, e.to_string())
}

pub fn not_loaded(pin_root: &Path) -> CniError {
    CniError::new(
        code::TRY_AGAIN_LATER,
        format!(
            "sidestep is not loaded at pin_root {}: the pod cannot be captured yet",
            pin_root.display()
        ),
    )
    .details(format!(
        "start the sidestep agent on this node, or run `sidestep load --cgroup <cgroup2 root> --pin-root {}`",
        pin_root.display()
    ))
}

impl ToCniError for EnrollError {
    fn to_cni(&self) -> CniError {
        enroll_error(self)
    }
}
