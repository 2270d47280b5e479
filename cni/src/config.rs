//! The plugin's network configuration (stdin). It accepts sidestep's own fields and both shapes of
//! Istio's config (flat at HEAD, `kubernetes{...}` in 1.20 and before), so an operator can swap
//! `istio-cni` for `sidestep` in a conflist without rewriting the entry. Unknown fields are
//! tolerated, as Go's json.Unmarshal tolerates them in istio-cni.

use std::{
    collections::BTreeMap,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use serde_json::Value;
use sidestep::policy::{InboundHook, Policy};

use crate::spec::{
    CniError, CniVersion, Command, code, env::valid_name, error::ToCniError, result::PrevResult,
    result::ResultError,
};

pub const DEFAULT_PIN_ROOT: &str = sidestep::pins::DEFAULT_PIN_ROOT;
pub const DEFAULT_STATE_DIR: &str = "/var/run/sidestep/cni";
/// An ADD runs before any container of the pod starts, so the proxy opens its listener under the
/// loaded sockops program, which is all the sk_lookup hook needs; it makes no TCX link (an RCU
/// grace period per attach and per detach) and runs no program per received packet. Enrolments
/// of running pods (the agent's repair) ask for `tc`, which also finds existing listeners.
pub const DEFAULT_INBOUND_HOOK: InboundHook = InboundHook::SkLookup;
/// The capability name containerd and CRI-O fill in when the plugin declares it.
pub const POD_ANNOTATIONS_CAPABILITY: &str = "io.kubernetes.cri.pod-annotations";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mesh {
    #[default]
    Istio,
    Linkerd,
    Kuma,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum FailStrategy {
    /// A pod that should be captured and cannot be does not start.
    #[default]
    #[serde(rename = "FAIL_CLOSE")]
    Close,
    /// It starts uncaptured, with a warning and a marker the agent counts.
    #[serde(rename = "FAIL_OPEN")]
    Open,
}

/// Where ADD reads the pod from (`pod_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PodSourceChoice {
    /// The runtime's annotations when it passed them, else the Pod from the API (the behaviour
    /// of versions before 0.2, which never read the proxy container's spec when annotations came).
    #[serde(rename = "prefer-annotations")]
    PreferAnnotations,
    /// The default: the Pod from the API when a kubeconfig is configured, as istio-cni reads it:
    /// the proxy container's securityContext, env and args decide too. The runtime's annotations
    /// are the fallback when the API does not answer within the retry budget, and the only
    /// source without a kubeconfig.
    #[default]
    Auto,
    /// The API only: no answer within the budget is an error (fail_strategy decides).
    Api,
    /// The runtime's annotations only (`io.kubernetes.cri.pod-annotations`): no API call, for
    /// clusters that want none. The container spec is not seen: the proxy UID/GID are the
    /// mesh's defaults and the injector's status annotation stands in for the container list.
    Annotations,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesConfig {
    pub kubeconfig: Option<PathBuf>,
    pub pod_read_retries: u32,
    pub pod_read_interval: Duration,
    pub request_timeout: Duration,
}

impl Default for KubernetesConfig {
    /// Istio's: 30 tries, 1 s apart.
    fn default() -> Self {
        Self {
            kubeconfig: None,
            pod_read_retries: 30,
            pod_read_interval: Duration::from_secs(1),
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// One entry of `cni.dev/valid-attachments` (GC).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub cni_version: CniVersion,
    pub name: String,
    pub plugin_type: String,
    pub pin_root: PathBuf,
    pub state_dir: PathBuf,
    pub mesh: Mesh,
    pub exclude_namespaces: Vec<String>,
    /// Where the node agent runs; its own pods are never captured (Istio's `pod_namespace`).
    pub agent_namespace: Option<String>,
    pub log_level: Option<String>,
    pub log_file: Option<PathBuf>,
    pub kubernetes: KubernetesConfig,
    pub pod_source: PodSourceChoice,
    pub policy: Option<Policy>,
    pub fail_strategy: FailStrategy,
    /// Where inbound capture hooks in, for every pod this network enrols (`inbound_hook`).
    pub inbound_hook: InboundHook,
    /// ADD decides and reports, and changes nothing (`decide_only`): the agent's repair modes
    /// that do not enrol (`delete`, `label`) ask the plugin's rules this way.
    pub decide_only: bool,
    /// The agent's repair names the netns it found (`expect_netns_cookie`): ADD refuses the netns
    /// at CNI_NETNS if it is another, as a `/proc/PID/ns/net` path is once its process exited
    /// and another process (in a netns and user namespace of its own) took the PID.
    pub expect_netns_cookie: Option<u64>,
    /// Istio ambient mode (`ambient_enabled`, istio-cni's key): a pod the ambient selectors pick
    /// is enrolled with istio-cni's in-pod rules for ztunnel instead of the sidecar rules, and
    /// the namespace is read from the API beside the pod for its labels.
    pub ambient_enabled: bool,
    /// From runtimeConfig; `None` when the runtime did not pass them.
    pub pod_annotations: Option<BTreeMap<String, String>>,
    pub prev_result: Option<PrevResult>,
    pub valid_attachments: Option<Vec<Attachment>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot decode the network configuration: {0}")]
    Syntax(serde_json::Error),
    #[error("the network configuration must be a JSON object")]
    NotObject,
    #[error("the network configuration has no cniVersion")]
    MissingVersion,
    #[error("{0}")]
    Version(CniError),
    #[error("CNI {version} has no {command} command")]
    CommandNotInVersion {
        command: Command,
        version: CniVersion,
    },
    #[error("invalid network configuration: {field}: {reason}")]
    Field { field: String, reason: String },
    #[error(transparent)]
    PrevResult(#[from] ResultError),
}

impl ToCniError for ConfigError {
    fn to_cni(&self) -> CniError {
        match self {
            Self::Syntax(_) | Self::NotObject => {
                CniError::new(code::DECODING_FAILURE, self.to_string())
            }
            Self::MissingVersion | Self::CommandNotInVersion { .. } => {
                CniError::new(code::INCOMPATIBLE_VERSION, self.to_string()).details(format!(
                    "sidestep-cni supports {}",
                    CniVersion::supported_list()
                ))
            }
            Self::Version(e) => e.clone(),
            Self::Field { .. } => CniError::new(code::INVALID_CONFIG, self.to_string()),
            Self::PrevResult(e) => e.to_cni(),
        }
    }
}

/// `plugin_log_level`, else `log_level`: a level name, or tracing's directives. A bare word that
/// is neither would make tracing log only a target of that name, silencing the plugin.
fn log_level(
    plugin_log_level: Option<String>,
    log_level: Option<String>,
) -> Result<Option<String>, ConfigError> {
    let (name, level) = match (plugin_log_level, log_level) {
        (Some(l), _) => ("plugin_log_level", l),
        (None, Some(l)) => ("log_level", l),
        (None, None) => return Ok(None),
    };
    if level.is_empty() {
        return Ok(None);
    }
    if crate::logging::valid_level(&level) {
        Ok(Some(level))
    } else {
        Err(field(
            name,
            format!(
                "{level:?} is not a level (none, error, warn, info, debug, trace, or tracing \
                 directives such as sidestep_cni=debug)"
            ),
        ))
    }
}

fn field(field: &str, reason: impl ToString) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        reason: reason.to_string(),
    }
}

#[derive(Deserialize, Default)]
struct RawKubernetes {
    kubeconfig: Option<PathBuf>,
    exclude_namespaces: Option<Vec<String>>,
    pod_read_retries: Option<u32>,
    pod_read_interval_ms: Option<u64>,
    request_timeout_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
struct RawRuntimeConfig {
    #[serde(rename = "io.kubernetes.cri.pod-annotations")]
    pod_annotations: Option<BTreeMap<String, String>>,
}

/// The fields sidestep reads; everything else in the object is tolerated.
struct Raw {
    name: Option<String>,
    plugin_type: Option<String>,
    pin_root: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    mesh: Option<Mesh>,
    exclude_namespaces: Option<Vec<String>>,
    log_level: Option<String>,
    plugin_log_level: Option<String>,
    log_file: Option<PathBuf>,
    kubernetes: Option<RawKubernetes>,
    pod_source: Option<PodSourceChoice>,
    policy: Option<Value>,
    fail_strategy: Option<FailStrategy>,
    inbound_hook: Option<InboundHook>,
    decide_only: Option<bool>,
    expect_netns_cookie: Option<u64>,
    ambient_enabled: Option<bool>,
    pod_namespace: Option<String>,
    runtime_config: Option<RawRuntimeConfig>,
    prev_result: Option<Value>,
    valid_attachments: Option<Vec<Attachment>>,
}

/// Each top-level key decoded on its own, so the error names the field at fault.
fn take<T: for<'de> Deserialize<'de>>(
    obj: &serde_json::Map<String, Value>,
    key: &str,
) -> Result<Option<T>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v).map(Some).map_err(|e| field(key, e)),
    }
}

/// A path the kernel can take: a NUL byte ends it early at every system call, so an ADD with
/// one would be told "not loaded, try again later" forever instead of "invalid config".
fn no_nul(name: &str, p: &Path) -> Result<(), ConfigError> {
    if p.as_os_str().as_bytes().contains(&0) {
        return Err(field(name, format!("{p:?} contains a NUL byte")));
    }
    Ok(())
}

fn absolute(name: &str, p: Option<PathBuf>, default: &str) -> Result<PathBuf, ConfigError> {
    let p = p.unwrap_or_else(|| PathBuf::from(default));
    no_nul(name, &p)?;
    if !p.is_absolute() {
        return Err(field(
            name,
            format!("{} is not an absolute path", p.display()),
        ));
    }
    Ok(p)
}

/// Keys of the plugin's own config object: sidestep's, the CNI spec's, and istio-cni's (an entry
/// swapped from `istio-cni` keeps them). Anything else is named in a warning.
const KNOWN_FIELDS: &[&str] = &[
    // sidestep's (see `Raw`)
    "name",
    "type",
    "pin_root",
    "state_dir",
    "mesh",
    "exclude_namespaces",
    "log_level",
    "plugin_log_level",
    "log_file",
    "kubernetes",
    "pod_source",
    "policy",
    "fail_strategy",
    "inbound_hook",
    "decide_only",
    "expect_netns_cookie",
    "ambient_enabled",
    "pod_namespace",
    "runtimeConfig",
    "prevResult",
    "cni.dev/valid-attachments",
    // the CNI spec's
    "cniVersion",
    "cniVersions",
    "capabilities",
    "args",
    "ipam",
    "dns",
    "disableCheck",
    "disableGC",
    // istio-cni's, accepted and not used
    "cni_agent_run_dir",
    "enablement_selectors",
    "native_nftables",
    "log_uds_address",
    "cni_event_address",
];

fn unknown_fields(obj: &serde_json::Map<String, Value>) -> Vec<String> {
    obj.keys()
        .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()))
        .cloned()
        .collect()
}

