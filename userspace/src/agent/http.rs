//! `/healthz` (liveness: the agent answers), `/readyz` (programs attached and CNI config in
//! place) and `/metrics`, on hyper 1.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::Agent;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("setting listen: cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
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
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "try /healthz, /readyz or /metrics\n".into(),
        ),
    };
    Ok(r)
}

/// Binds now (so a bad address stops the agent at start) and serves in the background.
pub async fn serve(agent: Arc<Agent>, addr: SocketAddr) -> Result<SocketAddr, HttpError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })?;
    let bound = listener.local_addr().unwrap_or(addr);
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
