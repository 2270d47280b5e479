//! The plugin's log lines and skip notices, sent to the node agent as it runs, so that
//! `kubectl logs` of the agent shows them (istio-cni's plugin sends its own to its agent the
//! same way, over a socket).
//!
//! One datagram per line, a JSON object, to the agent's Unix datagram socket
//! `<state_dir>/log.sock` (the agent's `plugin::log` reads it). The plugin runs in the runtime's
//! ADD and DEL, so nothing here may hold them up or fail them: the socket is non-blocking, an
//! absent agent (no socket file, or nobody bound to it) is found once at start and nothing is
//! sent, and a datagram the agent has no room for is dropped. The plugin's own stderr and
//! `log_file` carry every line whatever happens here.

use std::{fmt::Write as _, os::unix::net::UnixDatagram, path::Path, sync::OnceLock};

use serde_json::{Value, json};
use tracing::{Event, Level, Subscriber, field::Field};
use tracing_subscriber::{Layer, layer::Context};

// The agent's socket, in the state directory both share (its format's owner names it).
pub use sidestep::statedir::LOG_SOCKET_NAME as SOCKET_NAME;

/// A line longer than this is cut: a datagram must fit the socket's send buffer.
const MAX_MESSAGE: usize = 4096;

/// Who the invocation is about, from the CNI environment: every datagram carries it, so that
/// the agent names the pod on each line it writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Invocation {
    pub command: String,
    pub container_id: String,
    pub pod_namespace: String,
    pub pod_name: String,
    pub pod_uid: String,
}

impl Invocation {
    /// From `CNI_COMMAND`, `CNI_CONTAINERID` and `CNI_ARGS`'s `K8S_POD_*`. A `CNI_ARGS` that does
    /// not parse leaves the pod unnamed: the plugin's own checks report it.
    pub fn from_env(get_env: &dyn Fn(&str) -> Option<String>) -> Self {
        let args = get_env("CNI_ARGS")
            .and_then(|a| crate::spec::env::CniArgs::parse(&a).ok())
            .unwrap_or_default();
        let arg = |k: &str| args.get(k).unwrap_or_default().to_owned();
        Self {
            command: get_env("CNI_COMMAND").unwrap_or_default(),
            container_id: get_env("CNI_CONTAINERID").unwrap_or_default(),
            pod_namespace: arg("K8S_POD_NAMESPACE"),
            pod_name: arg("K8S_POD_NAME"),
            pod_uid: arg("K8S_POD_UID"),
        }
    }

    fn datagram(&self, fields: Value) -> Vec<u8> {
        let mut v = json!({
            "command": self.command,
            "containerId": self.container_id,
            "podNamespace": self.pod_namespace,
            "podName": self.pod_name,
            "podUid": self.pod_uid,
        });
        if let (Some(o), Value::Object(f)) = (v.as_object_mut(), fields) {
            o.extend(f);
        }
        serde_json::to_vec(&v).unwrap_or_default()
    }
}

/// A socket connected to the agent's, non-blocking.
#[derive(Debug)]
pub struct Sender {
    socket: UnixDatagram,
    invocation: Invocation,
}

impl Sender {
    /// Connected to `<state_dir>/log.sock`, or `None` when no agent listens there now.
    pub fn connect(state_dir: &Path, invocation: Invocation) -> Option<Self> {
        let socket = UnixDatagram::unbound().ok()?;
        socket.set_nonblocking(true).ok()?;
        socket.connect(state_dir.join(SOCKET_NAME)).ok()?;
        Some(Self { socket, invocation })
    }

    /// Sends one datagram; a full queue, a gone agent or anything else drops it.
    fn send(&self, fields: Value) {
        let _ = self.socket.send(&self.invocation.datagram(fields));
    }

    pub fn log(&self, level: &Level, message: &str) {
        self.send(json!({"kind": "log", "level": level.as_str(), "message": cut(message)}));
    }

    /// The ADD left the pod uncaptured for `reason` ([`crate::mesh::SkipReason::code`]).
    pub fn skipped(&self, reason: &str, detail: &str) {
        self.send(json!({"kind": "skip", "reason": reason, "message": cut(detail)}));
    }
}