/// The config's version, when it has a usable one: errors are reported in it.
pub fn peek_version(stdin: &[u8]) -> Option<CniVersion> {
    let v: Value = serde_json::from_slice(stdin).ok()?;
    v.get("cniVersion")?.as_str()?.parse().ok()
}

impl PluginConfig {
    pub fn parse(stdin: &[u8], command: Command) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_slice(stdin).map_err(ConfigError::Syntax)?;
        let obj = value.as_object().ok_or(ConfigError::NotObject)?;
        let cni_version: CniVersion = match obj.get("cniVersion") {
            None | Some(Value::Null) => return Err(ConfigError::MissingVersion),
            Some(Value::String(s)) => s.parse().map_err(ConfigError::Version)?,
            Some(_) => return Err(field("cniVersion", "must be a string")),
        };
        if !cni_version.allows(command) {
            return Err(ConfigError::CommandNotInVersion {
                command,
                version: cni_version,
            });
        }
        let raw = Raw {
            name: take(obj, "name")?,
            plugin_type: take(obj, "type")?,
            pin_root: take(obj, "pin_root")?,
            state_dir: take(obj, "state_dir")?,
            mesh: take(obj, "mesh")?,
            exclude_namespaces: take(obj, "exclude_namespaces")?,
            log_level: take(obj, "log_level")?,
            plugin_log_level: take(obj, "plugin_log_level")?,
            log_file: take(obj, "log_file")?,
            kubernetes: take(obj, "kubernetes")?,
            pod_source: take(obj, "pod_source")?,
            policy: take(obj, "policy")?,
            fail_strategy: take(obj, "fail_strategy")?,
            inbound_hook: take(obj, "inbound_hook")?,
            decide_only: take(obj, "decide_only")?,
            expect_netns_cookie: take(obj, "expect_netns_cookie")?,
            ambient_enabled: take(obj, "ambient_enabled")?,
            pod_namespace: take(obj, "pod_namespace")?,
            runtime_config: take(obj, "runtimeConfig")?,
            prev_result: obj.get("prevResult").filter(|v| !v.is_null()).cloned(),
            valid_attachments: take(obj, "cni.dev/valid-attachments")?,
        };
        let unknown = unknown_fields(obj);
        if !unknown.is_empty() {
            // Tolerated, as istio-cni tolerates them, but named: a misspelled field would
            // otherwise keep its default without a word.
            tracing::warn!(
                "unknown config fields ignored (misspelled?): {}",
                unknown.join(", ")
            );
        }
        Self::from_raw(raw, cni_version, command)
    }

    fn from_raw(raw: Raw, cni_version: CniVersion, command: Command) -> Result<Self, ConfigError> {
        let name = raw
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| field("name", "is required"))?;
        if !valid_name(&name) {
            return Err(field("name", format!("{name:?} has invalid characters")));
        }
        let plugin_type = raw
            .plugin_type
            .filter(|t| !t.is_empty())
            .ok_or_else(|| field("type", "is required"))?;
        let kube = raw.kubernetes.unwrap_or_default();
        let mut exclude_namespaces = raw.exclude_namespaces.unwrap_or_default();
        exclude_namespaces.extend(kube.exclude_namespaces.unwrap_or_default());
        exclude_namespaces.sort();
        exclude_namespaces.dedup();
        let defaults = KubernetesConfig::default();
        let kubernetes = KubernetesConfig {
            kubeconfig: kube.kubeconfig.filter(|p| !p.as_os_str().is_empty()),
            pod_read_retries: kube.pod_read_retries.unwrap_or(defaults.pod_read_retries),
            pod_read_interval: kube
                .pod_read_interval_ms
                .map_or(defaults.pod_read_interval, Duration::from_millis),
            request_timeout: kube
                .request_timeout_ms
                .map_or(defaults.request_timeout, Duration::from_millis),
        };
        if let Some(kc) = &kubernetes.kubeconfig {
            no_nul("kubernetes.kubeconfig", kc)?;
        }
        if kubernetes.pod_read_retries == 0 {
            return Err(field("kubernetes.pod_read_retries", "must be at least 1"));
        }
        let pod_source = raw.pod_source.unwrap_or_default();
        if pod_source == PodSourceChoice::Api && kubernetes.kubeconfig.is_none() {
            return Err(field(
                "pod_source",
                "\"api\" needs kubernetes.kubeconfig (the agent writes one)",
            ));
        }
        let policy = raw
            .policy
            .map(|v| {
                let p: Policy = serde_json::from_value(v).map_err(|e| field("policy", e))?;
                p.validate().map_err(|e| field("policy", e))?;
                Ok::<_, ConfigError>(p)
            })
            .transpose()?;
        if raw.ambient_enabled == Some(true) && raw.mesh.is_some_and(|m| m != Mesh::Istio) {
            return Err(field(
                "ambient_enabled",
                "ambient mode is Istio's; set mesh to \"istio\" or remove ambient_enabled",
            ));
        }
        // The runtime's annotations carry no labels: the ambient selectors cannot be read there.
        if raw.ambient_enabled == Some(true)
            && matches!(
                pod_source,
                PodSourceChoice::Annotations | PodSourceChoice::PreferAnnotations
            )
        {
            return Err(field(
                "pod_source",
                "ambient_enabled needs the Pod and its namespace from the API (their \
                 istio.io/dataplane-mode labels); use \"auto\" or \"api\"",
            ));
        }
        let prev_result = match raw.prev_result {
            // DEL is best effort: a prevResult it cannot read must not keep a pod from going away.
            Some(v) if command == Command::Del => PrevResult::parse(&v, cni_version)
                .map_err(|e| tracing::warn!("DEL ignores the prevResult: {e}"))
                .ok(),
            Some(v) => Some(PrevResult::parse(&v, cni_version)?),
            None => None,
        };
        if command == Command::Gc && raw.valid_attachments.is_none() {
            return Err(field(
                "cni.dev/valid-attachments",
                "is required for GC (an empty list removes every attachment)",
            ));
        }
        Ok(Self {
            cni_version,
            name,
            plugin_type,
            pin_root: absolute("pin_root", raw.pin_root, DEFAULT_PIN_ROOT)?,
            state_dir: absolute("state_dir", raw.state_dir, DEFAULT_STATE_DIR)?,
            mesh: raw.mesh.unwrap_or_default(),
            exclude_namespaces,
            agent_namespace: raw.pod_namespace.filter(|n| !n.is_empty()),
            log_level: log_level(raw.plugin_log_level, raw.log_level)?,
            log_file: raw
                .log_file
                .map(|p| absolute("log_file", Some(p), ""))
                .transpose()?,
            kubernetes,
            pod_source,
            policy,
            fail_strategy: raw.fail_strategy.unwrap_or_default(),
            inbound_hook: raw.inbound_hook.unwrap_or(DEFAULT_INBOUND_HOOK),
            decide_only: raw.decide_only.unwrap_or(false),
            expect_netns_cookie: raw.expect_netns_cookie,
            ambient_enabled: raw.ambient_enabled.unwrap_or(false),
            pod_annotations: raw.runtime_config.and_then(|r| r.pod_annotations),
            prev_result,
            valid_attachments: raw.valid_attachments,
        })
    }

    pub fn pin_root(&self) -> &Path {
        &self.pin_root
    }
}

#[cfg(test)]
mod tests;
