//! The netns-cookie index of the state directory (its rules: the parent module's documentation):
//! which attachments use a netns cookie, listable without opening a record. The plugin writes
//! and reads it; the agent removes the entries of the records it removes.
//!
//! ```text
//! <state_dir>/cookies/<netns cookie>/<containerID>@<ifname>   empty: that record names the cookie
//! <state_dir>/cookies/<netns cookie>/incomplete               records may name it without an entry
//! <state_dir>/cookies/<netns cookie>/shared                   no one record says what the maps hold
//! ```
//! An entry is made before the record that names the cookie and removed after it, so the entries
//! are a superset of the records: a reader confirms an entry by its record. The marker names hold
//! no `@`, so they cannot be an attachment's.

use std::{
    collections::BTreeSet,
    fs::{self, DirBuilder, OpenOptions},
    io,
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use super::{Record, StateDir, StateError, record_file_of, salvage_cookie};

/// The index directory, under the state directory.
pub const DIR: &str = "cookies";
/// Marker: a plugin that kept no index (an older version) may have enrolled the cookie, so its
/// records are found only by reading them all.
pub const INCOMPLETE: &str = "incomplete";
/// Marker: no one record says what the maps hold for the cookie: two attachments enrolled it
/// (the last one's policy winning), or a re-enrolment failed half-way.
pub const SHARED: &str = "shared";

/// What a cookie's directory holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// `<containerID>@<ifname>` of each entry.
    pub entries: Vec<String>,
    pub incomplete: bool,
    pub shared: bool,
}

impl Listing {
    pub fn has(&self, container_id: &str, ifname: &str) -> bool {
        let name = entry_name(container_id, ifname);
        self.entries.contains(&name)
    }
}

pub fn entry_name(container_id: &str, ifname: &str) -> String {
    format!("{container_id}@{ifname}")
}

/// The index of the state directory at `state_dir`.
#[derive(Debug, Clone)]
pub struct Index {
    dir: PathBuf,
}

impl Index {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(DIR),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn cookie_dir(&self, cookie: u64) -> PathBuf {
        self.dir.join(cookie.to_string())
    }

    /// The cookie's directory; `None` when it has none.
    pub fn list(&self, cookie: u64) -> io::Result<Option<Listing>> {
        let rd = match fs::read_dir(self.cookie_dir(cookie)) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut l = Listing::default();
        for e in rd {
            let name = e?.file_name();
            let name = name.to_string_lossy();
            match &*name {
                INCOMPLETE => l.incomplete = true,
                SHARED => l.shared = true,
                n if n.contains('@') && !n.starts_with('.') => l.entries.push(n.to_owned()),
                _ => {}
            }
        }
        l.entries.sort();
        Ok(Some(l))
    }

