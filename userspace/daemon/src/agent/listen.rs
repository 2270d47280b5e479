//! The `listen` setting: where the agent serves its endpoints, and how it binds there. Apart
//! from the HTTP server, so that the settings can parse it without depending on the server.

use std::{
    fmt, io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
};

use tokio::net::{TcpListener, TcpSocket};

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

    pub(super) async fn bind(self) -> io::Result<TcpListener> {
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
