//! The plugin's whole input: the CNI_* environment and the network configuration on stdin, as
//! far as the pure decision goes (`plugin::run` minus the data path and the state directory).
//!
//! Input: optional environment lines `KEY=VALUE`, a line `---`, then stdin. Without the `---`
//! line everything is stdin and the environment is an ADD for pod shop/web-1.
//!
//! Checked: the config parses the same way for every command that the version allows, and is
//! refused for the others; what parses is well formed (absolute paths, a valid name, a policy
//! that validates, a prevResult that goes back out unchanged); errors map to the spec's codes;
//! the decision the config leads to satisfies the policy invariants.

#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sidestep_cni::{
    config::{ConfigError, PluginConfig, peek_version},
    mesh::{self, PreDecision},
    podsource::{self, PodReadError, Unavailable},
    spec::{
        self, CniVersion, Command, SUPPORTED_VERSIONS, code,
        env::{CniEnv, valid_ifname, valid_name},
        error::ToCniError,
        result::PrevResult,
    },
};
use sidestep_fuzz::{check_decision, check_enrolled_policy, without_version};

const COMMANDS: [Command; 6] = [
    Command::Add,
    Command::Del,
    Command::Check,
    Command::Status,
    Command::Gc,
    Command::Version,
];

const DEFAULT_ENV: &[(&str, &str)] = &[
    ("CNI_COMMAND", "ADD"),
    ("CNI_CONTAINERID", "abc123"),
    ("CNI_NETNS", "/run/netns/x"),
    ("CNI_IFNAME", "eth0"),
    (
        "CNI_ARGS",
        "IgnoreUnknown=1;K8S_POD_NAME=web-1;K8S_POD_NAMESPACE=shop",
    ),
];

fn split(data: &[u8]) -> (BTreeMap<String, String>, &[u8]) {
    let sep = b"\n---\n";
    let found = if data.starts_with(b"---\n") {
        Some((0, 4))
    } else {
        data.windows(sep.len())
            .position(|w| w == sep)
            .map(|i| (i, i + sep.len()))
    };
    let Some((end, start)) = found else {
        let env = DEFAULT_ENV
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        return (env, data);
    };
    let env = String::from_utf8_lossy(&data[..end])
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    (env, &data[start..])
}

fn check_error(e: &ConfigError, peek: Option<CniVersion>) {
    let cni = e.to_cni();
    assert!(
        [
            code::INCOMPATIBLE_VERSION,
            code::DECODING_FAILURE,
            code::INVALID_CONFIG
        ]
        .contains(&cni.code),
        "config error with code {}: {e}",
        cni.code
    );
    assert!(!cni.msg.is_empty());
    let wire = cni.to_json(peek);
    let v: CniVersion = wire["cniVersion"]
        .as_str()
        .expect("error result has a cniVersion")
        .parse()
        .expect("error result's cniVersion is supported");
    assert_eq!(v, peek.unwrap_or(CniVersion::LATEST));
    assert_eq!(wire["code"], cni.code);
}

fn check_prev_result(pr: &PrevResult, v: CniVersion, stdin: &Value) {
    let out = pr.output(v);
    assert_eq!(out["cniVersion"], v.as_str());
    // A chained plugin that changes nothing hands back its prevResult.
    assert_eq!(
        without_version(&out),
        without_version(&stdin["prevResult"]),
        "prevResult does not go back out unchanged"
    );
    let again = PrevResult::parse(&out, v).unwrap_or_else(|e| panic!("output re-parse: {e}"));
    assert_eq!(again.ips, pr.ips);
    assert_eq!(pr.ips.len(), out["ips"].as_array().map_or(0, Vec::len));
}

fn check_config(cfg: &PluginConfig, cmd: Command, peek: Option<CniVersion>, stdin: &[u8]) {
    assert_eq!(peek, Some(cfg.cni_version), "peek_version disagrees");
    assert!(cfg.cni_version.allows(cmd));
    assert!(valid_name(&cfg.name), "name {:?}", cfg.name);
    assert!(!cfg.plugin_type.is_empty());
    assert!(cfg.pin_root.is_absolute() && cfg.state_dir.is_absolute());
    assert!(cfg.log_file.as_ref().is_none_or(|p| p.is_absolute()));
    assert!(cfg.log_level.as_ref().is_none_or(|l| !l.is_empty()));
    assert!(cfg.agent_namespace.as_ref().is_none_or(|n| !n.is_empty()));
    assert!(
        cfg.kubernetes
            .kubeconfig
            .as_ref()
            .is_none_or(|p| !p.as_os_str().is_empty())
    );
    assert!(cfg.kubernetes.pod_read_retries >= 1);
    assert!(
        cfg.exclude_namespaces.windows(2).all(|w| w[0] < w[1]),
        "exclude_namespaces not sorted and deduplicated: {:?}",
        cfg.exclude_namespaces
    );
    if let Some(p) = &cfg.policy {
        check_enrolled_policy(p);
    }
    if cmd == Command::Gc {
        assert!(cfg.valid_attachments.is_some());
    }
    let value: Value = serde_json::from_slice(stdin).expect("parsed config is JSON");
    if let Some(pr) = &cfg.prev_result {
        check_prev_result(pr, cfg.cni_version, &value);
    } else if cmd != Command::Del {
        assert!(value.get("prevResult").is_none_or(Value::is_null));
    }
}