    /// Creates `name` (an entry or a marker) in the cookie's directory, and the directory.
    fn touch(&self, cookie: u64, name: &str) -> io::Result<()> {
        let dir = self.cookie_dir(cookie);
        let path = dir.join(name);
        let once = || {
            DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&path)
                .map(drop)
        };
        // A DEL removes a directory it left empty, and may do so between our mkdir and our
        // create: make it again.
        let mut tries = 0;
        loop {
            match once() {
                Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => tries += 1,
                other => return other,
            }
        }
    }

    /// Adds the attachment's entry; returns the cookie's directory as it is afterwards.
    pub fn add(&self, cookie: u64, container_id: &str, ifname: &str) -> io::Result<Listing> {
        self.touch(cookie, &entry_name(container_id, ifname))?;
        Ok(self.list(cookie)?.unwrap_or_default())
    }

    pub fn mark(&self, cookie: u64, marker: &str) -> io::Result<()> {
        self.touch(cookie, marker)
    }

    /// Removes the attachment's entry. With `last` (no record names the cookie any more, as far
    /// as the caller could tell) the markers go too, once no entry is left. The directory is
    /// removed when empty. A missing entry or directory is not an error.
    pub fn remove(
        &self,
        cookie: u64,
        container_id: &str,
        ifname: &str,
        last: bool,
    ) -> io::Result<()> {
        let dir = self.cookie_dir(cookie);
        ignore_missing(fs::remove_file(dir.join(entry_name(container_id, ifname))))?;
        // Usually nothing is left, and the directory just goes.
        remove_empty_dir(&dir)?;
        if last
            && let Some(l) = self.list(cookie)?
            && l.entries.is_empty()
        {
            for (marker, there) in [(INCOMPLETE, l.incomplete), (SHARED, l.shared)] {
                if there {
                    ignore_missing(fs::remove_file(dir.join(marker)))?;
                }
            }
        }
        self.remove_dir_if_empty(cookie)
    }

    /// Removes the cookie's directory, and then the index's, if it holds nothing: rmdir(2)
    /// refuses a directory that is not empty, so an entry or marker written meanwhile keeps it.
    pub fn remove_dir_if_empty(&self, cookie: u64) -> io::Result<()> {
        remove_empty_dir(&self.cookie_dir(cookie))?;
        remove_empty_dir(&self.dir)
    }

    /// Removes the whole index (entries, markers, directories; nothing else), for an uninstall
    /// that removes every record.
    pub fn remove_all(&self) -> io::Result<()> {
        for cookie in self.cookies() {
            let dir = self.cookie_dir(cookie);
            if let Some(l) = self.list(cookie)? {
                for name in l
                    .entries
                    .iter()
                    .map(String::as_str)
                    .chain([INCOMPLETE, SHARED])
                {
                    ignore_missing(fs::remove_file(dir.join(name)))?;
                }
            }
            remove_empty_dir(&dir)?;
        }
        remove_empty_dir(&self.dir)
    }

    /// Every cookie with a directory.
    pub fn cookies(&self) -> Vec<u64> {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect()
    }
}

fn remove_empty_dir(dir: &Path) -> io::Result<()> {
    match fs::remove_dir(dir) {
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty
            ) =>
        {
            Ok(())
        }
        other => other,
    }
}

fn ignore_missing(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

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
        matches!(Self::read_json::<Record>(&path), Ok(Some(r)) if r.netns_cookie == cookie)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_markers_and_cleanup() {
        let tmp = tempfile::tempdir().unwrap();
        let ix = Index::new(tmp.path());
        assert_eq!(ix.list(7).unwrap(), None);
        let l = ix.add(7, "c1", "eth0").unwrap();
        assert_eq!(l.entries, ["c1@eth0"]);
        assert!(l.has("c1", "eth0") && !l.has("c1", "net1"));
        ix.mark(7, SHARED).unwrap();
        let l = ix.add(7, "c1", "net1").unwrap();
        assert_eq!(l.entries, ["c1@eth0", "c1@net1"]);
        assert!(l.shared && !l.incomplete);
        // Not the last: the marker stays while an entry does.
        ix.remove(7, "c1", "net1", false).unwrap();
        ix.remove(7, "c1", "eth0", false).unwrap();
        assert!(ix.list(7).unwrap().unwrap().shared);
        ix.remove(7, "c1", "eth0", true).unwrap();
        assert_eq!(ix.list(7).unwrap(), None);
        assert!(!ix.dir().exists(), "an empty index directory goes too");
        // An uninstall takes everything of ours, and nothing else.
        ix.add(9, "c", "eth0").unwrap();
        ix.mark(9, INCOMPLETE).unwrap();
        ix.add(10, "d", "eth0").unwrap();
        fs::write(ix.dir().join("not-ours"), "").unwrap();
        ix.remove_all().unwrap();
        assert!(ix.cookies().is_empty());
        assert!(ix.dir().join("not-ours").exists());
        // Removing what is not there is fine.
        ix.remove(8, "c", "eth0", true).unwrap();
    }
}
