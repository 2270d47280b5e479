//! A pod's interface and addresses as a CNI result would give them, read from its netns: the
//! agent's repair rebuilds a plugin call from them, and the plugin reads them when its runtime
//! passed no result.

use std::{net::IpAddr, path::Path};

use super::{Netns, NetnsError};

/// A pod's interface and addresses, as a CNI result would give them (for repair).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAddresses {
    pub ifname: String,
    /// Address and prefix length.
    pub ips: Vec<(IpAddr, u8)>,
}

/// Why a live netns's addresses were not read.
#[derive(Debug, thiserror::Error)]
pub enum AddressesError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A `/proc/PID/ns/net` path whose process exited, and whose PID another process has now.
    #[error("it names another netns now (its process is gone)")]
    Replaced,
    #[error("it has no interface with an address")]
    NoAddress,
}

/// The first interface other than loopback that has a global address, with its addresses, in
/// the netns at `path` if it still has `cookie` (a process that took a scanned process's PID
/// cannot have its netns read instead).
pub fn pod_addresses(path: &Path, cookie: u64) -> Result<PodAddresses, AddressesError> {
    let ns = Netns::open(path)?;
    if ns.cookie()? != cookie {
        return Err(AddressesError::Replaced);
    }
    addresses(&ns)
}

/// [`pod_addresses`] of the netns at `path`, whichever it is (the plugin's, given the path by
/// its runtime).
pub fn addresses_at(path: &Path) -> Option<PodAddresses> {
    addresses(&Netns::open(path).ok()?).ok()
}

fn addresses(ns: &Netns) -> Result<PodAddresses, AddressesError> {
    let addrs = ns.run(|| {
        let mut out: Vec<(String, IpAddr, u8)> = Vec::new();
        for a in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
            if a.interface_name == "lo" {
                continue;
            }
            let (Some(addr), Some(mask)) = (a.address, a.netmask) else {
                continue;
            };
            let entry = if let (Some(a4), Some(m4)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in())
            {
                (IpAddr::V4(a4.ip()), u32::from(m4.ip()).count_ones() as u8)
            } else if let (Some(a6), Some(m6)) = (addr.as_sockaddr_in6(), mask.as_sockaddr_in6()) {
                let ip = a6.ip();
                if ip.is_unicast_link_local() {
                    continue;
                }
                (IpAddr::V6(ip), u128::from(m6.ip()).count_ones() as u8)
            } else {
                continue;
            };
            out.push((a.interface_name.clone(), entry.0, entry.1));
        }
        Ok(out)
    })?;
    let ifname = addrs.first().ok_or(AddressesError::NoAddress)?.0.clone();
    Ok(PodAddresses {
        ips: addrs
            .iter()
            .filter(|(n, _, _)| *n == ifname)
            .map(|(_, ip, len)| (*ip, *len))
            .collect(),
        ifname,
    })
}
