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
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::Value;

use super::template::{self, PluginTemplate};
use crate::{mounts, pins::DEFAULT_PIN_ROOT, policy::Policy};

/// Flags of `sidestep agent` and `sidestep uninstall`. Values are kept as text so that flags,
/// variables and ConfigMap keys go through one parser.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct AgentArgs {
    /// A mounted ConfigMap directory (one file per setting) or a JSON object file.
    #[arg(long, env = "SIDESTEP_CONFIG")]
    pub config: Option<PathBuf>,
    /// The host's CNI bin directory as mounted in the agent [default: /opt/cni/bin].
    #[arg(long, env = "SIDESTEP_CNI_BIN_DIR")]
    pub cni_bin_dir: Option<String>,
    /// The host's CNI conf directory as mounted in the agent [default: /etc/cni/net.d].
    #[arg(long, env = "SIDESTEP_CNI_CONF_DIR")]
    pub cni_conf_dir: Option<String>,
    /// The conf directory as the host (the plugin) sees it [default: --cni-conf-dir].
    #[arg(long, env = "SIDESTEP_HOST_CNI_CONF_DIR")]
    pub host_cni_conf_dir: Option<String>,
    /// The conf file to chain into [default: the highest-priority file]; in standalone mode, the
    /// file to write [default: 99-sidestep.conflist].
    #[arg(long, env = "SIDESTEP_CNI_CONF_NAME")]
    pub cni_conf_name: Option<String>,
    /// `chained` (insert into the primary CNI's conflist) or `standalone` [default: chained].
    #[arg(long, env = "SIDESTEP_CNI_MODE")]
    pub cni_mode: Option<String>,
    /// A file holding the plugin entry, with placeholders such as __PIN_ROOT__.
    #[arg(long, env = "SIDESTEP_PLUGIN_TEMPLATE")]
    pub plugin_template: Option<String>,
    /// The plugin entry as inline JSON, with placeholders.
    #[arg(long, env = "SIDESTEP_PLUGIN_JSON")]
    pub plugin_json: Option<String>,
    /// The plugin binary to install [default: sidestep-cni next to this binary, else
    /// /opt/cni/bin/sidestep-cni].
    #[arg(long, env = "SIDESTEP_CNI_BINARY")]
    pub cni_binary: Option<String>,
    /// The plugin's log level (__LOG_LEVEL__) [default: info].
    #[arg(long, env = "SIDESTEP_CNI_LOG_LEVEL")]
    pub cni_log_level: Option<String>,
    /// The kubeconfig file written for the plugin, in the conf dir [default:
    /// ZZZ-sidestep-kubeconfig].
    #[arg(long, env = "SIDESTEP_KUBECONFIG_NAME")]
    pub kubeconfig_name: Option<String>,
    /// Its mode, octal [default: 0600].
    #[arg(long, env = "SIDESTEP_KUBECONFIG_MODE")]
    pub kubeconfig_mode: Option<String>,
    /// Where the pod's service account is mounted.
    #[arg(long, env = "SIDESTEP_SERVICE_ACCOUNT_DIR")]
    pub service_account_dir: Option<String>,
    #[arg(long, env = "SIDESTEP_PIN_ROOT")]
    pub pin_root: Option<String>,
    /// The cgroup2 directory to attach at [default: the cgroup2 root, from mountinfo].
    #[arg(long, env = "SIDESTEP_CGROUP")]
    pub cgroup: Option<String>,
    /// The plugin's state directory [default: /var/run/sidestep/cni].
    #[arg(long, env = "SIDESTEP_STATE_DIR")]
    pub state_dir: Option<String>,
    /// Address for /healthz, /readyz and /metrics [default: 0.0.0.0:9964].
    #[arg(long, env = "SIDESTEP_LISTEN")]
    pub listen: Option<String>,
    /// How often to reconcile pods, e.g. 30s or 2m [default: 30s].
    #[arg(long, env = "SIDESTEP_RECONCILE_INTERVAL")]
    pub reconcile_interval: Option<String>,
    /// Enrol running pods that were never enrolled, in place [default: false].
    #[arg(long, env = "SIDESTEP_REPAIR", num_args = 0..=1, default_missing_value = "true")]
    pub repair: Option<String>,
    /// The policy (JSON, camelCase) repair enrols with [default: Istio's].
    #[arg(long, env = "SIDESTEP_REPAIR_POLICY")]
    pub repair_policy: Option<String>,
    /// Comma-separated directories of pod network namespaces [default: /run/netns].
    #[arg(long, env = "SIDESTEP_NETNS_DIRS")]
    pub netns_dirs: Option<String>,
    /// Only netns whose name starts with this count as pods [default: all].
    #[arg(long, env = "SIDESTEP_NETNS_PREFIX")]
    pub netns_prefix: Option<String>,
    /// Also find pods through /proc/*/ns/net [default: true].
    #[arg(long, env = "SIDESTEP_SCAN_PROC", num_args = 0..=1, default_missing_value = "true")]
    pub scan_proc: Option<String>,
    /// The host's /proc as mounted in the agent [default: /proc].
    #[arg(long, env = "SIDESTEP_PROC_DIR")]
    pub proc_dir: Option<String>,
    /// `text` or `json` [default: text].
    #[arg(long, env = "SIDESTEP_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Capacity of the pod map when the maps are first created.
    #[arg(long, env = "SIDESTEP_POD_CAPACITY")]
    pub pod_capacity: Option<String>,
    /// The node's name (__NODE_NAME__), from the downward API.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// The agent's namespace (__POD_NAMESPACE__), from the downward API.
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// `sidestep uninstall --if-requested` proceeds only when this is true [default: false].
    #[arg(long, env = "SIDESTEP_UNINSTALL_REQUESTED", num_args = 0..=1, default_missing_value = "true")]
    pub uninstall_requested: Option<String>,
    /// Load this BPF object instead of the embedded one (upgrade tests).
    #[arg(long, env = "SIDESTEP_BPF_OBJECT_FILE", hide = true)]
    pub bpf_object: Option<String>,
}

