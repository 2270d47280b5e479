//! Re-routed virtual interfaces: tc ingress DNAT and tc egress reverse rewrite on each, pinned
//! beside the pod's inbound links.

use std::fs;

use aya::programs::SchedClassifier;
use sidestep_abi::program_names;

use super::mkdir_private;
use crate::{
    error::EnrollError,
    netns::Netns,
    pins::{PinLayout, REROUTE_EGRESS_SUFFIX, REROUTE_INGRESS_SUFFIX, is_reroute_pin},
    tcattach,
};

/// One re-routed virtual interface as the data path knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RerouteInterface {
    pub key: sidestep_abi::RerouteIfKey,
    pub value: sidestep_abi::RerouteIf,
}

/// Reads what REDIRECT would use on each of `names` in the pod netns: its ifindex and MAC (what
/// the tc programs find it by) and its first IPv4 and first IPv6 address (the kernel's REDIRECT
/// takes the first address of the incoming interface). A listed interface that does not exist
/// fails: iptables would hold a rule by name until the interface appears, but a tc program needs
/// the device, and the pod must not run with a listed interface uncaptured.
pub fn reroute_interfaces(
    netns: &Netns,
    netns_cookie: u64,
    names: &[String],
    all_ranges: bool,
) -> Result<Vec<(String, RerouteInterface)>, EnrollError> {
    use sidestep_abi::{RerouteIf, RerouteIfKey, reroute_flags};
    let names = names.to_vec();
    // The closure's own errors are the interface's, not the netns's: carried out as Ok(Err).
    let found = netns.run(move || {
        let addrs: Vec<_> = nix::ifaddrs::getifaddrs()
            .map_err(std::io::Error::from)?
            .collect();
        let mut out = Vec::new();
        for name in names {
            let ifindex = match nix::net::if_::if_nametoindex(name.as_str()) {
                Ok(i) => i,
                Err(e) => {
                    return Ok(Err(format!(
                        "interface {name} does not exist in the pod netns ({e}); sidestep \
                         attaches to it at enrolment and cannot wait for it to appear"
                    )));
                }
            };
            let mut key = RerouteIfKey {
                ifindex,
                ..Default::default()
            };
            let mut value = RerouteIf {
                netns_cookie,
                flags: if all_ranges {
                    reroute_flags::ALL_RANGES
                } else {
                    0
                },
                ..Default::default()
            };
            let mut has_mac = false;
            for a in addrs.iter().filter(|a| a.interface_name == name) {
                let Some(addr) = a.address.as_ref() else {
                    continue;
                };
                if let Some(link) = addr.as_link_addr()
                    && let Some(mac) = link.addr()
                {
                    key.mac = mac;
                    has_mac = true;
                } else if let Some(v4) = addr.as_sockaddr_in()
                    && value.flags & reroute_flags::HAS_V4 == 0
                {
                    let ip = std::net::IpAddr::V4(v4.ip());
                    value.addr4 = crate::policy::address_words(&ip);
                    value.flags |= reroute_flags::HAS_V4;
                } else if let Some(v6) = addr.as_sockaddr_in6()
                    && value.flags & reroute_flags::HAS_V6 == 0
                {
                    let ip = std::net::IpAddr::V6(v6.ip());
                    value.addr6 = crate::policy::address_words(&ip);
                    value.flags |= reroute_flags::HAS_V6;
                }
            }
            if !has_mac {
                return Ok(Err(format!("interface {name} has no Ethernet address")));
            }
            out.push((name, RerouteInterface { key, value }));
        }
        Ok(Ok(out))
    })?;
    found.map_err(EnrollError::Reroute)
}

/// Attaches the re-route programs (tc ingress DNAT, tc egress reverse rewrite) to each interface,
/// pinned as `<ifname>:reroute-ingress` / `<ifname>:reroute-egress` in the pod's tc link
/// directory, and detaches those of interfaces no longer listed. On failure every re-route link
/// of the pod is gone.
pub fn attach_reroute(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
    names: &[String],
) -> Result<(), EnrollError> {
    let dir = layout.pod_links_dir(netns_cookie);
    mkdir_private(&dir).map_err(|source| EnrollError::StateDir {
        path: dir.clone(),
        source,
    })?;
    let ingress_path = layout.program(program_names::REROUTE_INGRESS);
    let egress_path = layout.program(program_names::REROUTE_EGRESS);
    let names = names.to_vec();
    let dir_in = dir.clone();
    let result = netns.run(move || {
        let wanted: Vec<String> = names
            .iter()
            .flat_map(|n| {
                [
                    format!("{n}{REROUTE_INGRESS_SUFFIX}"),
                    format!("{n}{REROUTE_EGRESS_SUFFIX}"),
                ]
            })
            .collect();
        for e in fs::read_dir(&dir_in)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_reroute_pin(&name) && !wanted.contains(&name) {
                let (interface, slot) = tcattach::slot_of_pin(&name);
                tcattach::detach_here(&e.path(), &interface, slot);
            }
        }
        if names.is_empty() {
            return Ok(());
        }
        let mut ingress =
            SchedClassifier::from_pin(&ingress_path).map_err(std::io::Error::other)?;
        let mut egress = SchedClassifier::from_pin(&egress_path).map_err(std::io::Error::other)?;
        for name in &names {
            for (prog, slot, suffix) in [
                (
                    &mut ingress,
                    tcattach::REROUTE_INGRESS,
                    REROUTE_INGRESS_SUFFIX,
                ),
                (&mut egress, tcattach::REROUTE_EGRESS, REROUTE_EGRESS_SUFFIX),
            ] {
                let pin = dir_in.join(format!("{name}{suffix}"));
                tcattach::attach_here(prog, name, slot, &pin).map_err(|e| {
                    std::io::Error::other(format!("re-route {:?}: {e}", slot.attach_type))
                })?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        detach_reroute(layout, netns, netns_cookie);
        return Err(e.into());
    }
    Ok(())
}

/// Detaches the pod's re-route links only (the inbound ones stay).
pub fn detach_reroute(layout: &PinLayout, netns: &Netns, netns_cookie: u64) {
    let dir = layout.pod_links_dir(netns_cookie);
    let _ = netns.run(|| {
        for e in fs::read_dir(&dir).into_iter().flat_map(|d| d.flatten()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_reroute_pin(&name) {
                let (interface, slot) = tcattach::slot_of_pin(&name);
                tcattach::detach_here(&e.path(), &interface, slot);
            }
        }
        Ok(())
    });
    // Empty once nothing else is attached; a directory with inbound links stays.
    let _ = fs::remove_dir(&dir);
}

/// The re-routed interfaces of a pod that have both links pinned.
pub fn rerouted_interfaces(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    let names: Vec<String> = fs::read_dir(layout.pod_links_dir(netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names
        .iter()
        .filter_map(|n| n.strip_suffix(REROUTE_INGRESS_SUFFIX))
        .filter(|i| names.contains(&format!("{i}{REROUTE_EGRESS_SUFFIX}")))
        .map(str::to_string)
        .collect()
}
