//! GC (CNI 1.1): remove every attachment of this network that the runtime no longer lists, with
//! its netns-cookie index entry, and sweep the index of what crashes left (entries without a
//! record, directories no record needs). Errors do not stop it; they are reported together at
//! the end, as the spec asks.

use std::{collections::BTreeSet, path::Path};

use sidestep::enroll::Removal;

use super::Ctx;
use crate::spec::{CniError, code};

/// `(containerID, ifname)` from a state file name, for files that no longer decode.
fn key_from_file(path: &Path) -> Option<(String, String)> {
    let stem = path.file_stem()?.to_str()?;
    let (cid, ifname) = stem.split_once('@')?;
    Some((cid.to_owned(), ifname.to_owned()))
}

pub fn gc(ctx: &Ctx<'_>) -> Result<(), CniError> {
    let valid: BTreeSet<(String, String)> = ctx
        .cfg
        .valid_attachments
        .iter()
        .flatten()
        .map(|a| (a.container_id.clone(), a.ifname.clone()))
        .collect();
    let mut errors = Vec::new();
    let mut removed = BTreeSet::new();
    // The cookies of the records that stay, for the index sweep.
    let mut named = BTreeSet::new();
    for (path, record) in ctx.state.records() {
        let r = match record {
            Ok(r) => r,
            Err(e) => {
                if key_from_file(&path).is_some_and(|k| !valid.contains(&k)) {
                    tracing::warn!("GC removes undecodable record: {e}");
                    if let Err(e) = ctx.state.remove_path(&path) {
                        errors.push(e.to_string());
                    }
                } else {
                    named.extend(crate::state::salvage_cookie(&path));
                }
                continue;
            }
        };
        let key = (r.container_id.clone(), r.ifname.clone());
        if r.network != ctx.cfg.name || valid.contains(&key) {
            named.insert(r.netns_cookie);
            continue;
        }
        removed.insert(key);
        let last = ctx
            .state
            .sharing(r.netns_cookie, &r.container_id, &r.ifname, &removed)
            .others
            == 0;
        // The scan, not the record's keys: GC is the safety net for whatever DEL missed.
        if last && let Err(e) = ctx.dp.remove(r.netns_cookie, Removal::Scan) {
            named.insert(r.netns_cookie);
            errors.push(format!(
                "{}/{} (netns cookie {}): {e}",
                r.container_id, r.ifname, r.netns_cookie
            ));
            continue;
        }
        tracing::info!(
            "GC removed stale attachment {}/{}",
            r.container_id,
            r.ifname
        );
        if let Err(e) = ctx.state.remove_path(&path) {
            named.insert(r.netns_cookie);
            errors.push(e.to_string());
            continue;
        }
        if let Err(e) = ctx
            .state
            .unindex(r.netns_cookie, &r.container_id, &r.ifname, last)
        {
            errors.push(e.to_string());
        }
    }
    errors.extend(ctx.state.sweep_index(&named));
    for (path, marker) in ctx.state.markers() {
        let stale = match &marker {
            Ok(m) => {
                m.network == ctx.cfg.name
                    && !valid.contains(&(m.container_id.clone(), m.ifname.clone()))
            }
            Err(_) => key_from_file(&path).is_some_and(|k| !valid.contains(&k)),
        };
        if stale && let Err(e) = ctx.state.remove_path(&path) {
            errors.push(e.to_string());
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(CniError::new(
            code::CLEANUP_FAILED,
            format!("GC could not remove {} stale attachment(s)", errors.len()),
        )
        .details(errors.join("; ")))
    }
}
