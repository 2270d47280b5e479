//! The CNI directories as the container runtime is configured to use them: the plugin must be
//! installed where the runtime looks for binaries, and the entry written where it reads its
//! configuration. The runtime (containerd or CRI-O) is found by a scan of `<proc-dir>/*/comm`,
//! its configuration read through `<proc-dir>/<pid>/root`, and its directories compared with the
//! agent's by identity (device and inode through that same root), so neither the agent's mount
//! namespace nor the path it mounts them at matters.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use toml::{Table, Value};

use super::{DOC_RUNTIME, Found, Item};
use crate::agent::settings::Settings;

const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";
const DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
const CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";
const CRIO_CONFIG: &str = "/etc/crio/crio.conf";
const CRIO_CONFIG_DIR: &str = "/etc/crio/crio.conf.d";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RuntimeError {
    #[error("{path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("{path}: cannot read it ({reason})")]
    Read { path: String, reason: String },
}

/// The CNI directories a runtime uses, in the runtime's own mount namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeDirs {
    /// Searched in order for plugin binaries.
    pub bin_dirs: Vec<PathBuf>,
    pub conf_dir: PathBuf,
    /// Where they were set: the file and table, or "defaults".
    pub source: String,
}

impl RuntimeDirs {
    fn defaults(source: String) -> Self {
        Self {
            bin_dirs: vec![PathBuf::from(DEFAULT_BIN_DIR)],
            conf_dir: PathBuf::from(DEFAULT_CONF_DIR),
            source,
        }
    }
}

/// Files read for a path: (path, text) of each (more than one for a `*` pattern).
pub type Files = Vec<(String, String)>;
/// Reads a path of the runtime's view.
pub type Reader<'a> = &'a dyn Fn(&str) -> Result<Files, RuntimeError>;

/// A CNI table of containerd's: its name and values, each unset one `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniTable {
    pub table: &'static str,
    pub bin_dirs: Option<Vec<PathBuf>>,
    pub conf_dir: Option<PathBuf>,
}

/// What one containerd configuration file says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Containerd {
    /// The CRI plugin is disabled: this containerd runs no Kubernetes pods (Docker's).
    pub no_cri: bool,
    pub cni: Option<CniTable>,
    /// Files it imports (paths or `*` patterns), merged over it in order.
    pub imports: Vec<String>,
}

fn parse_table(path: &str, text: &str) -> Result<Table, RuntimeError> {
    text.parse::<Table>().map_err(|e| RuntimeError::Parse {
        path: path.into(),
        reason: e.message().trim().to_owned(),
    })
}

fn string(v: Option<&Value>) -> Option<PathBuf> {
    v.and_then(Value::as_str).map(PathBuf::from)
}

fn strings(v: Option<&Value>) -> Option<Vec<PathBuf>> {
    v.and_then(Value::as_array).map(|a| {
        a.iter()
            .filter_map(Value::as_str)
            .map(PathBuf::from)
            .collect()
    })
}

/// A containerd configuration file: containerd 2's `[plugins.'io.containerd.cri.v1.runtime'.cni]`
/// (`bin_dirs`, or 2.0's `bin_dir`, and `conf_dir`), containerd 1.x's
/// `[plugins."io.containerd.grpc.v1.cri".cni]` (`bin_dir`, `conf_dir`), or a version 1 file's
/// `[plugins.cri.cni]`.
pub fn containerd(path: &str, text: &str) -> Result<Containerd, RuntimeError> {
    const TABLES: [(&str, &str); 3] = [
        (
            "io.containerd.cri.v1.runtime",
            "plugins.'io.containerd.cri.v1.runtime'.cni",
        ),
        (
            "io.containerd.grpc.v1.cri",
            "plugins.\"io.containerd.grpc.v1.cri\".cni",
        ),
        ("cri", "plugins.cri.cni"),
    ];
    let t = parse_table(path, text)?;
    let list = |k: &str| -> Vec<String> {
        t.get(k)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    };
    let no_cri = list("disabled_plugins").iter().any(|p| {
        matches!(
            p.as_str(),
            "cri" | "io.containerd.grpc.v1.cri" | "io.containerd.cri.v1.runtime"
        )
    });
    let plugins = t.get("plugins").and_then(Value::as_table);
    let cni = TABLES.into_iter().find_map(|(key, table)| {
        let cni = plugins?.get(key)?.as_table()?.get("cni")?.as_table()?;
        let bin_dirs = strings(cni.get("bin_dirs"))
            .or_else(|| string(cni.get("bin_dir")).map(|d| vec![d]))
            .filter(|d| !d.is_empty());
        Some(CniTable {
            table,
            bin_dirs,
            conf_dir: string(cni.get("conf_dir")),
        })
    });
    Ok(Containerd {
        no_cri,
        cni,
        imports: list("imports"),
    })
}

