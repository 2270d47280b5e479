//! The agent's settings: command-line flags, their environment variables, and a ConfigMap.
//!
//! Every setting has one name, used as the flag (`--cni-conf-dir`), as the ConfigMap key
//! (`cni-conf-dir`) and, upper-cased with `SIDESTEP_`, as the environment variable
//! (`SIDESTEP_CNI_CONF_DIR`). A flag or variable wins over the ConfigMap, which wins over the
//! default. The ConfigMap is read from `--config`: a mounted ConfigMap directory (one file per
//! key) or a JSON object file. A bad value stops the agent with a message naming the setting.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::Value;

pub use super::args::AgentArgs;
use super::{
    args::{CONFIG_ONLY_KEYS, KEYS, cli_value, env_name},
    listen::Listen,
    template::{self, PluginTemplate},
};
use sidestep::{mounts, pins::DEFAULT_PIN_ROOT, policy::Policy};

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("setting {setting} ({origin}): {reason}")]
    Invalid {
        setting: String,
        origin: String,
        reason: String,
    },
    #[error("setting config: cannot read {path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("setting config: {path} has unknown key {key:?}; known keys: {known}")]
    UnknownKey {
        path: PathBuf,
        key: String,
        known: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CniMode {
    Chained,
    Standalone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// The resolved, validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub cni_bin_dir: PathBuf,
    pub cni_conf_dir: PathBuf,
    pub host_cni_conf_dir: PathBuf,
    /// `None` in chained mode: the highest-priority file.
    pub cni_conf_name: Option<String>,
    pub cni_mode: CniMode,
    pub template: PluginTemplate,
    pub cni_binary: PathBuf,
    pub cni_log_level: String,
    pub kubeconfig_name: String,
    pub kubeconfig_mode: u32,
    pub service_account_dir: PathBuf,
    /// The plugin's service account token, which the plugin's kubeconfig carries.
    pub cni_service_account_dir: PathBuf,
    pub pin_root: PathBuf,
    pub cgroup: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub listen: Listen,
    /// How old the data-path figures of /metrics may be: the pod map is walked at most once
    /// per this, whatever the number of scrapes.
    pub metrics_max_age: Duration,
    /// Whether /metrics has per-pod series; off, only the node's figures (cardinality).
    pub metrics_per_pod: bool,
    pub reconcile_interval: Duration,
    pub repair: bool,
    /// What repair does with a pod that should be captured and is not.
    pub repair_mode: RepairMode,
    pub repair_policy: Policy,
    /// Set: repair finds each netns's pod through the API and lets the plugin decide.
    pub api_kubeconfig: Option<PathBuf>,
    pub netns_dirs: Vec<PathBuf>,
    pub netns_prefix: String,
    pub scan_proc: bool,
    pub proc_dir: PathBuf,
    pub log_level: String,
    pub log_format: LogFormat,
    pub pod_capacity: Option<u32>,
    /// The most addresses gained after enrolment that the address follower registers, node-wide.
    pub late_address_budget: usize,
    pub node_name: String,
    /// The taint removed from this node once ready (None: off).
    pub readiness_taint: Option<String>,
    /// Istio ambient mode: ZDS for ztunnel, and `ambient_enabled` in the plugin's entry.
    pub ambient: bool,
    pub ztunnel_socket: PathBuf,
    pub pod_namespace: String,
    pub uninstall_requested: bool,
    /// The configuration file or directory (a mounted ConfigMap), re-read for
    /// [`Settings::uninstall_requested_now`].
    pub config_path: Option<PathBuf>,
    pub bpf_object: Option<PathBuf>,
}

pub const DEFAULT_STANDALONE_NAME: &str = "99-sidestep.conflist";

/// Where each value came from, for error messages.
struct Resolver<'a> {
    args: &'a AgentArgs,
    config: BTreeMap<String, String>,
    config_path: Option<PathBuf>,
}

