//! `/healthz` (liveness: the agent answers), `/readyz` (programs attached and CNI config in
//! place), `/metrics` and `/debug/pods` (the last reconcile's pods by name, for `sidestep
//! check`), on hyper 1.

use std::{convert::Infallible, io, sync::Arc};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;

pub use super::listen::Listen;
use super::{Agent, pods, repair};

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("setting listen: cannot listen on {addr}: {source}")]
    Bind { addr: Listen, source: io::Error },
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

async fn handle(
    agent: Arc<Agent>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        ));
    }
    let path = req.uri().path().to_owned();
    let r = match path.as_str() {
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => {
            let a = agent.clone();
            let (ready, why) = tokio::task::spawn_blocking(move || a.readiness())
                .await
                .unwrap_or((false, "readiness check panicked".into()));
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            reply(status, "text/plain", why)
        }
        "/metrics" => {
            let a = agent.clone();
            let body = tokio::task::spawn_blocking(move || a.metrics())
                .await
                .unwrap_or_default();
            reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            )
        }
        "/debug/pods" => {
            let a = agent.clone();
            match tokio::task::spawn_blocking(move || debug_pods(&a)).await {
                Ok(p) => reply(
                    StatusCode::OK,
                    "application/json",
                    serde_json::to_string_pretty(&p).unwrap_or_default() + "\n",
                ),
                Err(_) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    "naming the pods panicked\n".into(),
                ),
            }
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "try /healthz, /readyz, /metrics or /debug/pods\n".into(),
        ),
    };
    Ok(r)
}

/// `GET /debug/pods`: the pods of the agent's last reconcile, named where it can tell.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DebugPods {
    /// Reconciles so far; 0: nothing below is known yet.
    pub reconciles: u64,
    /// With repair off the agent cannot tell a meshed pod from another, and `unenrolled` holds
    /// every uncaptured pod netns in scope.
    pub repair: bool,
    pub enrolled: Vec<PodRef>,
    /// Live pod netns that are not captured (and repair did not skip).
    pub unenrolled: Vec<PodRef>,
    /// Pods the plugin's ADD leaves uncaptured on purpose (repair asked it), with its reason.
    pub skipped: Vec<PodRef>,
    /// FAIL_OPEN markers: pods the plugin let start uncaptured.
    pub failopen: usize,
    /// While an uninstall drain runs: where it stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining: Option<String>,
}

/// One pod netns.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodRef {
    pub netns_cookie: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// `namespace/name`, when a record or the API names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Why it is skipped, or why it has no name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Names the last report's pods: enrolled ones by their records, the others by the records
/// too, else by their addresses among the node's pods (the watch's, else one list of the API's,
/// as repair matches them), so that an operator reads `shop/web`, not a netns path.
fn debug_pods(agent: &Agent) -> DebugPods {
    let s = &agent.settings;
    let report = agent.last_report();
    let named: std::collections::BTreeMap<u64, String> = pods::records(&s.state_dir)
        .into_values()
        .filter_map(|r| match (r.pod_namespace, r.pod_name) {
            (Some(ns), Some(n)) if !n.is_empty() => Some((r.netns_cookie, format!("{ns}/{n}"))),
            _ => None,
        })
        .collect();
    let mut node_pods = None;
    let mut name = |l: &pods::LiveNetns| -> Result<String, String> {
        if let Some(n) = named.get(&l.cookie) {
            return Ok(n.clone());
        }
        let by_address = node_pods.get_or_insert_with(|| {
            match (agent.pod_watch.pods(), repair::api_access(s)) {
                (Some(watched), _) => Ok(repair::by_address(&watched)),
                (None, Some(api)) => repair::node_pods(&api, &s.node_name),
                (None, None) => Err("not in a cluster: no pod names".into()),
            }
        });
        let by_address = by_address.as_ref().map_err(Clone::clone)?;
        let addrs = pods::pod_addresses(l).map_err(|e| e.to_string())?;
        let ips: Vec<_> = addrs.ips.iter().map(|(ip, _)| *ip).collect();
        repair::match_pod(by_address, &ips).map(|p| format!("{}/{}", p.namespace, p.name))
    };
    let netns_ref = |l: &pods::LiveNetns, name: Result<String, String>| PodRef {
        netns_cookie: l.cookie,
        netns: Some(l.path.display().to_string()),
        reason: name.as_ref().err().cloned(),
        pod: name.ok(),
    };
    let unenrolled = report
        .unenrolled
        .iter()
        .map(|l| netns_ref(l, name(l)))
        .collect();
    let skipped = report
        .skipped
        .iter()
        .map(|(l, why)| PodRef {
            reason: Some(why.clone()),
            ..netns_ref(l, named.get(&l.cookie).cloned().ok_or_else(String::new))
        })
        .collect();
    let enrolled = sidestep::maps::enrolled_cookies(&s.pin_root)
        .into_iter()
        .map(|cookie| PodRef {
            netns_cookie: cookie,
            pod: named.get(&cookie).cloned(),
            ..PodRef::default()
        })
        .collect();
    DebugPods {
        reconciles: agent
            .counters
            .reconciles
            .load(std::sync::atomic::Ordering::Relaxed),
        repair: s.repair,
        enrolled,
        unenrolled,
        skipped,
        failopen: report.failopen,
        draining: report.draining,
    }
}

/// Binds now (so a bad address stops the agent at start) and serves in the background.
pub async fn serve(agent: Arc<Agent>, addr: Listen) -> Result<Listen, HttpError> {
    let listener = addr
        .bind()
        .await
        .map_err(|source| HttpError::Bind { addr, source })?;
    // A dual-stack socket's own address, [::]:port, would read as IPv6 only.
    let bound = match (addr, listener.local_addr()) {
        (Listen::Addr(_), Ok(a)) => Listen::Addr(a),
        (Listen::AllAddresses(_), Ok(a)) => Listen::AllAddresses(a.port()),
        (_, Err(_)) => addr,
    };
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let agent = agent.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(agent.clone(), req));
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await
                {
                    tracing::debug!(error = %e, "http connection");
                }
            });
        }
    });
    Ok(bound)
}
