//! Per-pod inbound capture: the tc ingress program on the pod's interfaces, attached from inside
//! the pod netns, with TCX links pinned at `<pin_root>/links/tc/<netns cookie>/<ifname>`.

use std::{
    fs,
    os::{fd::AsFd as _, unix::fs::DirBuilderExt},
    path::{Path, PathBuf},
};

use aya::{
    programs::{SchedClassifier, TcAttachType, links::FdLink, tc},
    util::KernelVersion,
};
use sidestep_abi::program_names;

use crate::{
    error::{EnrollError, LoadError},
    loader::detach_links_under,
    netns::Netns,
    pins::PinLayout,
    policy::InboundHook,
};

pub fn pod_links_dir(layout: &PinLayout, netns_cookie: u64) -> PathBuf {
    layout.links_dir().join("tc").join(netns_cookie.to_string())
}

/// Per-pod link directories are 0700 like the pin root the loader makes, so that no directory
/// below it is open to other users even where the pin root's own mode was loosened.
fn mkdir_private(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

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
    let dir = pod_links_dir(layout, netns_cookie);
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
        let tcx = has_tcx();
        let mut attached = Vec::new();
        for name in names.into_iter().filter(|n| !excluded.contains(n)) {
            let pin = dir_in.join(&name);
            if pin.exists() {
                detach_links_under_file(&pin);
            }
            let Some(prog) = prog.as_mut() else {
                let ifindex = nix::net::if_::if_nametoindex(name.as_str())?;
                attached.push((name, ifindex));
                continue;
            };
            // Kernels before 6.6 have no TCX; aya then attaches through netlink and needs clsact.
            // With TCX the qdisc is not used, and adding it costs a netlink round trip and, on a
            // fresh interface, a qdisc graft, in every ADD.
            if !tcx
                && let Err(e) = tc::qdisc_add_clsact(&name)
                && !matches!(&e, tc::TcError::IoError(io) if io.raw_os_error() == Some(libc::EEXIST))
                && !matches!(&e, tc::TcError::NetlinkError(_))
            {
                tracing::debug!(interface = %name, error = %e, "clsact");
            }
            let id = prog
                .attach(&name, TcAttachType::Ingress)
                .map_err(|e| std::io::Error::other(format!("attach tc ingress to {name}: {e}")))?;
            let link = prog.take_link(id).map_err(std::io::Error::other)?;
            match FdLink::try_from(link) {
                Ok(fd_link) => {
                    fd_link
                        .pin(&pin)
                        .map_err(|e| std::io::Error::other(format!("pin {}: {e}", pin.display())))?;
                }
                // A netlink filter outlives us on its own; it is removed with the interface.
                Err(aya::programs::links::LinkError::InvalidLink) => {}
                Err(e) => return Err(std::io::Error::other(e)),
            }
            let ifindex = nix::net::if_::if_nametoindex(name.as_str())?;
            attached.push((name, ifindex));
        }
        Ok(attached)
    });
    let result = result.and_then(|attached| {
        attach_sk_lookup(layout, netns, netns_cookie)?;
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
            let _ = detach_links_under(&dir);
            let _ = fs::remove_dir(&dir);
            Err(e.into())
        }
    }
}

/// Whether aya attaches tc programs as TCX links here (it does from kernel 6.6 on, by the same
/// version test).
fn has_tcx() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

fn detach_links_under_file(pin: &std::path::Path) {
    if let Ok(link) = crate::sys::obj_get(pin) {
        use std::os::fd::AsFd as _;
        let _ = crate::sys::link_detach(link.as_fd());
    }
    let _ = fs::remove_file(pin);
}

fn sk_lookup_pin(layout: &PinLayout, netns_cookie: u64) -> PathBuf {
    layout
        .links_dir()
        .join("sklookup")
        .join(netns_cookie.to_string())
}

/// The pod's sk_lookup link (the kernel's listener lookup: every captured SYN with the sk_lookup
/// hook, those tc leaves to it with tc). Made with raw bpf(2) calls: loading a pinned program
/// through aya first probes the kernel's features, a dozen test loads that an ADD need not pay.
fn attach_sk_lookup(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
) -> Result<(), crate::error::NetnsError> {
    let pin = sk_lookup_pin(layout, netns_cookie);
    let io = |e: std::io::Error| crate::error::NetnsError::Enter {
        path: netns.path().to_path_buf(),
        source: e,
    };
    if pin.exists() {
        return Ok(());
    }
    mkdir_private(pin.parent().unwrap_or(layout.links_dir().as_path())).map_err(io)?;
    let prog = crate::sys::obj_get(&layout.program(program_names::SK_LOOKUP)).map_err(io)?;
    let netns_file = fs::File::open(netns.path()).map_err(io)?;
    let link = crate::sys::link_create(
        prog.as_fd(),
        netns_file.as_fd(),
        aya_obj::generated::bpf_attach_type::BPF_SK_LOOKUP,
    )
    .map_err(|e| io(std::io::Error::other(format!("attach sk_lookup: {e}"))))?;
    crate::sys::obj_pin(link.as_fd(), &pin)
        .map_err(|e| io(std::io::Error::other(format!("pin {}: {e}", pin.display()))))?;
    Ok(())
}

/// Detaches every inbound link of the pod (tc and sk_lookup). Works when the netns is already
/// gone. Idempotent.
pub fn detach_inbound(layout: &PinLayout, netns_cookie: u64) -> Result<(), LoadError> {
    detach_links_under_file(&sk_lookup_pin(layout, netns_cookie));
    let dir = pod_links_dir(layout, netns_cookie);
    detach_links_under(&dir)?;
    match fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(LoadError::Unpin {
            path: dir,
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Whether the pod's sk_lookup link is pinned.
pub fn has_sk_lookup(layout: &PinLayout, netns_cookie: u64) -> bool {
    sk_lookup_pin(layout, netns_cookie).exists()
}

/// The interfaces of a pod that currently have a pinned tc link.
pub fn attached_interfaces(layout: &PinLayout, netns_cookie: u64) -> Vec<String> {
    fs::read_dir(pod_links_dir(layout, netns_cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}
