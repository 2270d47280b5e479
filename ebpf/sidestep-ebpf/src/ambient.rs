//! Istio ambient mode: the decision of istio-cni's in-pod nat OUTPUT chain (ISTIO_OUTPUT) for a
//! connect in an ambient pod's netns, and the two inbound exceptions of its PREROUTING chain.
//!
//! ztunnel is not a UID here: it runs in its own pod, enters each ambient pod's netns to open its
//! listeners and connections there, and marks every such socket (`ambient::MARK`). The mark is
//! what Istio's rules test, and what this module tests.

use sidestep_abi::{
    OrigDst, PodPolicy, TupleKey, ambient, flags, is_v4_mapped, linux, redirect_kind, rule,
};

use crate::{
    maps::{SIDESTEP_ADDRS, SIDESTEP_PEND},
    policy::{
        Connect, Verdict, is_host_loopback, is_local_destination, is_loopback, is_pod_address,
        is_unspecified, pod_policy,
    },
};

/// The netns cookie of the node's own network namespace, set by the loader (which runs there);
/// 0 when unknown, which turns the node-socket exception off (its connections are captured).
#[unsafe(no_mangle)]
static NODE_NETNS_COOKIE: u64 = 0;

#[inline(always)]
fn node_netns_cookie() -> u64 {
    // SAFETY: a read of this object's own frozen read-only data.
    unsafe { core::ptr::read_volatile(&raw const NODE_NETNS_COOKIE) }
}

#[inline(always)]
pub fn is_ambient(pod: &PodPolicy) -> bool {
    pod.flags & flags::AMBIENT != 0
}

/// ztunnel's own socket. In ambient mode the pod entry's `proxy_uid` and `proxy_gid` hold the
/// mark and its mask (`sidestep_abi::ambient`).
#[inline(always)]
fn is_ztunnel(c: &Connect) -> bool {
    is_ztunnel_mark(c.policy, c.mark)
}

/// Whether a socket mark is ztunnel's, under the pod entry's mark and mask.
#[inline(always)]
pub fn is_ztunnel_mark(pod: &PodPolicy, mark: u32) -> bool {
    mark & pod.proxy_gid == pod.proxy_uid
}

/// 169.254.7.127 or its IPv6 twin: the source kubelet's probes are SNATed to on the node.
#[inline(always)]
pub fn is_probe_source(addr: &[u32; 4]) -> bool {
    if is_v4_mapped(addr) {
        addr[3] == u32::from_ne_bytes(ambient::PROBE_SNAT_V4)
    } else {
        let o = ambient::PROBE_SNAT_V6;
        addr[0] == u32::from_ne_bytes([o[0], o[1], o[2], o[3]])
            && addr[1] == u32::from_ne_bytes([o[4], o[5], o[6], o[7]])
            && addr[2] == u32::from_ne_bytes([o[8], o[9], o[10], o[11]])
            && addr[3] == u32::from_ne_bytes([o[12], o[13], o[14], o[15]])
    }
}

/// The record a connection from a socket of the node's own netns to an ambient pod leaves in
/// `SIDESTEP_PEND` when its SYN is about to leave, keyed as that socket sees it (the node's
/// cookie, node address and port, pod address and port); `None` for any other connection.
///
/// istio-cni SNATs such connections (`-m owner --socket-exists`, to the pods of its ipset) to
/// 169.254.7.127 in the node's nat POSTROUTING, and the pod's rules pass that source: kubelet's
/// probes reach the app, not ztunnel, whose policy (STRICT mTLS) would refuse plaintext. The
/// record is the same fact without the NAT: only a socket in the node's netns can make it, and
/// only for the exact 4-tuple of its own connection. Forwarded traffic (NodePort, other pods,
/// other nodes) has no such socket and stays captured.
///
/// The caller has checked `is_node_netns` first, before reading the socket's addresses: that
/// check is all that every other socket of the node pays.
#[inline(always)]
pub fn node_socket_record(
    local: [u32; 4],
    local_port: u16,
    remote: [u32; 4],
    remote_port: u16,
    family: u16,
) -> Option<(TupleKey, OrigDst)> {
    // SAFETY: the value is copied out at once.
    let pod = unsafe { SIDESTEP_ADDRS.get(remote) }.copied()?;
    if !pod_policy(pod).is_some_and(|p| is_ambient(&p)) {
        return None;
    }
    let key = TupleKey::new(
        node_netns_cookie(),
        (local, local_port),
        (remote, remote_port),
    );
    let record = OrigDst {
        addr: remote,
        port_be: remote_port.to_be(),
        kind: redirect_kind::NODE_SOCKET,
        family,
        side: sidestep_abi::socket_side::CLIENT,
    };
    Some((key, record))
}

/// Whether a socket of this netns is one of the node's own (never, while the cookie is unknown).
#[inline(always)]
pub fn is_node_netns(socket_netns_cookie: u64) -> bool {
    let node = node_netns_cookie();
    node != 0 && socket_netns_cookie == node
}

