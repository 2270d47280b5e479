//! The per-pod identity program: the first sk_lookup program in a pod's netns, which names the
//! pod for `sidestep_sk_lookup`.
//!
//! sk_lookup programs have no netns helper (`bpf_get_netns_cookie` is refused for them), so
//! the shared program could only find the pod by the connection's destination address, and a
//! SYN to an address enrolment never saw (IPv6 link-local, a second interface, an address added
//! later) reached the app around the proxy. A netns runs its sk_lookup programs in attach order,
//! on one CPU with migration disabled; this program, attached first, writes the pod's netns
//! cookie into this CPU's slot of `SIDESTEP_NSID`, and `sidestep_sk_lookup`, attached after it,
//! takes it (and clears it).
//!
//! It is twelve instructions, assembled here with the cookie as an immediate: loading it costs a
//! few microseconds, far less than loading a per-pod copy of the shared program would, and it
//! needs no object file. It is not pinned as a program; its link is, at
//! `<pin_root>/links/podid/<netns cookie>`, apart from `links/sklookup/` so that an upgrade,
//! which switches every link there to the new shared program, never touches it.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::PathBuf,
};

use aya_obj::generated::{bpf_attach_type, bpf_attr, bpf_cmd, bpf_prog_type};
use sidestep_abi::program_names;

use crate::pins::PinLayout;

/// Where every pod's identity link is pinned.
pub fn links_dir(layout: &PinLayout) -> PathBuf {
    layout.links_dir().join("podid")
}

pub fn pin(layout: &PinLayout, netns_cookie: u64) -> PathBuf {
    links_dir(layout).join(netns_cookie.to_string())
}

const BPF_REG_0: u8 = 0;
const BPF_REG_1: u8 = 1;
const BPF_REG_2: u8 = 2;
const BPF_REG_10: u8 = 10;
const BPF_PSEUDO_MAP_FD: u8 = 1;
const BPF_FUNC_MAP_LOOKUP_ELEM: i32 = 1;
const SK_PASS: i32 = 1;

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | (dst & 0x0f);
    b[2..4].copy_from_slice(&off.to_le_bytes());
    b[4..8].copy_from_slice(&imm.to_le_bytes());
    b
}

/// The program's instructions: `*lookup(NSID, 0) = cookie; return SK_PASS`. SK_PASS without a
/// selected socket lets the next program decide.
fn instructions(map_fd: i32, netns_cookie: u64) -> Vec<[u8; 8]> {
    vec![
        // *(u32 *)(r10 - 4) = 0: the array key.
        insn(0x62, BPF_REG_10, 0, -4, 0),
        // r2 = r10; r2 += -4
        insn(0xbf, BPF_REG_2, BPF_REG_10, 0, 0),
        insn(0x07, BPF_REG_2, 0, 0, -4),
        // r1 = the map (ld_imm64 of a map fd, which the kernel resolves).
        insn(0x18, BPF_REG_1, BPF_PSEUDO_MAP_FD, 0, map_fd),
        insn(0, 0, 0, 0, 0),
        insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM),
        // if r0 == 0 goto the return.
        insn(0x15, BPF_REG_0, 0, 3, 0),
        // r1 = cookie (ld_imm64).
        insn(0x18, BPF_REG_1, 0, 0, netns_cookie as u32 as i32),
        insn(0, 0, 0, 0, (netns_cookie >> 32) as u32 as i32),
        // *(u64 *)(r0 + 0) = r1
        insn(0x7b, BPF_REG_0, BPF_REG_1, 0, 0),
        // return SK_PASS
        insn(0xb7, BPF_REG_0, 0, 0, SK_PASS),
        insn(0x95, 0, 0, 0, 0),
    ]
}

/// Loads the identity program for `netns_cookie`, writing to the map `nsid_map`
/// (`SIDESTEP_NSID`).
pub fn load(nsid_map: BorrowedFd<'_>, netns_cookie: u64) -> io::Result<OwnedFd> {
    let insns = instructions(nsid_map.as_raw_fd(), netns_cookie);
    let license = c"GPL";
    let mut log = vec![0u8; 4096];
    let mut name = [0 as libc::c_char; 16];
    for (d, s) in name
        .iter_mut()
        .zip(program_names::POD_IDENTITY.bytes().take(15))
    {
        *d = s as libc::c_char;
    }
    // SAFETY: bpf_attr is plain data; all-zero is its documented "unset" state.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain fields of the BPF_PROG_LOAD member of the union; every pointer
    // refers to a buffer that outlives the syscall below.
    unsafe {
        let p = &mut attr.__bindgen_anon_3;
        p.prog_type = bpf_prog_type::BPF_PROG_TYPE_SK_LOOKUP as u32;
        p.expected_attach_type = bpf_attach_type::BPF_SK_LOOKUP as u32;
        p.insn_cnt = insns.len() as u32;
        p.insns = insns.as_ptr() as u64;
        p.license = license.as_ptr() as u64;
        p.prog_name = name;
        p.log_level = 1;
        p.log_size = log.len() as u32;
        p.log_buf = log.as_mut_ptr() as u64;
    }
    // SAFETY: `attr` is a valid bpf_attr of the size passed; the kernel reads the buffers above.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_PROG_LOAD as libc::c_long,
            &raw mut attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        let err = io::Error::last_os_error();
        let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
        let text = String::from_utf8_lossy(&log[..end]);
        return Err(io::Error::new(
            err.kind(),
            format!(
                "load {}: {err}; verifier: {}",
                program_names::POD_IDENTITY,
                text.trim()
            ),
        ));
    }
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_is_split_over_the_wide_load() {
        let insns = instructions(7, 0x1122_3344_5566_7788);
        assert_eq!(insns.len(), 12);
        assert_eq!(insns[3][1], (BPF_PSEUDO_MAP_FD << 4) | BPF_REG_1);
        assert_eq!(i32::from_le_bytes(insns[3][4..8].try_into().unwrap()), 7);
        assert_eq!(
            u32::from_le_bytes(insns[7][4..8].try_into().unwrap()),
            0x5566_7788
        );
        assert_eq!(
            u32::from_le_bytes(insns[8][4..8].try_into().unwrap()),
            0x1122_3344
        );
        // The branch lands on `r0 = SK_PASS`.
        let off = i16::from_le_bytes(insns[6][2..4].try_into().unwrap());
        assert_eq!(6 + 1 + off as usize, 10);
        assert_eq!(insns[11][0], 0x95);
    }
}
