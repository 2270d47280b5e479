//! sk_msg: data between an app and its own proxy on loopback goes socket to socket.
//!
//! Both ends of a redirected local connection join `SIDESTEP_SOCKS` in sockops (only for pods
//! with the `SK_MSG` flag). Each message is handed straight to the peer socket's receive queue,
//! skipping the TCP/IP stack and loopback device in between.
//!
//! The kernel puts no limit on that queue (`bpf_tcp_ingress` charges the peer's receive memory
//! until TCP's global limits fail, and the writer then gets ENOMEM; see
//! docs/research/skmsg-enomem.md). So after each redirect the program reads how much the peer
//! holds (`sk_rmem_alloc`, which counts its `ingress_msg` queue) and, above [`queue_cap`],
//! switches this socket to the ordinary TCP path **for good**: its flag in `SIDESTEP_SKMSG` is
//! set and never cleared, so TCP's flow control takes over. The queue stays within the cap plus
//! one message. Sticky because the peer reads its `ingress_msg` queue before its TCP receive
//! queue: redirect -> TCP keeps the byte order, TCP -> redirect would not. For the same reason a
//! socket whose peer is not in the map (not there yet, or closed) takes the TCP path for good.
//!
//! Why after, and why `bpf_probe_read_kernel`: sk_msg cannot hold the peer itself. A sockhash
//! lookup returns a referenced socket, and sk_msg programs may not call `bpf_sk_release`, so the
//! verifier refuses it ("program of this type cannot use helper bpf_sk_release"). The redirect
//! helper stores the peer in the kernel's `struct sk_msg` (`sk_redir`, our context) without a
//! reference of ours; the socket is held by the sockhash and RCU while the program runs, and the
//! reads below are fault-safe whatever they find. Offsets come from the kernel's BTF through the
//! loader (aya has no CO-RE), as frozen read-only globals.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_INGRESS, BPF_SK_STORAGE_GET_F_CREATE, sk_action::SK_PASS},
    helpers::generated::{bpf_get_netns_cookie, bpf_probe_read_kernel, bpf_sk_storage_get},
    macros::sk_msg,
    programs::SkMsgContext,
};
use sidestep_abi::{TupleKey, linux, v4_mapped};

use crate::{
    context::{load, load_ip6},
    maps::{SIDESTEP_SKMSG, SIDESTEP_SOCKS},
};

/// Byte offset of `sk_redir` in the kernel's `struct sk_msg` (what an sk_msg program's context
/// points to), and of `sk_rmem_alloc` and `sk_rcvbuf` in `struct sock`, set by the loader from
/// the kernel's BTF. `0` means unresolved: then nothing is redirected, since nothing could bound
/// the peer's queue.
#[unsafe(no_mangle)]
static SK_MSG_REDIR_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SK_RMEM_ALLOC_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SK_RCVBUF_OFFSET: u32 = 0;

/// The least a peer may hold before the switch: 4 MiB. Above it the cap is the peer's own
/// `sk_rcvbuf` (as much as TCP would let it queue; autotuning takes it up to `tcp_rmem[2]`,
/// 6 MiB by default). The floor keeps request/response traffic (messages far below a MiB, read
/// as they come) on the shortcut while a fresh peer's `sk_rcvbuf` is still 128 KiB, and bounds
/// what one connection pins in kernel memory far below `tcp_mem` on any node.
const QUEUE_FLOOR: i32 = 4 << 20;

/// The most the peer may hold, this message included, for the next message to be redirected.
#[inline(always)]
fn queue_cap(rcvbuf: i32) -> i32 {
    if rcvbuf > QUEUE_FLOOR {
        rcvbuf
    } else {
        QUEUE_FLOOR
    }
}

/// Reads a kernel value at `addr`; `None` if it faults.
#[inline(always)]
fn read_kernel<T: Copy + Default>(addr: u64) -> Option<T> {
    let mut value = T::default();
    // SAFETY: bpf_probe_read_kernel never faults: it copies `size_of::<T>()` bytes into our
    // stack value or fails.
    let ret = unsafe {
        bpf_probe_read_kernel(
            core::ptr::from_mut(&mut value).cast(),
            size_of::<T>() as u32,
            addr as *const core::ffi::c_void,
        )
    };
    (ret == 0).then_some(value)
}

