//! The state directory, written and read only through these types: the CNI plugin's
//! per-attachment records, fail-open markers, the netns-cookie index and the invocation timings.
//! A record is what DEL needs once the netns is gone (the cookie) and what CHECK and GC compare
//! against; the agent lists, collects and re-enrols from the same records, and turns the timings
//! into metrics. The plugin and the agent are built from this one module, so they cannot
//! disagree on the format; records written by earlier releases stay readable
//! (`userspace/fixtures/state/`, tested in `record`).
//!
//! ```text
//! <state_dir>/<containerID>@<ifname>.json            one enrolled attachment
//! <state_dir>/failopen/<containerID>@<ifname>.json   a pod let through uncaptured (FAIL_OPEN)
//! ```
//! `@` cannot occur in a container ID, so the name is unambiguous. Records are written to a
//! temporary file and renamed, so a reader sees the old record or the new one, never half.
//!
//! ADD writes its record twice: `pending` (the netns cookie and policy, before the first map
//! write) and then complete. A plugin killed in between leaves the pending record, from which
//! DEL, GC and the agent's reconcile find what to undo even when the netns is gone.
//!
//! A record that does not decode (truncated, garbage, an unknown format, a directory in its
//! place) is reported by path; [`salvage_cookie`] still finds its netns cookie when the text
//! holds one, and [`StateDir::remove_record`] moves a directory aside instead of failing.
//!
//! ## The netns-cookie index
//!
//! Whether another attachment uses the same netns (DEL must not unenrol a netns that keeps an
//! interface on a sidestep network) is answered by listing one small directory instead of
//! reading every record ([`Index`]):
//!
//! ```text
//! <state_dir>/cookies/<netns cookie>/<containerID>@<ifname>   empty file: that record names the cookie
//! <state_dir>/cookies/<netns cookie>/incomplete               a plugin without the index may have enrolled it
//! <state_dir>/cookies/<netns cookie>/shared                   no one record says what the maps hold
//! ```
//! Listings of records skip it (it is a directory, not a `.json` file), so older plugins and
//! agents ignore it. Its rules, each safe to be killed after:
//! - ADD makes its entry before the pending record, so the entries are a superset of the
//!   records naming the cookie; DEL, GC and the agent remove an entry after its record. An entry
//!   counts only when its record exists and names the cookie (a stale one is ignored).
//! - ADD marks the cookie `incomplete` when it finds the netns enrolled already and no entry
//!   (but its own from an earlier ADD of the same attachment) explains it: a plugin of the
//!   previous version, which wrote records but no index, enrolled it. Such a cookie, one with no
//!   directory, or a query whose own entry is missing (its record is older than the index) is
//!   answered by reading every record, as before the index.
//! - ADD marks the cookie `shared` when another entry is there (the maps then hold what the
//!   last ADD wrote), and when it fails after finding the netns enrolled (a re-enrolment may
//!   have stopped half-way): no single record describes the maps, so the last DEL scans them
//!   ([`crate::enroll::unenroll_cookie`]) instead of deleting its record's keys.
//! - The markers go with the last entry, when the DEL that leaves no record naming the cookie
//!   removes it; GC sweeps entries and directories that crashes left.
//!
//! What the index cannot see: an attachment that a plugin without the index ADDs to a netns
//! after this one indexed it (a downgrade, then an upgrade, while the pod lives). Its record
//! names the cookie with no entry and no marker, so the last indexed attachment's DEL would
//! unenrol the netns under it. Deleting `cookies/` after a downgrade (it is only a cache of the
//! records) makes every such DEL read the records again.

use std::{
    collections::BTreeMap,
    fs::{self, DirBuilder, OpenOptions},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Serialize, de::DeserializeOwned};

use crate::policy::InboundHook;

pub mod index;
mod record;
pub mod timings;

pub use index::{Index, Listing, Sharing, entry_name};

/// The agent's datagram socket for the plugin's log lines, in the state directory both share:
/// the plugin sends to it, the agent binds it and re-logs what arrives.
pub const LOG_SOCKET_NAME: &str = "log.sock";
pub use record::{FailOpenMarker, RECORD_FORMAT, Record, RecordSummary, SummaryPolicy};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot create the state directory {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} is not a sidestep record ({reason}); remove it")]
    Corrupt { path: PathBuf, reason: String },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
    #[error("cannot update the netns-cookie index {path}: {source}")]
    Index { path: PathBuf, source: io::Error },
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn file_name(container_id: &str, ifname: &str) -> String {
    record_file_of(&entry_name(container_id, ifname))
}

