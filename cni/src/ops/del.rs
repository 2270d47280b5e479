//! DEL: undo ADD, idempotently, and succeed when the netns, the record or the pins are gone, so
//! that a pod can always be deleted (also after sidestep was uninstalled).

use std::collections::BTreeSet;

use super::{Ctx, others_sharing};
use crate::spec::{CniError, code};

pub fn del(ctx: &Ctx<'_>) -> Result<(), CniError> {
    let (cid, ifname) = ctx.env.attachment();
    let record = match ctx.state.read_record(cid, ifname) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("DEL {cid}/{ifname}: unreadable record ignored: {e}");
            None
        }
    };
    // Without a record (an ADD that skipped the pod, or lost state), the netns says which pod
    // it was, if it still exists. A host netns yields no cookie, so it is never unenrolled.
    let cookie = record.as_ref().map(|r| r.netns_cookie).or_else(|| {
        let netns = ctx.env.netns.as_deref()?;
        ctx.dp
            .netns_cookie(netns)
            .map_err(|e| tracing::debug!("DEL {cid}/{ifname}: no cookie from the netns: {e}"))
            .ok()
    });
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
    let remove = |r: Result<bool, crate::state::StateError>| {
        r.map_err(|e| CniError::new(code::CLEANUP_FAILED, e.to_string()))
    };
    remove(ctx.state.remove_record(cid, ifname))?;
    remove(ctx.state.remove_marker(cid, ifname))?;
    Ok(())
}
