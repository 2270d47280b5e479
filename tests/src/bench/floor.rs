//! The floor under the bpf_stats figures: what the kernel charges for calling a program that does
//! nothing, at each hook sidestep's programs use.
//!
//! bpf_stats times every call with two clock reads, and the kernel runs a cgroup's sock_ops
//! program at every event of every TCP socket in it (RTO and window initialisation, ECN, the
//! established callbacks), whatever the program asks for. So part of the per-connection figure
//! is the price of being attached at all. A no-op program (`r0 = 1; exit`) at each of those
//! hooks, attached beside sidestep's to the same cgroup and netns for one window, is called as
//! often and timed the same way: its ns/call is that price, measured, and sidestep's programs
//! cost the rest.
//!
//! The programs are loaded from raw instructions and never pinned; their links are held by file
//! descriptors only, so they detach when the set drops or this process ends.

use std::{
    fs::File,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{Context, Result, bail};
use aya_obj::generated::{bpf_attach_type, bpf_attr, bpf_cmd, bpf_prog_info, bpf_prog_type};

use super::bpfstats::ProgSample;

/// One hook and the sidestep programs that run there.
#[derive(Clone, Copy, Debug)]
pub struct Hook {
    /// The no-op's program name (at most 15 bytes: the kernel keeps no more).
    pub name: &'static str,
    prog_type: bpf_prog_type,
    attach_type: bpf_attach_type,
    /// sk_lookup programs attach to a netns; the rest to the cgroup.
    per_netns: bool,
    pub stands_for: &'static [&'static str],
}

pub const HOOKS: [Hook; 13] = {
    use bpf_attach_type::*;
    use bpf_prog_type::*;
    const fn cgroup(
        name: &'static str,
        prog_type: bpf_prog_type,
        attach_type: bpf_attach_type,
        stands_for: &'static [&'static str],
    ) -> Hook {
        Hook {
            name,
            prog_type,
            attach_type,
            per_netns: false,
            stands_for,
        }
    }
    let addr = BPF_PROG_TYPE_CGROUP_SOCK_ADDR;
    [
        cgroup(
            "floor_sockops",
            BPF_PROG_TYPE_SOCK_OPS,
            BPF_CGROUP_SOCK_OPS,
            &["sidestep_sockops"],
        ),
        cgroup(
            "floor_connect4",
            addr,
            BPF_CGROUP_INET4_CONNECT,
            &["sidestep_connect4"],
        ),
        cgroup(
            "floor_connect6",
            addr,
            BPF_CGROUP_INET6_CONNECT,
            &["sidestep_connect6"],
        ),
        cgroup(
            "floor_getpeer4",
            addr,
            BPF_CGROUP_INET4_GETPEERNAME,
            &["sidestep_getpeername4"],
        ),
        cgroup(
            "floor_getpeer6",
            addr,
            BPF_CGROUP_INET6_GETPEERNAME,
            &["sidestep_getpeername6"],
        ),
        cgroup(
            "floor_sockopt",
            BPF_PROG_TYPE_CGROUP_SOCKOPT,
            BPF_CGROUP_GETSOCKOPT,
            &["sidestep_getsockopt"],
        ),
        cgroup(
            "floor_setsopt",
            BPF_PROG_TYPE_CGROUP_SOCKOPT,
            BPF_CGROUP_SETSOCKOPT,
            &["sidestep_setsockopt"],
        ),
        cgroup(
            "floor_sendmsg4",
            addr,
            BPF_CGROUP_UDP4_SENDMSG,
            &["sidestep_sendmsg4"],
        ),
        cgroup(
            "floor_sendmsg6",
            addr,
            BPF_CGROUP_UDP6_SENDMSG,
            &["sidestep_sendmsg6"],
        ),
        cgroup(
            "floor_recvmsg4",
            addr,
            BPF_CGROUP_UDP4_RECVMSG,
            &["sidestep_recvmsg4"],
        ),
        cgroup(
            "floor_recvmsg6",
            addr,
            BPF_CGROUP_UDP6_RECVMSG,
            &["sidestep_recvmsg6"],
        ),
        // Every egress packet of every socket under the cgroup, loopback included.
        cgroup(
            "floor_egress",
            BPF_PROG_TYPE_CGROUP_SKB,
            BPF_CGROUP_INET_EGRESS,
            &["sidestep_route_guard"],
        ),
        Hook {
            name: "floor_sk_lookup",
            prog_type: BPF_PROG_TYPE_SK_LOOKUP,
            attach_type: BPF_SK_LOOKUP,
            per_netns: true,
            // Both run on every SYN: the pod's identity program, then the shared one.
            stands_for: &["sidestep_pod_id", "sidestep_sk_lookup"],
        },
    ]
};

/// The hook a sidestep program runs at, if a no-op stands in for it (tc and sk_msg programs
/// have none: they are not called on the sk_lookup lane's new connections).
pub fn hook_of(program: &str) -> Option<&'static Hook> {
    HOOKS.iter().find(|h| h.stands_for.contains(&program))
}

