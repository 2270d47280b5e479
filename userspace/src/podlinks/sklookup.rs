//! A pod's sk_lookup links: its identity program, then the shared listener lookup, each a netns
//! link pinned under the pin root.

use std::{fs, os::fd::AsFd as _, path::Path};

use sidestep_abi::program_names;

use super::mkdir_private;
use crate::{netns::Netns, pins::PinLayout};

/// The pod's sk_lookup links: its identity program first, then the shared program (the kernel's
/// listener lookup: every captured SYN with the sk_lookup hook, those tc leaves to it with tc).
/// A netns runs its sk_lookup programs in attach order, and the shared one learns the pod from
/// the identity one ([`crate::identity`]). Made with raw bpf(2) calls: loading a pinned program
/// through aya first probes the kernel's features, a dozen test loads that an ADD need not pay.
pub(super) fn attach(
    layout: &PinLayout,
    netns: &Netns,
    netns_cookie: u64,
) -> Result<(), crate::netns::NetnsError> {
    let pin = layout.sk_lookup_pin(netns_cookie);
    let id_pin = crate::identity::pin(layout, netns_cookie);
    let io = |e: std::io::Error| crate::netns::NetnsError::Enter {
        path: netns.path().to_path_buf(),
        source: e,
    };
    crate::sys::failpoint("enroll:before-sk-lookup");
    let shared_attached = pin.exists() && attached(&pin);
    let identity_attached = id_pin.exists() && attached(&id_pin);
    for p in [&pin, &id_pin] {
        mkdir_private(p.parent().unwrap_or(layout.links_dir().as_path())).map_err(io)?;
    }
    let nsid = crate::sys::obj_get(&layout.map(sidestep_abi::map_names::POD_IDENTITY))
        .map_err(|e| io(std::io::Error::other(format!("open SIDESTEP_NSID: {e}"))))?;
    let id_prog = crate::identity::load(nsid.as_fd(), netns_cookie).map_err(io)?;
    if identity_attached {
        // A fresh program in place (the link keeps its place in the order): a reload may have
        // recreated the map the old one writes.
        let link = crate::sys::obj_get(&id_pin).map_err(io)?;
        crate::sys::link_update(link.as_fd(), id_prog.as_fd()).map_err(io)?;
    } else {
        if id_pin.exists() {
            fs::remove_file(&id_pin).map_err(io)?;
        }
        link_netns(id_prog.as_fd(), netns, &id_pin).map_err(io)?;
    }
    if shared_attached && identity_attached {
        // A re-enrolment after a reload: the link must run the program pinned now, which a
        // reload's own sweep of the links can miss for a link pinned while it ran.
        return follow_pinned_program(layout, &pin).map_err(io);
    }
    let prog = crate::sys::obj_get(&layout.program(program_names::SK_LOOKUP)).map_err(io)?;
    if shared_attached {
        // Enrolled by a version without the identity program, whose link now runs after the
        // shared one: a second shared link goes in after it, replaces the first one's pin in one
        // rename, and then the first one is detached. The pod is captured throughout.
        let old = crate::sys::obj_get(&pin).map_err(io)?;
        let staged = pin.with_file_name(format!("{netns_cookie}-new"));
        let _ = fs::remove_file(&staged);
        link_netns(prog.as_fd(), netns, &staged).map_err(io)?;
        fs::rename(&staged, &pin).map_err(io)?;
        crate::sys::link_detach(old.as_fd()).map_err(io)?;
        return Ok(());
    }
    if pin.exists() {
        // Pinned but detached (an unenrolment killed between its detach and its unlink): a new
        // link replaces it.
        fs::remove_file(&pin).map_err(io)?;
    }
    link_netns(prog.as_fd(), netns, &pin).map_err(io)
}

/// Attaches `prog` as the netns's next sk_lookup program and pins the link at `pin`.
fn link_netns(prog: std::os::fd::BorrowedFd<'_>, netns: &Netns, pin: &Path) -> std::io::Result<()> {
    let link = crate::sys::link_create(
        prog,
        netns.fd(),
        aya_obj::generated::bpf_attach_type::BPF_SK_LOOKUP,
    )
    .map_err(|e| std::io::Error::other(format!("attach sk_lookup: {e}")))?;
    crate::sys::obj_pin(link.as_fd(), pin)
        .map_err(|e| std::io::Error::other(format!("pin {}: {e}", pin.display())))
}

/// Moves the link pinned at `pin` to the pinned sk_lookup program when it runs another one.
fn follow_pinned_program(layout: &PinLayout, pin: &std::path::Path) -> std::io::Result<()> {
    let link = crate::sys::obj_get(pin)?;
    let prog_pin = layout.program(program_names::SK_LOOKUP);
    let running = crate::sys::link_info(link.as_fd())?.prog_id;
    let pinned = aya::programs::ProgramInfo::from_pin(&prog_pin)
        .map(|i| i.id())
        .map_err(std::io::Error::other)?;
    if running != pinned {
        let prog = crate::sys::obj_get(&prog_pin)?;
        crate::sys::link_update(link.as_fd(), prog.as_fd())?;
    }
    Ok(())
}

/// Whether the netns link pinned at `pin` is attached: the kernel reports no netns once it was
/// detached, or its netns died.
pub(super) fn attached(pin: &std::path::Path) -> bool {
    crate::sys::obj_get(pin)
        .and_then(|link| crate::sys::link_info(link.as_fd()))
        .is_ok_and(|i| i.link_type == crate::sys::BPF_LINK_TYPE_NETNS && i.netns_ino != 0)
}
