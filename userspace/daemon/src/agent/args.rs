//! The agent's flags. Each is also a ConfigMap key (its name without `--`) and an environment
//! variable (`SIDESTEP_` and the name in upper case); values stay text here so that the three
//! sources go through one parser in [`super::settings`].

use std::path::PathBuf;

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
    /// Where the agent's own service account is mounted: its API requests carry that token
    /// [default: /var/run/secrets/kubernetes.io/serviceaccount].
    #[arg(long, env = "SIDESTEP_SERVICE_ACCOUNT_DIR")]
    pub service_account_dir: Option<String>,
    /// Where the plugin's service account token is mounted (`token` and `ca.crt`, a
    /// service-account-token Secret of sidestep-cni): the plugin's kubeconfig carries it, never
    /// the agent's own token [default: /var/run/secrets/sidestep-cni].
    #[arg(long, env = "SIDESTEP_CNI_SERVICE_ACCOUNT_DIR")]
    pub cni_service_account_dir: Option<String>,
    /// Where the programs and maps are pinned, on the host's bpffs [default: /sys/fs/bpf/sidestep].
    #[arg(long, env = "SIDESTEP_PIN_ROOT")]
    pub pin_root: Option<String>,
    /// The cgroup2 directory to attach at [default: the node's cgroup2 root, from mountinfo;
    /// refused in a private cgroup namespace, where that mount is the agent's own cgroup].
    #[arg(long, env = "SIDESTEP_CGROUP")]
    pub cgroup: Option<String>,
    /// The plugin's state directory [default: /var/run/sidestep/cni].
    #[arg(long, env = "SIDESTEP_STATE_DIR")]
    pub state_dir: Option<String>,
    /// Where /healthz, /readyz and /metrics listen: `:PORT` for every address of both families,
    /// or one address, `127.0.0.1:9964` or `[::1]:9964` [default: :9964].
    #[arg(long, env = "SIDESTEP_LISTEN")]
    pub listen: Option<String>,
    /// How old the pod map's figures in /metrics may be: it is walked at most once per this,
    /// however many scrapes come [default: 5s].
    #[arg(long, env = "SIDESTEP_METRICS_MAX_AGE")]
    pub metrics_max_age: Option<String>,
    /// Export the per-pod series of /metrics (labels namespace, pod, netns_cookie); false keeps
    /// only the node's figures, for a Prometheus that cannot afford a series set per pod
    /// [default: true].
    #[arg(long, env = "SIDESTEP_METRICS_PER_POD", num_args = 0..=1, default_missing_value = "true")]
    pub metrics_per_pod: Option<String>,
    /// How often to reconcile pods, e.g. 30s or 2m [default: 30s].
    #[arg(long, env = "SIDESTEP_RECONCILE_INTERVAL")]
    pub reconcile_interval: Option<String>,
    /// Repair running pods that were never enrolled [default: true with node-name (in a
    /// cluster), else false].
    #[arg(long, env = "SIDESTEP_REPAIR", num_args = 0..=1, default_missing_value = "true")]
    pub repair: Option<String>,
    /// What repair does with a pod that should be captured and is not: `repair` (enrol it in
    /// place), `delete` (delete it, so it is recreated through the CNI chain) or `label` (label
    /// it sidestep.io/uninitialized=true) [default: repair].
    #[arg(long, env = "SIDESTEP_REPAIR_MODE")]
    pub repair_mode: Option<String>,
    /// The policy (JSON, camelCase) repair enrols with [default: Istio's].
    #[arg(long, env = "SIDESTEP_REPAIR_POLICY")]
    pub repair_policy: Option<String>,
    /// The kubeconfig repair reads the node's pods with [default: the one written for the
    /// plugin, when in a cluster]; the repair's ADD reads the pod with it too.
    #[arg(long, env = "SIDESTEP_API_KUBECONFIG")]
    pub api_kubeconfig: Option<String>,
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
    /// The most addresses the agent registers, for all pods of the node together, that pods
    /// gained after their enrolment (an address past it is captured as outbound: fail closed)
    /// [default: 4096, a quarter of the node's address map].
    #[arg(long, env = "SIDESTEP_LATE_ADDRESS_BUDGET")]
    pub late_address_budget: Option<String>,
    /// Remove this taint from the agent's node once /readyz is true (`true`: the default key,
    /// sidestep.io/agent-not-ready), as Istio's untaint controller does for
    /// cni.istio.io/not-ready [default: off].
    #[arg(long, env = "SIDESTEP_READINESS_TAINT")]
    pub readiness_taint: Option<String>,
    /// Istio ambient mode: the plugin enrols pods the ambient selectors pick with istio-cni's
    /// in-pod rules, and the agent serves ZDS to ztunnel, handing it each such pod's netns
    /// [default: false].
    #[arg(long, env = "SIDESTEP_AMBIENT", num_args = 0..=1, default_missing_value = "true")]
    pub ambient: Option<String>,
    /// Where the agent serves ZDS for ztunnel (ztunnel's INPOD_UDS)
    /// [default: /var/run/ztunnel/ztunnel.sock].
    #[arg(long, env = "SIDESTEP_ZTUNNEL_SOCKET")]
    pub ztunnel_socket: Option<String>,
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
pub(super) fn cli_value<'a>(a: &'a AgentArgs, key: &str) -> Option<&'a String> {
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
        "cni-service-account-dir" => a.cni_service_account_dir.as_ref(),
        "pin-root" => a.pin_root.as_ref(),
        "cgroup" => a.cgroup.as_ref(),
        "state-dir" => a.state_dir.as_ref(),
        "listen" => a.listen.as_ref(),
        "metrics-max-age" => a.metrics_max_age.as_ref(),
        "metrics-per-pod" => a.metrics_per_pod.as_ref(),
        "reconcile-interval" => a.reconcile_interval.as_ref(),
        "repair" => a.repair.as_ref(),
        "repair-mode" => a.repair_mode.as_ref(),
        "repair-policy" => a.repair_policy.as_ref(),
        "api-kubeconfig" => a.api_kubeconfig.as_ref(),
        "netns-dirs" => a.netns_dirs.as_ref(),
        "netns-prefix" => a.netns_prefix.as_ref(),
        "scan-proc" => a.scan_proc.as_ref(),
        "proc-dir" => a.proc_dir.as_ref(),
        "log-format" => a.log_format.as_ref(),
        "pod-capacity" => a.pod_capacity.as_ref(),
        "late-address-budget" => a.late_address_budget.as_ref(),
        "node-name" => a.node_name.as_ref(),
        "readiness-taint" => a.readiness_taint.as_ref(),
        "ambient" => a.ambient.as_ref(),
        "ztunnel-socket" => a.ztunnel_socket.as_ref(),
        "pod-namespace" => a.pod_namespace.as_ref(),
        "uninstall-requested" => a.uninstall_requested.as_ref(),
        "bpf-object" => a.bpf_object.as_ref(),
        _ => None,
    }
}

/// ConfigMap keys that are not flags of the agent but are read from the ConfigMap too.
pub(super) const CONFIG_ONLY_KEYS: [&str; 1] = ["log-level"];

pub(super) const KEYS: [&str; 38] = [
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
    "cni-service-account-dir",
    "pin-root",
    "cgroup",
    "state-dir",
    "listen",
    "metrics-max-age",
    "metrics-per-pod",
    "reconcile-interval",
    "repair",
    "repair-mode",
    "repair-policy",
    "api-kubeconfig",
    "netns-dirs",
    "netns-prefix",
    "scan-proc",
    "proc-dir",
    "log-format",
    "pod-capacity",
    "late-address-budget",
    "node-name",
    "readiness-taint",
    "ambient",
    "ztunnel-socket",
    "pod-namespace",
    "uninstall-requested",
    "bpf-object",
];

pub(super) fn env_name(key: &str) -> String {
    match key {
        "node-name" => "NODE_NAME".into(),
        "pod-namespace" => "POD_NAMESPACE".into(),
        "bpf-object" => "SIDESTEP_BPF_OBJECT_FILE".into(),
        _ => format!("SIDESTEP_{}", key.replace('-', "_").to_ascii_uppercase()),
    }
}
