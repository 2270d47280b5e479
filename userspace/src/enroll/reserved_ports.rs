//! Ambient pods: ztunnel's in-pod ports are kept out of the kernel's automatic port choice.
//!
//! cgroup/bind4/6 (`portguard.rs`) refuse an explicit bind of ztunnel's ports by any socket
//! without ztunnel's mark, but a socket that listens or connects without binding first takes an
//! ephemeral port, which no bind hook sees. A pod may move `ip_local_port_range` (a safe sysctl)
//! over 15001-15053, and its app could then hold one of ztunnel's ports before ztunnel binds it.
//! The netns's `ip_local_reserved_ports` (one list for IPv4 and IPv6) keeps the kernel from
//! choosing them; an explicit bind, ztunnel's, is unaffected. Entries already there are kept.

use std::{collections::BTreeSet, fs, io};

use crate::netns::{Netns, NetnsError};

const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Adds `ports` to the netns's reserved ports.
pub fn reserve(netns: &Netns, ports: &[u16]) -> Result<(), NetnsError> {
    let ports = ports.to_vec();
    netns.run(move || {
        let current = fs::read_to_string(RESERVED_PORTS)?;
        if let Some(list) = with_ports(&current, &ports)? {
            fs::write(RESERVED_PORTS, list)?;
        }
        Ok(())
    })
}

/// The list with `ports` added, or `None` when every one is reserved already. The kernel prints
/// the list as comma-separated ports and `low-high` ranges.
fn with_ports(current: &str, ports: &[u16]) -> io::Result<Option<String>> {
    let invalid = |entry: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{RESERVED_PORTS} holds {entry:?}, not a port or a range"),
        )
    };
    let mut ranges: Vec<(u16, u16)> = Vec::new();
    for entry in current.trim().split(',').filter(|e| !e.is_empty()) {
        let (low, high) = entry.split_once('-').unwrap_or((entry, entry));
        let parse = |p: &str| p.trim().parse::<u16>().map_err(|_| invalid(entry));
        ranges.push((parse(low)?, parse(high)?));
    }
    let missing: BTreeSet<u16> = ports
        .iter()
        .copied()
        .filter(|p| !ranges.iter().any(|(low, high)| (*low..=*high).contains(p)))
        .collect();
    if missing.is_empty() {
        return Ok(None);
    }
    let mut list: Vec<String> = ranges
        .iter()
        .map(|(low, high)| {
            if low == high {
                low.to_string()
            } else {
                format!("{low}-{high}")
            }
        })
        .collect();
    list.extend(missing.iter().map(u16::to_string));
    Ok(Some(list.join(",")))
}

#[cfg(test)]
mod tests {
    use super::with_ports;

    #[test]
    fn ports_join_what_the_kernel_already_reserves() {
        let ztunnel = [15001, 15006, 15008, 15053];
        assert_eq!(
            with_ports("\n", &ztunnel).unwrap().as_deref(),
            Some("15001,15006,15008,15053")
        );
        assert_eq!(
            with_ports("8080,15000-15007\n", &ztunnel)
                .unwrap()
                .as_deref(),
            Some("8080,15000-15007,15008,15053")
        );
        assert_eq!(
            with_ports("15001,15006,15008,15053\n", &ztunnel).unwrap(),
            None
        );
        assert!(with_ports("80,x\n", &ztunnel).is_err());
    }
}