impl Resolver<'_> {
    /// The value and a description of its origin.
    fn get(&self, key: &str) -> Option<(String, String)> {
        if let Some(v) = cli_value(self.args, key) {
            return Some((v.clone(), format!("--{key} or {}", env_name(key))));
        }
        let path = self.config_path.as_ref()?;
        self.config
            .get(key)
            .map(|v| (v.clone(), format!("key {key} of {}", path.display())))
    }

    fn err(key: &str, origin: &str, reason: impl ToString) -> SettingsError {
        SettingsError::Invalid {
            setting: key.into(),
            origin: origin.into(),
            reason: reason.to_string(),
        }
    }

    fn parse<T>(
        &self,
        key: &str,
        default: impl FnOnce() -> Result<T, String>,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, SettingsError> {
        match self.get(key) {
            Some((v, origin)) => parse(v.trim()).map_err(|r| Self::err(key, &origin, r)),
            None => default().map_err(|r| Self::err(key, "default", r)),
        }
    }

    fn string(&self, key: &str, default: &str) -> String {
        self.get(key).map_or_else(|| default.into(), |(v, _)| v)
    }

    fn dir(&self, key: &str, default: &str, must_exist: bool) -> Result<PathBuf, SettingsError> {
        let check = |v: &str| {
            let p = absolute(v)?;
            if must_exist && !p.is_dir() {
                return Err(format!("{} is not a directory", p.display()));
            }
            Ok(p)
        };
        self.parse(key, || check(default), check)
    }

    fn boolean(&self, key: &str, default: bool) -> Result<bool, SettingsError> {
        self.parse(key, || Ok(default), parse_bool)
    }
}

fn absolute(v: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(v);
    if !p.is_absolute() {
        return Err(format!("{v:?} is not an absolute path"));
    }
    Ok(p)
}

pub fn parse_bool(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" | "" => Ok(false),
        _ => Err(format!("{v:?} is not a boolean (true or false)")),
    }
}

/// `30s`, `500ms`, `2m`, `1h`, or plain seconds.
/// Istio's repair modes (`cni.repair.repairPods`, `deletePods`, `labelPods`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairMode {
    /// Enrol the pod in place.
    Repair,
    /// Delete the pod, so that its controller recreates it through the CNI chain.
    Delete,
    /// Label it `sidestep.io/uninitialized=true` and leave it.
    Label,
}

impl RepairMode {
    pub fn parse(v: &str) -> Result<Self, String> {
        match v.trim() {
            "repair" => Ok(Self::Repair),
            "delete" => Ok(Self::Delete),
            "label" => Ok(Self::Label),
            other => Err(format!("{other:?}: expected repair, delete or label")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Repair => "repair",
            Self::Delete => "delete",
            Self::Label => "label",
        }
    }
}

/// The readiness taint's key when none is named: a node provisioner adds it with effect
/// NoSchedule, and the agent removes it once ready.
pub const DEFAULT_READINESS_TAINT: &str = "sidestep.io/agent-not-ready";

/// `false`/empty: off; `true`: [`DEFAULT_READINESS_TAINT`]; else a taint key (`[prefix/]name`).
pub fn parse_taint_key(v: &str) -> Result<Option<String>, String> {
    let v = v.trim();
    match v {
        "" | "false" => return Ok(None),
        "true" => return Ok(Some(DEFAULT_READINESS_TAINT.into())),
        _ => {}
    }
    let name = v.rsplit_once('/').map_or(v, |(_, n)| n);
    let ok = !name.is_empty()
        && name.len() <= 63
        && v.len() <= 316
        && v.bytes().filter(|b| *b == b'/').count() <= 1
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'));
    if ok {
        Ok(Some(v.to_owned()))
    } else {
        Err(format!(
            "{v:?} is not a taint key ([prefix/]name of letters, digits, '-', '_', '.'); use true for {DEFAULT_READINESS_TAINT}"
        ))
    }
}

pub fn parse_duration(v: &str) -> Result<Duration, String> {
    let (num, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{v:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("{v:?}: unknown unit {unit:?} (ms, s, m or h)")),
    };
    if d < Duration::from_millis(100) {
        return Err(format!("{v:?} is shorter than 100ms"));
    }
    Ok(d)
}

/// A file name in a directory: no separators, not empty, not `.` or `..`.
fn file_name(v: &str) -> Result<String, String> {
    if v.is_empty() || v.contains('/') || v == "." || v == ".." || v.contains('\0') {
        return Err(format!("{v:?} is not a file name"));
    }
    Ok(v.into())
}

fn conf_name(v: &str, mode: CniMode) -> Result<String, String> {
    let v = file_name(v)?;
    let ok = match mode {
        CniMode::Chained => [".conf", ".conflist", ".json"]
            .iter()
            .any(|e| v.ends_with(e)),
        CniMode::Standalone => v.ends_with(".conflist"),
    };
    if !ok {
        return Err(match mode {
            CniMode::Chained => format!("{v:?} must end with .conf, .conflist or .json"),
            CniMode::Standalone => format!("{v:?} must end with .conflist in standalone mode"),
        });
    }
    Ok(v)
}

/// Reads a ConfigMap directory (each regular file not starting with `.` is a key) or a JSON file.
pub fn read_config(path: &Path) -> Result<BTreeMap<String, String>, SettingsError> {
    let err = |reason: String| SettingsError::Config {
        path: path.to_path_buf(),
        reason,
    };
    let mut out = BTreeMap::new();
    if path.is_dir() {
        for entry in fs::read_dir(path)
            .map_err(|e| err(e.to_string()))?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            // A mounted ConfigMap has `..data` and `..<timestamp>` entries beside the keys.
            if name.starts_with('.') || !entry.path().is_file() {
                continue;
            }
            let text = fs::read_to_string(entry.path()).map_err(|e| err(format!("{name}: {e}")))?;
            out.insert(name, text.trim_end_matches(['\n', '\r']).to_owned());
        }
    } else {
        let text = fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| err("not a JSON object".into()))?;
        for (k, v) in obj {
            let s = match v {
                Value::String(s) => s.clone(),
                Value::Null => continue,
                other => other.to_string(),
            };
            out.insert(k.clone(), s);
        }
    }
    for key in out.keys() {
        if !KEYS.contains(&key.as_str()) && !CONFIG_ONLY_KEYS.contains(&key.as_str()) {
            return Err(SettingsError::UnknownKey {
                path: path.to_path_buf(),
                key: key.clone(),
                known: KEYS.join(", "),
            });
        }
    }
    Ok(out)
}

