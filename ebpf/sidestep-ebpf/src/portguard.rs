//! cgroup/bind4 and cgroup/bind6: in an ambient pod, only ztunnel binds ztunnel's ports.
//!
//! ztunnel listens inside the pod's netns on the outbound, inbound, HBONE and DNS ports, and
//! sidestep steers captured traffic to whatever listens there. sidestep's ADD does not wait for
//! ztunnel (docs/ARCHITECTURE.md, "Ambient mode"), so without this an app that binds one of these
//! ports first would receive the pod's captured traffic with no policy applied, and ztunnel's
//! own bind would then fail. ztunnel marks every in-pod socket before it binds it (its in-pod
//! socket factory sets SO_MARK first), and setting a mark takes CAP_NET_ADMIN or CAP_NET_RAW,
//! which ztunnel has and an app container should not: the mark is the proof of ownership, as it
//! is in istio-cni's rules. A bind of any other port, or in a sidecar pod, is left alone.

use aya_ebpf::{
    EbpfContext, helpers::generated::bpf_get_netns_cookie, macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use sidestep_abi::defaults;

use crate::{ambient, context::load, policy};

const ALLOW: i32 = 1;
/// bind fails with EPERM.
const REFUSE: i32 = 0;

#[cgroup_sock_addr(bind4)]
pub fn sidestep_bind4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the kernel hands us a valid bpf_sock_addr for the duration of the call.
    if unsafe { refuses(&ctx) } {
        REFUSE
    } else {
        ALLOW
    }
}

#[cgroup_sock_addr(bind6)]
pub fn sidestep_bind6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    if unsafe { refuses(&ctx) } {
        REFUSE
    } else {
        ALLOW
    }
}

/// Whether this bind takes one of ztunnel's ports in an ambient pod without ztunnel's mark.
///
/// # Safety
/// `ctx` must be the live context of a bind4 or bind6 program.
#[inline(always)]
unsafe fn refuses(ctx: &SockAddrContext) -> bool {
    let sa = ctx.sock_addr;
    // SAFETY: 4-byte context field.
    let port = u16::from_be(unsafe { load(&raw const (*sa).user_port) } as u16);
    // Port 0 asks the kernel for an ephemeral port: enrolment reserves these from that choice
    // in an ambient pod's netns (userspace/src/enroll/reserved_ports.rs), whatever range the pod
    // sets.
    if port == 0 {
        return false;
    }
    // SAFETY: valid sock_addr context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(pod) = policy::pod_policy(netns_cookie) else {
        return false;
    };
    if !ambient::is_ambient(&pod) {
        return false;
    }
    let ztunnel_port = port == pod.outbound_port
        || port == pod.inbound_port
        || port == pod.dns_port
        || port == defaults::TUNNEL_PORT;
    if !ztunnel_port {
        return false;
    }
    // SAFETY: context pointer field.
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    if sk.is_null() {
        return true;
    }
    // SAFETY: `sk` is this context's full socket; `mark` is a 4-byte field.
    let mark = unsafe { load(&raw const (*sk).mark) };
    !ambient::is_ztunnel_mark(&pod, mark)
}
