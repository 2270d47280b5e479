//! Whether an enrolment is still what its record says (CNI CHECK): the pod map entry, the
//! re-route links, the sk_lookup and identity links, the attachment's addresses and the tc links.
//! [`observe`] reads the data path once; [`compare`] is the rule, a pure function, so that a
//! fake data path in the plugin's tests is held to the same rule.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use crate::{
    enroll::NetnsKeys,
    maps::PolicyMaps,
    pins::{PinLayout, REROUTE_EGRESS_SUFFIX, REROUTE_INGRESS_SUFFIX},
    podlinks,
    policy::{InboundHook, Policy},
};

/// What a record says an attachment's enrolment left in the data path.
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// `<containerID>/<ifname>`, for messages.
    pub attachment: &'a str,
    pub policy: &'a Policy,
    /// Interfaces that carry inbound capture.
    pub interfaces: &'a [String],
    /// The keys enrolment derived from the netns; `None` in records of older plugins.
    pub netns_keys: Option<&'a NetnsKeys>,
}

/// The pod map's entry for a cookie, against the recorded policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEntry {
    Missing,
    Matches,
    Differs,
    /// The map could not be read.
    Unreadable(String),
}

/// The data path's view of one cookie, as far as CHECK looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub pod_entry: PodEntry,
    pub reroute_pins: Vec<String>,
    pub sk_lookup: bool,
    pub identity: bool,
    /// Those of the expected attachment addresses `SIDESTEP_ADDRS` does not map to the cookie.
    pub missing_addresses: Vec<IpAddr>,
    /// Interfaces with a pinned inbound tc link.
    pub tc_interfaces: Vec<String>,
}

/// How the data path differs from the record. The texts are what CNI CHECK reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    #[error("netns cookie {cookie} is not in the pod map under {}", pin_root.display())]
    NotInPodMap { cookie: u64, pin_root: PathBuf },
    #[error("the pod map entry of netns cookie {cookie} differs from the recorded policy")]
    PodEntryDiffers { cookie: u64 },
    #[error("cannot read the pod map: {0}")]
    PodMapUnreadable(String),
    #[error("the re-route links [{}] of netns cookie {cookie} are missing", missing.join(", "))]
    RerouteLinks { cookie: u64, missing: Vec<String> },
    #[error("the inbound sk_lookup program is not attached to netns cookie {cookie}")]
    NoSkLookup { cookie: u64 },
    #[error(
        "the identity sk_lookup program of netns cookie {cookie} is not attached: inbound to \
         addresses enrolment did not register would not be captured"
    )]
    NoIdentity { cookie: u64 },
    #[error(
        "the addresses [{}] of {attachment} are not registered to netns cookie {cookie}",
        join(missing)
    )]
    Addresses {
        cookie: u64,
        attachment: String,
        missing: Vec<IpAddr>,
    },
    #[error(
        "the inbound tc program is not attached to [{}] of netns cookie {cookie}",
        missing.join(", ")
    )]
    TcLinks { cookie: u64, missing: Vec<String> },
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads what [`compare`] needs of `cookie` from the pins under `pin_root`.
pub fn observe(pin_root: &Path, cookie: u64, expected: &Expected<'_>) -> Observed {
    let layout = PinLayout::new(pin_root);
    let maps = PolicyMaps::open(pin_root);
    let pod_entry = match &maps {
        Err(e) => PodEntry::Unreadable(e.to_string()),
        Ok(maps) => {
            let pod = expected.policy.to_map_entries(cookie).pod;
            let want = expected.netns_keys.map_or(pod, |k| k.adjust(pod));
            match maps.pods.get(&cookie, 0) {
                Ok(have) if have == want => PodEntry::Matches,
                Ok(_) => PodEntry::Differs,
                Err(_) => PodEntry::Missing,
            }
        }
    };
    let wanted_addresses = expected
        .netns_keys
        .map_or(&[][..], |k| &k.interface_addresses[..]);
    let missing_addresses = wanted_addresses
        .iter()
        .filter(|ip| {
            maps.as_ref().map_or(true, |m| {
                m.addresses
                    .get(&crate::policy::address_words(ip), 0)
                    .map_or(true, |owner| owner != cookie)
            })
        })
        .copied()
        .collect();
    Observed {
        pod_entry,
        reroute_pins: podlinks::reroute_pins(&layout, cookie),
        sk_lookup: podlinks::has_sk_lookup(&layout, cookie),
        identity: podlinks::has_identity(&layout, cookie),
        missing_addresses,
        tc_interfaces: podlinks::attached_interfaces(&layout, cookie),
    }
}