/// Every key a ConfigMap may hold, with its flag's value.
fn cli_value<'a>(a: &'a AgentArgs, key: &str) -> Option<&'a String> {
    match key {
        "cni-bin-dir" => a.cni_bin_dir.as_ref(),
        "cni-conf-dir" => a.cni_conf_dir.as_ref(),
        "host-cni-conf-dir" => a.host_cni_conf_dir.as_ref(),
        "cni-conf-name" => a.cni_conf_name.as_ref(),
        "cni-mode" => a.cni_mode.as_ref(),
        "plugin-template" => a.plugin_template.as_ref(),
        "plugin-json" => a.plugin_json.as_ref(),
        "cni-binary" => a.cni_binary.as_ref(),
        "cni-log-level" => a.cni_log_level.as_ref(),
        "kubeconfig-name" => a.kubeconfig_name.as_ref(),
        "kubeconfig-mode" => a.kubeconfig_mode.as_ref(),
        "service-account-dir" => a.service_account_dir.as_ref(),
        "pin-root" => a.pin_root.as_ref(),
        "cgroup" => a.cgroup.as_ref(),
        "state-dir" => a.state_dir.as_ref(),
        "listen" => a.listen.as_ref(),
        "reconcile-interval" => a.reconcile_interval.as_ref(),
        "repair" => a.repair.as_ref(),
        "repair-policy" => a.repair_policy.as_ref(),
        "netns-dirs" => a.netns_dirs.as_ref(),
        "netns-prefix" => a.netns_prefix.as_ref(),
        "scan-proc" => a.scan_proc.as_ref(),
        "proc-dir" => a.proc_dir.as_ref(),
        "log-format" => a.log_format.as_ref(),
        "pod-capacity" => a.pod_capacity.as_ref(),
        "node-name" => a.node_name.as_ref(),
        "pod-namespace" => a.pod_namespace.as_ref(),
        "uninstall-requested" => a.uninstall_requested.as_ref(),
        "bpf-object" => a.bpf_object.as_ref(),
        _ => None,
    }
}

