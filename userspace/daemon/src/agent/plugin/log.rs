//! The plugin's log, in the agent's: every invocation sends its lines (and, when its ADD leaves
//! a pod uncaptured, a skip notice) to the datagram socket `<state_dir>/log.sock`, and the agent
//! writes each line again through its own log, at the plugin's level, under the target
//! `sidestep::cni`, naming the pod and container. `kubectl logs` of the agent then shows what
//! the plugin did on its node, as istio-cni's agent shows its plugin's lines. The plugin's side
//! (`sidestep_cni::logging::agent`) never waits for the agent: a line the agent is too slow for
//! is lost here, and stays in the plugin's own stderr and `log_file`.
//!
//! A skip notice for a pod with Istio's `istio-init` init container (Istio's iptables captures
//! it, not sidestep) is a warning: a log line and an Event on the pod, once per pod. Every
//! skipped pod counts once in `sidestep_cni_skipped_pods_total{reason}`.

use std::{
    collections::{BTreeSet, VecDeque},
    io,
    os::unix::{
        fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
        net::UnixDatagram,
    },
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use serde::Deserialize;

use crate::agent::{
    Agent,
    podapi::{NodePod, Reason, Subject},
};

/// The socket's name in the state directory; the plugin's `logging::agent::SOCKET_NAME`.
pub use sidestep::statedir::LOG_SOCKET_NAME as SOCKET_NAME;

/// How often the socket file is checked (gone, taken by another agent, uninstall requested).
const CHECK: Duration = Duration::from_secs(2);

/// Pods remembered as warned about; past this the oldest are forgotten (an Event again for one
/// of them after this many others is harmless, unbounded memory is not).
const REMEMBERED: usize = 8192;

/// The skip reason that means another capture (Istio's iptables) owns the pod.
pub const ISTIO_INIT: &str = "istio-init";

/// The inode of the socket file this agent bound, for removing only its own at shutdown.
static BOUND_INODE: AtomicU64 = AtomicU64::new(0);

/// One datagram from the plugin.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", default)]
pub struct Datagram {
    /// `log` (a line) or `skip` (the ADD left the pod uncaptured).
    pub kind: String,
    pub level: String,
    pub message: String,
    /// A skip's fixed reason code (`istio-init`, `not-injected`, ...).
    pub reason: String,
    pub command: String,
    pub container_id: String,
    pub pod_namespace: String,
    pub pod_name: String,
    pub pod_uid: String,
}

impl Datagram {
    fn pod(&self) -> String {
        match (self.pod_namespace.as_str(), self.pod_name.as_str()) {
            (_, "") => "-".into(),
            ("", n) => n.into(),
            (ns, n) => format!("{ns}/{n}"),
        }
    }

    /// What makes a pod the same pod for "once per pod": its UID, else its name, else the
    /// container (a workload without Kubernetes identity).
    fn pod_key(&self) -> String {
        if !self.pod_uid.is_empty() {
            return format!("uid {}", self.pod_uid);
        }
        if !self.pod_name.is_empty() {
            return format!("pod {}", self.pod());
        }
        format!("container {}", self.container_id)
    }
}

/// A set that answers "first time?", keeping the last `cap` keys.
#[derive(Debug)]
pub struct Once {
    seen: BTreeSet<String>,
    order: VecDeque<String>,
    cap: usize,
}

impl Once {
    pub fn new(cap: usize) -> Self {
        Self {
            seen: BTreeSet::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// True the first time `key` is asked about (while it is remembered).
    pub fn first(&mut self, key: &str) -> bool {
        if self.seen.contains(key) {
            return false;
        }
        if self.order.len() >= self.cap
            && let Some(old) = self.order.pop_front()
        {
            self.seen.remove(&old);
        }
        self.seen.insert(key.to_owned());
        self.order.push_back(key.to_owned());
        true
    }
}

/// What a skip notice calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Seen for this pod already.
    Nothing,
    /// Count it under its reason.
    Count,
    /// Count it, and warn (log and Event): Istio's iptables captures the pod.
    CountAndWarn,
}

/// The decision for a skip notice: once per pod, and a warning only for istio-init.
pub fn on_skip(once: &mut Once, d: &Datagram) -> Action {
    if !once.first(&d.pod_key()) {
        return Action::Nothing;
    }
    if d.reason == ISTIO_INIT {
        Action::CountAndWarn
    } else {
        Action::Count
    }
}

/// The warning's text.
pub fn istio_init_message() -> String {
    "not captured by sidestep: the pod has Istio's istio-init init container, so Istio's \
     iptables captures its traffic. Istio's injector adds istio-init when it does not know that a \
     CNI plugin captures: set Istio's values.istio_cni.enabled=true (pilot.cni.enabled), so that \
     new pods get istio-validation instead, then restart the pod"
        .into()
}

/// Binds the socket (so that the first ADDs after the agent's start are heard), then reads it
/// on a thread of its own for the agent's life.
pub fn spawn(agent: Arc<Agent>) -> io::Result<std::thread::JoinHandle<()>> {
    let first = listen(&agent, true);
    if let Err(e) = &first {
        // Said once; the thread keeps trying (an agent still stopping holds the socket).
        tracing::info!(socket = %agent.settings.state_dir.join(SOCKET_NAME).display(), error = %e, "not reading the plugin's log yet (its lines stay in its own stderr)");
    }
    std::thread::Builder::new()
        .name("plugin-log".into())
        .spawn(move || run(&agent, first))
}

/// The socket, unless uninstall is requested. At the start (`create`) the state directory is
/// made if missing, root-only, as the timings poll makes it a second later; after that, never:
/// the plugin writes only into an existing one, so that nothing comes back after an uninstall.
fn listen(agent: &Agent, create: bool) -> io::Result<Bound> {
    if agent.settings.uninstall_requested_now() {
        return Err(io::Error::other("uninstall requested"));
    }
    let dir = &agent.settings.state_dir;
    if create && !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    Bound::bind(&dir.join(SOCKET_NAME))
}

/// The socket bound at `path`, with the inode it made.
struct Bound {
    socket: UnixDatagram,
    path: PathBuf,
    inode: u64,
}

impl Bound {
    /// Binds at `path`, replacing a socket file nobody is bound to (an agent that died); never
    /// another live agent's (two run for a moment in a rolling update), nor any other file.
    fn bind(path: &Path) -> io::Result<Self> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if !m.file_type().is_socket() => {
                return Err(io::Error::other(format!(
                    "{} exists and is no socket; not replacing it",
                    path.display()
                )));
            }
            Ok(_) => {
                let probe = UnixDatagram::unbound()?;
                if probe.connect(path).is_ok() {
                    return Err(io::Error::other(format!(
                        "another process is bound to {} (an agent still stopping)",
                        path.display()
                    )));
                }
                std::fs::remove_file(path)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let socket = UnixDatagram::bind(path)?;
        // Only root (the plugin, run by the runtime) may send: a line names a pod, and the
        // agent posts Events on it.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        socket.set_read_timeout(Some(CHECK))?;
        let inode = std::fs::symlink_metadata(path)?.ino();
        BOUND_INODE.store(inode, Ordering::Relaxed);
        Ok(Self {
            socket,
            path: path.to_path_buf(),
            inode,
        })
    }

    /// Whether the file at the path is still the one this bound.
    fn current(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode)
    }

    /// Stops listening; the file goes only if it is still ours.
    fn close(self) {
        if self.current() {
            let _ = std::fs::remove_file(&self.path);
        }
        BOUND_INODE.store(0, Ordering::Relaxed);
    }
}

/// Removes the socket file if this agent bound it (at shutdown: a plugin then finds no socket
/// rather than one nobody reads, and an uninstall finds the state directory empty).
pub fn unbind(state_dir: &Path) {
    let path = state_dir.join(SOCKET_NAME);
    let ours = BOUND_INODE.load(Ordering::Relaxed);
    if ours != 0 && std::fs::symlink_metadata(&path).is_ok_and(|m| m.ino() == ours) {
        let _ = std::fs::remove_file(&path);
    }
}

fn run(agent: &Agent, first: io::Result<Bound>) {
    let path = agent.settings.state_dir.join(SOCKET_NAME);
    let mut last_error = first.as_ref().err().map(ToString::to_string);
    let mut bound = first.ok();
    let mut once = Once::new(REMEMBERED);
    let mut checked = Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if bound.is_none() || checked.elapsed() >= CHECK {
            checked = Instant::now();
            if agent.settings.uninstall_requested_now() {
                // The drain removes the state directory once it is empty.
                if let Some(b) = bound.take() {
                    tracing::info!("uninstall requested: no longer reading the plugin's log");
                    b.close();
                }
                std::thread::sleep(CHECK);
                continue;
            }
            if bound.as_ref().is_some_and(|b| !b.current()) {
                bound = None;
            }
            if bound.is_none() {
                match listen(agent, false) {
                    Ok(b) => {
                        tracing::debug!(socket = %path.display(), "reading the plugin's log");
                        last_error = None;
                        bound = Some(b);
                    }
                    Err(e) => {
                        let text = e.to_string();
                        if last_error.as_deref() != Some(text.as_str()) {
                            tracing::debug!(socket = %path.display(), error = %text, "not reading the plugin's log yet");
                        }
                        last_error = Some(text);
                        std::thread::sleep(CHECK);
                        continue;
                    }
                }
            }
        }
        let Some(b) = bound.as_ref() else { continue };
        match b.socket.recv(&mut buf) {
            Ok(n) => handle(agent, &mut once, &buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => {
                tracing::debug!(error = %e, "reading the plugin's log");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn handle(agent: &Agent, once: &mut Once, bytes: &[u8]) {
    let Ok(d) = serde_json::from_slice::<Datagram>(bytes) else {
        tracing::debug!(
            bytes = bytes.len(),
            "an unreadable datagram on the plugin's log socket"
        );
        return;
    };
    match d.kind.as_str() {
        "skip" => skipped(agent, once, &d),
        _ => emit(&d),
    }
}

/// The plugin's line, at its level.
fn emit(d: &Datagram) {
    let pod = d.pod();
    macro_rules! at {
        ($level:expr) => {
            tracing::event!(
                target: "sidestep::cni",
                $level,
                pod = %pod,
                container_id = %d.container_id,
                command = %d.command,
                "{}",
                d.message
            )
        };
    }
    match d.level.as_str() {
        "ERROR" => at!(tracing::Level::ERROR),
        "WARN" => at!(tracing::Level::WARN),
        "DEBUG" => at!(tracing::Level::DEBUG),
        "TRACE" => at!(tracing::Level::TRACE),
        _ => at!(tracing::Level::INFO),
    }
}

fn skipped(agent: &Agent, once: &mut Once, d: &Datagram) {
    let action = on_skip(once, d);
    if action == Action::Nothing {
        return;
    }
    agent.counters.warnings.count_skipped(&d.reason);
    if action != Action::CountAndWarn {
        return;
    }
    let message = istio_init_message();
    tracing::warn!(pod = %d.pod(), container_id = %d.container_id, "{message}");
    if d.pod_name.is_empty() || d.pod_namespace.is_empty() {
        return;
    }
    let uid = if d.pod_uid.is_empty() {
        agent
            .pod_watch
            .uid_of(&d.pod_namespace, &d.pod_name)
            .unwrap_or_default()
    } else {
        d.pod_uid.clone()
    };
    let pod = NodePod {
        namespace: d.pod_namespace.clone(),
        name: d.pod_name.clone(),
        uid,
    };
    agent
        .events
        .post(Subject::Pod(pod), Reason::IstioInitPresent, message);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skip(ns: &str, name: &str, uid: &str, reason: &str) -> Datagram {
        Datagram {
            kind: "skip".into(),
            reason: reason.into(),
            pod_namespace: ns.into(),
            pod_name: name.into(),
            pod_uid: uid.into(),
            container_id: format!("c-{name}"),
            ..Datagram::default()
        }
    }

    #[test]
    fn warns_once_per_pod_and_only_for_istio_init() {
        let mut once = Once::new(100);
        let web = skip("shop", "web", "u1", ISTIO_INIT);
        assert_eq!(on_skip(&mut once, &web), Action::CountAndWarn);
        // The runtime's retry, repair's ADD of the same pod: nothing again.
        assert_eq!(on_skip(&mut once, &web), Action::Nothing);
        // Another pod of the same name (recreated: a new UID) is another pod.
        let again = skip("shop", "web", "u2", ISTIO_INIT);
        assert_eq!(on_skip(&mut once, &again), Action::CountAndWarn);
        // Not injected: counted, no warning.
        let plain = skip("shop", "plain", "u3", "not-injected");
        assert_eq!(on_skip(&mut once, &plain), Action::Count);
        assert_eq!(on_skip(&mut once, &plain), Action::Nothing);
        // Without a UID, the name decides.
        let named = skip("shop", "named", "", ISTIO_INIT);
        assert_eq!(on_skip(&mut once, &named), Action::CountAndWarn);
        assert_eq!(on_skip(&mut once, &named), Action::Nothing);
    }

    #[test]
    fn forgets_the_oldest_past_its_bound() {
        let mut once = Once::new(2);
        assert!(once.first("a"));
        assert!(once.first("b"));
        assert!(!once.first("a"));
        assert!(once.first("c"));
        assert!(once.first("a"), "a was the oldest, forgotten for c");
        assert!(!once.first("c"));
    }

    #[test]
    fn reads_the_plugins_datagram() {
        let d: Datagram = serde_json::from_str(
            r#"{"kind":"log","level":"WARN","message":"m","command":"ADD",
                "containerId":"c1","podNamespace":"shop","podName":"web","podUid":"u1",
                "unknown":"ignored"}"#,
        )
        .unwrap();
        assert_eq!(d.pod(), "shop/web");
        assert_eq!(d.pod_key(), "uid u1");
        assert_eq!(d.level, "WARN");
        assert_eq!(d.container_id, "c1");
    }

    #[test]
    fn binds_over_a_dead_socket_but_not_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SOCKET_NAME);
        // A socket file left by an agent that died.
        drop(UnixDatagram::bind(&path).unwrap());
        let b = Bound::bind(&path).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // Another agent starting meanwhile leaves it alone.
        assert!(Bound::bind(&path).is_err());
        assert!(b.current());
        b.close();
        assert!(!path.exists());
        std::fs::write(&path, "not a socket").unwrap();
        assert!(
            Bound::bind(&path).is_err(),
            "a regular file is never replaced"
        );
    }
}
