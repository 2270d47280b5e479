//! sk_lookup, per pod netns: steers the kernel's own listener lookup for a captured inbound
//! connection to the proxy's listener. With the `tc` hook, tc ingress assigns new SYNs before any
//! lookup happens, and this program covers the SYN that tc leaves to the kernel because its
//! 4-tuple is still in TIME_WAIT (the kernel recycles the TIME_WAIT socket, then looks up a
//! listener). With the `sk_lookup` hook it captures every inbound connection alone. Either way
//! the proxy accepts, and the original destination is published for SO_ORIGINAL_DST.
//!
//! The pod is named by its identity program (`SIDESTEP_NSID`), which runs first in the pod's
//! netns, so capture covers every address of every interface the pod does not exclude:
//! link-local, secondary, added after enrolment, on interfaces no ADD named (Istio's
//! `-A PREROUTING -p tcp -j ISTIO_INBOUND` has no `-i` and no `-d`). Without it (a pod enrolled by
//! an older version) the destination address names the pod, as it always did.

use aya_ebpf::{
    bindings::sk_action::{SK_DROP, SK_PASS},
    macros::sk_lookup,
    programs::SkLookupContext,
};
use sidestep_abi::{
    InterfaceKey, ListenerKey, OrigDst, TupleKey, flags, iface_kind, linux, redirect_kind, rule,
    socket_side, v4_mapped,
};

use crate::{
    ambient,
    context::{load, load_ip6},
    debuglog,
    inbound::captures_port,
    maps::{
        SIDESTEP_ADDRS, SIDESTEP_IFACES, SIDESTEP_LSTN, SIDESTEP_NEST, SIDESTEP_NSID, SIDESTEP_PEND,
    },
    policy,
};

const LOOPBACK_IFINDEX: u32 = 1;

/// The netns cookie the pod's identity program left for this run, or 0; the slot is cleared, so
/// a later lookup on this CPU in a netns without one never takes it for its own.
#[inline(always)]
pub fn take_identity() -> u64 {
    match SIDESTEP_NSID.get_ptr_mut(0) {
        // SAFETY: this CPU's slot; the identity program wrote it earlier in this same array run,
        // which runs with migration disabled.
        Some(slot) => unsafe {
            let cookie = *slot;
            if cookie != 0 {
                *slot = 0;
            }
            cookie
        },
        None => 0,
    }
}

