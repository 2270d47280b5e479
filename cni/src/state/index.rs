//! The state directory's netns-cookie index as the operations use it (layout and rules: the
//! parent module's documentation).

use std::{
    collections::BTreeSet,
    fs, io,
    path::Path,
    time::{Duration, SystemTime},
};

use sidestep::stateindex::{INCOMPLETE, Index, SHARED, entry_name};

use super::{AttachmentRecord, StateDir, StateError, record_file_of, salvage_cookie};

/// An entry or marker younger than this may belong to an ADD under way (it makes its entry
/// just before its record), so GC leaves it.
const SWEEP_AGE: Duration = Duration::from_secs(60);

/// Who else uses a netns cookie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharing {
    /// Other attachments whose record names the cookie.
    pub others: usize,
    /// The index vouches that the asking attachment's ADD alone enrolled the cookie, so its
    /// record says what the maps hold for it.
    pub sole: bool,
}

impl StateDir {
    pub fn index(&self) -> Index {
        Index::new(&self.root)
    }

    fn index_error(&self, cookie: u64) -> impl Fn(io::Error) -> StateError + '_ {
        move |source| StateError::Index {
            path: self.index().cookie_dir(cookie),
            source,
        }
    }

    /// Whether the record named by the index entry `entry` exists and names `cookie`.
    fn confirms(&self, entry: &str, cookie: u64) -> bool {
        let path = self.root.join(record_file_of(entry));
        matches!(Self::read_json::<AttachmentRecord>(&path), Ok(Some(r)) if r.netns_cookie == cookie)
    }

    /// ADD, before its pending record: the attachment's entry, and the markers the cookie needs.
    /// `enrolled`: the netns is in the pod map already (an error reading it counts as yes).
    pub fn index_attachment(
        &self,
        cookie: u64,
        container_id: &str,
        ifname: &str,
        enrolled: bool,
    ) -> Result<(), StateError> {
        let ix = self.index();
        let err = self.index_error(cookie);
        let own = entry_name(container_id, ifname);
        let before = ix.list(cookie).map_err(&err)?.unwrap_or_default();
        // Our entry is made only after this decision, so an entry of ours says an earlier ADD
        // of this attachment made it, and that ADD's enrolment explains the pod entry.
        let explained = before.has(container_id, ifname)
            || before
                .entries
                .iter()
                .any(|e| *e != own && self.confirms(e, cookie));
        if enrolled && !explained && !before.incomplete {
            tracing::info!(
                "netns cookie {cookie} is enrolled without a record that the index knows; its \
                 attachments are counted by reading every record"
            );
            ix.mark(cookie, INCOMPLETE).map_err(&err)?;
        }
        // Our entry goes in before we look for others, so that of two ADDs into one netns at
        // once, the later to look sees the other.
        let after = ix.add(cookie, container_id, ifname).map_err(&err)?;
        if !after.shared && after.entries.iter().any(|e| *e != own) {
            ix.mark(cookie, SHARED).map_err(&err)?;
        }
        Ok(())
    }

    /// Marks the cookie `shared`: the maps may hold keys that no one record describes.
    pub fn mark_unexact(&self, cookie: u64) -> Result<(), StateError> {
        self.index()
            .mark(cookie, SHARED)
            .map_err(self.index_error(cookie))
    }

    /// Removes the attachment's entry, after its record. `last`: no record names the cookie any
    /// more, so its markers can go with the last entry.
    pub fn unindex(
        &self,
        cookie: u64,
        container_id: &str,
        ifname: &str,
        last: bool,
    ) -> Result<(), StateError> {
        self.index()
            .remove(cookie, container_id, ifname, last)
            .map_err(self.index_error(cookie))
    }

    /// Attachments of this state directory other than `(container_id, ifname)` and those in
    /// `ignore` that use `cookie`, from the index where it is complete for the cookie, and from
    /// every record otherwise. A netns with two interfaces on sidestep networks stays enrolled
    /// until its last one goes.
    pub fn sharing(
        &self,
        cookie: u64,
        container_id: &str,
        ifname: &str,
        ignore: &BTreeSet<(String, String)>,
    ) -> Sharing {
        let ignored = |cid: &str, ifn: &str| {
            (cid == container_id && ifn == ifname)
                || ignore.contains(&(cid.to_owned(), ifn.to_owned()))
        };
        match self.index().list(cookie) {
            Ok(Some(l)) if !l.incomplete && l.has(container_id, ifname) => {
                let others = l
                    .entries
                    .iter()
                    .filter(|e| e.split_once('@').is_some_and(|(c, i)| !ignored(c, i)))
                    .filter(|e| self.confirms(e, cookie))
                    .count();
                Sharing {
                    others,
                    sole: !l.shared,
                }
            }
            listing => {
                if let Err(e) = listing {
                    tracing::warn!(
                        "netns cookie {cookie}: cannot read the index ({e}); reading every record"
                    );
                }
                let others = self
                    .records()
                    .into_iter()
                    .filter_map(|(_, r)| r.ok())
                    .filter(|r| r.netns_cookie == cookie && !ignored(&r.container_id, &r.ifname))
                    .count();
                Sharing {
                    others,
                    sole: false,
                }
            }
        }
    }

    /// GC: removes index entries whose record is gone or names another cookie, and the markers
    /// and directories of cookies that no record in `named` (the cookies the remaining records
    /// name) uses. Entries and markers younger than [`SWEEP_AGE`] stay: an ADD may be writing
    /// them. Returns what could not be removed.
    pub fn sweep_index(&self, named: &BTreeSet<u64>) -> Vec<String> {
        let ix = self.index();
        let old = |p: &Path| {
            fs::symlink_metadata(p)
                .and_then(|m| m.modified())
                .is_ok_and(|t| SystemTime::now().duration_since(t).unwrap_or_default() >= SWEEP_AGE)
        };
        let mut errors = Vec::new();
        for cookie in ix.cookies() {
            let dir = ix.cookie_dir(cookie);
            let Ok(Some(l)) = ix.list(cookie) else {
                continue;
            };
            let mut left = 0;
            for e in &l.entries {
                let path = dir.join(e);
                let record = self.root.join(record_file_of(e));
                let stale = !self.confirms(e, cookie)
                    && salvage_cookie(&record).is_none_or(|c| c != cookie);
                if !stale || !old(&path) {
                    left += 1;
                    continue;
                }
                if let Err(e) = fs::remove_file(&path)
                    && e.kind() != io::ErrorKind::NotFound
                {
                    errors.push(format!("{}: {e}", path.display()));
                }
            }
            if left == 0 && !named.contains(&cookie) {
                for m in [INCOMPLETE, SHARED] {
                    let path = dir.join(m);
                    if old(&path)
                        && let Err(e) = fs::remove_file(&path)
                        && e.kind() != io::ErrorKind::NotFound
                    {
                        errors.push(format!("{}: {e}", path.display()));
                    }
                }
            }
            if let Err(e) = ix.remove_dir_if_empty(cookie) {
                errors.push(format!("{}: {e}", dir.display()));
            }
        }
        errors
    }
}
