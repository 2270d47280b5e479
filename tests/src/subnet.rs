//! Choosing free subnets for a test bridge and creating it, under a machine-wide lock.

use std::fs::OpenOptions;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use nix::fcntl::{Flock, FlockArg};
use serde_json::Value;

use crate::util::cmd;

/// Serialises subnet choice and bridge creation across test processes.
const LOCK_FILE: &str = "/run/sidestep-tests.lock";
/// Candidate IPv4 /24s: 10.200.0.0/24 ... 10.207.255.0/24.
const V4_SLOTS: u32 = 2048;

/// The `.1` / `::1` of a subnet.
fn gateway(network: IpAddr) -> IpAddr {
    match network {
        IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(u32::from(a) + 1)),
        IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a) + 1)),
    }
}

fn slot(i: u32) -> (Ipv4Net, Ipv6Net) {
    let v4 = Ipv4Addr::new(10, 200 + (i / 256) as u8, (i % 256) as u8, 0);
    let v6 = Ipv6Addr::new(0xfd5e, 0x7e57, 0, i as u16, 0, 0, 0, 0);
    (
        Ipv4Net::new(v4, 24).expect("valid prefix"),
        Ipv6Net::new(v6, 64).expect("valid prefix"),
    )
}

/// Prefixes in use on the host: every route (all tables) and every address.
fn used_prefixes() -> Result<Vec<IpNet>> {
    let mut out = Vec::new();
    for fam in ["-4", "-6"] {
        let routes: Value =
            serde_json::from_str(&cmd(&["ip", "-j", fam, "route", "show", "table", "all"])?)?;
        for r in routes.as_array().into_iter().flatten() {
            if let Some(dst) = r["dst"].as_str().filter(|d| *d != "default") {
                if let Ok(n) = dst.parse::<IpNet>() {
                    out.push(n);
                } else if let Ok(a) = dst.parse::<IpAddr>() {
                    out.push(IpNet::from(a));
                }
            }
        }
        let links: Value = serde_json::from_str(&cmd(&["ip", "-j", fam, "addr", "show"])?)?;
        for l in links.as_array().into_iter().flatten() {
            for a in l["addr_info"].as_array().into_iter().flatten() {
                let (Some(ip), Some(len)) = (a["local"].as_str(), a["prefixlen"].as_u64()) else {
                    continue;
                };
                if let Ok(ip) = ip.parse::<IpAddr>()
                    && let Ok(n) = IpNet::new(ip, len as u8)
                {
                    out.push(n.trunc());
                }
            }
        }
    }
    Ok(out)
}

fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// Picks free subnets and creates the bridge with the gateway addresses, under the lock.
pub(crate) fn create_bridge(
    bridge: &str,
    start: u32,
    dual: bool,
) -> Result<(Ipv4Net, Option<Ipv6Net>)> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .with_context(|| format!("open {LOCK_FILE}"))?;
    let _lock = Flock::lock(lock, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .with_context(|| format!("flock {LOCK_FILE}"))?;
    let used = used_prefixes()?;
    let (v4, v6) = (0..V4_SLOTS)
        .map(|k| slot(start.wrapping_add(k) % V4_SLOTS))
        .find(|(v4, v6)| {
            let (a, b) = (IpNet::V4(*v4), IpNet::V6(*v6));
            !used
                .iter()
                .any(|u| overlaps(u, &a) || (dual && overlaps(u, &b)))
        })
        .context("no free 10.200.0.0/13 subnet for a test bridge")?;
    // An address of its own: a bridge without one takes the lowest of its ports' MACs, so it
    // would change as pods join, and the bridge plugin's CHECK compares it with the ADD's.
    let [a, b, c, d] = start.to_be_bytes();
    let mac = format!("02:5e:{a:02x}:{b:02x}:{c:02x}:{d:02x}");
    cmd(&[
        "ip", "link", "add", "name", bridge, "address", &mac, "type", "bridge",
    ])?;
    let setup = || -> Result<()> {
        let gw4 = format!("{}/24", gateway(v4.network().into()));
        cmd(&["ip", "addr", "add", &gw4, "dev", bridge])?;
        if dual {
            let gw6 = format!("{}/64", gateway(v6.network().into()));
            cmd(&["ip", "-6", "addr", "add", &gw6, "dev", bridge, "nodad"])?;
        }
        cmd(&["ip", "link", "set", bridge, "up"])?;
        Ok(())
    };
    if let Err(e) = setup() {
        let _ = cmd(&["ip", "link", "del", bridge]);
        return Err(e);
    }
    Ok((v4, dual.then_some(v6)))
}