/// Whether this inbound SYN belongs to a connection a socket of the node opened
/// (`node_socket_record`): the pod's inbound capture leaves it to the app.
#[inline(always)]
pub fn is_from_node_socket(
    client: [u32; 4],
    client_port: u16,
    server: [u32; 4],
    server_port: u16,
) -> bool {
    let node = node_netns_cookie();
    if node == 0 {
        return false;
    }
    let key = TupleKey::new(node, (client, client_port), (server, server_port));
    // SAFETY: the value is read at once.
    unsafe { SIDESTEP_PEND.get(key) }.is_some_and(|o| o.kind == redirect_kind::NODE_SOCKET)
}

/// An ambient pod's socket accepted the connection `accepted` (keyed as `SIDESTEP_PEND` keys its
/// pod's records: the pod's cookie, client, server): if the node opened it, its record goes now.
/// The handshake is over, so no lookup needs it any more (under SYN cookies the final ACK was
/// the last one); kept until the node's socket closed, long-lived connections would hold
/// entries of the LRU that the pods' hand-offs share.
#[inline(always)]
pub fn forget_node_socket(accepted: TupleKey) {
    let node = node_netns_cookie();
    if node == 0 || !pod_policy(accepted.netns_cookie).is_some_and(|p| is_ambient(&p)) {
        return;
    }
    let _ = SIDESTEP_PEND.remove(TupleKey {
        netns_cookie: node,
        ..accepted
    });
}

/// ztunnel delivering an inbound connection to its pod's app from the client's own address
/// (IP_TRANSPARENT, ztunnel's default when it may): never captured, and given the connection
/// mark (`ambient::CONN_MARK`) so that the app's replies route back to ztunnel. Istio does the
/// same with a connmark: mangle PREROUTING turns ztunnel's packet mark into it, mangle OUTPUT
/// restores it on the replies, and `fwmark 0x111/0xfff lookup 100` delivers them on `lo`.
#[inline(always)]
pub fn is_orig_src_passthrough(c: &Connect) -> bool {
    is_ambient(c.policy)
        && c.protocol == linux::IPPROTO_TCP
        && is_ztunnel(c)
        && !is_unspecified(&c.bound_src)
        && !is_loopback(&c.bound_src)
        && is_pod_address(c.netns_cookie, &c.dst)
        && !is_pod_address(c.netns_cookie, &c.bound_src)
}

/// istio-cni's in-pod nat ISTIO_OUTPUT, first match wins (docs/ARCHITECTURE.md, "Ambient mode";
/// `tests/tests/parity_ambient.rs` checks it against the real rules).
#[inline(always)]
pub fn outbound_verdict(c: &Connect) -> Verdict {
    let p = c.policy;
    // Without IPv6 capture (`--no-ipv6`; istio-cni's rules without IPv6 enabled) IPv6 passes.
    if !is_v4_mapped(&c.dst) && p.flags & flags::IPV6 == 0 {
        return Verdict::pass(rule::NO_IPV6);
    }
    let tcp = c.protocol == linux::IPPROTO_TCP;
    // 1. -d 169.254.7.127 -p tcp -j ACCEPT: replies to kubelet's SNATed probes.
    if tcp && is_probe_source(&c.dst) {
        return Verdict::pass(rule::AMBIENT_PROBE_REPLY);
    }
    let ztunnel = is_ztunnel(c);
    let host_loopback = is_host_loopback(&c.dst);
    let local_dst = is_local_destination(c);
    let dns = p.flags & flags::DNS_CAPTURE != 0 && c.dst_port == 53 && !ztunnel;
    let to_dns = |rule| Verdict::redirect(p.dns_port, redirect_kind::DNS, rule);
    // 2. ! -o lo -p udp --dport 53, not ztunnel's: to ztunnel's DNS proxy.
    if dns && c.protocol == linux::IPPROTO_UDP && !local_dst {
        return to_dns(rule::AMBIENT_DNS_UDP);
    }
    // 3. ! -d 127.0.0.1 -p tcp --dport 53, not ztunnel's: the same (a pod address included).
    if dns && tcp && !host_loopback {
        return to_dns(rule::AMBIENT_DNS_TCP);
    }
    if !tcp {
        return Verdict::pass(rule::NOT_CAPTURED_PROTOCOL);
    }
    // 4. -p tcp -m mark --mark 0x111/0xfff -j ACCEPT.
    if c.mark & ambient::MARK_MASK == ambient::CONN_MARK {
        return Verdict::pass(rule::AMBIENT_CONN_MARK);
    }
    // 5. ! -d 127.0.0.1 -o lo -j ACCEPT: the pod calling itself.
    if local_dst && !host_loopback {
        return Verdict::pass(rule::AMBIENT_LOOPBACK);
    }
    // 6. ! -d 127.0.0.1 -p tcp, not ztunnel's: to ztunnel's outbound listener.
    if !host_loopback && !ztunnel && p.flags & flags::OUTBOUND != 0 {
        return Verdict::redirect(
            p.outbound_port,
            redirect_kind::OUTBOUND,
            rule::AMBIENT_OUTBOUND,
        );
    }
    Verdict::pass(if ztunnel {
        rule::AMBIENT_ZTUNNEL
    } else {
        rule::END_OF_CHAIN
    })
}