/// containerd's directories from its configuration file and the files it imports (merged over
/// it in order, as containerd does), each read by `read` (a path in the runtime's view; `*` in
/// an import's file name is expanded by `read` returning every match). `None`: its CRI plugin
/// is disabled.
pub fn containerd_dirs(
    config: &str,
    read: Reader<'_>,
) -> Result<Option<RuntimeDirs>, RuntimeError> {
    let mut dirs = RuntimeDirs::defaults(format!("{config}, containerd's defaults"));
    let mut files = read(config)?;
    let mut i = 0;
    while let Some((path, text)) = files.get(i).cloned() {
        i += 1;
        let c = containerd(&path, &text)?;
        if c.no_cri {
            return Ok(None);
        }
        if let Some(CniTable {
            table,
            bin_dirs,
            conf_dir,
        }) = c.cni
        {
            if let Some(b) = bin_dirs {
                dirs.bin_dirs = b;
            }
            if let Some(d) = conf_dir {
                dirs.conf_dir = d;
            }
            dirs.source = format!("{path} [{table}]");
        }
        for import in c.imports {
            // A relative import is relative to the importing file.
            let full = Path::new(&path)
                .parent()
                .unwrap_or(Path::new("/"))
                .join(&import);
            files.extend(read(&full.display().to_string())?);
        }
    }
    Ok(Some(dirs))
}

/// CRI-O's directories: `[crio.network] network_dir` and `plugin_dirs` of `crio.conf`, then of
/// each drop-in in `crio.conf.d` (in the order given: CRI-O reads them sorted by name, later ones
/// winning), then the command line's `--cni-config-dir` and `--cni-plugin-dir`.
pub fn crio_dirs(files: &[(String, String)], args: &[String]) -> Result<RuntimeDirs, RuntimeError> {
    let mut dirs = RuntimeDirs::defaults("CRI-O's defaults".into());
    for (path, text) in files {
        let t = parse_table(path, text)?;
        let Some(net) = t
            .get("crio")
            .and_then(Value::as_table)
            .and_then(|c| c.get("network"))
            .and_then(Value::as_table)
        else {
            continue;
        };
        if let Some(d) = string(net.get("network_dir")) {
            dirs.conf_dir = d;
            dirs.source = format!("{path} [crio.network]");
        }
        if let Some(d) = strings(net.get("plugin_dirs")).filter(|d| !d.is_empty()) {
            dirs.bin_dirs = d;
            dirs.source = format!("{path} [crio.network]");
        }
    }
    let conf = flag_values(args, &["--cni-config-dir"], &[]);
    if let Some(d) = conf.last() {
        dirs.conf_dir = PathBuf::from(d);
        dirs.source = "crio's command line".into();
    }
    let bins = flag_values(args, &["--cni-plugin-dir"], &[]);
    if !bins.is_empty() {
        dirs.bin_dirs = bins.iter().map(PathBuf::from).collect();
        dirs.source = "crio's command line".into();
    }
    Ok(dirs)
}

/// Every value of a flag on a command line: `--flag v`, `--flag=v`, and for `short`, `-c v`.
pub fn flag_values(args: &[String], long: &[&str], short: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let named = long.iter().chain(short).find(|f| a == *f);
        if named.is_some() {
            if let Some(v) = it.next() {
                out.push(v.clone());
            }
            continue;
        }
        if let Some(v) = long
            .iter()
            .chain(short)
            .find_map(|f| a.strip_prefix(&format!("{f}=")))
        {
            out.push(v.to_owned());
        }
    }
    out
}

/// Whether the runtime's directories are the agent's, by identity; `id` gives (dev, ino) of a
/// path in the runtime's view, `ours` of the agent's setting.
pub fn compare(
    runtime: &str,
    dirs: &RuntimeDirs,
    id: &dyn Fn(&Path) -> Option<(u64, u64)>,
    bin: (&Path, Option<(u64, u64)>),
    conf: (&Path, Option<(u64, u64)>),
) -> Found {
    let mut wrong = Vec::new();
    let conf_same = conf.1.is_some() && id(&dirs.conf_dir) == conf.1;
    if !conf_same {
        wrong.push(format!(
            "reads its CNI configuration from {}, not cni-conf-dir {}",
            dirs.conf_dir.display(),
            conf.0.display()
        ));
    }
    let bin_same = bin.1.is_some() && dirs.bin_dirs.iter().any(|d| id(d) == bin.1);
    if !bin_same {
        wrong.push(format!(
            "looks for plugins in {}, not cni-bin-dir {}",
            dirs.bin_dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            bin.0.display()
        ));
    }
    if wrong.is_empty() {
        Ok(format!(
            "{runtime} uses cni-bin-dir and cni-conf-dir (its {} and {}, from {})",
            dirs.bin_dirs
                .iter()
                .find(|d| id(d) == bin.1)
                .unwrap_or(&dirs.bin_dirs[0])
                .display(),
            dirs.conf_dir.display(),
            dirs.source
        ))
    } else {
        Err((
            format!("{runtime} {} (from {})", wrong.join(", and "), dirs.source),
            "mount the runtime's directories into the agent, or point the settings cni-bin-dir \
             / cni-conf-dir (and host-cni-conf-dir) at them: the runtime never calls a plugin \
             it cannot find"
                .into(),
        ))
    }
}