fn cut(s: &str) -> &str {
    if s.len() <= MAX_MESSAGE {
        return s;
    }
    let mut end = MAX_MESSAGE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

static SENDER: OnceLock<Sender> = OnceLock::new();

/// Sets the process's sender; only the binary's main does (tests run invocations in-process
/// and send nothing).
pub fn install(sender: Sender) {
    let _ = SENDER.set(sender);
}

/// Tells the agent that the ADD left the pod uncaptured; nothing without an agent.
pub fn skipped(reason: &str, detail: &str) {
    if let Some(s) = SENDER.get() {
        s.skipped(reason, detail);
    }
}

/// The tracing layer that sends each line (behind the plugin's level filter) to the agent.
pub struct Forward;

impl<S: Subscriber> Layer<S> for Forward {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let Some(sender) = SENDER.get() else {
            return;
        };
        let mut line = Line::default();
        event.record(&mut line);
        sender.log(event.metadata().level(), &line.text());
    }
}

/// The event's message, then its other fields as `name=value`, as the fmt layer writes them.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Line {
    fn text(self) -> String {
        match (self.message.is_empty(), self.fields.is_empty()) {
            (_, true) => self.message,
            (true, false) => self.fields,
            (false, false) => format!("{} {}", self.message, self.fields),
        }
    }
}

impl tracing::field::Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
            return;
        }
        if !self.fields.is_empty() {
            self.fields.push(' ');
        }
        let _ = write!(self.fields, "{}={value:?}", field.name());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn names_the_pod_from_the_cni_environment() {
        let i = Invocation::from_env(&env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web;K8S_POD_UID=u1",
            ),
        ]));
        assert_eq!(i.pod_namespace, "shop");
        assert_eq!(i.pod_name, "web");
        assert_eq!(i.pod_uid, "u1");
        assert_eq!(i.container_id, "c1");
        // A broken CNI_ARGS names no pod; the invocation itself still reports the error.
        let bad = Invocation::from_env(&env(&[("CNI_ARGS", "nonsense")]));
        assert_eq!(bad.pod_name, "");
    }

    #[test]
    fn sends_without_blocking_and_drops_when_nobody_reads() {
        let dir = tempfile::tempdir().unwrap();
        // No agent: no sender at all.
        assert!(Sender::connect(dir.path(), Invocation::default()).is_none());
        let agent = UnixDatagram::bind(dir.path().join(SOCKET_NAME)).unwrap();
        let s = Sender::connect(
            dir.path(),
            Invocation {
                command: "ADD".into(),
                pod_name: "web".into(),
                ..Invocation::default()
            },
        )
        .unwrap();
        s.log(&Level::WARN, "hello");
        let mut buf = [0u8; 65536];
        let n = agent.recv(&mut buf).unwrap();
        let v: Value = serde_json::from_slice(&buf[..n]).unwrap();
        assert_eq!(v["kind"], "log");
        assert_eq!(v["level"], "WARN");
        assert_eq!(v["message"], "hello");
        assert_eq!(v["podName"], "web");
        // An agent that reads nothing: its queue fills, and sends go on returning at once.
        let started = std::time::Instant::now();
        for _ in 0..10_000 {
            s.skipped("istio-init", &"x".repeat(10_000));
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        let n = agent.recv(&mut buf).unwrap();
        let v: Value = serde_json::from_slice(&buf[..n]).unwrap();
        assert_eq!(v["kind"], "skip");
        assert_eq!(v["message"].as_str().unwrap().len(), MAX_MESSAGE);
        // The agent went away: still no error, no wait.
        drop(agent);
        s.log(&Level::INFO, "nobody");
    }

    #[test]
    fn a_line_is_its_message_then_its_fields() {
        let l = Line {
            message: "m".into(),
            fields: "a=1".into(),
        };
        assert_eq!(l.text(), "m a=1");
        assert_eq!(cut(&"é".repeat(MAX_MESSAGE)).len(), MAX_MESSAGE);
    }
}
