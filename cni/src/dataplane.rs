//! The data path as the operations see it. [`Pinned`] is the real one (the sidestep library on
//! the pins under `pin_root`); tests substitute a fake to exercise rollback and idempotence
//! without BPF.

use std::{
    cell::RefCell,
    path::{Path, PathBuf},
};

use sidestep::{
    enroll::{
        self, Enrolled, Plan, Removal,
        verify::{self, Expected, Mismatch},
    },
    error::{EnrollError, MapsError, NetnsError},
    maps::{MapIdentity, PolicyMaps},
    netns::Netns,
    pins::PinLayout,
    podlinks,
    policy::InboundHook,
};

use crate::spec::{CniError, code, error::ToCniError};

/// What ADD asks of the netns and the maps before it plans, each read only when asked.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ask {
    /// Whether something listens on this port in the netns (the inbound hook's rule), asked only
    /// when the cookie is not enrolled already.
    pub listening_on: Option<u16>,
    /// The netns's own addresses (the pod IPs when nothing else gave them).
    pub addresses: bool,
}

/// The answers to an [`Ask`].
#[derive(Debug, Default)]
pub struct Facts {
    /// The cookie is in the pod map; `true` when that cannot be read (the answer decides only
    /// whether the index marks the cookie for the slow, always correct path).
    pub enrolled: bool,
    /// The inbound hook the cookie is enrolled with (another attachment's ADD), if it is.
    pub enrolled_hook: Option<InboundHook>,
    /// Whether a TCP socket already listens on the asked port; an error when it cannot tell.
    pub listening: Option<Result<bool, NetnsError>>,
    /// The addresses of the netns's first interface that has a global one (none: empty).
    pub addresses: Vec<std::net::IpAddr>,
}

