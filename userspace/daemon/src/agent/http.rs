//! `/healthz` (liveness: the agent answers), `/readyz` (programs attached and CNI config in
//! place) and `/metrics`, on hyper 1.

use std::{
    convert::Infallible,
    fmt, io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket};

use super::Agent;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("setting listen: cannot listen on {addr}: {source}")]
    Bind { addr: Listen, source: io::Error },
}

/// The `listen` setting: where the endpoints are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// `:PORT`: every address of both families, as Go's `:PORT` (IPv4 alone on a host without
    /// IPv6). A hostNetwork pod's probes and Prometheus reach it at the node's address, whatever
    /// the cluster's IP family.
    AllAddresses(u16),
    /// `ADDR:PORT` or `[ADDR]:PORT`: that address only (`127.0.0.1:9964`: the node itself).
    Addr(SocketAddr),
}

impl Listen {
    pub const DEFAULT: Self = Self::AllAddresses(9964);

    pub fn parse(v: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{v:?} is neither :PORT (every address) nor ADDRESS:PORT (e.g. 127.0.0.1:9964, \
                 [::1]:9964)"
            )
        };
        match v.strip_prefix(':') {
            Some(port) => port.parse().map(Self::AllAddresses).map_err(|_| bad()),
            None => v.parse().map(Self::Addr).map_err(|_| bad()),
        }
    }

    pub fn port(&self) -> u16 {
        match self {
            Self::AllAddresses(port) => *port,
            Self::Addr(a) => a.port(),
        }
    }

    async fn bind(self) -> io::Result<TcpListener> {
        let port = match self {
            Self::Addr(a) => return TcpListener::bind(a).await,
            Self::AllAddresses(port) => port,
        };
        match bind_dual_stack(port) {
            // No IPv6 on this host (ipv6.disable=1): IPv4 is all there is.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
                ) =>
            {
                TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await
            }
            other => other,
        }
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AllAddresses(port) => write!(f, ":{port}"),
            Self::Addr(a) => write!(f, "{a}"),
        }
    }
}

/// `[::]:port` that takes IPv4 too, whatever the host's `net.ipv6.bindv6only` says.
fn bind_dual_stack(port: u16) -> io::Result<TcpListener> {
    let socket = TcpSocket::new_v6()?;
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv6V6Only, &false)
        .map_err(io::Error::from)?;
    // As TcpListener::bind does: a restarted agent must not wait out TIME_WAIT for its port.
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))?;
    socket.listen(1024)
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
