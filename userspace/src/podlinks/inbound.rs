//! The inbound tc program on a pod's interfaces (`inbound_hook: tc`), or, with the sk_lookup
//! hook, the sk_lookup links alone; either way the interfaces captured.

use std::{fs, path::Path};

use aya::programs::SchedClassifier;
use sidestep_abi::program_names;

use super::{mkdir_private, sklookup};
use crate::{
    error::EnrollError,
    links::{self, detach_links_under},
    netns::Netns,
    pins::PinLayout,
    policy::InboundHook,
    tcattach,
};

/// Interfaces of the current netns (the caller's thread), loopback excluded.
fn interfaces_here() -> std::io::Result<Vec<String>> {
    Ok(nix::net::if_::if_nameindex()?
        .iter()
        .map(|i| i.name().to_string_lossy().into_owned())
        .filter(|n| n != "lo")
        .collect())
}

/// Attaches inbound capture to `interfaces` (all but loopback when `None`) minus `excluded`.
/// Returns the interfaces captured. Re-attaching an interface replaces its link. With
/// [`InboundHook::SkLookup`] no tc program is attached (and any left from a `tc` enrolment is
/// detached): the per-netns sk_lookup link alone captures, on the interfaces returned.
pub fn attach_inbound(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
    interfaces: Option<&[String]>,
    excluded: &[String],
    hook: InboundHook,
) -> Result<Vec<(String, u32)>, EnrollError> {
    let dir = layout.pod_links_dir(netns_cookie);
    mkdir_private(&dir).map_err(|source| EnrollError::StateDir {
        path: dir.clone(),
        source,
    })?;
    let prog_path = layout.program(program_names::TC_INGRESS);
    let wanted = interfaces.map(<[String]>::to_vec);
    let excluded = excluded.to_vec();
    let dir_in = dir.clone();
    let result = netns.run(move || {
        let names = match wanted {
            Some(w) => w,
            None => interfaces_here()?,
        };
        // Only the tc hook needs the program through aya (whose first use probes the kernel).
        let mut prog = match hook {
            InboundHook::Tc => {
                Some(SchedClassifier::from_pin(&prog_path).map_err(std::io::Error::other)?)
            }
            InboundHook::SkLookup => None,
        };
        for name in &excluded {
            let pin = dir_in.join(name);
            if pin.exists() {
                tcattach::detach_here(&pin, name, tcattach::INBOUND);
            }
        }
        let mut attached = Vec::new();
        for name in names.into_iter().filter(|n| !excluded.contains(n)) {
            let pin = dir_in.join(&name);
            match prog.as_mut() {
                Some(prog) => tcattach::attach_here(prog, &name, tcattach::INBOUND, &pin)?,
                None if pin.exists() => tcattach::detach_here(&pin, &name, tcattach::INBOUND),
                None => {}
            }
            let ifindex = nix::net::if_::if_nametoindex(name.as_str())?;
            attached.push((name, ifindex));
        }
        Ok(attached)
    });
    let result = result.and_then(|attached| {
        sklookup::attach(layout, netns, netns_cookie)?;
        Ok(attached)
    });
    match result {
        Ok(attached) if !attached.is_empty() => {
            if hook == InboundHook::SkLookup {
                // No tc link lives here (any from an earlier `tc` enrolment was detached).
                let _ = fs::remove_dir(&dir);
            }
            Ok(attached)
        }
        // Inbound capture with nowhere to attach would leave the pod silently uncaptured.
        Ok(_) => {
            let _ = fs::remove_dir(&dir);
            Err(EnrollError::NoInterface(netns.path().to_path_buf()))
        }
        Err(e) => {
            let _ = netns.run(|| {
                detach_pins_here(&dir);
                Ok(())
            });
            let _ = detach_links_under(&dir);
            let _ = fs::remove_dir(&dir);
            Err(e.into())
        }
    }
}

/// Detaches what every pin in `dir` records (TCX links and filters), from inside the pod's netns.
fn detach_pins_here(dir: &Path) {
    for e in fs::read_dir(dir).into_iter().flat_map(|d| d.flatten()) {
        let (interface, slot) = tcattach::slot_of_pin(&e.file_name().to_string_lossy());
        tcattach::detach_here(&e.path(), &interface, slot);
    }
}

/// Detaches the tc attachment of one interface of a pod (a link, or a filter inside the pod's
/// netns while it lives) and removes its pin.
pub fn detach_link_pin(layout: &PinLayout, netns_cookie: u64, pin: &Path) {
    if tcattach::is_link_pin(pin) {
        links::detach_link(pin);
        return;
    }
    tcattach::detach_record(tcattach::find_pod_netns(layout, netns_cookie).as_ref(), pin);
}
