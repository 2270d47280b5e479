//! DEL: undo ADD, idempotently, and succeed when the netns, the record or the pins are gone, so
//! that a pod can always be deleted (also after sidestep was uninstalled).
//!
//! Killed between any two steps (the `del:*` failpoints), a repeated DEL finishes: the record
//! goes last, so its cookie is there for the retry. A record that no longer decodes is reported
//! by path, and its cookie comes from the netns or, when that is gone, from the record's text.

use std::collections::BTreeSet;

use sidestep::sys::failpoint;

use super::{Ctx, others_sharing};
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
    failpoint("del:before-unenroll");
    if let Some(cookie) = cookie {
        if others_sharing(&ctx.state, cookie, cid, ifname, &BTreeSet::new()) > 0 {
            tracing::info!(
                "DEL {cid}/{ifname}: netns cookie {cookie} stays enrolled for its other interfaces"
            );
        } else {
            match ctx.dp.unenroll(cookie) {
                Ok(was) => tracing::info!(
                    "DEL {cid}/{ifname}: netns cookie {cookie} unenrolled (was enrolled: {was})"
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
    Ok(())
}
