//! A pod's links, all pinned under the pin root and keyed by its netns cookie: the inbound tc
//! program on its interfaces (`inbound`, `links/tc/<cookie>/<ifname>`), its sk_lookup links
//! (`sklookup`: the pod's identity program, then the shared listener lookup) and the re-route
//! programs of its virtual interfaces (`reroute`, beside the tc links). Each is attached from
//! inside the pod netns and taken away here, also once the netns is gone.

mod inbound;
mod reroute;
mod sklookup;

use std::{fs, os::unix::fs::DirBuilderExt, path::Path};

pub use inbound::{attach_inbound, detach_link_pin};
pub use reroute::{
    RerouteInterface, attach_reroute, detach_reroute, reroute_interfaces, rerouted_interfaces,
};

use crate::{
    error::LoadError,
    links::{self, detach_links_under},
    pins::{PinLayout, is_reroute_pin},
    tcattach,
};

/// Per-pod link directories are 0700 like the pin root the loader makes, so that no directory
/// below it is open to other users even where the pin root's own mode was loosened.
fn mkdir_private(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Detaches every inbound link of the pod (tc and sk_lookup). Works when the netns is already
/// gone. Idempotent.
pub fn detach_inbound(layout: &PinLayout, netns_cookie: u64) -> Result<(), LoadError> {
    // Filters first: their netns is found through the sk_lookup link.
    tcattach::detach_filter_records(layout, netns_cookie);
    // The shared program first: without it the identity program only writes a slot.
    links::detach_link(&layout.sk_lookup_pin(netns_cookie));
    links::detach_link(&crate::identity::pin(layout, netns_cookie));
    let dir = layout.pod_links_dir(netns_cookie);
    detach_links_under(&dir)?;
    match fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(LoadError::Unpin {
            path: dir,
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Whether the pod's sk_lookup link is pinned and still attached to its netns.
pub fn has_sk_lookup(layout: &PinLayout, netns_cookie: u64) -> bool {
    sklookup::attached(&layout.sk_lookup_pin(netns_cookie))
}

/// Whether the pod's identity link is pinned and attached (without it sk_lookup finds the pod
/// only by the addresses enrolment registered).
pub fn has_identity(layout: &PinLayout, netns_cookie: u64) -> bool {
    sklookup::attached(&crate::identity::pin(layout, netns_cookie))
}

/// The interfaces of a pod that currently have a pinned inbound tc link.
pub fn attached_interfaces(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    fs::read_dir(layout.pod_links_dir(netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !is_reroute_pin(n))
                .collect()
        })
        .unwrap_or_default()
}

/// The pod's re-route link pins (`<ifname>:reroute-ingress`, `<ifname>:reroute-egress`).
pub fn reroute_pins(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    fs::read_dir(layout.pod_links_dir(netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| is_reroute_pin(n))
                .collect()
        })
        .unwrap_or_default()
}