/// The data path, in the few coarse calls the operations make: read the facts ADD decides on,
/// apply a plan, remove what a record (or a scan) says, verify a record, and look for traces.
pub trait Dataplane {
    fn pin_root(&self) -> &Path;
    fn is_loaded(&self) -> bool;
    /// Opens the netns (refusing the host's) and reads its cookie.
    fn netns_cookie(&self, netns: &Path) -> Result<u64, NetnsError>;
    fn facts(&self, netns: &Path, cookie: u64, ask: Ask) -> Facts;
    /// Enrols the plan's netns for its attachment.
    fn apply(&self, plan: &Plan) -> Result<Enrolled, EnrollError>;
    /// Whether the maps the last [`Dataplane::apply`] wrote are still the pinned ones: a reload
    /// that recreated one meanwhile took those writes with the old map.
    fn current(&self) -> bool;
    /// Removes what `removal` names of the cookie's enrolment and its links; `Ok(false)` when it
    /// had nothing. Succeeds when the programs are not loaded at all (nothing left to remove).
    fn remove(&self, cookie: u64, removal: Removal<'_>) -> Result<bool, EnrollError>;
    /// Whether the data path still holds what the record says its ADD made.
    fn verify(&self, cookie: u64, expected: &Expected<'_>) -> Result<(), Mismatch>;
    /// Whether anything of the cookie is in the data path (links or a pod entry).
    fn traces(&self, cookie: u64) -> bool;
}

pub struct Pinned {
    pin_root: PathBuf,
    /// The netns [`Dataplane::netns_cookie`] opened, kept for the enrolment that follows in the
    /// same ADD: opening it checks it is not the host's, and once is enough.
    opened: RefCell<Option<Netns>>,
    /// The maps [`Dataplane::facts`] opened, kept for that enrolment too.
    maps: RefCell<Option<PolicyMaps>>,
    /// The maps the last enrolment wrote, for [`Dataplane::current`].
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

    fn listening(&self, netns: &Path, port: u16) -> Result<bool, NetnsError> {
        let ns = self.open_netns(netns)?;
        let found = ns.run(|| sidestep::netns::tcp_listening_on(port));
        *self.opened.borrow_mut() = Some(ns);
        found
    }

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

    fn facts(&self, netns: &Path, cookie: u64, ask: Ask) -> Facts {
        let maps = PolicyMaps::open(&self.pin_root).ok();
        let entry = maps.as_ref().map(|m| m.pod(cookie));
        let enrolled = match &entry {
            Some(Ok(pod)) => pod.is_some(),
            Some(Err(e)) => {
                tracing::debug!("netns cookie {cookie}: {e}");
                true
            }
            None => true,
        };
        let enrolled_hook = match &entry {
            Some(Ok(Some(pod))) => InboundHook::of_pod_flags(pod.flags),
            _ => None,
        };
        // Kept for the enrolment that follows.
        *self.maps.borrow_mut() = maps;
        let listening = ask
            .listening_on
            .filter(|_| enrolled_hook.is_none())
            .map(|port| self.listening(netns, port));
        let addresses = if ask.addresses {
            sidestep::netns::addresses::addresses_at(netns)
                .map(|a| a.ips.into_iter().map(|(ip, _)| ip).collect())
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        Facts {
            enrolled,
            enrolled_hook,
            listening,
            addresses,
        }
    }

    fn apply(&self, plan: &Plan) -> Result<Enrolled, EnrollError> {
        // The same order of checks as enroll::enroll: policy, maps, then the netns.
        plan.policy.validate()?;
        let maps = match self.maps.borrow_mut().take() {
            Some(m) => m,
            None => PolicyMaps::open(&self.pin_root)?,
        };
        let ns = self.open_netns(plan.netns())?;
        *self.enrolled_into.borrow_mut() = Some(maps.identity());
        enroll::enroll_netns(
            &self.pin_root,
            maps,
            &ns,
            &plan.policy,
            Some(std::slice::from_ref(&plan.ifname)),
        )
    }

    fn current(&self) -> bool {
        self.enrolled_into
            .borrow()
            .as_ref()
            .is_some_and(MapIdentity::still_pinned)
    }

    fn remove(&self, cookie: u64, removal: Removal<'_>) -> Result<bool, EnrollError> {
        if let Removal::Attachment {
            ifname,
            addresses,
            inbound_ifindexes,
        } = removal
        {
            return match enroll::unenroll_attachment(
                &self.pin_root,
                cookie,
                ifname,
                addresses,
                inbound_ifindexes,
            ) {
                Ok(()) => Ok(true),
                // Not loaded: nothing of it is in any map.
                Err(EnrollError::Maps(MapsError::NotLoaded(_))) => Ok(false),
                Err(e) => Err(e),
            };
        }
        let Some(mut maps) = self.open_for_unenrol(cookie)? else {
            return Ok(false);
        };
        let was = match removal {
            Removal::Recorded(recorded) => enroll::unenroll_recorded(&mut maps, cookie, &recorded)?,
            _ => enroll::unenroll_cookie(&mut maps, cookie)?,
        };
        podlinks::detach_inbound(&PinLayout::new(&self.pin_root), cookie)?;
        Ok(was)
    }

    fn verify(&self, cookie: u64, expected: &Expected<'_>) -> Result<(), Mismatch> {
        let observed = verify::observe(&self.pin_root, cookie, expected);
        verify::compare(&self.pin_root, cookie, expected, &observed)
    }

    fn traces(&self, cookie: u64) -> bool {
        verify::traces(&self.pin_root, cookie)
    }
}

/// How the library's errors reach the runtime. `pin_root` goes into "not loaded" messages so
/// the operator sees where the plugin looked.
pub fn enroll_error(e: &EnrollError) -> CniError {
    match e {
        EnrollError::Netns(n) => netns_error(n),
        EnrollError::Maps(MapsError::NotLoaded(root)) => not_loaded(root, None),
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

/// "Not loaded": try again later. `agent_namespace` (the entry's `pod_namespace`, which the
/// agent writes) says the node runs the agent as a DaemonSet, so the hint points at its pod.
pub fn not_loaded(pin_root: &Path, agent_namespace: Option<&str>) -> CniError {
    let error = CniError::new(
        code::TRY_AGAIN_LATER,
        format!(
            "sidestep is not loaded at pin_root {}: the pod cannot be captured yet",
            pin_root.display()
        ),
    );
    match agent_namespace {
        Some(ns) => error.details(format!(
            "the sidestep agent on this node has not loaded it: see its pod and log \
             (kubectl -n {ns} get pods -o wide, then kubectl -n {ns} logs <the pod on this \
             node>); its /readyz says what is missing"
        )),
        None => error.details(format!(
            "start the sidestep agent on this node, or run `sidestep load --cgroup <cgroup2 \
             root> --pin-root {}`",
            pin_root.display()
        )),
    }
}

impl ToCniError for EnrollError {
    fn to_cni(&self) -> CniError {
        enroll_error(self)
    }
}
