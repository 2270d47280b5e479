//! The node's CNI configuration: finding the file the runtime uses, putting the sidestep entry
//! into it (once), taking it out again, and writing files atomically with their mode kept.
//!
//! The runtime (containerd, CRI-O, through libcni) uses the first file of the conf directory in
//! lexical order whose name ends in `.conf`, `.conflist` or `.json`. The entry goes at the end of
//! that file's `plugins`, after the primary plugin and anything chained to it, as istio-cni puts
//! its own: it then sees the final prevResult. A lone `.conf` becomes a `.conflist` of one
//! plugin, with the same mode, and the `.conf` is removed.

use std::{
    fs::{self, OpenOptions},
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use serde_json::{Value, json};

pub const CONF_EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    #[error("cannot read the CNI conf directory {path}: {source}")]
    ReadDir { path: PathBuf, source: io::Error },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// Often transient: another CNI is writing the file. The watcher retries.
    #[error("{path} is not a CNI configuration: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

/// CNI configuration files of `dir`, highest priority first.
pub fn conf_files(dir: &Path) -> Result<Vec<PathBuf>, ConfError> {
    let entries = fs::read_dir(dir).map_err(|source| ConfError::ReadDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                && p.extension()
                    .is_some_and(|x| CONF_EXTENSIONS.iter().any(|e| x == *e))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Reads a conf file as a conflist: `.conf` (and `.json` without `plugins`) files are wrapped.
/// Returns the list and whether it was wrapped.
pub fn read_as_list(path: &Path) -> Result<(Value, bool), ConfError> {
    let text = fs::read(path).map_err(|source| ConfError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let invalid = |reason: String| ConfError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let v: Value = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
    if !v.is_object() {
        return Err(invalid("not a JSON object".into()));
    }
    let is_list = path.extension().is_some_and(|x| x == "conflist") || v.get("plugins").is_some();
    if is_list {
        if !v["plugins"].is_array() {
            return Err(invalid("\"plugins\" is not an array".into()));
        }
        return Ok((v, false));
    }
    if !v["type"].is_string() {
        return Err(invalid("a single-plugin config needs a \"type\"".into()));
    }
    Ok((wrap(&v), true))
}

/// A single-plugin config as a conflist of one, as libcni's ConfListFromConf does.
pub fn wrap(conf: &Value) -> Value {
    let mut plugin = conf.clone();
    if let Some(o) = plugin.as_object_mut() {
        o.remove("cniVersion");
        o.remove("name");
    }
    json!({
        "cniVersion": conf.get("cniVersion").cloned().unwrap_or(json!("0.3.1")),
        "name": conf.get("name").cloned().unwrap_or(json!("k8s-pod-network")),
        "plugins": [plugin],
    })
}

/// How many entries of `plugin_type` the list has.
pub fn count_entries(list: &Value, plugin_type: &str) -> usize {
    list["plugins"]
        .as_array()
        .map_or(0, |p| p.iter().filter(|e| e["type"] == plugin_type).count())
}

/// The list with exactly one `entry`, at the end. `None` when it already has exactly that entry
/// (wherever it is), so an unchanged file is never rewritten.
pub fn insert_entry(list: &Value, entry: &Value) -> Option<Value> {
    let plugin_type = &entry["type"];
    let plugins = list["plugins"].as_array()?;
    let ours: Vec<&Value> = plugins
        .iter()
        .filter(|p| p["type"] == *plugin_type)
        .collect();
    if ours.len() == 1 && ours[0] == entry {
        return None;
    }
    let mut out = list.clone();
    let mut kept: Vec<Value> = plugins
        .iter()
        .filter(|p| p["type"] != *plugin_type)
        .cloned()
        .collect();
    kept.push(entry.clone());
    out["plugins"] = Value::Array(kept);
    Some(out)
}

/// The list without entries of `plugin_type`; `None` when it has none.
pub fn remove_entry(list: &Value, plugin_type: &str) -> Option<Value> {
    let plugins = list["plugins"].as_array()?;
    if !plugins.iter().any(|p| p["type"] == plugin_type) {
        return None;
    }
    let mut out = list.clone();
    out["plugins"] = Value::Array(
        plugins
            .iter()
            .filter(|p| p["type"] != plugin_type)
            .cloned()
            .collect(),
    );
    Some(out)
}

/// The standalone conflist: a network of sidestep alone.
pub fn standalone(entry: &Value) -> Value {
    json!({ "cniVersion": "1.0.0", "name": "sidestep", "plugins": [entry] })
}

pub fn file_mode(path: &Path) -> Option<u32> {
    fs::metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader (the runtime, another CNI) sees the old file or the new one. The temporary name starts
/// with `.` and has no CNI extension, so the runtime never picks it up.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), ConfError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.sidestep-tmp-{}", std::process::id()));
    let result = (|| {
        let _ = fs::remove_file(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        // The umask may have narrowed the mode given to open.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(|source| ConfError::Write {
        path: path.to_path_buf(),
        source,
    })
}

pub fn to_bytes(v: &Value) -> Vec<u8> {
    let mut b = serde_json::to_vec_pretty(v).unwrap_or_default();
    b.push(b'\n');
    b
}

/// What [`ensure_chained`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ensured {
    /// The entry was already there.
    Unchanged(PathBuf),
    /// The file was (re)written with the entry.
    Written(PathBuf),
    /// A `.conf` was turned into this `.conflist` with the entry.
    Wrapped { from: PathBuf, to: PathBuf },
    /// No configuration to chain into yet (the primary CNI has not written one).
    Waiting,
}

impl Ensured {
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Unchanged(p) | Self::Written(p) | Self::Wrapped { to: p, .. } => Some(p),
            Self::Waiting => None,
        }
    }
    pub fn wrote(&self) -> bool {
        matches!(self, Self::Written(_) | Self::Wrapped { .. })
    }
}

/// Whether the file is a conflist of `plugin_type` alone (a standalone file of ours).
fn ours_alone(path: &Path, plugin_type: &str) -> bool {
    read_as_list(path).is_ok_and(|(l, _)| {
        l["plugins"]
            .as_array()
            .is_some_and(|p| !p.is_empty() && p.iter().all(|e| e["type"] == plugin_type))
    })
}

/// The file to chain into: `name`, or the highest-priority file that is not ours alone.
pub fn chain_target(
    dir: &Path,
    name: Option<&str>,
    plugin_type: &str,
) -> Result<Option<PathBuf>, ConfError> {
    if let Some(n) = name {
        let p = dir.join(n);
        if p.is_file() {
            return Ok(Some(p));
        }
        // A named .conf we already wrapped lives on as its .conflist.
        let wrapped = p.with_extension("conflist");
        return Ok(
            (p.extension().is_some_and(|x| x == "conf") && wrapped.is_file()).then_some(wrapped),
        );
    }
    Ok(conf_files(dir)?
        .into_iter()
        .find(|p| !ours_alone(p, plugin_type)))
}

/// Puts `entry` into the chain target. Idempotent: never two entries of one type.
pub fn ensure_chained(dir: &Path, name: Option<&str>, entry: &Value) -> Result<Ensured, ConfError> {
    let plugin_type = entry["type"].as_str().unwrap_or_default();
    let Some(path) = chain_target(dir, name, plugin_type)? else {
        return Ok(Ensured::Waiting);
    };
    let mode = file_mode(&path).unwrap_or(0o644);
    let (list, wrapped) = read_as_list(&path)?;
    if wrapped {
        let to = path.with_extension("conflist");
        let with = insert_entry(&list, entry).unwrap_or(list);
        write_atomic(&to, &to_bytes(&with), mode)?;
        fs::remove_file(&path).map_err(|source| ConfError::Remove {
            path: path.clone(),
            source,
        })?;
        return Ok(Ensured::Wrapped { from: path, to });
    }
    match insert_entry(&list, entry) {
        None => Ok(Ensured::Unchanged(path)),
        Some(with) => {
            write_atomic(&path, &to_bytes(&with), mode)?;
            Ok(Ensured::Written(path))
        }
    }
}

/// Writes the standalone conflist `dir/name` unless it already holds exactly that.
pub fn ensure_standalone(dir: &Path, name: &str, entry: &Value) -> Result<Ensured, ConfError> {
    let path = dir.join(name);
    let want = standalone(entry);
    if let Ok((have, false)) = read_as_list(&path)
        && have == want
    {
        return Ok(Ensured::Unchanged(path));
    }
    write_atomic(&path, &to_bytes(&want), 0o644)?;
    Ok(Ensured::Written(path))
}

/// Whether the configuration the runtime uses holds the entry (for /readyz).
pub fn entry_in_place(
    dir: &Path,
    name: Option<&str>,
    standalone_mode: bool,
    entry: &Value,
) -> bool {
    let path = if standalone_mode {
        name.map(|n| dir.join(n))
    } else {
        let t = entry["type"].as_str().unwrap_or_default();
        chain_target(dir, name, t).ok().flatten()
    };
    path.and_then(|p| read_as_list(&p).ok())
        .is_some_and(|(list, wrapped)| {
            !wrapped
                && list["plugins"]
                    .as_array()
                    .is_some_and(|p| p.contains(entry))
        })
}

/// Removes every entry of `plugin_type` from every conf file of `dir`, and the standalone file
/// `standalone_name` if given. Returns the files changed.
pub fn remove_everywhere(
    dir: &Path,
    plugin_type: &str,
    standalone_name: Option<&str>,
) -> Result<Vec<PathBuf>, ConfError> {
    let mut changed = Vec::new();
    if let Some(n) = standalone_name {
        let p = dir.join(n);
        match fs::remove_file(&p) {
            Ok(()) => changed.push(p),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(ConfError::Remove { path: p, source }),
        }
    }
    for path in conf_files(dir)? {
        let Ok((list, false)) = read_as_list(&path) else {
            continue;
        };
        if let Some(without) = remove_entry(&list, plugin_type) {
            let mode = file_mode(&path).unwrap_or(0o644);
            write_atomic(&path, &to_bytes(&without), mode)?;
            changed.push(path);
        }
    }
    Ok(changed)
}

pub mod competing;

#[cfg(test)]
mod tests;