/// ConfigMap keys that are not flags of the agent but are read from the ConfigMap too.
const CONFIG_ONLY_KEYS: [&str; 1] = ["log-level"];

const KEYS: [&str; 29] = [
    "cni-bin-dir",
    "cni-conf-dir",
    "host-cni-conf-dir",
    "cni-conf-name",
    "cni-mode",
    "plugin-template",
    "plugin-json",
    "cni-binary",
    "cni-log-level",
    "kubeconfig-name",
    "kubeconfig-mode",
    "service-account-dir",
    "pin-root",
    "cgroup",
    "state-dir",
    "listen",
    "reconcile-interval",
    "repair",
    "repair-policy",
    "netns-dirs",
    "netns-prefix",
    "scan-proc",
    "proc-dir",
    "log-format",
    "pod-capacity",
    "node-name",
    "pod-namespace",
    "uninstall-requested",
    "bpf-object",
];

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
    pub pin_root: PathBuf,
    pub cgroup: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub listen: SocketAddr,
    pub reconcile_interval: Duration,
    pub repair: bool,
    pub repair_policy: Policy,
    pub netns_dirs: Vec<PathBuf>,
    pub netns_prefix: String,
    pub scan_proc: bool,
    pub proc_dir: PathBuf,
    pub log_level: String,
    pub log_format: LogFormat,
    pub pod_capacity: Option<u32>,
    pub node_name: String,
    pub pod_namespace: String,
    pub uninstall_requested: bool,
    pub bpf_object: Option<PathBuf>,
}

pub const DEFAULT_STANDALONE_NAME: &str = "99-sidestep.conflist";

/// Where each value came from, for error messages.
struct Resolver<'a> {
    args: &'a AgentArgs,
    config: BTreeMap<String, String>,
    config_path: Option<PathBuf>,
}

fn env_name(key: &str) -> String {
    match key {
        "node-name" => "NODE_NAME".into(),
        "pod-namespace" => "POD_NAMESPACE".into(),
        "bpf-object" => "SIDESTEP_BPF_OBJECT_FILE".into(),
        _ => format!("SIDESTEP_{}", key.replace('-', "_").to_ascii_uppercase()),
    }
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
        CniMode::Chained => [".conf", ".conflist", ".json"].iter().any(|e| v.ends_with(e)),
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
        for entry in fs::read_dir(path).map_err(|e| err(e.to_string()))?.flatten() {
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
                conf_name(v.trim(), mode).map_err(|e| Resolver::err("cni-conf-name", &origin, e))?,
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
            listen: r.parse(
                "listen",
                || Ok(SocketAddr::from(([0, 0, 0, 0], 9964))),
                |v| {
                    v.parse()
                        .map_err(|_| format!("{v:?} is not an address:port"))
                },
            )?,
            reconcile_interval: r.parse(
                "reconcile-interval",
                || Ok(Duration::from_secs(30)),
                parse_duration,
            )?,
            repair: r.boolean("repair", false)?,
            repair_policy,
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
            node_name: r.string("node-name", ""),
            pod_namespace: r.string("pod-namespace", ""),
            uninstall_requested: r.boolean("uninstall-requested", false)?,
            bpf_object: r
                .get("bpf-object")
                .map(|(v, origin)| absolute(v.trim()).map_err(|e| Resolver::err("bpf-object", &origin, e)))
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

fn default_cni_binary() -> Result<PathBuf, String> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("sidestep-cni")));
    beside
        .into_iter()
        .chain([PathBuf::from("/opt/cni/bin/sidestep-cni")])
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "no sidestep-cni binary beside this one nor at /opt/cni/bin/sidestep-cni; name it".into()
        })
}

#[cfg(test)]
mod tests;
