//! The few kernel struct field offsets sk_msg reads, from the running kernel's BTF.
//!
//! aya has no CO-RE, so the loader resolves them here and hands them to the object as read-only
//! globals (`sidestep_abi::globals`). aya-obj parses BTF but keeps member offsets crate-private,
//! so this walks the type section itself: only what finding a struct's members needs.

use std::{
    borrow::Cow,
    path::{Path, PathBuf},
};

/// Why the offsets sk_msg needs could not be had. `Clone`: the answer is computed once per
/// process and handed to every enrolment that asks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BtfError {
    #[error(
        "the kernel refuses bpf_probe_read_kernel to sk_msg programs (lockdown in \
         confidentiality mode, or an LSM)"
    )]
    ProbeReadRefused,
    #[error("{path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    /// Not BTF this reader understands.
    #[error("{path}: {reason}")]
    Malformed { path: PathBuf, reason: String },
    /// BTF, but the kernel's structs are not laid out as sk_msg needs.
    #[error("{path}: {reason}")]
    Layout { path: PathBuf, reason: String },
}

/// What went wrong inside a BTF blob, before the file it came from is known.
#[derive(Debug)]
enum Fault {
    Malformed(Cow<'static, str>),
    Layout(Cow<'static, str>),
}

impl Fault {
    fn in_file(self, path: &Path) -> BtfError {
        let path = path.to_path_buf();
        match self {
            Fault::Malformed(r) => BtfError::Malformed {
                path,
                reason: r.into_owned(),
            },
            Fault::Layout(r) => BtfError::Layout {
                path,
                reason: r.into_owned(),
            },
        }
    }
}

/// Byte offsets in `struct sock` (and so in `struct tcp_sock`, which begins with it), and in
/// `struct sk_msg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SockOffsets {
    /// `sk_msg.sk_redir`: the socket a message was just redirected to.
    pub msg_sk_redir: u32,
    /// `sk_rmem_alloc`, i.e. `sk_backlog.rmem_alloc.counter`.
    pub rmem_alloc: u32,
    /// `sk_rcvbuf`.
    pub rcvbuf: u32,
}

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_TYPE_TAG: u32 = 18;

#[derive(Clone, Copy)]
struct Type {
    name_off: u32,
    kind: u32,
    kind_flag: bool,
    vlen: usize,
    /// `size` or `type`, by kind.
    size_type: u32,
    /// Where the kind's trailing data starts in the type section.
    extra: usize,
}

struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    /// Index `id - 1`.
    all: Vec<Type>,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Result<Self, Fault> {
        let magic = data
            .get(0..2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .ok_or(Fault::Malformed(Cow::Borrowed("BTF too short")))?;
        if magic != BTF_MAGIC {
            return Err(Fault::Malformed(Cow::Owned(format!(
                "not little-endian BTF (magic {magic:#x})"
            ))));
        }
        let field = |i: usize| {
            u32_at(data, 4 + 4 * i).ok_or(Fault::Malformed(Cow::Borrowed("BTF header too short")))
        };
        let (hdr_len, type_off, type_len, str_off, str_len) = (
            field(0)? as usize,
            field(1)? as usize,
            field(2)? as usize,
            field(3)? as usize,
            field(4)? as usize,
        );
        let section = |off: usize, len: usize| {
            data.get(hdr_len + off..hdr_len + off + len)
                .ok_or(Fault::Malformed(Cow::Borrowed("BTF section out of bounds")))
        };
        let types = section(type_off, type_len)?;
        let strings = section(str_off, str_len)?;
        let mut all = Vec::new();
        let mut at = 0;
        while at < types.len() {
            let name_off =
                u32_at(types, at).ok_or(Fault::Malformed(Cow::Borrowed("truncated BTF type")))?;
            let info = u32_at(types, at + 4)
                .ok_or(Fault::Malformed(Cow::Borrowed("truncated BTF type")))?;
            let size_type = u32_at(types, at + 8)
                .ok_or(Fault::Malformed(Cow::Borrowed("truncated BTF type")))?;
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let extra = at + 12;
            let trailing = match kind {
                // INT, VAR, DECL_TAG: one u32.
                1 | 14 | 17 => 4,
                // ARRAY
                3 => 12,
                // STRUCT, UNION, DATASEC, ENUM64: 12 bytes per entry.
                4 | 5 | 15 | 19 => 12 * vlen,
                // ENUM, FUNC_PROTO: 8 bytes per entry.
                6 | 13 => 8 * vlen,
                // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
                2 | 7..=12 | 16 | 18 => 0,
                k => {
                    return Err(Fault::Malformed(Cow::Owned(format!(
                        "unknown BTF kind {k}"
                    ))));
                }
            };
            all.push(Type {
                name_off,
                kind,
                kind_flag: info >> 31 != 0,
                vlen,
                size_type,
                extra,
            });
            at = extra + trailing;
        }
        Ok(Self {
            types,
            strings,
            all,
        })
    }

    fn name(&self, off: u32) -> &'a [u8] {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&c| c == 0).unwrap_or(rest.len())]
    }