/// What the socket this message was just redirected to holds and may hold: (`sk_rmem_alloc`,
/// `sk_rcvbuf`).
#[inline(always)]
fn peer_queue(ctx: &SkMsgContext, offsets: (u32, u32, u32)) -> Option<(i32, i32)> {
    let (redir, rmem, rcvbuf) = offsets;
    let peer: u64 = read_kernel(ctx.as_ptr() as u64 + u64::from(redir))?;
    if peer == 0 {
        return None;
    }
    Some((
        read_kernel(peer + u64::from(rmem))?,
        read_kernel(peer + u64::from(rcvbuf))?,
    ))
}

/// Switches the socket to the TCP path for good.
#[inline(always)]
fn stick_to_tcp(flag_map: *mut core::ffi::c_void, sk: *mut core::ffi::c_void, netns_cookie: u64) {
    let mut on: u32 = 1;
    // SAFETY: an sk_storage get-or-create on this message's socket, with a stack value.
    let set = unsafe {
        bpf_sk_storage_get(
            flag_map,
            sk,
            core::ptr::from_mut(&mut on).cast(),
            u64::from(BPF_SK_STORAGE_GET_F_CREATE),
        )
    };
    // Without the flag (no memory for 4 bytes) a later message is judged afresh: the one order
    // hazard left.
    if !set.is_null() {
        crate::policy::count(netns_cookie, |c| c.sk_msg_fallbacks += 1);
    }
}

#[sk_msg]
pub fn sidestep_sk_msg(ctx: SkMsgContext) -> u32 {
    let md = ctx.msg;
    // SAFETY: `sk` is a pointer field of sk_msg_md (the socket the message is sent on).
    let sk = unsafe { load(&raw const (*md).__bindgen_anon_3.sk) }.cast::<core::ffi::c_void>();
    if sk.is_null() {
        return SK_PASS;
    }
    let flag_map = core::ptr::from_ref(&SIDESTEP_SKMSG).cast_mut().cast();
    // SAFETY: an sk_storage lookup (no create) on this message's socket.
    if !unsafe { bpf_sk_storage_get(flag_map, sk, core::ptr::null_mut(), 0) }.is_null() {
        // Switched to TCP earlier: never back.
        return SK_PASS;
    }
    // SAFETY: reads of this object's own frozen read-only data.
    let offsets = unsafe {
        (
            core::ptr::read_volatile(&raw const SK_MSG_REDIR_OFFSET),
            core::ptr::read_volatile(&raw const SK_RMEM_ALLOC_OFFSET),
            core::ptr::read_volatile(&raw const SK_RCVBUF_OFFSET),
        )
    };
    if offsets.0 == 0 || offsets.1 == 0 || offsets.2 == 0 {
        return SK_PASS;
    }
    // SAFETY: 4-byte context fields of sk_msg_md, read one at a time; every field on every path
    // so each load keeps a constant offset.
    let (family, local4, remote4, local6, remote6, local_port, remote_port, size) = unsafe {
        (
            load(&raw const (*md).family),
            load(&raw const (*md).local_ip4),
            load(&raw const (*md).remote_ip4),
            load_ip6(&raw const (*md).local_ip6),
            load_ip6(&raw const (*md).remote_ip6),
            load(&raw const (*md).local_port) as u16,
            // As in sock_ops: the big-endian port sits in the upper 16 bits.
            u16::from_be((load(&raw const (*md).remote_port) >> 16) as u16),
            load(&raw const (*md).size),
        )
    };
    let (local, remote) = if family == u32::from(linux::AF_INET) {
        (v4_mapped(local4), v4_mapped(remote4))
    } else {
        (local6, remote6)
    };
    // SAFETY: valid sk_msg context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // The peer socket's own view of this connection: its local end is our remote end.
    let peer = TupleKey::new(netns_cookie, (remote, remote_port), (local, local_port));
    // A failed redirect (no peer, or not established) takes the ordinary path rather than
    // dropping data, and so does every later message.
    if SIDESTEP_SOCKS.redirect_msg(&ctx, peer, u64::from(BPF_F_INGRESS)) != i64::from(SK_PASS) {
        stick_to_tcp(flag_map, sk, netns_cookie);
        return SK_PASS;
    }
    crate::policy::count(netns_cookie, |c| c.sk_msg_redirects += 1);
    // This message is committed to the peer (SK_PASS now means redirect, SK_DROP would fail the
    // write). What the peer holds decides the next ones.
    let backed_up = match peer_queue(&ctx, offsets) {
        // `size` is one sendmsg's worth (a few pages), so the sum cannot overflow.
        Some((queued, rcvbuf)) => queued.saturating_add(size as i32) > queue_cap(rcvbuf),
        None => true,
    };
    if backed_up {
        stick_to_tcp(flag_map, sk, netns_cookie);
    }
    SK_PASS
}
