//! One invocation, from environment and stdin to what goes on stdout and the exit code. The
//! binary's main only gathers its inputs and prints the outcome, so all of this runs in tests.

use serde_json::Value;

use crate::{
    config::{PluginConfig, peek_version},
    dataplane::{Dataplane, Pinned},
    ops::{self, Ctx},
    podsource::{PodReader, Unavailable},
    spec::{self, CniError, CniVersion, Command, env::CniEnv, error::ToCniError},
    state::StateDir,
};

/// What the process prints and how it exits.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub stdout: Option<Value>,
    pub success: bool,
}

impl Outcome {
    fn ok(stdout: Option<Value>) -> Self {
        Self {
            stdout,
            success: true,
        }
    }

    fn error(e: &CniError, version: Option<CniVersion>) -> Self {
        tracing::error!(
            "{} (code {}){}",
            e.msg,
            e.code,
            if e.details.is_empty() {
                String::new()
            } else {
                format!(": {}", e.details)
            }
        );
        Self {
            stdout: Some(e.to_json(version)),
            success: false,
        }
    }
}

/// The outside world an invocation uses; tests replace it.
pub trait Deps {
    fn dataplane(&self, cfg: &PluginConfig) -> Box<dyn Dataplane>;
    fn pod_reader(&self, cfg: &PluginConfig) -> Box<dyn PodReader>;
}

/// The node: pinned programs, and the Kubernetes API when the build has a client.
pub struct Node;

impl Deps for Node {
    fn dataplane(&self, cfg: &PluginConfig) -> Box<dyn Dataplane> {
        Box::new(Pinned::new(cfg.pin_root()))
    }

    fn pod_reader(&self, cfg: &PluginConfig) -> Box<dyn PodReader> {
        match &cfg.kubernetes.kubeconfig {
            #[cfg(feature = "kubernetes")]
            Some(path) => Box::new(
                crate::kubeapi::KubeReader::new(path, cfg.kubernetes.request_timeout)
                    .with_namespace_labels(cfg.ambient_enabled),
            ),
            #[cfg(not(feature = "kubernetes"))]
            Some(path) => Box::new(Unavailable(format!(
                "this build of sidestep-cni has no Kubernetes client (kubeconfig {}); let the \
                 runtime pass pod annotations (capability io.kubernetes.cri.pod-annotations)",
                path.display()
            ))),
            None => Box::new(Unavailable("no kubernetes.kubeconfig in the config".into())),
        }
    }
}

pub fn run(get_env: &dyn Fn(&str) -> Option<String>, stdin: &[u8], deps: &dyn Deps) -> Outcome {
    let started = std::time::Instant::now();
    let env = match CniEnv::from_lookup(get_env) {
        Ok(e) => e,
        Err(e) => return Outcome::error(&e, peek_version(stdin)),
    };
    if env.command == Command::Version {
        let requested: Option<String> = serde_json::from_slice::<Value>(stdin)
            .ok()
            .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned));
        return Outcome::ok(Some(spec::version_response(requested.as_deref())));
    }
    let cfg = match PluginConfig::parse(stdin, env.command) {
        Ok(c) => c,
        Err(e) => return Outcome::error(&e.to_cni(), peek_version(stdin)),
    };
    let dp = deps.dataplane(&cfg);
    let reader = deps.pod_reader(&cfg);
    let ctx = Ctx {
        cfg: &cfg,
        env: &env,
        dp: dp.as_ref(),
        pods: reader.as_ref(),
        state: StateDir::new(&cfg.state_dir),
    };
    let result = match env.command {
        Command::Add => ops::add(&ctx).map(Some),
        Command::Del => ops::del(&ctx).map(|()| None),
        Command::Check => ops::check(&ctx).map(|()| None),
        Command::Gc => ops::gc(&ctx).map(|()| None),
        Command::Status => status(dp.as_ref()).map(|()| None),
        Command::Version => unreachable!("answered before the config is parsed"),
    };
    // For the agent's /metrics, with the error's code; never fails the call. VERSION never
    // gets here.
    sidestep::statedir::timings::append(
        &cfg.state_dir,
        env.command.as_str(),
        result.as_ref().err().map(|e| e.code),
        started.elapsed(),
    );
    match result {
        Ok(out) => Outcome::ok(out),
        Err(e) => Outcome::error(&e, Some(cfg.cni_version)),
    }
}

/// STATUS: ready when the programs are pinned.
fn status(dp: &dyn Dataplane) -> Result<(), CniError> {
    if dp.is_loaded() {
        return Ok(());
    }
    Err(CniError::new(
        spec::code::NOT_AVAILABLE,
        format!(
            "sidestep is not loaded at pin_root {}",
            dp.pin_root().display()
        ),
    )
    .details("start the sidestep agent on this node, or run `sidestep load`"))
}

/// What `sidestep-cni` run by hand prints: what it is, and the CNI versions it speaks.
pub fn about() -> String {
    let versions: Vec<&str> = crate::spec::SUPPORTED_VERSIONS
        .iter()
        .map(|v| v.as_str())
        .collect();
    format!(
        "sidestep-cni {}: chained CNI plugin that captures a meshed pod's traffic to its \
         sidecar with eBPF (run by the container runtime with CNI_COMMAND set)\nCNI protocol \
         versions supported: {}",
        env!("CARGO_PKG_VERSION"),
        versions.join(", ")
    )
}
