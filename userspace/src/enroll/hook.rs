//! The inbound hook when the operator named none: `sk_lookup` (no per-packet program, no TCX
//! attach), except where it cannot work. The CNI plugin applies the same rule at ADD
//! (cni/src/ops/add.rs), so both entry points give one default.

use std::path::Path;

use crate::{maps::PolicyMaps, netns::Netns, policy::InboundHook};

/// Why the default is not `sk_lookup` for this netns, if it is not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcBecause {
    /// The netns is enrolled with `tc` already: its proxy may be listening unknown to sk_lookup.
    EnrolledWithTc,
    /// Something listens on the inbound port already (a running pod): sk_lookup learns a proxy's
    /// listener only from a listen(2) after enrolment.
    AlreadyListening(u16),
    /// The netns's sockets could not be read: counted as a listener.
    Unknown(String),
}

/// `sk_lookup`, or `tc` and the reason.
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
    match enrolled {
        Some(InboundHook::Tc) => return Err(TcBecause::EnrolledWithTc),
        Some(InboundHook::SkLookup) => return Ok(InboundHook::SkLookup),
        None => {}
    }
    match netns.run(|| crate::netns::tcp_listening_on(inbound_port)) {
        Ok(false) => Ok(InboundHook::SkLookup),
        Ok(true) => Err(TcBecause::AlreadyListening(inbound_port)),
        Err(e) => Err(TcBecause::Unknown(e.to_string())),
    }
}

impl std::fmt::Display for TcBecause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EnrolledWithTc => write!(f, "the netns is enrolled with the tc hook already"),
            Self::AlreadyListening(port) => write!(
                f,
                "port {port} already listens in the netns (sk_lookup learns a proxy's listener \
                 only from a listen(2) after enrolment)"
            ),
            Self::Unknown(e) => write!(f, "cannot tell whether the proxy listens already ({e})"),
        }
    }
}