/// A runtime process found in the proc directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
    pub args: Vec<String>,
}

/// containerd and CRI-O processes under `proc_dir`, by PID.
pub fn runtimes(proc_dir: &Path) -> Vec<Process> {
    let Ok(entries) = fs::read_dir(proc_dir) else {
        return Vec::new();
    };
    let mut out: BTreeMap<u32, Process> = BTreeMap::new();
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(comm) = fs::read_to_string(e.path().join("comm")) else {
            continue;
        };
        let comm = comm.trim().to_owned();
        if comm != "containerd" && comm != "crio" {
            continue;
        }
        let args = fs::read(e.path().join("cmdline"))
            .map(|b| {
                b.split(|c| *c == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect()
            })
            .unwrap_or_default();
        out.insert(pid, Process { pid, comm, args });
    }
    out.into_values().collect()
}

/// A path of the runtime's mount namespace, as seen through `root` (its `/proc/PID/root`).
fn through(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn dev_ino(path: &Path) -> Option<(u64, u64)> {
    fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Reads a file of the runtime's view, expanding a `*` in its file name.
fn read_through(root: &Path, path: &str) -> Result<Files, RuntimeError> {
    let p = Path::new(path);
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let read = |p: &Path| {
        fs::read_to_string(through(root, p)).map_err(|e| RuntimeError::Read {
            path: p.display().to_string(),
            reason: e.to_string(),
        })
    };
    let Some((prefix, suffix)) = name.split_once('*') else {
        return Ok(vec![(path.to_owned(), read(p)?)]);
    };
    let dir = p.parent().unwrap_or(Path::new("/"));
    let mut names: Vec<String> = fs::read_dir(through(root, dir))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix) && n.ends_with(suffix) && n.len() >= name.len() - 1)
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let f = dir.join(&n);
            read(&f).map(|t| (f.display().to_string(), t))
        })
        .collect()
}

/// The directories `process` uses; `None` for a containerd without its CRI plugin.
fn dirs_of(proc_dir: &Path, process: &Process) -> Result<Option<RuntimeDirs>, RuntimeError> {
    let root = proc_dir.join(process.pid.to_string()).join("root");
    if process.comm == "containerd" {
        let config = flag_values(&process.args, &["--config"], &["-c"])
            .pop()
            .unwrap_or_else(|| CONTAINERD_CONFIG.into());
        return containerd_dirs(&config, &|p| read_through(&root, p));
    }
    let config = flag_values(&process.args, &["--config"], &["-c"])
        .pop()
        .unwrap_or_else(|| CRIO_CONFIG.into());
    let drop_ins = flag_values(&process.args, &["--config-dir"], &["-d"])
        .pop()
        .unwrap_or_else(|| CRIO_CONFIG_DIR.into());
    // Either may be absent: CRI-O runs on its defaults.
    let mut files = read_through(&root, &config).unwrap_or_default();
    files.extend(read_through(&root, &format!("{drop_ins}/*.conf")).unwrap_or_default());
    crio_dirs(&files, &process.args).map(Some)
}

pub(super) fn item(s: &Settings) -> Item {
    let found = runtimes(&s.proc_dir);
    if found.is_empty() {
        return Item::warn(
            "runtime",
            DOC_RUNTIME,
            format!(
                "no containerd or crio process under proc-dir {}: the runtime's CNI directories \
                 cannot be compared",
                s.proc_dir.display()
            ),
            "in the agent's pod, proc-dir must be the host's /proc (hostPID, or a hostPath \
             mount); reading the runtime's configuration through it needs CAP_SYS_PTRACE",
        );
    }
    let bin = (s.cni_bin_dir.as_path(), dev_ino(&s.cni_bin_dir));
    let conf = (s.cni_conf_dir.as_path(), dev_ino(&s.cni_conf_dir));
    let mut failures = Vec::new();
    let mut unknown = Vec::new();
    for p in &found {
        let who = format!("{} (pid {})", p.comm, p.pid);
        match dirs_of(&s.proc_dir, p) {
            Ok(None) => unknown.push(format!("{who} runs without its CRI plugin")),
            Ok(Some(dirs)) => {
                let root = s.proc_dir.join(p.pid.to_string()).join("root");
                let id = |d: &Path| dev_ino(&through(&root, d));
                match compare(&who, &dirs, &id, bin, conf) {
                    Ok(line) => return Item::new("runtime", DOC_RUNTIME, Ok(line)),
                    Err(e) => failures.push(e),
                }
            }
            Err(e) => unknown.push(format!("{who}: {e}")),
        }
    }
    match failures.into_iter().next() {
        Some(first) => Item::new("runtime", DOC_RUNTIME, Err(first)),
        None => Item::warn(
            "runtime",
            DOC_RUNTIME,
            format!(
                "the runtime's CNI directories cannot be told: {}",
                unknown.join("; ")
            ),
            "reading another process's root needs CAP_SYS_PTRACE (the agent keeps it with \
             scan-proc)",
        ),
    }
}

#[cfg(test)]
mod tests;