#[sk_lookup]
pub fn sidestep_sk_lookup(ctx: SkLookupContext) -> u32 {
    // Called inside tc ingress's own socket lookup: tc decides that SYN. The identity program's
    // cookie stays in its slot for tc, which takes it as the proof of the netns its lookup ran
    // in (inbound.rs, `lookup`).
    if SIDESTEP_NEST.get(0).is_some_and(|nested| *nested != 0) {
        return SK_PASS;
    }
    // First, before any other return, so that the slot never outlives this run.
    let named = take_identity();
    let sl = ctx.lookup;
    // SAFETY: 4-byte context fields of bpf_sk_lookup, every one read on every path.
    let (protocol, family, ifindex, local4, local6, local_port, remote4, remote6, remote_port) = unsafe {
        (
            load(&raw const (*sl).protocol),
            load(&raw const (*sl).family),
            load(&raw const (*sl).ingress_ifindex),
            load(&raw const (*sl).local_ip4),
            load_ip6(&raw const (*sl).local_ip6),
            load(&raw const (*sl).local_port),
            load(&raw const (*sl).remote_ip4),
            load_ip6(&raw const (*sl).remote_ip6),
            // remote_port is a __be16 followed by padding; read the whole word.
            load((&raw const (*sl).remote_port).cast::<u32>()),
        )
    };
    // Only TCP from outside the pod: over lo come the proxy's own hand-offs to the app.
    if protocol != linux::IPPROTO_TCP || ifindex == LOOPBACK_IFINDEX {
        return SK_PASS;
    }
    let v4 = family == u32::from(linux::AF_INET);
    let (local, remote) = if v4 {
        (v4_mapped(local4), v4_mapped(remote4))
    } else {
        (local6, remote6)
    };
    let netns_cookie = if named != 0 {
        named
    } else {
        // SAFETY: the value is copied out at once.
        match unsafe { SIDESTEP_ADDRS.get(local) } {
            Some(cookie) => *cookie,
            None => return SK_PASS,
        }
    };
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return SK_PASS;
    };
    let iface = InterfaceKey {
        netns_cookie,
        ifindex,
        _reserved: 0,
    };
    // SAFETY: the value is read at once.
    let kind = unsafe { SIDESTEP_IFACES.get(iface) }.copied();
    let excluded = if pod.flags & flags::NETNS_WIDE != 0 {
        kind.is_some_and(|k| k == iface_kind::EXCLUDED || k == iface_kind::REROUTED)
    } else {
        // An older enrolment listed the captured interfaces only.
        kind.is_none()
    };
    let debug = pod.flags & flags::DEBUG != 0;
    let port = local_port as u16;
    if excluded {
        if debug {
            debuglog::inbound(
                &ctx,
                netns_cookie,
                &local,
                port,
                0,
                rule::IN_EXCLUDED_INTERFACE,
            );
        }
        return SK_PASS;
    }
    let remote_port = u16::from_be(remote_port as u16);
    let pending = TupleKey::new(netns_cookie, (remote, remote_port), (local, port));
    // The proxy's hand-off to the app (127.0.0.6, ::6) and the pod calling its own address are
    // never captured inbound: Istio's PREROUTING never sees them (their nat decision was made
    // in OUTPUT). The kernel may report them on the interface that owns the address rather
    // than on lo, so their source decides. IPv6 takes a local source from the wire, so there
    // such a source passes only with sock_ops' record of the pod's own connect, and a forged
    // one from off the pod is captured. IPv4 drops a local source from the wire as a martian,
    // except a loopback one where `route_localnet` is on (kube-proxy turns it on for the node,
    // and a new netns copies it): in such a pod a loopback source needs the record too.
    if has_local_source(netns_cookie, &remote, &local) {
        let trusted_alone =
            v4 && (pod.flags & flags::ROUTE_LOCALNET == 0 || !policy::is_loopback(&remote));
        // SAFETY: the value is read at once.
        let own = trusted_alone
            || unsafe { SIDESTEP_PEND.get(pending) }
                .is_some_and(|o| o.kind == redirect_kind::LOCAL_SELF);
        if own {
            return SK_PASS;
        }
    }
    // TPROXY: the proxy's own transparent connection to its app, from the client's address (in
    // ambient mode ztunnel's). Its SYN comes over lo, but the kernel reports the pod interface as
    // its ingress.
    if pod.flags & (flags::TPROXY | flags::AMBIENT) != 0
        // SAFETY: the value is read at once, before any update of the map could reuse the slot.
        && unsafe { SIDESTEP_PEND.get(pending) }
            .is_some_and(|o| o.kind == redirect_kind::TPROXY_PASSTHROUGH)
    {
        return SK_PASS;
    }
    // Ambient: kubelet's probes reach the app directly, SNATed on the node (Istio's node rules)
    // or opened by a socket of the node (sidestep's record of it).
    if ambient::is_ambient(&pod) {
        let passed = if ambient::is_probe_source(&remote) {
            rule::IN_PROBE_SOURCE
        } else if ambient::is_from_node_socket(remote, remote_port, local, port) {
            rule::IN_NODE_SOCKET
        } else {
            0
        };
        if passed != 0 {
            if debug {
                debuglog::inbound(&ctx, netns_cookie, &local, port, 0, passed);
            }
            return SK_PASS;
        }
    }
    if port == pod.inbound_port || !captures_port(netns_cookie, &pod, port) {
        // With tc in front, tc counted this SYN already.
        if pod.flags & flags::INBOUND_SK_LOOKUP != 0 {
            policy::count(netns_cookie, |c| c.passed_inbound += 1);
        }
        if debug {
            debuglog::inbound(
                &ctx,
                netns_cookie,
                &local,
                port,
                0,
                rule::IN_PORT_NOT_CAPTURED,
            );
        }
        return SK_PASS;
    }
    let mut key = ListenerKey {
        netns_cookie,
        family,
        port: u32::from(pod.inbound_port),
    };
    let mut assigned = SIDESTEP_LSTN.redirect_sk_lookup(&ctx, key, 0).is_ok();
    if !assigned && v4 {
        // A dual-stack listener on [::] serves IPv4 too.
        key.family = u32::from(linux::AF_INET6);
        assigned = SIDESTEP_LSTN.redirect_sk_lookup(&ctx, key, 0).is_ok();
    }
    if debug {
        let outcome = if assigned {
            rule::IN_CAPTURED_PORT
        } else {
            rule::IN_NO_LISTENER
        };
        debuglog::inbound(
            &ctx,
            netns_cookie,
            &local,
            port,
            redirect_kind::INBOUND,
            outcome,
        );
    }
    if !assigned {
        // Captured, but no proxy listens: refuse rather than deliver around the proxy.
        return SK_DROP;
    }
    let orig = OrigDst {
        addr: local,
        port_be: port.to_be(),
        kind: redirect_kind::INBOUND,
        family: if v4 { linux::AF_INET } else { linux::AF_INET6 },
        side: socket_side::ACCEPTED,
    };
    let _ = SIDESTEP_PEND.insert(pending, orig, 0);
    policy::count(netns_cookie, |c| c.redirected_inbound += 1);
    SK_PASS
}

/// A source only the pod itself should have: loopback, the passthrough source, one of the
/// pod's addresses, or the destination itself.
#[inline(always)]
fn has_local_source(netns_cookie: u64, remote: &[u32; 4], local: &[u32; 4]) -> bool {
    policy::is_loopback(remote)
        || policy::is_passthrough_source(remote)
        || same_address(remote, local)
        || policy::is_pod_address(netns_cookie, remote)
}

#[inline(always)]
fn same_address(a: &[u32; 4], b: &[u32; 4]) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3]
}
