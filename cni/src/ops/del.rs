//! DEL: undo ADD, idempotently, and succeed when the netns, the record or the pins are gone, so
//! that a pod can always be deleted (also after sidestep was uninstalled).
//!
//! Killed between any two steps (the `del:*` failpoints), a repeated DEL finishes: the record
//! goes after the enrolment, so its cookie is there for the retry, and the record's index entry
//! after the record (a stale entry is ignored, and the retry or GC removes it). A record that no
//! longer decodes is reported by path, and its cookie comes from the netns or, when that is gone,
//! from the record's text.
//!
//! A complete record of a netns no other attachment enrolled says which keys its ADD wrote, and
//! DEL deletes those (a cost that does not grow with the node's pods). Without one (no record, a
//! damaged or pending one, a shared netns, an index that does not vouch for it) DEL scans every
//! map for the cookie, as it always did.

use std::collections::BTreeSet;

use sidestep::{enroll::Removal, sys::failpoint};

use super::Ctx;
use crate::{
    spec::{CniError, code},
    state::salvage_cookie,
};

pub fn del(ctx: &Ctx<'_>) -> Result<(), CniError> {
    let (cid, ifname) = ctx.env.attachment();
    let (record, damaged) = match ctx.state.read_record(cid, ifname) {
        Ok(r) => (r, false),
        Err(e) => {
            tracing::error!("DEL {cid}/{ifname}: {e}; finding the pod's netns cookie without it");
            (None, true)
        }
    };
    // Without a record (an ADD that skipped the pod, or lost state), the netns says which pod
    // it was, if it still exists. A host netns yields no cookie, so it is never unenrolled.
    let from_netns = || {
        let netns = ctx.env.netns.as_deref()?;
        ctx.dp
            .netns_cookie(netns)
            .map_err(|e| tracing::debug!("DEL {cid}/{ifname}: no cookie from the netns: {e}"))
            .ok()
    };
    let salvaged = || {
        let c = salvage_cookie(&ctx.state.record_path(cid, ifname))?;
        tracing::warn!("DEL {cid}/{ifname}: netns cookie {c} read from the damaged record");
        Some(c)
    };
    let cookie = record
        .as_ref()
        .map(|r| r.netns_cookie)
        .or_else(from_netns)
        .or_else(|| if damaged { salvaged() } else { None });
    if damaged && cookie.is_none() {
        tracing::error!(
            "DEL {cid}/{ifname}: neither the netns nor the damaged record names a netns \
             cookie; the agent's reconcile reports entries no record accounts for"
        );
    }
    // A pod the plugin never captured (skipped, or let through by FAIL_OPEN) has no record, no
    // pod entry, no index directory and no per-pod link: enrolment writes the pod entry before
    // any link, and a killed ADD leaves a pending record and its index entry. Nothing to undo,
    // so no record reads or map scans, which on a node with many unmeshed pods would make their
    // every DEL grow with the node. (Keys a failed first enrolment's best-effort rollback could
    // not delete are inert without a pod entry: every program looks the pod up first.)
    let never_captured = record.is_none()
        && !damaged
        && cookie.is_some_and(|c| {
            // The directory first: the data path's traces open maps.
            !ctx.state.index().cookie_dir(c).exists() && !ctx.dp.traces(c)
        });
    if never_captured {
        tracing::debug!("DEL {cid}/{ifname}: never captured, nothing to unenrol");
    }
    failpoint("del:before-unenroll");
    // Whether no record names the cookie once ours is gone (so its index markers can go).
    let mut last = false;
    if let Some(cookie) = cookie.filter(|_| !never_captured) {
        let sharing = ctx.state.sharing(cookie, cid, ifname, &BTreeSet::new());
        if sharing.others > 0 {
            // Its interface's addresses and links go; the pod stays captured on the others.
            if let Some(r) = record.as_ref().filter(|r| r.netns_cookie == cookie) {
                let addresses = r.netns_keys.as_ref().map_or_else(
                    || r.policy.pod_ips.clone(),
                    |k| k.interface_addresses.clone(),
                );
                let ifindexes = r.inbound_ifindexes.clone().unwrap_or_default();
                let removal = Removal::Attachment {
                    ifname,
                    addresses: &addresses,
                    inbound_ifindexes: &ifindexes,
                };
                if let Err(e) = ctx.dp.remove(cookie, removal) {
                    return Err(CniError::new(
                        code::CLEANUP_FAILED,
                        format!("cannot remove attachment {ifname} of netns cookie {cookie}: {e}"),
                    ));
                }
            }
            tracing::info!(
                "DEL {cid}/{ifname}: netns cookie {cookie} stays enrolled for its other interfaces"
            );
        } else {
            last = true;
            // A pending record's ADD may have been a re-enrolment that stopped half-way, with
            // the old policy's keys still in the maps: only a finished one is exact.
            let exact = record
                .as_ref()
                .filter(|r| sharing.sole && !r.pending && r.netns_cookie == cookie);
            let (result, how) = match exact {
                Some(r) => (
                    ctx.dp.remove(cookie, Removal::Recorded(r.recorded())),
                    "by its record's keys",
                ),
                None => (ctx.dp.remove(cookie, Removal::Scan), "by scanning the maps"),
            };
            match result {
                Ok(was) => tracing::info!(
                    "DEL {cid}/{ifname}: netns cookie {cookie} unenrolled {how} (was enrolled: \
                     {was})"
                ),
                // Keep the record: a retried DEL needs its cookie.
                Err(e) => {
                    return Err(CniError::new(
                        code::CLEANUP_FAILED,
                        format!("cannot unenrol netns cookie {cookie}: {e}"),
                    ));
                }
            }
        }
    }
    failpoint("del:after-unenroll");
    let remove = |r: Result<bool, crate::state::StateError>| {
        r.map_err(|e| CniError::new(code::CLEANUP_FAILED, e.to_string()))
    };
    remove(ctx.state.remove_record(cid, ifname))?;
    remove(ctx.state.remove_marker(cid, ifname))?;
    failpoint("del:after-record");
    // A stale entry is harmless (an entry counts only with its record), so this cannot fail DEL.
    if let Some(cookie) = cookie
        && let Err(e) = ctx.state.unindex(cookie, cid, ifname, last)
    {
        tracing::warn!("DEL {cid}/{ifname}: {e}; GC removes the entry later");
    }
    Ok(())
}
