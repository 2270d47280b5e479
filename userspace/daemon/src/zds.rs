//! The node agent's side of ZDS, Istio ambient's protocol to ztunnel (istio/istio
//! `cni/pkg/nodeagent/ztunnelserver*.go` is the reference; docs/research/ambient.md has the
//! reading). ztunnel connects to our `AF_UNIX` `SOCK_SEQPACKET` socket and says hello; we send it
//! a snapshot of every ambient workload we know (an Add carrying the pod's netns fd, or a Keep
//! when we hold no netns), then `SnapshotSent`, then Adds and Dels as pods come and go. Each
//! message waits for ztunnel's Ack before the next (an Ack with an error is a NACK). ztunnel
//! opens its listeners inside each netns it is given; sidestep's programs then steer the pod's
//! traffic to them (docs/ARCHITECTURE.md, "Ambient mode").
//!
//! One thread per connection, because the socket type has no async wrapper and a connection
//! carries one message at a time anyway.

pub mod proto;
pub mod wire;

use std::{
    collections::BTreeMap,
    fs, io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    time::Duration,
};

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, listen, socket,
};

use proto::{
    AddWorkload, DelWorkload, KeepWorkload, SnapshotSent, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello, workload_request::Payload, workload_response,
};
use wire::WireError;

/// Istio's deadline for each message and for the hello.
const DEADLINE: Duration = Duration::from_secs(5);
/// How long an idle connection goes between liveness checks (Istio's keep-alive interval).
const KEEPALIVE: Duration = Duration::from_secs(5);
/// How long [`ZdsServer::add`] waits for its Ack, a snapshot of other pods possibly ahead of it.
const ADD_WAIT: Duration = Duration::from_secs(30);

/// Where ztunnel looks for the agent by default (`INPOD_UDS`).
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// An ambient pod as ztunnel knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// The pod's `metadata.uid`.
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// The pod's netns (a runtime bind mount or /proc/PID/ns/net); `None` when unknown, which
    /// a snapshot sends as a Keep.
    pub netns: Option<PathBuf>,
}

impl Workload {
    /// `UID,NAMESPACE,NAME,SERVICE_ACCOUNT,NETNS`, as `sidestep ztunnel-serve --workload` takes it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        let [uid, namespace, name, service_account, netns] = parts.as_slice() else {
            return Err(format!(
                "{text:?}: expected UID,NAMESPACE,NAME,SERVICE_ACCOUNT,NETNS (5 fields, got {})",
                parts.len()
            ));
        };
        if [uid, namespace, name, service_account, netns]
            .iter()
            .any(|f| f.is_empty())
        {
            return Err(format!("{text:?}: a field is empty"));
        }
        Ok(Self {
            uid: (*uid).into(),
            name: (*name).into(),
            namespace: (*namespace).into(),
            service_account: (*service_account).into(),
            netns: Some(PathBuf::from(netns)),
        })
    }

    fn info(&self) -> WorkloadInfo {
        WorkloadInfo {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            service_account: self.service_account.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("ZDS socket {path}: {step}: {source}")]
    Socket {
        path: PathBuf,
        step: &'static str,
        source: io::Error,
    },
    #[error("no ztunnel is connected to {0}: the pod stays pending until one is")]
    NoZtunnel(PathBuf),
    #[error("ztunnel refused workload {uid}: {reason}")]
    Nack { uid: String, reason: String },
    #[error("workload {uid}: cannot open its netns {path}: {source}")]
    Netns {
        uid: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("ztunnel connection {id}: {source}")]
    Connection {
        id: u64,
        #[source]
        source: WireError,
    },
    #[error("ztunnel connection {id} went away before answering")]
    Gone { id: u64 },
    #[error("ztunnel connection {id} sent a message nobody asked for")]
    Unasked { id: u64 },
}

enum Command {
    Add(Workload, mpsc::Sender<Result<(), ZdsError>>),
    Del(String, mpsc::Sender<Result<(), ZdsError>>),
}

struct Connection {
    id: u64,
    commands: mpsc::Sender<Command>,
    /// Its snapshot has been sent and acknowledged.
    ready: Arc<AtomicBool>,
}