/// The first way `observed` differs from what `expected` says, in the order an operator fixes
/// them: the pod entry, then each kind of link.
pub fn compare(
    pin_root: &Path,
    cookie: u64,
    expected: &Expected<'_>,
    observed: &Observed,
) -> Result<(), Mismatch> {
    match &observed.pod_entry {
        PodEntry::Matches => {}
        PodEntry::Missing => {
            return Err(Mismatch::NotInPodMap {
                cookie,
                pin_root: pin_root.to_path_buf(),
            });
        }
        PodEntry::Differs => return Err(Mismatch::PodEntryDiffers { cookie }),
        PodEntry::Unreadable(e) => return Err(Mismatch::PodMapUnreadable(e.clone())),
    }
    let policy = expected.policy;
    // Re-routed interfaces get their two links whenever the pod captures any outbound range.
    if !policy.include_outbound_ip_ranges.is_empty() {
        let missing: Vec<String> = policy
            .reroute_virtual_interfaces
            .iter()
            .flat_map(|i| {
                [REROUTE_INGRESS_SUFFIX, REROUTE_EGRESS_SUFFIX].map(|s| format!("{i}{s}"))
            })
            .filter(|p| !observed.reroute_pins.contains(p))
            .collect();
        if !missing.is_empty() {
            return Err(Mismatch::RerouteLinks { cookie, missing });
        }
    }
    if expected.interfaces.is_empty() {
        return Ok(());
    }
    if !observed.sk_lookup {
        return Err(Mismatch::NoSkLookup { cookie });
    }
    // Records of this version name the identity program and the attachment's addresses.
    if expected.netns_keys.is_some() {
        if !observed.identity {
            return Err(Mismatch::NoIdentity { cookie });
        }
        if !observed.missing_addresses.is_empty() {
            return Err(Mismatch::Addresses {
                cookie,
                attachment: expected.attachment.to_owned(),
                missing: observed.missing_addresses.clone(),
            });
        }
    }
    if policy.inbound_hook == InboundHook::SkLookup {
        return Ok(());
    }
    let missing: Vec<String> = expected
        .interfaces
        .iter()
        .filter(|i| !observed.tc_interfaces.contains(i))
        .cloned()
        .collect();
    if !missing.is_empty() {
        return Err(Mismatch::TcLinks { cookie, missing });
    }
    Ok(())
}

/// Whether anything of `cookie` is in the data path: its links (checked first: they need no
/// map) or its pod entry. A map that cannot be read counts as yes, so that DEL then unenrols.
pub fn traces(pin_root: &Path, cookie: u64) -> bool {
    let layout = PinLayout::new(pin_root);
    podlinks::has_sk_lookup(&layout, cookie)
        || !podlinks::attached_interfaces(&layout, cookie).is_empty()
        || !podlinks::reroute_pins(&layout, cookie).is_empty()
        || PolicyMaps::open(pin_root).map_or(true, |maps| maps.is_enrolled(cookie).unwrap_or(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed() -> Observed {
        Observed {
            pod_entry: PodEntry::Matches,
            reroute_pins: vec!["tun0:reroute-ingress".into(), "tun0:reroute-egress".into()],
            sk_lookup: true,
            identity: true,
            missing_addresses: Vec::new(),
            tc_interfaces: vec!["eth0".into()],
        }
    }

    #[test]
    fn each_difference_is_named_in_order() {
        let policy = Policy {
            reroute_virtual_interfaces: vec!["tun0".into()],
            inbound_hook: InboundHook::Tc,
            ..Policy::default()
        };
        let keys = NetnsKeys::default();
        let interfaces = ["eth0".to_owned()];
        let expected = Expected {
            attachment: "c/eth0",
            policy: &policy,
            interfaces: &interfaces,
            netns_keys: Some(&keys),
        };
        let root = Path::new("/p");
        let cmp = |o: &Observed| compare(root, 7, &expected, o);
        assert_eq!(cmp(&observed()), Ok(()));
        let with = |f: fn(&mut Observed)| {
            let mut o = observed();
            f(&mut o);
            cmp(&o).unwrap_err().to_string()
        };
        assert_eq!(
            with(|o| o.pod_entry = PodEntry::Missing),
            "netns cookie 7 is not in the pod map under /p"
        );
        assert!(
            with(|o| o.reroute_pins.clear()).contains("tun0:reroute-ingress, tun0:reroute-egress")
        );
        assert!(with(|o| o.sk_lookup = false).contains("sk_lookup program is not attached"));
        assert!(with(|o| o.identity = false).contains("identity sk_lookup program"));
        assert_eq!(
            with(|o| o.missing_addresses = vec!["10.0.0.1".parse().unwrap()]),
            "the addresses [10.0.0.1] of c/eth0 are not registered to netns cookie 7"
        );
        assert!(with(|o| o.tc_interfaces.clear()).contains("tc program is not attached to [eth0]"));
        // With sk_lookup the tc links are not asked for; an older record has no addresses.
        let sk = Policy {
            inbound_hook: InboundHook::SkLookup,
            ..policy.clone()
        };
        let older = Expected {
            policy: &sk,
            netns_keys: None,
            ..expected
        };
        let mut o = observed();
        o.tc_interfaces.clear();
        o.identity = false;
        assert_eq!(compare(root, 7, &older, &o), Ok(()));
    }
}
