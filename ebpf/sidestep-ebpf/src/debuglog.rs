//! Per-pod verdict logging through aya-log, for pods with `flags::DEBUG` (`sidestep.io/debug`).
//!
//! One line per decision, as `key=value` fields the agent parses: it names the pod from the netns
//! cookie and the rule from its number (`sidestep_abi::rule`). Callers test the flag first, so a
//! pod without it pays one AND and branch.

use aya_ebpf::EbpfContext;
use aya_log_ebpf::info;

use crate::policy::addr_bytes;

/// A connect's verdict: `kind` 0 is passed, else the `redirect_kind`.
#[inline(always)]
pub fn connect<C: EbpfContext>(
    ctx: &C,
    netns_cookie: u64,
    dst: &[u32; 4],
    dst_port: u16,
    uid: u32,
    kind: u16,
    rule: u16,
) {
    let dst = addr_bytes(dst);
    info!(
        ctx,
        "connect netns={} dst={:i} port={} uid={} kind={} rule={}",
        netns_cookie,
        dst,
        dst_port,
        uid,
        kind,
        rule
    );
}

/// An inbound SYN's verdict: `kind` 0 is passed (to the app's own listener), else redirected.
#[inline(always)]
pub fn inbound<C: EbpfContext>(
    ctx: &C,
    netns_cookie: u64,
    dst: &[u32; 4],
    dst_port: u16,
    kind: u16,
    rule: u16,
) {
    let dst = addr_bytes(dst);
    info!(
        ctx,
        "inbound netns={} dst={:i} port={} kind={} rule={}",
        netns_cookie,
        dst,
        dst_port,
        kind,
        rule
    );
}