/// The no-ops, attached. Field order is drop order: the links go before their programs.
pub struct NoopSet {
    links: Vec<OwnedFd>,
    progs: Vec<(&'static Hook, OwnedFd)>,
}

impl NoopSet {
    /// Attaches a no-op at every hook: to `cgroup`, and to each netns in `netns`.
    pub fn attach(cgroup: &Path, netns: &[&Path]) -> Result<Self> {
        let cgroup_fd = File::open(cgroup).with_context(|| format!("open {}", cgroup.display()))?;
        let netns_fds = netns
            .iter()
            .map(|p| File::open(p).with_context(|| format!("open {}", p.display())))
            .collect::<Result<Vec<_>>>()?;
        let mut set = Self {
            links: Vec::new(),
            progs: Vec::new(),
        };
        for hook in &HOOKS {
            let prog = load(hook).with_context(|| format!("load {}", hook.name))?;
            let targets: Vec<&File> = if hook.per_netns {
                netns_fds.iter().collect()
            } else {
                vec![&cgroup_fd]
            };
            for target in targets {
                let link = link_create(&prog, target, hook.attach_type)
                    .with_context(|| format!("attach {}", hook.name))?;
                set.links.push(link);
            }
            set.progs.push((hook, prog));
        }
        Ok(set)
    }

    /// Each no-op's cumulative counters, named by its hook.
    pub fn sample(&self) -> Result<Vec<ProgSample>> {
        self.progs
            .iter()
            .map(|(hook, fd)| {
                let info = prog_info(fd).with_context(|| format!("read {}", hook.name))?;
                Ok(ProgSample {
                    name: hook.name.to_owned(),
                    run_count: info.run_cnt,
                    run_time_ns: info.run_time_ns,
                })
            })
            .collect()
    }
}

/// `r0 = 1; exit`: 1 is the pass value (or the only one allowed) at every hook above.
fn instructions() -> [u64; 2] {
    let mov_r0_1 = 0xb7 | (1_u64 << 32);
    let exit = 0x95;
    [mov_r0_1, exit]
}

fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<i32> {
    // SAFETY: `attr` is a valid bpf_attr of the size passed, and every pointer in it refers to
    // a buffer that outlives the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            std::ptr::from_mut(attr),
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as i32)
    }
}

/// A file descriptor the kernel just returned.
fn owned(fd: i32) -> OwnedFd {
    // SAFETY: a new descriptor from a successful bpf() call, owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn load(hook: &Hook) -> Result<OwnedFd> {
    let insns = instructions();
    let license = c"GPL";
    let mut log = vec![0u8; 4096];
    // SAFETY: bpf_attr is plain data; all-zero is its documented "unset" state.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain fields of the BPF_PROG_LOAD member of the union.
    unsafe {
        let p = &mut attr.__bindgen_anon_3;
        p.prog_type = hook.prog_type as u32;
        p.expected_attach_type = hook.attach_type as u32;
        p.insn_cnt = insns.len() as u32;
        p.insns = insns.as_ptr() as u64;
        p.license = license.as_ptr() as u64;
        for (d, s) in p.prog_name.iter_mut().zip(hook.name.bytes().take(15)) {
            *d = s as libc::c_char;
        }
        p.log_level = 1;
        p.log_size = log.len() as u32;
        p.log_buf = log.as_mut_ptr() as u64;
    }
    match bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(owned(fd)),
        Err(e) => {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            bail!(
                "{e}; verifier: {}",
                String::from_utf8_lossy(&log[..end]).trim()
            )
        }
    }
}

fn link_create(prog: &OwnedFd, target: &File, attach_type: bpf_attach_type) -> io::Result<OwnedFd> {
    // SAFETY: as in `load`.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain fields of the BPF_LINK_CREATE member of the union.
    unsafe {
        let l = &mut attr.link_create;
        l.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
        l.__bindgen_anon_2.target_fd = target.as_raw_fd() as u32;
        l.attach_type = attach_type as u32;
    }
    bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr).map(owned)
}

fn prog_info(prog: &OwnedFd) -> io::Result<bpf_prog_info> {
    // SAFETY: bpf_prog_info is plain data; the kernel fills what it knows.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    // SAFETY: as in `load`.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.info.bpf_fd = prog.as_raw_fd() as u32;
    attr.info.info_len = std::mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = std::ptr::from_mut(&mut info) as u64;
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_program_with_a_hook_has_one_and_names_fit() {
        for p in [
            "sidestep_sockops",
            "sidestep_connect4",
            "sidestep_getsockopt",
            "sidestep_route_guard",
            "sidestep_pod_id",
            "sidestep_sk_lookup",
        ] {
            assert!(hook_of(p).is_some(), "{p}");
        }
        assert!(hook_of("sidestep_tc_ingress").is_none());
        for h in &HOOKS {
            assert!(h.name.len() <= 15, "{}", h.name);
        }
        // mov64 r0, 1 (opcode 0xb7, imm 1 in the high word); exit (0x95).
        assert_eq!(instructions(), [0x0000_0001_0000_00b7, 0x95]);
    }
}