    fn get(&self, id: u32) -> Option<Type> {
        self.all.get((id as usize).checked_sub(1)?).copied()
    }

    /// Follows typedefs and qualifiers.
    fn resolve(&self, mut id: u32) -> Option<Type> {
        for _ in 0..32 {
            let t = self.get(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_type;
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// The member `name` of a struct or union: (its type id, its byte offset).
    fn member(&self, t: Type, name: &str) -> Option<(u32, u32)> {
        if t.kind != KIND_STRUCT && t.kind != KIND_UNION {
            return None;
        }
        (0..t.vlen).find_map(|i| {
            let at = t.extra + 12 * i;
            let name_off = u32_at(self.types, at)?;
            if self.name(name_off) != name.as_bytes() {
                return None;
            }
            let ty = u32_at(self.types, at + 4)?;
            let raw = u32_at(self.types, at + 8)?;
            // With kind_flag the top 8 bits are a bitfield size; those fields are not for us.
            let (bits, bitfield) = if t.kind_flag {
                (raw & 0x00ff_ffff, raw >> 24)
            } else {
                (raw, 0)
            };
            (bitfield == 0 && bits.is_multiple_of(8)).then_some((ty, bits / 8))
        })
    }

    /// A 4-byte signed-or-unsigned int, possibly behind typedefs (`int`, `atomic_t`'s counter).
    fn is_int4(&self, id: u32) -> bool {
        self.resolve(id)
            .is_some_and(|t| t.kind == KIND_INT && t.size_type == 4)
    }

    /// The struct called `name` that has `member` (a name can belong to more than one type).
    fn struct_with(&self, name: &[u8], member: &str) -> Option<Type> {
        self.all
            .iter()
            .find(|t| {
                t.kind == KIND_STRUCT
                    && self.name(t.name_off) == name
                    && self.member(**t, member).is_some()
            })
            .copied()
    }

    fn sock_offsets(&self) -> Result<SockOffsets, Fault> {
        let sock = self
            .struct_with(b"sock", "__sk_common")
            .ok_or(Fault::Layout(Cow::Borrowed("no struct sock")))?;
        let (backlog_ty, backlog) =
            self.member(sock, "sk_backlog")
                .ok_or(Fault::Layout(Cow::Borrowed(
                    "struct sock has no sk_backlog",
                )))?;
        let backlog_t = self
            .resolve(backlog_ty)
            .ok_or(Fault::Layout(Cow::Borrowed("bad sk_backlog type")))?;
        let (rmem_ty, rmem) = self
            .member(backlog_t, "rmem_alloc")
            .ok_or(Fault::Layout(Cow::Borrowed("sk_backlog has no rmem_alloc")))?;
        let atomic = self
            .resolve(rmem_ty)
            .ok_or(Fault::Layout(Cow::Borrowed("bad rmem_alloc type")))?;
        let (counter_ty, counter) =
            self.member(atomic, "counter")
                .ok_or(Fault::Layout(Cow::Borrowed(
                    "rmem_alloc is not an atomic_t",
                )))?;
        if !self.is_int4(counter_ty) {
            return Err(Fault::Layout(Cow::Borrowed(
                "sk_rmem_alloc is not a 4-byte int",
            )));
        }
        let (rcvbuf_ty, rcvbuf) = self
            .member(sock, "sk_rcvbuf")
            .ok_or(Fault::Layout(Cow::Borrowed("struct sock has no sk_rcvbuf")))?;
        if !self.is_int4(rcvbuf_ty) {
            return Err(Fault::Layout(Cow::Borrowed(
                "sk_rcvbuf is not a 4-byte int",
            )));
        }
        let msg = self
            .struct_with(b"sk_msg", "sk_redir")
            .ok_or(Fault::Layout(Cow::Borrowed("no struct sk_msg")))?;
        let (redir_ty, msg_sk_redir) = self
            .member(msg, "sk_redir")
            .ok_or(Fault::Layout(Cow::Borrowed("no sk_redir")))?;
        if self.resolve(redir_ty).is_none_or(|t| t.kind != KIND_PTR) {
            return Err(Fault::Layout(Cow::Borrowed(
                "sk_msg.sk_redir is not a pointer",
            )));
        }
        if msg_sk_redir == 0 || msg_sk_redir + 8 > msg.size_type {
            return Err(Fault::Layout(Cow::Owned(format!(
                "implausible sk_msg.sk_redir offset {msg_sk_redir}"
            ))));
        }
        let offsets = SockOffsets {
            msg_sk_redir,
            rmem_alloc: backlog + rmem + counter,
            rcvbuf,
        };
        let size = sock.size_type;
        if offsets.rmem_alloc == 0
            || offsets.rcvbuf == 0
            || offsets.rmem_alloc + 4 > size
            || offsets.rcvbuf + 4 > size
        {
            return Err(Fault::Layout(Cow::Owned(format!(
                "implausible offsets {offsets:?} in a {size}-byte sock"
            ))));
        }
        Ok(offsets)
    }
}

/// The offsets in the BTF at `path`.
pub fn sock_offsets_from(path: &Path) -> Result<SockOffsets, BtfError> {
    let data = std::fs::read(path).map_err(|e| BtfError::Unreadable {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Btf::parse(&data)
        .and_then(|btf| btf.sock_offsets())
        .map_err(|fault| fault.in_file(path))
}

/// The running kernel's offsets, when sk_msg may read at them; read once per process.
pub fn sock_offsets() -> Result<SockOffsets, BtfError> {
    static CACHE: std::sync::OnceLock<Result<SockOffsets, BtfError>> = std::sync::OnceLock::new();
    CACHE
        .get_or_init(|| {
            // A program calling a helper the kernel refuses would not load at all; with the
            // offsets 0 the verifier never walks the call (the branch on them is dead).
            if !crate::features::sk_msg_reads_kernel() {
                return Err(BtfError::ProbeReadRefused);
            }
            sock_offsets_from(Path::new(VMLINUX))
        })
        .clone()
}

/// Names by id, for the test below.
#[cfg(test)]
fn struct_names(btf: &Btf) -> std::collections::HashMap<String, u32> {
    btf.all
        .iter()
        .enumerate()
        .filter(|(_, t)| t.kind == KIND_STRUCT)
        .map(|(i, t)| {
            (
                String::from_utf8_lossy(btf.name(t.name_off)).into_owned(),
                i as u32 + 1,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this machine's kernel: the offsets bpftool prints for the same fields.
    #[test]
    fn resolves_the_running_kernels_sock() {
        let Ok(data) = std::fs::read(VMLINUX) else {
            eprintln!("no {VMLINUX}; skipped");
            return;
        };
        let btf = Btf::parse(&data).expect("parse vmlinux BTF");
        assert!(struct_names(&btf).contains_key("tcp_sock"));
        let o = btf.sock_offsets().expect("offsets");
        assert_ne!(o.rmem_alloc, o.rcvbuf);
        assert!(
            o.rmem_alloc.is_multiple_of(4) && o.rcvbuf.is_multiple_of(4),
            "{o:?}"
        );
    }

    #[test]
    fn rejects_what_is_not_btf() {
        assert!(Btf::parse(b"\x7fELF....................").is_err());
        assert!(Btf::parse(b"").is_err());
    }
}