/// The same stdin under every command: one answer, refused only where the spec says so.
fn per_command(stdin: &[u8]) {
    let peek = peek_version(stdin);
    let results: Vec<_> = COMMANDS
        .iter()
        .map(|&cmd| {
            let r = PluginConfig::parse(stdin, cmd);
            match &r {
                Ok(cfg) => check_config(cfg, cmd, peek, stdin),
                Err(e) => check_error(e, peek),
            }
            r
        })
        .collect();
    let [add, del, check, status, gc, version] = &results[..] else {
        unreachable!()
    };
    let Ok(add) = add else {
        // DEL tolerates a bad prevResult, nothing else.
        assert!(check.is_err() && status.is_err() && gc.is_err() && version.is_err());
        return;
    };
    let same = |other: &Result<PluginConfig, ConfigError>, what: &str| match other {
        Ok(c) => assert_eq!(
            format!("{c:?}"),
            format!("{add:?}"),
            "{what} differs from ADD"
        ),
        Err(e) => panic!("ADD parses but {what} fails: {e}"),
    };
    same(del, "DEL");
    same(version, "VERSION");
    let v = add.cni_version;
    if v >= CniVersion::V0_4_0 {
        same(check, "CHECK");
    } else {
        assert!(matches!(
            check,
            Err(ConfigError::CommandNotInVersion { .. })
        ));
    }
    if v >= CniVersion::V1_1_0 {
        same(status, "STATUS");
        if add.valid_attachments.is_some() {
            same(gc, "GC");
        } else {
            assert!(gc.is_err());
        }
    } else {
        assert!(matches!(
            status,
            Err(ConfigError::CommandNotInVersion { .. })
        ));
        assert!(matches!(gc, Err(ConfigError::CommandNotInVersion { .. })));
    }
}

fn check_env(env: &CniEnv) {
    let need = match env.command {
        Command::Add | Command::Check => (true, true, true),
        Command::Del => (true, false, true),
        _ => (false, false, false),
    };
    if need.0 {
        assert!(valid_name(
            env.container_id.as_deref().expect("container id")
        ));
    }
    if need.1 {
        assert!(env.netns.is_some());
    }
    if need.2 {
        valid_ifname(env.ifname.as_deref().expect("ifname")).expect("valid ifname");
    }
    for (k, v) in &env.args.0 {
        assert_eq!(k.trim(), k);
        assert_eq!(v.trim(), v);
    }
}

/// The invocation as `plugin::run` takes it, up to the data path.
fn invocation(env_map: &BTreeMap<String, String>, stdin: &[u8]) {
    let env = match CniEnv::from_lookup(|k| env_map.get(k).cloned()) {
        Ok(e) => e,
        Err(e) => {
            assert_eq!(e.code, code::INVALID_ENV, "env error {e}");
            return;
        }
    };
    check_env(&env);
    if env.command == Command::Version {
        let requested = serde_json::from_slice::<Value>(stdin)
            .ok()
            .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned));
        let r = spec::version_response(requested.as_deref());
        let echoed: CniVersion = r["cniVersion"].as_str().unwrap().parse().unwrap();
        assert!(SUPPORTED_VERSIONS.contains(&echoed));
        return;
    }
    let Ok(cfg) = PluginConfig::parse(stdin, env.command) else {
        return;
    };
    match mesh::before_pod_read(&cfg, &env.args) {
        PreDecision::Skip(r) => {
            let _ = r.to_string();
        }
        PreDecision::ConfigPolicy(p) => {
            assert_eq!(cfg.policy.as_ref(), Some(&*p));
            assert!(
                env.args.get("K8S_POD_NAME").is_none()
                    || env.args.get("K8S_POD_NAMESPACE").is_none()
            );
        }
        PreDecision::ReadPod(id) => {
            assert_eq!(env.args.get("K8S_POD_NAME"), Some(id.name.as_str()));
            assert_eq!(
                env.args.get("K8S_POD_NAMESPACE"),
                Some(id.namespace.as_str())
            );
            assert!(!cfg.exclude_namespaces.contains(&id.namespace));
            // The API path would retry with sleeps; only the runtime's annotations are read here.
            if cfg.pod_annotations.is_none() && cfg.kubernetes.kubeconfig.is_some() {
                return;
            }
            match podsource::pod_info(&cfg, &id, &Unavailable("fuzzing".into())) {
                Ok(pod) => {
                    assert_eq!(
                        (pod.name.as_str(), pod.namespace.as_str()),
                        (id.name.as_str(), id.namespace.as_str())
                    );
                    let _ = check_decision(cfg.mesh, &pod);
                }
                Err(PodReadError::NoSource { .. }) => assert!(cfg.pod_annotations.is_none()),
                Err(e) => panic!("unexpected pod read error {e}"),
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (env, stdin) = split(data);
    per_command(stdin);
    invocation(&env, stdin);
});
