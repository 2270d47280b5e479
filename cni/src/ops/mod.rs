//! The effects of each command. They take the parsed invocation and a [`Dataplane`], decide with
//! the pure functions of [`crate::mesh`], and report failures as spec errors.

mod add;
mod check;
mod del;
mod gc;

pub use add::add;
pub use check::check;
pub use del::del;
pub use gc::gc;

use crate::{
    config::{FailStrategy, PluginConfig},
    dataplane::{Dataplane, not_loaded},
    mesh::{self, Decision, Enrolment, Identity, PreDecision, SkipReason},
    podsource::{self, PodReader},
    spec::{CniError, code, env::CniEnv, error::ToCniError},
    state::{FailOpenMarker, StateDir, now_unix},
};

/// Everything one invocation works with.
pub struct Ctx<'a> {
    pub cfg: &'a PluginConfig,
    pub env: &'a CniEnv,
    pub dp: &'a dyn Dataplane,
    pub pods: &'a dyn PodReader,
    pub state: StateDir,
}

/// The outcome of the decision for this attachment.
pub(crate) enum Resolved {
    /// Not captured, and where the pod data that decided it came from (`None`: no pod read).
    Skip(SkipReason, Option<podsource::SourceUsed>),
    Enrol(Box<ToEnrol>),
}

pub(crate) struct ToEnrol {
    pub enrolment: Enrolment,
    pub identity: Option<Identity>,
    /// status.podIPs of the pod object, for when prevResult has none.
    pub api_ips: Vec<std::net::IpAddr>,
    /// Where the pod data came from (`None`: the config's own policy, no pod read).
    pub source: Option<podsource::SourceUsed>,
}

/// Why a pod that should be captured is not; FAIL_OPEN lets these through.
pub(crate) struct Uncaptured {
    pub error: CniError,
    pub identity: Option<Identity>,
}

pub(crate) fn resolve(ctx: &Ctx<'_>) -> Result<Resolved, Result<Uncaptured, CniError>> {
    match mesh::before_pod_read(ctx.cfg, &ctx.env.args) {
        PreDecision::Skip(r) => Ok(Resolved::Skip(r, None)),
        PreDecision::ConfigPolicy(policy) => Ok(Resolved::Enrol(Box::new(ToEnrol {
            enrolment: Enrolment {
                policy: *policy,
                hairpin: true,
            },
            identity: None,
            api_ips: Vec::new(),
            source: None,
        }))),
        PreDecision::ReadPod(id) => {
            let (pod, source) = podsource::pod_info(ctx.cfg, &id, ctx.pods).map_err(|e| {
                let c = match e {
                    podsource::PodReadError::NoSource { .. } => code::INVALID_CONFIG,
                    podsource::PodReadError::Api { .. } => code::POD_UNREADABLE,
                };
                Ok(Uncaptured {
                    error: CniError::new(c, e.to_string()),
                    identity: Some(id.clone()),
                })
            })?;
            // Ambient pods are picked by labels (the pod's and its namespace's) that only the
            // API has: a pod decided from the runtime's annotations could be ambient and go
            // uncaptured. Only an injected sidecar pod is known not to be.
            if ctx.cfg.ambient_enabled
                && source != podsource::SourceUsed::Api
                && pod.annotation(mesh::istio::STATUS).is_none()
            {
                return Err(Ok(Uncaptured {
                    error: CniError::new(
                        code::POD_UNREADABLE,
                        format!(
                            "pod {id}: ambient_enabled, and the pod and its namespace could not \
                             be read from the API, so whether the pod is ambient \
                             (istio.io/dataplane-mode) is unknown"
                        ),
                    ),
                    identity: Some(id.clone()),
                }));
            }
            match mesh::decide_pod_with(ctx.cfg.mesh, ctx.cfg.ambient_enabled, &pod)
                .map_err(|e| Err(e.to_cni()))?
            {
                Decision::Skip(r) => Ok(Resolved::Skip(r, Some(source))),
                Decision::Enrol(e) => Ok(Resolved::Enrol(Box::new(ToEnrol {
                    enrolment: *e,
                    identity: Some(id),
                    api_ips: pod.pod_ips,
                    source: Some(source),
                }))),
            }
        }
    }
}

/// How a pod is named in logs and markers: its Kubernetes identity, else the container.
pub(crate) fn pod_label(identity: Option<&Identity>, container_id: &str) -> String {
    identity.map_or_else(
        || format!("container {container_id}"),
        |i| format!("pod {i}"),
    )
}

/// The pod as CNI_ARGS names it, for logs written before (or without) a pod read.
pub(crate) fn args_label(ctx: &Ctx<'_>) -> String {
    let args = &ctx.env.args;
    match (args.get("K8S_POD_NAMESPACE"), args.get("K8S_POD_NAME")) {
        (Some(ns), Some(name)) => format!("pod {ns}/{name}"),
        (None, Some(name)) => format!("pod {name}"),
        _ => pod_label(None, ctx.env.attachment().0),
    }
}

/// FAIL_CLOSE: the error. FAIL_OPEN: a warning, a marker for the agent, and success.
pub(crate) fn uncaptured(ctx: &Ctx<'_>, u: Uncaptured) -> Result<(), CniError> {
    if ctx.cfg.fail_strategy == FailStrategy::Close {
        return Err(u.error);
    }
    let (cid, ifname) = ctx.env.attachment();
    let who = pod_label(u.identity.as_ref(), cid);
    tracing::warn!(
        "FAIL_OPEN: {who} starts WITHOUT traffic capture: {} (code {})",
        u.error.msg,
        u.error.code
    );
    let marker = FailOpenMarker {
        network: ctx.cfg.name.clone(),
        container_id: cid.into(),
        ifname: ifname.into(),
        pod_name: u.identity.as_ref().map(|i| i.name.clone()),
        pod_namespace: u.identity.as_ref().map(|i| i.namespace.clone()),
        reason: u.error.msg,
        created_unix: now_unix(),
    };
    if let Err(e) = ctx.state.write_marker(&marker) {
        tracing::error!("FAIL_OPEN marker for {who} not written, the agent will not count it: {e}");
    }
    Ok(())
}

/// Fails with the spec's "try again later" unless the programs are pinned.
pub(crate) fn require_loaded(ctx: &Ctx<'_>) -> Result<(), CniError> {
    if ctx.dp.is_loaded() {
        Ok(())
    } else {
        Err(not_loaded(
            ctx.dp.pin_root(),
            ctx.cfg.agent_namespace.as_deref(),
        ))
    }
}

#[cfg(test)]
mod tests;
