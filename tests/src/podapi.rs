//! A local HTTP server that answers as kube-apiserver does for the pods it holds, for the agent's
//! list, get and watch: `GET /api/v1/pods?fieldSelector=spec.nodeName=N` (a PodList with the
//! current resourceVersion), `?watch=true&resourceVersion=R` (chunked JSON lines, one event per
//! change after R: ADDED / MODIFIED / DELETED, BOOKMARK lines when asked for, and an ERROR event
//! with a 410 Status when R is older than what it keeps, as after etcd compaction), and
//! `GET /api/v1/namespaces/NS/pods/NAME` (and PATCH of it or of its `status`), and Namespaces:
//! `GET /api/v1/namespaces/NS`, and the list and watch of `/api/v1/namespaces`. Pods and
//! namespaces can be added, changed and deleted while clients watch.
//! Stops when dropped. The agent tests and the CNI benchmark's API lane use it; it answers a
//! request as soon as it arrives (a blocking accept), so its own latency stays in microseconds.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex, atomic::AtomicBool, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::Result;
use serde_json::{Value, json};

#[derive(Default)]
struct State {
    pods: Vec<Value>,
    namespaces: Vec<Value>,
    nodes: Vec<Value>,
    /// Events created (POST .../events), in order.
    events_posted: Vec<Value>,
    /// (resourceVersion, event type, object), oldest first.
    events: Vec<(u64, &'static str, Value)>,
    rv: u64,
    /// Watches from a resourceVersion below this get 410 Gone.
    oldest: u64,
    /// Bumped to end every open watch (as an API server restart or a timeout would).
    generation: u64,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    requests: Mutex<Vec<String>>,
}

pub struct PodApi {
    pub kubeconfig: PathBuf,
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PodApi {
    pub fn start(dir: &Path, pods: Vec<Value>) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let port = addr.port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 1,
                oldest: 1,
                ..State::default()
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            requests: Mutex::new(Vec::new()),
        });
        let api = Self {
            kubeconfig: dir.join("api-kubeconfig"),
            addr,
            shared: shared.clone(),
        };
        for p in pods {
            api.add(p);
        }
        std::thread::spawn(move || {
            // Drop wakes this accept with a connection of its own once `stop` is set.
            while !shared.stop.load(Ordering::Relaxed) {
                let Ok((stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                if shared.stop.load(Ordering::Relaxed) {
                    break;
                }
                let shared = shared.clone();
                std::thread::spawn(move || serve(&shared, stream));
            }
        });
        std::fs::write(
            &api.kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: t\n\
                 clusters: [{{name: t, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n\
                 contexts: [{{name: t, context: {{cluster: t, user: t}}}}]\n\
                 users: [{{name: t, user: {{token: sidestep-test-token}}}}]\n"
            ),
        )?;
        Ok(api)
    }

    fn change(&self, kind: &'static str, mut pod: Value) {
        let mut st = lock(&self.shared.state);
        st.rv += 1;
        let rv = st.rv;
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        let same = |p: &Value| {
            p["metadata"]["namespace"] == pod["metadata"]["namespace"]
                && p["metadata"]["name"] == pod["metadata"]["name"]
        };
        let list = if is_namespace(&pod) {
            &mut st.namespaces
        } else {
            &mut st.pods
        };
        let existed = list.iter().any(same);
        list.retain(|p| !same(p));
        let kind = match kind {
            "DELETED" => kind,
            _ if existed => "MODIFIED",
            _ => "ADDED",
        };
        if kind != "DELETED" {
            list.push(pod.clone());
        }
        st.events.push((rv, kind, pod));
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Adds (or relabels) a Namespace; open namespace watches see ADDED (or MODIFIED).
    pub fn set_namespace(&self, name: &str, labels: Value) {
        self.change(
            "ADDED",
            json!({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": name, "uid": format!("uid-ns-{name}"), "labels": labels}}),
        );
    }

    /// Adds (or replaces) a pod; open watches see ADDED (or MODIFIED).
    pub fn add(&self, pod: Value) {
        self.change("ADDED", pod);
    }

    /// Deletes a pod; open watches see DELETED.
    pub fn delete(&self, pod: &Value) {
        self.change("DELETED", pod.clone());
    }

    /// Ends every open watch, lets history move on (a change the clients never saw) and forgets
    /// it (etcd compaction): a client that watches again from its last resourceVersion gets 410
    /// Gone and must list again.
    pub fn compact_and_end_watches(&self) {
        let mut st = lock(&self.shared.state);
        st.rv += 1;
        st.oldest = st.rv + 1;
        st.events.clear();
        st.generation += 1;
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Adds a Node object (`metadata.name`, `spec.taints`).
    pub fn add_node(&self, mut node: Value) {
        let mut st = lock(&self.shared.state);
        st.rv += 1;
        node["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        st.nodes.push(node);
    }

    /// The Events clients created, in order.
    pub fn events(&self) -> Vec<Value> {
        lock(&self.shared.state).events_posted.clone()
    }

    /// The pod as the API holds it now (None once deleted).
    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        lock(&self.shared.state)
            .pods
            .iter()
            .find(|p| p["metadata"]["namespace"] == ns && p["metadata"]["name"] == name)
            .cloned()
    }

    /// The node as the API holds it now.
    pub fn node(&self, name: &str) -> Option<Value> {
        lock(&self.shared.state)
            .nodes
            .iter()
            .find(|n| n["metadata"]["name"] == name)
            .cloned()
    }

    pub fn requests(&self) -> Vec<String> {
        lock(&self.shared.requests).clone()
    }
}

impl Drop for PodApi {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.changed.notify_all();
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

fn query_value<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn is_namespace(v: &Value) -> bool {
    v["kind"] == "Namespace"
}

fn serve(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(clone);
    let mut first = String::new();
    let _ = reader.read_line(&mut first);
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    let _ = std::io::Read::read_exact(&mut reader, &mut body);
    let method = first.split_whitespace().next().unwrap_or("").to_owned();
    let target = first.split_whitespace().nth(1).unwrap_or("").to_owned();
    lock(&shared.requests).push(if method == "GET" {
        target.clone()
    } else {
        format!("{method} {target} {}", String::from_utf8_lossy(&body))
    });
    let (path, query) = target.split_once('?').unwrap_or((target.as_str(), ""));
    let query = query.replace("%3D", "=").replace("%2F", "/");
    let node = query_value(&query, "fieldSelector")
        .and_then(|f| f.strip_prefix("spec.nodeName="))
        .map(str::to_owned);
    let on_node =
        |p: &Value| !is_namespace(p) && node.as_deref().is_none_or(|n| p["spec"]["nodeName"] == n);
    let mut out = stream;
    let watching = matches!(query_value(&query, "watch"), Some("true" | "1"));
    if watching && (path == "/api/v1/namespaces" || path == "/api/v1/pods") {
        let from: u64 = query_value(&query, "resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bookmarks = query_value(&query, "allowWatchBookmarks") == Some("true");
        let timeout = query_value(&query, "timeoutSeconds")
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(300), Duration::from_secs);
        let kind: (&str, &dyn Fn(&Value) -> bool) = if path == "/api/v1/namespaces" {
            ("Namespace", &is_namespace)
        } else {
            ("Pod", &on_node)
        };
        watch(shared, out, from, bookmarks, timeout, kind);
        return;
    }
    let (status, body) = if let Some(name) = path.strip_prefix("/api/v1/nodes/") {
        node_request(shared, &method, name, &body)
    } else if path == "/api/v1/namespaces" {
        let st = lock(&shared.state);
        (
            200,
            json!({"kind": "NamespaceList", "apiVersion": "v1",
                   "metadata": {"resourceVersion": st.rv.to_string()}, "items": st.namespaces}),
        )
    } else if path == "/api/v1/pods" {
        let st = lock(&shared.state);
        let items: Vec<Value> = st.pods.iter().filter(|p| on_node(p)).cloned().collect();
        (
            200,
            json!({"kind": "PodList", "apiVersion": "v1",
                   "metadata": {"resourceVersion": st.rv.to_string()}, "items": items}),
        )
    } else {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match parts.as_slice() {
            ["api", "v1", "namespaces", ns, "events"] if method == "POST" => {
                let mut event: Value = serde_json::from_slice(&body).unwrap_or_default();
                event["metadata"]["name"] = json!(format!(
                    "{}{}",
                    event["metadata"]["generateName"].as_str().unwrap_or(""),
                    lock(&shared.state).events_posted.len()
                ));
                event["metadata"]["namespace"] = json!(ns);
                lock(&shared.state).events_posted.push(event.clone());
                (201, event)
            }
            ["api", "v1", "namespaces", ns] => {
                let st = lock(&shared.state);
                match st.namespaces.iter().find(|n| n["metadata"]["name"] == *ns) {
                    Some(n) => (200, n.clone()),
                    None => not_found(path),
                }
            }
            ["api", "v1", "namespaces", ns, "pods", name]
            | ["api", "v1", "namespaces", ns, "pods", name, "status"] => {
                pod_request(shared, &method, ns, name, &body, path)
            }
            _ => not_found(path),
        }
    };
    let body = body.to_string();
    let _ = write!(
        out,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// GET a pod, PATCH its labels and annotations (a JSON merge patch, on the pod or its status
/// subresource), or DELETE it (honouring a UID precondition); a delete is a DELETED event for
/// watchers.
fn pod_request(
    shared: &Shared,
    method: &str,
    ns: &str,
    name: &str,
    body: &[u8],
    path: &str,
) -> (u16, Value) {
    let mut st = lock(&shared.state);
    let Some(i) = st
        .pods
        .iter()
        .position(|p| p["metadata"]["namespace"] == ns && p["metadata"]["name"] == name)
    else {
        return not_found(path);
    };
    match method {
        "PATCH" => {
            let patch: Value = serde_json::from_slice(body).unwrap_or_default();
            st.rv += 1;
            let rv = st.rv;
            let pod = &mut st.pods[i];
            for field in ["labels", "annotations"] {
                if let Some(map) = patch["metadata"][field].as_object() {
                    if !pod["metadata"][field].is_object() {
                        pod["metadata"][field] = json!({});
                    }
                    for (k, v) in map {
                        // A JSON merge patch: null removes the key.
                        match (v.is_null(), pod["metadata"][field].as_object_mut()) {
                            (true, Some(fields)) => {
                                fields.remove(k);
                            }
                            _ => pod["metadata"][field][k] = v.clone(),
                        }
                    }
                }
            }
            pod["metadata"]["resourceVersion"] = json!(rv.to_string());
            let pod = pod.clone();
            st.events.push((rv, "MODIFIED", pod.clone()));
            drop(st);
            shared.changed.notify_all();
            (200, pod)
        }
        "DELETE" => {
            let params: Value = serde_json::from_slice(body).unwrap_or_default();
            if let Some(uid) = params["preconditions"]["uid"].as_str()
                && st.pods[i]["metadata"]["uid"] != uid
            {
                return (
                    409,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "reason": "Conflict", "code": 409, "message": "uid precondition"}),
                );
            }
            st.rv += 1;
            let rv = st.rv;
            let pod = st.pods.remove(i);
            st.events.push((rv, "DELETED", pod.clone()));
            drop(st);
            shared.changed.notify_all();
            (200, pod)
        }
        _ => (200, st.pods[i].clone()),
    }
}

/// GET a node, or PATCH it with a JSON merge patch of `spec.taints` that carries the node's
/// `metadata.resourceVersion` (409 Conflict when it is not the current one).
fn node_request(shared: &Shared, method: &str, name: &str, body: &[u8]) -> (u16, Value) {
    let mut st = lock(&shared.state);
    st.rv += 1;
    let rv = st.rv;
    let Some(node) = st.nodes.iter_mut().find(|n| n["metadata"]["name"] == name) else {
        return not_found(&format!("/api/v1/nodes/{name}"));
    };
    if method != "PATCH" {
        return (200, node.clone());
    }
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return (
            400,
            json!({"kind": "Status", "code": 400, "message": "bad patch"}),
        );
    };
    if let Some(want) = patch["metadata"]["resourceVersion"].as_str()
        && node["metadata"]["resourceVersion"] != want
    {
        return (
            409,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": "Conflict", "code": 409, "message": "the object has been modified"}),
        );
    }
    if let Some(taints) = patch["spec"].get("taints") {
        node["spec"]["taints"] = taints.clone();
    }
    node["metadata"]["resourceVersion"] = json!(rv.to_string());
    (200, node.clone())
}

fn not_found(path: &str) -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
               "reason": "NotFound", "code": 404, "message": format!("{path} not found")}),
    )
}

fn chunk(out: &mut TcpStream, line: &Value) -> std::io::Result<()> {
    let text = format!("{line}\n");
    write!(out, "{:x}\r\n{text}\r\n", text.len())?;
    out.flush()
}

fn watch(
    shared: &Shared,
    mut out: TcpStream,
    from: u64,
    bookmarks: bool,
    timeout: Duration,
    (kind, on_node): (&str, &dyn Fn(&Value) -> bool),
) {
    if write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return;
    }
    let deadline = Instant::now() + timeout;
    let mut sent = from;
    let mut st = lock(&shared.state);
    let generation = st.generation;
    if from < st.oldest.saturating_sub(1) {
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
            "status": "Failure", "reason": "Expired", "code": 410,
            "message": format!("too old resource version: {from} ({})", st.oldest)}});
        drop(st);
        let _ = chunk(&mut out, &gone);
        let _ = write!(out, "0\r\n\r\n");
        return;
    }
    let mut last_bookmark = Instant::now();
    loop {
        if shared.stop.load(Ordering::Relaxed)
            || st.generation != generation
            || Instant::now() >= deadline
        {
            drop(st);
            lock(&shared.requests).push(format!("debug: watch from {from} ends at {sent}"));
            break;
        }
        let fresh: Vec<(u64, &'static str, Value)> = st
            .events
            .iter()
            .filter(|(rv, _, p)| *rv > sent && on_node(p))
            .cloned()
            .collect();
        let now_rv = st.rv;
        drop(st);
        for (rv, kind, pod) in fresh {
            if let Err(e) = chunk(&mut out, &json!({"type": kind, "object": pod})) {
                lock(&shared.requests).push(format!("debug: watch from {from}: write: {e}"));
                return;
            }
            sent = rv;
        }
        sent = sent.max(now_rv);
        if bookmarks && last_bookmark.elapsed() >= Duration::from_secs(1) {
            let mark = json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1",
                "metadata": {"resourceVersion": sent.to_string()}}});
            if let Err(e) = chunk(&mut out, &mark) {
                lock(&shared.requests).push(format!("debug: watch from {from}: bookmark: {e}"));
                return;
            }
            last_bookmark = Instant::now();
        }
        st = lock(&shared.state);
        if st.rv == now_rv {
            st = shared
                .changed
                .wait_timeout(st, Duration::from_millis(500))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
    let _ = write!(out, "0\r\n\r\n");
}