impl Settings {
    /// Whether an uninstall is requested now: at start, or since, in the configuration that the
    /// preStop `sidestep uninstall --if-requested` reads (parsed as it parses it). While it is,
    /// the agent restores nothing that the uninstall takes away: the CNI entry, the plugin
    /// binary, the kubeconfig, the pins. A configuration that cannot be read counts as not
    /// requested: the agent keeps the node working.
    pub fn uninstall_requested_now(&self) -> bool {
        self.uninstall_requested
            || self.config_path.as_deref().is_some_and(|p| {
                read_config(p)
                    .ok()
                    .and_then(|c| c.get("uninstall-requested").cloned())
                    .is_some_and(|v| parse_bool(v.trim()) == Ok(true))
            })
    }

    /// Resolves and validates. `log_level` is the global `--log-level`/`SIDESTEP_LOG`, if given.
    pub fn resolve(args: &AgentArgs, log_level: Option<&str>) -> Result<Self, SettingsError> {
        let config = match &args.config {
            Some(p) => read_config(p)?,
            None => BTreeMap::new(),
        };
        let r = Resolver {
            args,
            config,
            config_path: args.config.clone(),
        };
        let cni_mode = r.parse(
            "cni-mode",
            || Ok(CniMode::Chained),
            |v| match v {
                "chained" => Ok(CniMode::Chained),
                "standalone" => Ok(CniMode::Standalone),
                _ => Err(format!("{v:?} is neither chained nor standalone")),
            },
        )?;
        let cni_conf_dir = r.dir("cni-conf-dir", "/etc/cni/net.d", true)?;
        let host_default = cni_conf_dir.display().to_string();
        let host_cni_conf_dir = r.dir("host-cni-conf-dir", &host_default, false)?;
        let cni_conf_name = match (r.get("cni-conf-name"), cni_mode) {
            (Some((v, origin)), mode) => Some(
                conf_name(v.trim(), mode)
                    .map_err(|e| Resolver::err("cni-conf-name", &origin, e))?,
            ),
            (None, CniMode::Standalone) => Some(DEFAULT_STANDALONE_NAME.into()),
            (None, CniMode::Chained) => None,
        };
        let template = match (r.get("plugin-template"), r.get("plugin-json")) {
            (Some((_, o1)), Some((_, o2))) => {
                return Err(Resolver::err(
                    "plugin-template",
                    &o1,
                    format!("give either plugin-template or plugin-json ({o2}), not both"),
                ));
            }
            (Some((path, origin)), None) => fs::read_to_string(path.trim())
                .map_err(|e| format!("cannot read {path}: {e}"))
                .and_then(|t| PluginTemplate::parse(&t))
                .map_err(|e| Resolver::err("plugin-template", &origin, e))?,
            (None, Some((json, origin))) => PluginTemplate::parse(&json)
                .map_err(|e| Resolver::err("plugin-json", &origin, e))?,
            (None, None) => PluginTemplate::parse(template::DEFAULT_TEMPLATE)
                .map_err(|e| Resolver::err("plugin-json", "default", e))?,
        };
        let ambient = r.boolean("ambient", false)?;
        // The plugin refuses every ADD with such an entry; refuse it here instead, where
        // the operator looks, before the node's pods fail to start.
        let mesh = template.mesh();
        if ambient && mesh.is_some_and(|m| m != "istio") {
            return Err(Resolver::err(
                "ambient",
                "configuration",
                format!(
                    "ambient mode is Istio's, and the plugin's mesh is {:?}: set ambient \
                     to false or mesh to \"istio\"",
                    mesh.unwrap_or_default()
                ),
            ));
        }
        let cni_binary = r.parse("cni-binary", default_cni_binary, |v| {
            let p = absolute(v)?;
            if !p.is_file() {
                return Err(format!("{} is not a file", p.display()));
            }
            Ok(p)
        })?;
        let kubeconfig_mode = r.parse(
            "kubeconfig-mode",
            || Ok(0o600),
            |v| match u32::from_str_radix(v.trim_start_matches("0o"), 8) {
                Ok(m) if m <= 0o777 => Ok(m),
                _ => Err(format!("{v:?} is not an octal file mode such as 0600")),
            },
        )?;
        let repair_policy = r.parse(
            "repair-policy",
            || Ok(Policy::default()),
            |v| {
                let text = fs::read_to_string(v).map_err(|e| format!("cannot read {v}: {e}"))?;
                let p: Policy = serde_json::from_str(&text).map_err(|e| format!("{v}: {e}"))?;
                p.validate().map_err(|e| format!("{v}: {e}"))?;
                Ok(p)
            },
        )?;
        let log_level = match log_level {
            Some(l) => l.to_owned(),
            None => r.string("log-level", "info"),
        };
        if tracing_subscriber::EnvFilter::try_new(&log_level).is_err() {
            return Err(Resolver::err(
                "log-level",
                "--log-level, SIDESTEP_LOG or key log-level",
                format!("{log_level:?} is not a log filter (e.g. info or sidestep=debug)"),
            ));
        }
        if r.boolean("ambient", false)? && r.string("node-name", "").is_empty() {
            let origin = r.get("ambient").map(|(_, o)| o).unwrap_or_default();
            return Err(Resolver::err(
                "ambient",
                &origin,
                "ambient mode needs node-name (NODE_NAME from the downward API): ztunnel names \
                 each pod by its UID, which the agent learns from its watch of the node's pods",
            ));
        }
        Ok(Self {
            cni_bin_dir: r.dir("cni-bin-dir", "/opt/cni/bin", true)?,
            cni_conf_dir,
            host_cni_conf_dir,
            cni_conf_name,
            cni_mode,
            template,
            cni_binary,
            cni_log_level: r.string("cni-log-level", "info"),
            kubeconfig_name: r.parse(
                "kubeconfig-name",
                || Ok("ZZZ-sidestep-kubeconfig".into()),
                file_name,
            )?,
            kubeconfig_mode,
            service_account_dir: r.dir(
                "service-account-dir",
                "/var/run/secrets/kubernetes.io/serviceaccount",
                false,
            )?,
            cni_service_account_dir: r.dir(
                "cni-service-account-dir",
                "/var/run/secrets/sidestep-cni",
                false,
            )?,
            pin_root: r.dir("pin-root", DEFAULT_PIN_ROOT, false)?,
            cgroup: r
                .get("cgroup")
                .map(|(v, origin)| {
                    let p = absolute(v.trim()).map_err(|e| Resolver::err("cgroup", &origin, e))?;
                    mounts::check_cgroup2_dir(&p)
                        .map_err(|e| Resolver::err("cgroup", &origin, e))?;
                    Ok::<_, SettingsError>(p)
                })
                .transpose()?,
            state_dir: r.dir("state-dir", "/var/run/sidestep/cni", false)?,
            listen: r.parse("listen", || Ok(Listen::DEFAULT), Listen::parse)?,
            metrics_max_age: r.parse(
                "metrics-max-age",
                || Ok(Duration::from_secs(5)),
                parse_duration,
            )?,
            metrics_per_pod: r.boolean("metrics-per-pod", true)?,
            reconcile_interval: r.parse(
                "reconcile-interval",
                || Ok(Duration::from_secs(30)),
                parse_duration,
            )?,
            // In a cluster (the downward API names the node) repair is on unless turned off, as
            // istio-cni's is; outside one it would enrol every netns in scope, so it is opt-in.
            repair: r.boolean("repair", !r.string("node-name", "").is_empty())?,
            repair_mode: r.parse("repair-mode", || Ok(RepairMode::Repair), RepairMode::parse)?,
            repair_policy,
            api_kubeconfig: r
                .get("api-kubeconfig")
                .map(|(v, origin)| {
                    absolute(v.trim()).map_err(|e| Resolver::err("api-kubeconfig", &origin, e))
                })
                .transpose()?,
            netns_dirs: r.parse(
                "netns-dirs",
                || Ok(vec![PathBuf::from("/run/netns")]),
                |v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(absolute)
                        .collect()
                },
            )?,
            netns_prefix: r.string("netns-prefix", ""),
            scan_proc: r.boolean("scan-proc", true)?,
            proc_dir: r.dir("proc-dir", "/proc", true)?,
            log_level,
            log_format: r.parse(
                "log-format",
                || Ok(LogFormat::Text),
                |v| match v {
                    "text" => Ok(LogFormat::Text),
                    "json" => Ok(LogFormat::Json),
                    _ => Err(format!("{v:?} is neither text nor json")),
                },
            )?,
            pod_capacity: r
                .get("pod-capacity")
                .map(|(v, origin)| match v.trim().parse::<u32>() {
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(Resolver::err(
                        "pod-capacity",
                        &origin,
                        format!("{v:?} is not a positive number"),
                    )),
                })
                .transpose()?,
            late_address_budget: r.parse(
                "late-address-budget",
                || Ok(crate::addrfollow::DEFAULT_LATE_ADDRESS_BUDGET),
                |v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| format!("{v:?} is not a number of addresses"))
                },
            )?,
            node_name: r.string("node-name", ""),
            readiness_taint: r.parse("readiness-taint", || Ok(None), parse_taint_key)?,
            ambient,
            ztunnel_socket: r.parse(
                "ztunnel-socket",
                || Ok(PathBuf::from(crate::zds::DEFAULT_SOCKET)),
                |v| absolute(v.trim()),
            )?,
            pod_namespace: r.string("pod-namespace", ""),
            uninstall_requested: r.boolean("uninstall-requested", false)?,
            config_path: args.config.clone(),
            bpf_object: r
                .get("bpf-object")
                .map(|(v, origin)| {
                    absolute(v.trim()).map_err(|e| Resolver::err("bpf-object", &origin, e))
                })
                .transpose()?,
        })
    }

    /// The file name the plugin is installed under: the entry's `type`.
    pub fn plugin_type(&self) -> &str {
        self.template.plugin_type()
    }

    pub fn kubeconfig_path(&self) -> PathBuf {
        self.cni_conf_dir.join(&self.kubeconfig_name)
    }

    pub fn installed_binary(&self) -> PathBuf {
        self.cni_bin_dir.join(self.plugin_type())
    }
}

/// sidestep-cni beside this binary, else where the image has it. Not checked here: only the
/// agent installs it (and says which setting to fix when it is missing); uninstall needs none.
fn default_cni_binary() -> Result<PathBuf, String> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("sidestep-cni")));
    Ok(beside
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("/opt/cni/bin/sidestep-cni")))
}

#[cfg(test)]
mod tests;
