//! The few bpf(2) commands aya 0.14 does not expose for our use: cgroup links for every program
//! type (aya cannot turn a getsockopt link into a pinnable FdLink), link update for atomic program
//! replacement, link detach, and link info.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

use aya_obj::generated::{bpf_attach_type, bpf_attr, bpf_cmd, bpf_link_info};

fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<i64> {
    // SAFETY: `attr` is a valid, zero-initialised bpf_attr of the size we pass.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn zeroed_attr() -> bpf_attr {
    // SAFETY: bpf_attr is plain data; all-zero is its documented "unset" state.
    unsafe { std::mem::zeroed() }
}

/// BPF_LINK_CREATE of `prog` on `target`: a cgroup (cgroup links always allow multiple programs)
/// or a network namespace (sk_lookup).
pub fn link_create(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    attach_type: bpf_attach_type,
) -> io::Result<OwnedFd> {
    let mut attr = zeroed_attr();
    attr.link_create.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
    attr.link_create.__bindgen_anon_2.target_fd = cgroup.as_raw_fd() as u32;
    attr.link_create.attach_type = attach_type as u32;
    let fd = bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether the kernel can attach `prog` (a sched_cls program) as a TCX link. Asked with an
/// ifindex no interface has, so nothing is ever attached: a kernel with TCX gets as far as
/// looking the interface up (ENODEV), one without refuses the attach type (EINVAL).
pub fn probe_tcx(prog: BorrowedFd<'_>) -> bool {
    let mut attr = zeroed_attr();
    attr.link_create.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
    attr.link_create.__bindgen_anon_2.target_ifindex = 0;
    attr.link_create.attach_type = bpf_attach_type::BPF_TCX_INGRESS as u32;
    match bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr) {
        Ok(fd) => {
            // SAFETY: the kernel returned a new file descriptor that nothing else owns; closing
            // it detaches whatever it made.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            true
        }
        Err(e) => e.raw_os_error() == Some(libc::ENODEV),
    }
}

/// What kind of BPF object a file descriptor refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BpfFdKind {
    Program,
    Link,
    Map,
}

/// The kind of a BPF object fd, from the anonymous inode the kernel names it by.
pub fn fd_kind(fd: BorrowedFd<'_>) -> Option<BpfFdKind> {
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    match target.to_str()? {
        "anon_inode:bpf-prog" => Some(BpfFdKind::Program),
        "anon_inode:bpf-link" => Some(BpfFdKind::Link),
        "anon_inode:bpf-map" => Some(BpfFdKind::Map),
        _ => None,
    }
}

/// BPF_PROG_ATTACH of `prog` to `target` (for sk_msg, the sockhash). The attachment lives as long
/// as the target; attaching again replaces the program.
pub fn prog_attach(
    prog: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: bpf_attach_type,
) -> io::Result<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_5.__bindgen_anon_1.target_fd = target.as_raw_fd() as u32;
    attr.__bindgen_anon_5.attach_bpf_fd = prog.as_raw_fd() as u32;
    attr.__bindgen_anon_5.attach_type = attach_type as u32;
    bpf(bpf_cmd::BPF_PROG_ATTACH, &mut attr).map(drop)
}

/// Atomically swaps the program behind a link: no moment exists where neither runs.
pub fn link_update(link: BorrowedFd<'_>, new_prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = zeroed_attr();
    attr.link_update.link_fd = link.as_raw_fd() as u32;
    attr.link_update.__bindgen_anon_1.new_prog_fd = new_prog.as_raw_fd() as u32;
    bpf(bpf_cmd::BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// Detaches a link even while other references (pins, fds) keep the link object alive.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = zeroed_attr();
    attr.link_detach.link_fd = link.as_raw_fd() as u32;
    bpf(bpf_cmd::BPF_LINK_DETACH, &mut attr).map(drop)
}

fn c_path(path: &Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt as _;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.bpf_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_4.pathname = path.as_ptr() as u64;
    bpf(bpf_cmd::BPF_OBJ_PIN, &mut attr).map(drop)
}

pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.pathname = path.as_ptr() as u64;
    let fd = bpf(bpf_cmd::BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// What the kernel says about a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    pub id: u32,
    pub prog_id: u32,
    pub link_type: u32,
    /// For cgroup links: the cgroup's id (its inode number) and attach type.
    pub cgroup_id: u64,
    pub attach_type: u32,
    /// For TCX links: the interface index.
    pub ifindex: u32,
    /// For netns links (sk_lookup): the netns inode, 0 once the netns is gone (the kernel
    /// detaches such a link when its netns dies; the link object lives on in its pin).
    pub netns_ino: u32,
}

pub const BPF_LINK_TYPE_CGROUP: u32 = 3;
pub const BPF_LINK_TYPE_TCX: u32 = 11;
pub const BPF_LINK_TYPE_NETNS: u32 = 5;

pub fn link_info(link: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    // SAFETY: plain data, zero is valid.
    let mut info: bpf_link_info = unsafe { std::mem::zeroed() };
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = link.as_raw_fd() as u32;
    attr.info.info_len = std::mem::size_of::<bpf_link_info>() as u32;
    attr.info.info = std::ptr::from_mut(&mut info) as u64;
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    // SAFETY: the kernel filled the union arm matching `type_`; we read only that arm.
    let (cgroup_id, attach_type, ifindex, netns_ino) = unsafe {
        match info.type_ {
            BPF_LINK_TYPE_CGROUP => (
                info.__bindgen_anon_1.cgroup.cgroup_id,
                info.__bindgen_anon_1.cgroup.attach_type,
                0,
                0,
            ),
            BPF_LINK_TYPE_TCX => (
                0,
                info.__bindgen_anon_1.tcx.attach_type,
                info.__bindgen_anon_1.tcx.ifindex,
                0,
            ),
            BPF_LINK_TYPE_NETNS => (
                0,
                info.__bindgen_anon_1.netns.attach_type,
                0,
                info.__bindgen_anon_1.netns.netns_ino,
            ),
            _ => (0, 0, 0, 0),
        }
    };
    Ok(LinkInfo {
        id: info.id,
        prog_id: info.prog_id,
        link_type: info.type_,
        cgroup_id,
        attach_type,
        ifindex,
        netns_ino,
    })
}

/// The environment variable that names a failpoint, e.g. `SIDESTEP_FAILPOINT=add:after-maps`.
pub const FAILPOINT_ENV: &str = "SIDESTEP_FAILPOINT";

/// Fault injection for the fault tests (tests/tests/faults*.rs), not for operators: when
/// `SIDESTEP_FAILPOINT` equals `name`, the process SIGKILLs itself right here, as an OOM kill or
/// a node's runtime timeout would, with no destructor and no cleanup. `stop:<name>` SIGSTOPs it
/// there instead, so that a test can change the world under a step (a reload mid-ADD) and let
/// it go on with SIGCONT. Unset (always, outside those tests) it costs one comparison against a
/// value read once. It grants nothing: whoever can set a root process's environment can already
/// kill or stop it.
pub fn failpoint(name: &str) {
    static POINT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let Some(armed) = POINT
        .get_or_init(|| std::env::var(FAILPOINT_ENV).ok().filter(|v| !v.is_empty()))
        .as_deref()
    else {
        return;
    };
    use nix::sys::signal::{Signal, raise};
    if armed == name {
        eprintln!("sidestep: failpoint {name}: SIGKILL");
        let _ = raise(Signal::SIGKILL);
    } else if armed.strip_prefix("stop:") == Some(name) {
        eprintln!("sidestep: failpoint {name}: SIGSTOP");
        let _ = raise(Signal::SIGSTOP);
    }
}
