//! sk_msg: data between an app and its own proxy on loopback goes socket to socket.
//!
//! Both ends of a redirected local connection join `SIDESTEP_SOCKS` in sockops (only for pods
//! with the `SK_MSG` flag). Each message is handed straight to the peer socket's receive queue,
//! skipping the TCP/IP stack and loopback device in between. If the peer is not in the map
//! (it closed, or was never added), the message takes the ordinary path.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_INGRESS, sk_action::SK_PASS},
    helpers::generated::bpf_get_netns_cookie,
    macros::sk_msg,
    programs::SkMsgContext,
};
use sidestep_abi::{TupleKey, linux, v4_mapped};

use crate::{
    context::{load, load_ip6},
    maps::SIDESTEP_SOCKS,
};

#[sk_msg]
pub fn sidestep_sk_msg(ctx: SkMsgContext) -> u32 {
    let md = ctx.msg;
    // SAFETY: 4-byte context fields of sk_msg_md, read one at a time; every field on every path
    // so each load keeps a constant offset.
    let (family, local4, remote4, local6, remote6, local_port, remote_port) = unsafe {
        (
            load(&raw const (*md).family),
            load(&raw const (*md).local_ip4),
            load(&raw const (*md).remote_ip4),
            load_ip6(&raw const (*md).local_ip6),
            load_ip6(&raw const (*md).remote_ip6),
            load(&raw const (*md).local_port) as u16,
            // As in sock_ops: the big-endian port sits in the upper 16 bits.
            u16::from_be((load(&raw const (*md).remote_port) >> 16) as u16),
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
    let peer = TupleKey {
        netns_cookie,
        client_addr: remote,
        server_addr: local,
        client_port: remote_port,
        server_port: local_port,
        _reserved: 0,
    };
    // A failed redirect (no peer) falls back to the ordinary path rather than dropping data.
    if SIDESTEP_SOCKS.redirect_msg(&ctx, peer, u64::from(BPF_F_INGRESS)) == i64::from(SK_PASS) {
        crate::policy::count(netns_cookie, |c| c.sk_msg_redirects += 1);
    }
    SK_PASS
}