/// The record file an index entry (`<containerID>@<ifname>`) stands for.
pub fn record_file_of(entry: &str) -> String {
    format!("{entry}.json")
}

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn record_path(&self, container_id: &str, ifname: &str) -> PathBuf {
        self.root.join(file_name(container_id, ifname))
    }

    pub fn failopen_dir(&self) -> PathBuf {
        self.root.join("failopen")
    }

    pub fn marker_path(&self, container_id: &str, ifname: &str) -> PathBuf {
        self.failopen_dir().join(file_name(container_id, ifname))
    }

    /// Creates `dir` root-only. An existing directory is tightened to 0700: records name pods
    /// and netns paths, which other users have no business listing.
    fn ensure_dir(dir: &Path) -> Result<(), StateError> {
        let err = |source| StateError::CreateDir {
            path: dir.to_path_buf(),
            source,
        };
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
        let meta = fs::metadata(dir).map_err(err)?;
        if meta.permissions().mode() & 0o077 != 0 {
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(err)?;
        }
        Ok(())
    }

    /// Written to a temporary file and renamed, never fsynced: a record describes kernel objects
    /// (pinned links, map entries, a netns) that do not outlive a reboot either, so it needs to
    /// survive only the death of a process, which the page cache gives. An fsync of the file and
    /// its directory cost more than the rest of an ADD on a disk-backed state dir.
    fn write_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), StateError> {
        let dir = path.parent().unwrap_or(&self.root);
        Self::ensure_dir(dir)?;
        if path.is_dir() {
            // rename(2) cannot replace a directory; whatever put it there, the record wins.
            Self::move_aside(path)?;
        }
        let werr = |source| StateError::Write {
            path: path.to_path_buf(),
            source,
        };
        // One fixed name per record (the runtime never runs two commands of one attachment at
        // once): a writer killed before its rename leaves a file the next write reuses.
        let tmp = Self::tmp_path(path);
        let body = serde_json::to_vec_pretty(value).map_err(|e| werr(io::Error::other(e)))?;
        Self::replace(path, &tmp, &body, Some("state:before-rename")).map_err(werr)
    }

    /// Writes `body` to `tmp` (root-only) and renames it over `path`, so a reader sees the old
    /// file or the new one; `tmp` goes when any step fails. `failpoint` sits before the rename.
    fn replace(path: &Path, tmp: &Path, body: &[u8], failpoint: Option<&str>) -> io::Result<()> {
        let result = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(tmp)?;
            f.write_all(body)?;
            if let Some(point) = failpoint {
                crate::sys::failpoint(point);
            }
            fs::rename(tmp, path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(tmp);
        }
        result
    }

    fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, StateError> {
        let text = match fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let corrupt = |reason: String| StateError::Corrupt {
            path: path.to_path_buf(),
            reason,
        };
        if text.is_empty() {
            return Err(corrupt("empty file".into()));
        }
        let value: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| corrupt(e.to_string()))?;
        // Records carry a format; markers do not. A newer plugin's record is not guessed at.
        if let Some(f) = value.get("format")
            && f.as_u64() != Some(u64::from(RECORD_FORMAT))
        {
            return Err(corrupt(format!(
                "unknown record format {f} (this plugin reads {RECORD_FORMAT})"
            )));
        }
        serde_json::from_value(value)
            .map(Some)
            .map_err(|e| corrupt(e.to_string()))
    }

    /// Renames what sits at `path` to a hidden `.<name>.corrupt-<unix time>` beside it: listings
    /// skip it, and an operator can still look at it.
    fn move_aside(path: &Path) -> Result<PathBuf, StateError> {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let aside = path.with_file_name(format!(".{name}.corrupt-{}", now_unix()));
        fs::rename(path, &aside).map_err(|source| StateError::Remove {
            path: path.to_path_buf(),
            source,
        })?;
        tracing::warn!(
            "{} is not a record file; moved it aside to {}",
            path.display(),
            aside.display()
        );
        Ok(aside)
    }

    fn remove(path: &Path) -> Result<bool, StateError> {
        match fs::remove_file(path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(_) if path.is_dir() => Self::move_aside(path).map(|_| true),
            Err(source) => Err(StateError::Remove {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    fn tmp_path(path: &Path) -> PathBuf {
        path.with_file_name(format!(
            ".{}.tmp",
            path.file_name().unwrap_or_default().to_string_lossy()
        ))
    }

    pub fn write_record(&self, r: &Record) -> Result<(), StateError> {
        self.write_json(&self.record_path(&r.container_id, &r.ifname), r)
    }

    /// The pending record ADD writes before it changes anything.
    pub fn write_pending(&self, r: &Record) -> Result<(), StateError> {
        let r = Record {
            pending: true,
            writer_pid: Some(std::process::id()),
            ..r.clone()
        };
        self.write_json(&self.record_path(&r.container_id, &r.ifname), &r)
    }

    pub fn read_record(
        &self,
        container_id: &str,
        ifname: &str,
    ) -> Result<Option<Record>, StateError> {
        Self::read_json(&self.record_path(container_id, ifname))
    }

    pub fn remove_record(&self, container_id: &str, ifname: &str) -> Result<bool, StateError> {
        let path = self.record_path(container_id, ifname);
        // What a writer killed before its rename left.
        let _ = fs::remove_file(Self::tmp_path(&path));
        Self::remove(&path)
    }

    pub fn write_marker(&self, m: &FailOpenMarker) -> Result<(), StateError> {
        self.write_json(&self.marker_path(&m.container_id, &m.ifname), m)
    }

    pub fn read_marker(
        &self,
        container_id: &str,
        ifname: &str,
    ) -> Result<Option<FailOpenMarker>, StateError> {
        Self::read_json(&self.marker_path(container_id, ifname))
    }

    pub fn remove_marker(&self, container_id: &str, ifname: &str) -> Result<bool, StateError> {
        Self::remove(&self.marker_path(container_id, ifname))
    }

    fn list<T: DeserializeOwned>(dir: &Path) -> Vec<(PathBuf, Result<T, StateError>)> {
        let Ok(entries) = fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut out: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| is_record_name(p))
            .map(|p| {
                let r = Self::read_json(&p).and_then(|v| {
                    v.ok_or_else(|| StateError::Read {
                        path: p.clone(),
                        source: io::ErrorKind::NotFound.into(),
                    })
                });
                (p, r)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every record, with the ones that do not decode reported by path.
    pub fn records(&self) -> Vec<(PathBuf, Result<Record, StateError>)> {
        Self::list(&self.root)
    }

    pub fn markers(&self) -> Vec<(PathBuf, Result<FailOpenMarker, StateError>)> {
        Self::list(&self.failopen_dir())
    }

    /// Every record as the agent lists pods, by file ([`RecordSummary`]: lenient, so a newer
    /// plugin's record is still listed); unreadable ones are skipped with a warning, and ones a
    /// DEL removed between listing and reading are skipped silently.
    pub fn summaries(&self) -> BTreeMap<PathBuf, RecordSummary> {
        Self::json_files(&self.root)
            .into_iter()
            .filter_map(|p| {
                match fs::read(&p).map(|b| serde_json::from_slice::<RecordSummary>(&b)) {
                    Ok(Ok(r)) => Some((p, r)),
                    Ok(Err(e)) => {
                        tracing::warn!(record = %p.display(), error = %e, "unreadable state record");
                        None
                    }
                    Err(_) => None,
                }
            })
            .collect()
    }

    /// The full record at `path` (a file [`Self::summaries`] listed); `None` once it is gone.
    pub fn read_record_at(&self, path: &Path) -> Result<Option<Record>, StateError> {
        Self::read_json(path)
    }

    /// Names of the record files (cheap: no parsing), for counting ADDs and DELs between scans.
    pub fn record_names(&self) -> Vec<String> {
        Self::names(&self.root)
    }

    /// Names of the fail-open marker files.
    pub fn marker_names(&self) -> Vec<String> {
        Self::names(&self.failopen_dir())
    }

    fn names(dir: &Path) -> Vec<String> {
        Self::json_files(dir)
            .into_iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect()
    }

    /// Regular `*.json` files of `dir` whose name does not start with a dot (temporary and
    /// moved-aside files do).
    fn json_files(dir: &Path) -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file() && is_record_name(p))
            .collect()
    }

    /// Records the inbound hook a re-enrolment used in the record at `path`, unless the record
    /// changed since `read` was read from it (a DEL removed it, an ADD rewrote it or is under
    /// way). Returns whether it wrote. Written through a temporary name of its own, never the
    /// plugin's fixed one, which an ADD of the same attachment may be writing. A DEL racing this
    /// can still lose to the rename; the record then names a dead netns, and the agent's next
    /// reconcile collects it.
    pub fn set_inbound_hook(
        &self,
        path: &Path,
        read: &Record,
        hook: InboundHook,
    ) -> Result<bool, StateError> {
        let Some(mut now) = Self::read_json::<Record>(path)? else {
            return Ok(false);
        };
        if now.created_unix != read.created_unix
            || now.netns_cookie != read.netns_cookie
            || now.pending
        {
            return Ok(false);
        }
        now.policy.inbound_hook = hook;
        let werr = |source| StateError::Write {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_file_name(format!(
            ".{}.agent-tmp-{}",
            path.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        let body = serde_json::to_vec_pretty(&now).map_err(|e| werr(io::Error::other(e)))?;
        Self::replace(path, &tmp, &body, None)
            .map(|()| true)
            .map_err(werr)
    }

    /// `sidestep uninstall`: every record, marker, temporary file, the timings and the index,
    /// then the directory itself when nothing else is left in it. Returns how many records and
    /// markers went.
    pub fn remove_all(&self) -> Result<usize, StateError> {
        let mut removed = 0;
        for dir in [self.failopen_dir(), self.root.clone()] {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for path in entries.flatten().map(|e| e.path()) {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let record = is_record_name(&path);
                // The plugin's `.X.json.tmp`, the agent's `.X.json.agent-tmp-PID`, and what
                // older plugins left (`X.json.tmp.PID`).
                let temporary =
                    name.starts_with('.') && name.contains(".json.") || name.contains(".json.tmp.");
                let timings = name == timings::FILE_NAME || name == timings::ROTATED_NAME;
                // Left by an agent that was killed: nothing binds it any more.
                let log_socket = dir == self.root && name == LOG_SOCKET_NAME;
                if log_socket {
                    Self::remove(&path)?;
                    continue;
                }
                if !(record || temporary || timings) || !path.is_file() {
                    continue;
                }
                if Self::remove(&path)? && record {
                    removed += 1;
                }
            }
        }
        self.index()
            .remove_all()
            .map_err(|source| StateError::Index {
                path: self.root.join(index::DIR),
                source,
            })?;
        for dir in [self.failopen_dir(), self.root.clone()] {
            match fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty
                    ) => {}
                Err(source) => return Err(StateError::Remove { path: dir, source }),
            }
        }
        Ok(removed)
    }

    /// Removes a file found by [`Self::records`] or [`Self::markers`].
    pub fn remove_path(&self, path: &Path) -> Result<bool, StateError> {
        Self::remove(path)
    }
}

/// A record or marker file name: `*.json`, not hidden (temporary and moved-aside files are).
fn is_record_name(p: &Path) -> bool {
    p.extension().is_some_and(|x| x == "json")
        && !p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
}

/// The netns cookie written in a record that no longer decodes (a truncated write, a stray
/// edit), so that DEL can still find the pod's entries and links in the kernel.
pub fn salvage_cookie(path: &Path) -> Option<u64> {
    let text = fs::read(path).ok()?;
    let text = String::from_utf8_lossy(&text);
    let after = &text[text.find("\"netnsCookie\"")? + "\"netnsCookie\"".len()..];
    let rest = after.trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    // A cut inside the number would name another cookie: accept only a number that ended.
    let next = rest[digits.len()..].chars().next();
    if digits.is_empty() || !next.is_some_and(|c| c == ',' || c == '}' || c.is_whitespace()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    fn record(cid: &str) -> Record {
        Record {
            format: RECORD_FORMAT,
            network: "net".into(),
            container_id: cid.into(),
            ifname: "eth0".into(),
            netns: "/run/netns/x".into(),
            netns_cookie: 42,
            interfaces: vec!["eth0".into()],
            inbound_ifindexes: Some(vec![2]),
            netns_keys: None,
            pod_name: Some("web".into()),
            pod_namespace: Some("default".into()),
            mesh: "istio".into(),
            policy: Policy::default(),
            pin_root: "/sys/fs/bpf/sidestep".into(),
            created_unix: 1,
            pending: false,
            writer_pid: None,
        }
    }

    #[test]
    fn records_round_trip_root_only() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path().join("a/b"));
        state.write_record(&record("c1")).unwrap();
        state.write_record(&record("c1")).unwrap();
        state.write_record(&record("c2")).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(state.root()), 0o700);
        assert_eq!(mode(&state.record_path("c1", "eth0")), 0o600);
        assert_eq!(state.read_record("c1", "eth0").unwrap(), Some(record("c1")));
        assert_eq!(state.records().len(), 2);
        assert!(state.remove_record("c1", "eth0").unwrap());
        assert!(!state.remove_record("c1", "eth0").unwrap());
        assert_eq!(state.read_record("c1", "eth0").unwrap(), None);
        // No temporary files are left behind.
        let names: Vec<_> = fs::read_dir(state.root()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
    }

    /// A killed agent leaves its log socket bound to nothing; the last step of an uninstall
    /// must not leave the directory behind for it. Anything else foreign stays.
    #[test]
    fn remove_all_takes_a_stale_log_socket_and_leaves_foreign_files() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path().join("state"));
        state.write_record(&record("c1")).unwrap();
        drop(std::os::unix::net::UnixDatagram::bind(state.root().join(LOG_SOCKET_NAME)).unwrap());
        assert_eq!(state.remove_all().unwrap(), 1);
        assert!(!state.root().exists(), "the directory stays");

        state.write_record(&record("c1")).unwrap();
        fs::write(state.root().join("operator-notes"), "mine").unwrap();
        state.remove_all().unwrap();
        assert!(state.root().join("operator-notes").exists());
        assert!(!state.root().join(LOG_SOCKET_NAME).exists());
    }

    #[test]
    fn loose_directories_are_tightened_and_corrupt_records_named() {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let state = StateDir::new(tmp.path());
        fs::write(state.record_path("bad", "eth0"), "{").unwrap();
        state.write_record(&record("ok")).unwrap();
        assert_eq!(
            fs::metadata(tmp.path()).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let e = state.read_record("bad", "eth0").unwrap_err();
        assert!(matches!(e, StateError::Corrupt { .. }), "{e}");
        let all = state.records();
        assert_eq!(all.iter().filter(|(_, r)| r.is_err()).count(), 1);
    }

    #[test]
    fn damaged_records_are_named_and_their_cookie_salvaged() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path());
        state.write_record(&record("c")).unwrap();
        let path = state.record_path("c", "eth0");
        let full = fs::read_to_string(&path).unwrap();
        let at = full.find("\"netnsCookie\"").unwrap();
        // Cut right after the cookie's number, and inside it.
        let end = at + full[at..].find(',').unwrap();
        fs::write(&path, &full[..end + 1]).unwrap();
        assert!(matches!(
            state.read_record("c", "eth0"),
            Err(StateError::Corrupt { .. })
        ));
        assert_eq!(salvage_cookie(&path), Some(42));
        fs::write(&path, &full[..end - 1]).unwrap();
        assert_eq!(salvage_cookie(&path), None);
        for body in ["", "\u{0}garbage", "[1,2]"] {
            fs::write(&path, body).unwrap();
            let e = state.read_record("c", "eth0").unwrap_err();
            assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        }
        let mut v: serde_json::Value = serde_json::from_str(&full).unwrap();
        v["format"] = 99.into();
        fs::write(&path, v.to_string()).unwrap();
        let e = state.read_record("c", "eth0").unwrap_err();
        assert!(e.to_string().contains("unknown record format 99"), "{e}");
        // A directory in a record's place: unreadable, then moved aside by DEL's remove and
        // replaced by ADD's write.
        fs::remove_file(&path).unwrap();
        fs::create_dir(&path).unwrap();
        assert!(state.read_record("c", "eth0").is_err());
        assert!(state.remove_record("c", "eth0").unwrap());
        assert!(!path.exists());
        fs::create_dir(&path).unwrap();
        state.write_record(&record("c")).unwrap();
        assert_eq!(state.read_record("c", "eth0").unwrap(), Some(record("c")));
    }

    #[test]
    fn pending_records_round_trip_and_old_records_are_complete() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path());
        state.write_pending(&record("c")).unwrap();
        assert!(state.read_record("c", "eth0").unwrap().unwrap().pending);
        state.write_record(&record("c")).unwrap();
        let text = fs::read_to_string(state.record_path("c", "eth0")).unwrap();
        assert!(!text.contains("pending"), "{text}");
        assert!(!state.read_record("c", "eth0").unwrap().unwrap().pending);
    }

    #[test]
    fn markers_live_apart() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path());
        let m = FailOpenMarker {
            network: "net".into(),
            container_id: "c".into(),
            ifname: "eth0".into(),
            pod_name: None,
            pod_namespace: None,
            reason: "not loaded".into(),
            created_unix: now_unix(),
        };
        state.write_marker(&m).unwrap();
        assert_eq!(state.read_marker("c", "eth0").unwrap(), Some(m));
        assert!(state.records().is_empty());
        assert_eq!(state.markers().len(), 1);
        assert!(state.remove_marker("c", "eth0").unwrap());
    }
}