#[derive(Default)]
struct State {
    workloads: BTreeMap<String, Workload>,
    /// Oldest first; Adds go to the last.
    connections: Vec<Connection>,
}

struct Shared {
    path: PathBuf,
    state: Mutex<State>,
    next_id: AtomicU64,
    /// Connections are served only once this is set (see [`ZdsServer::listen_closed`]).
    open: (Mutex<bool>, std::sync::Condvar),
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The ZDS server. Cloning shares it.
#[derive(Clone)]
pub struct ZdsServer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ZdsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZdsServer")
            .field("path", &self.shared.path)
            .finish_non_exhaustive()
    }
}

impl ZdsServer {
    /// Listens on `path` (a stale socket file there is removed first, as Istio's agent does) and
    /// serves every ztunnel that connects, for as long as the process runs.
    pub fn listen(path: &Path) -> Result<Self, ZdsError> {
        let server = Self::listen_closed(path)?;
        server.open();
        Ok(server)
    }

    /// As [`Self::listen`], but a ztunnel that connects waits (in the kernel's backlog) until
    /// [`Self::open`]: its first snapshot must hold every pod it already serves, or ztunnel drains
    /// the ones it lacks. The agent opens once it knows its node's ambient pods.
    pub fn listen_closed(path: &Path) -> Result<Self, ZdsError> {
        let failed = |step, source| ZdsError::Socket {
            path: path.to_path_buf(),
            step,
            source,
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| failed("create its directory", e))?;
        }
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed("remove the stale socket", e)),
        }
        let errno = |e: nix::Error| io::Error::from_raw_os_error(e as i32);
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| failed("socket", errno(e)))?;
        let addr = UnixAddr::new(path).map_err(|e| failed("address", errno(e)))?;
        bind(fd.as_raw_fd(), &addr).map_err(|e| failed("bind", errno(e)))?;
        listen(&fd, Backlog::new(16).expect("16 is a valid backlog"))
            .map_err(|e| failed("listen", errno(e)))?;
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(1),
            open: (Mutex::new(false), std::sync::Condvar::new()),
        });
        let server = Self { shared };
        let acceptor = server.clone();
        std::thread::Builder::new()
            .name("zds-accept".into())
            .spawn(move || acceptor.accept_loop(fd))
            .map_err(|e| failed("start its thread", e))?;
        tracing::info!(socket = %path.display(), "ZDS: waiting for ztunnel");
        Ok(server)
    }

    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Starts serving connections (see [`Self::listen_closed`]).
    pub fn open(&self) {
        let (open, changed) = &self.shared.open;
        *open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        changed.notify_all();
    }

    pub fn is_open(&self) -> bool {
        *self
            .shared
            .open
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a ztunnel is connected and has its snapshot.
    pub fn connected(&self) -> bool {
        self.shared
            .state()
            .connections
            .iter()
            .any(|c| c.ready.load(Ordering::Acquire))
    }

    /// The workloads the server knows, by UID.
    pub fn workloads(&self) -> Vec<Workload> {
        self.shared.state().workloads.values().cloned().collect()
    }

    /// Hands `workload` to the newest ztunnel and waits for its Ack. The workload is remembered
    /// either way, so every later connection's snapshot carries it.
    pub fn add(&self, workload: Workload) -> Result<(), ZdsError> {
        let (reply, answer) = mpsc::channel();
        let uid = workload.uid.clone();
        let sent = {
            let mut state = self.shared.state();
            state.workloads.insert(uid.clone(), workload.clone());
            state
                .connections
                .last()
                .map(|c| (c.id, c.commands.send(Command::Add(workload, reply))))
        };
        match sent {
            None => Err(ZdsError::NoZtunnel(self.shared.path.clone())),
            Some((id, Err(_))) => Err(ZdsError::Gone { id }),
            Some((id, Ok(()))) => answer
                .recv_timeout(ADD_WAIT)
                .unwrap_or(Err(ZdsError::Gone { id })),
        }
    }

    /// Forgets the workload and tells every connected ztunnel to drop it. Returns whether it was
    /// known, and the first error any connection gave.
    pub fn del(&self, uid: &str) -> Result<bool, ZdsError> {
        let (known, waits) = {
            let mut state = self.shared.state();
            let known = state.workloads.remove(uid).is_some();
            let waits: Vec<_> = state
                .connections
                .iter()
                .map(|c| {
                    let (reply, answer) = mpsc::channel();
                    let queued = c.commands.send(Command::Del(uid.to_owned(), reply)).is_ok();
                    (c.id, queued.then_some(answer))
                })
                .collect();
            (known, waits)
        };
        for (id, answer) in waits {
            // A connection that is gone has dropped the workload with itself.
            if let Some(answer) = answer
                && let Ok(Err(e)) = answer.recv_timeout(ADD_WAIT)
            {
                tracing::warn!(connection = id, error = %e, "ZDS: a Del was not acknowledged");
                return Err(e);
            }
        }
        Ok(known)
    }

    fn accept_loop(self, listener: OwnedFd) {
        {
            let (open, changed) = &self.shared.open;
            let mut is_open = open.lock().unwrap_or_else(PoisonError::into_inner);
            while !*is_open {
                is_open = changed
                    .wait(is_open)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        let mut failures = 0u32;
        loop {
            let raw = match accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                Ok(raw) => {
                    failures = 0;
                    raw
                }
                Err(nix::Error::EINTR) => continue,
                Err(e) => {
                    // EMFILE, ENOMEM and the like pass; the listener stays.
                    failures = (failures + 1).min(10);
                    tracing::error!(error = %e, "ZDS: accept failed; trying again");
                    std::thread::sleep(Duration::from_millis(50) * failures);
                    continue;
                }
            };
            // SAFETY: accept4 returned a new fd that nothing else owns.
            let conn = unsafe { OwnedFd::from_raw_fd(raw) };
            let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("zds-conn-{id}"))
                .spawn(move || serve(&shared, id, conn));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "ZDS: cannot start a connection thread");
            }
            // Istio's agent takes at most 5 connections a second.
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// One ztunnel connection, from its hello to its end.
fn serve(shared: &Arc<Shared>, id: u64, conn: OwnedFd) {
    let outcome = serve_connection(shared, id, &conn);
    let mut state = shared.state();
    state.connections.retain(|c| c.id != id);
    let left = state.connections.len();
    drop(state);
    match outcome {
        Ok(()) => tracing::info!(connection = id, left, "ZDS: ztunnel disconnected"),
        Err(e @ ZdsError::Unasked { .. }) => {
            tracing::warn!(connection = id, left, error = %e, "ZDS: protocol error; connection dropped")
        }
        Err(e) => tracing::warn!(connection = id, left, error = %e, "ZDS: connection dropped"),
    }
}

fn serve_connection(shared: &Arc<Shared>, id: u64, conn: &OwnedFd) -> Result<(), ZdsError> {
    let fd = conn.as_fd();
    let broken = |source| ZdsError::Connection { id, source };
    wire::set_deadlines(fd, DEADLINE).map_err(|e| broken(WireError::Io(e)))?;
    let (hello, _) = wire::recv::<ZdsHello>(fd, "the hello").map_err(broken)?;
    // Registered before the snapshot is taken, under the same lock: an Add from here on queues
    // behind the snapshot instead of missing it (ztunnel drops what a snapshot lacks).
    let (commands, queue) = mpsc::channel();
    let ready = Arc::new(AtomicBool::new(false));
    let snapshot: Vec<Workload> = {
        let mut state = shared.state();
        state.connections.push(Connection {
            id,
            commands,
            ready: ready.clone(),
        });
        state.workloads.values().cloned().collect()
    };
    tracing::info!(
        connection = id,
        version = hello.version,
        workloads = snapshot.len(),
        "ZDS: ztunnel connected; sending the snapshot"
    );
    for w in &snapshot {
        // Istio logs a NACK in a snapshot and goes on; ztunnel retries that workload itself.
        let sent = match send_workload(id, fd, w, true) {
            // A netns that cannot be opened now: ztunnel keeps the proxy it may run for it.
            Err(e @ ZdsError::Netns { .. }) => {
                tracing::warn!(connection = id, error = %e, "ZDS: sending a Keep instead");
                request(
                    id,
                    fd,
                    Payload::Keep(KeepWorkload { uid: w.uid.clone() }),
                    None,
                )
            }
            other => other,
        };
        match sent {
            Ok(()) => {}
            Err(e @ ZdsError::Nack { .. }) => {
                tracing::warn!(connection = id, error = %e, "ZDS: snapshot entry not taken")
            }
            Err(other) => return Err(other),
        }
    }
    request(id, fd, Payload::SnapshotSent(SnapshotSent {}), None).map_err(|e| match e {
        ZdsError::Nack { reason, .. } => ZdsError::Nack {
            uid: "(snapshot)".into(),
            reason,
        },
        other => other,
    })?;
    ready.store(true, Ordering::Release);
    loop {
        match queue.recv_timeout(KEEPALIVE) {
            Ok(Command::Add(w, reply)) => {
                let result = send_workload(id, fd, &w, false);
                let fatal = matches!(result, Err(ZdsError::Connection { .. }));
                let _ = reply.send(result);
                if fatal {
                    return Err(ZdsError::Gone { id });
                }
            }
            Ok(Command::Del(uid, reply)) => {
                let result = request(id, fd, Payload::Del(DelWorkload { uid }), None);
                let fatal = matches!(result, Err(ZdsError::Connection { .. }));
                let _ = reply.send(result);
                if fatal {
                    return Err(ZdsError::Gone { id });
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => match wire::idle_check(fd) {
                wire::Idle::Alive => {}
                wire::Idle::Closed => return Ok(()),
                wire::Idle::Unasked => return Err(ZdsError::Unasked { id }),
            },
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        }
    }
}

/// An Add with the netns fd, or (in a snapshot, without a netns) a Keep.
fn send_workload(
    id: u64,
    fd: BorrowedFd<'_>,
    w: &Workload,
    snapshot: bool,
) -> Result<(), ZdsError> {
    let Some(path) = &w.netns else {
        if snapshot {
            return request(
                id,
                fd,
                Payload::Keep(KeepWorkload { uid: w.uid.clone() }),
                None,
            );
        }
        return Err(ZdsError::Netns {
            uid: w.uid.clone(),
            path: PathBuf::new(),
            source: io::Error::new(io::ErrorKind::NotFound, "no netns known"),
        });
    };
    let netns = fs::File::open(path).map_err(|source| ZdsError::Netns {
        uid: w.uid.clone(),
        path: path.clone(),
        source,
    })?;
    let add = AddWorkload {
        uid: w.uid.clone(),
        workload_info: Some(w.info()),
    };
    request(id, fd, Payload::Add(add), Some(netns.as_fd())).map_err(|e| match e {
        ZdsError::Nack { reason, .. } => ZdsError::Nack {
            uid: w.uid.clone(),
            reason,
        },
        other => other,
    })
}

/// Sends one request and reads its answer.
fn request(
    id: u64,
    fd: BorrowedFd<'_>,
    payload: Payload,
    pass: Option<BorrowedFd<'_>>,
) -> Result<(), ZdsError> {
    let broken = |source| ZdsError::Connection { id, source };
    let uid = match &payload {
        Payload::Add(a) => a.uid.clone(),
        Payload::Del(d) => d.uid.clone(),
        Payload::Keep(k) => k.uid.clone(),
        Payload::SnapshotSent(_) => String::new(),
    };
    wire::send(
        fd,
        &WorkloadRequest {
            payload: Some(payload),
        },
        pass,
    )
    .map_err(broken)?;
    let (answer, _) = wire::recv::<WorkloadResponse>(fd, "an ack").map_err(broken)?;
    match answer.payload {
        Some(workload_response::Payload::Ack(ack)) if ack.error.is_empty() => Ok(()),
        Some(workload_response::Payload::Ack(ack)) => Err(ZdsError::Nack {
            uid,
            reason: ack.error,
        }),
        None => Err(ZdsError::Nack {
            uid,
            reason: "an answer without an ack".into(),
        }),
    }
}

#[cfg(test)]
mod tests;
