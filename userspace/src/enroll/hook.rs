//! The inbound hook when the operator named none: `sk_lookup` (no per-packet program, no TCX
//! attach), except where it cannot work. [`decide`] is the rule; the CLI ([`default_hook`]) and
//! the CNI plugin's ADD (cni/src/ops/add.rs) both apply it, so both entry points give one default.

use std::path::Path;

use crate::{
    maps::PolicyMaps,
    netns::{Netns, NetnsError},
    policy::InboundHook,
};

/// Why the default is not `sk_lookup` for this netns, if it is not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcBecause {
    /// The netns is enrolled with `tc` already: its proxy may be listening unknown to sk_lookup.
    EnrolledWithTc,
    /// Something listens on the inbound port already (a running pod): sk_lookup learns a proxy's
    /// listener only from a listen(2) after enrolment.
    AlreadyListening,
    /// The netns's sockets could not be read: counted as a listener.
    Unknown(String),
}

/// The rule itself, from what is known of the netns: the hook it is enrolled with (if it is),
/// and whether something listens on the inbound port (asked only when it is not enrolled).
pub fn decide(
    enrolled: Option<InboundHook>,
    listening: impl FnOnce() -> Result<bool, NetnsError>,
) -> Result<InboundHook, TcBecause> {
    match enrolled {
        Some(InboundHook::Tc) => return Err(TcBecause::EnrolledWithTc),
        Some(InboundHook::SkLookup) => return Ok(InboundHook::SkLookup),
        None => {}
    }
    match listening() {
        Ok(false) => Ok(InboundHook::SkLookup),
        Ok(true) => Err(TcBecause::AlreadyListening),
        Err(e) => Err(TcBecause::Unknown(e.to_string())),
    }
}

/// `sk_lookup`, or `tc` and the reason, for a netns enrolled by hand.
pub fn default_hook(
    pin_root: &Path,
    netns: &Netns,
    inbound_port: u16,
) -> Result<InboundHook, TcBecause> {
    if inbound_port == 0 {
        return Ok(InboundHook::SkLookup);
    }
    let enrolled = netns.cookie().ok().and_then(|cookie| {
        let maps = PolicyMaps::open(pin_root).ok()?;
        let pod = maps.pods.get(&cookie, 0).ok()?;
        InboundHook::of_pod_flags(pod.flags)
    });
    decide(enrolled, || {
        netns.run(|| crate::netns::tcp_listening_on(inbound_port))
    })
}

impl std::fmt::Display for TcBecause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EnrolledWithTc => write!(f, "the netns is enrolled with the tc hook already"),
            Self::AlreadyListening => write!(
                f,
                "the inbound port already listens in the netns (a running pod: sk_lookup learns \
                 a proxy's listener only from a listen(2) after enrolment)"
            ),
            Self::Unknown(e) => write!(f, "cannot tell whether the proxy listens already ({e})"),
        }
    }
}
