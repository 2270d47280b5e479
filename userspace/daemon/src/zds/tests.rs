//! The server against a client that behaves as ztunnel's `src/inpod` does: hello, then an Ack
//! for every request, the netns fd checked to be a network namespace.

use std::{
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};

use super::{proto::*, wire, *};

/// `NS_GET_NSTYPE` (linux/nsfs.h): `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

fn socket_path(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    (dir, path)
}

struct Ztunnel {
    fd: OwnedFd,
}

/// What the fake ztunnel received.
#[derive(Debug, PartialEq)]
enum Got {
    Add {
        uid: String,
        name: String,
        netns_fd: bool,
    },
    Keep(String),
    Del(String),
    SnapshotSent,
}

impl Ztunnel {
    fn connect(path: &Path) -> Self {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        connect(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
        wire::set_deadlines(fd.as_fd(), Duration::from_secs(10)).unwrap();
        let z = Self { fd };
        wire::send(
            z.fd.as_fd(),
            &ZdsHello {
                version: Version::V1 as i32,
            },
            None,
        )
        .unwrap();
        z
    }

    /// Reads one request and answers it with `error` (empty: an Ack).
    fn answer(&self, error: &str) -> Got {
        let (req, fds) = wire::recv::<WorkloadRequest>(self.fd.as_fd(), "a request").unwrap();
        let got = match req.payload.unwrap() {
            workload_request::Payload::Add(a) => {
                assert_eq!(fds.len(), 1, "an Add carries exactly one fd");
                Got::Add {
                    uid: a.uid,
                    name: a.workload_info.unwrap().name,
                    // SAFETY: an ioctl on an fd we own, with no argument.
                    netns_fd: unsafe { libc::ioctl(fds[0].as_raw_fd(), NS_GET_NSTYPE) }
                        == libc::CLONE_NEWNET,
                }
            }
            other => {
                assert!(fds.is_empty(), "only an Add carries an fd");
                match other {
                    workload_request::Payload::Keep(k) => Got::Keep(k.uid),
                    workload_request::Payload::Del(d) => Got::Del(d.uid),
                    workload_request::Payload::SnapshotSent(_) => Got::SnapshotSent,
                    workload_request::Payload::Add(_) => unreachable!(),
                }
            }
        };
        let ack = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack {
                error: error.into(),
            })),
        };
        wire::send(self.fd.as_fd(), &ack, None).unwrap();
        got
    }
}

fn pod(uid: &str, netns: Option<&str>) -> Workload {
    Workload {
        uid: uid.into(),
        name: format!("pod-{uid}"),
        namespace: "default".into(),
        service_account: "default".into(),
        netns: netns.map(PathBuf::from),
    }
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_new_ztunnel_gets_the_snapshot_then_adds_and_dels() {
    let (_dir, path) = socket_path("ztunnel.sock");
    std::fs::write(&path, "stale").unwrap();
    let server = ZdsServer::listen(&path).unwrap();
    // Known before ztunnel connects: an Add without a connection fails, and is remembered.
    assert!(matches!(
        server.add(pod("a", Some("/proc/self/ns/net"))),
        Err(ZdsError::NoZtunnel(_))
    ));
    let mut unknown_netns = pod("b", None);
    unknown_netns.netns = None;
    let _ = server.add(unknown_netns);

    let z = Ztunnel::connect(&path);
    assert_eq!(
        z.answer(""),
        Got::Add {
            uid: "a".into(),
            name: "pod-a".into(),
            netns_fd: true
        }
    );
    assert_eq!(z.answer(""), Got::Keep("b".into()));
    assert_eq!(z.answer(""), Got::SnapshotSent);
    wait_until("the connection to be ready", || server.connected());

    let adder = {
        let server = server.clone();
        std::thread::spawn(move || server.add(pod("c", Some("/proc/self/ns/net"))))
    };
    assert_eq!(
        z.answer(""),
        Got::Add {
            uid: "c".into(),
            name: "pod-c".into(),
            netns_fd: true
        }
    );
    adder.join().unwrap().unwrap();

    let deleter = {
        let server = server.clone();
        std::thread::spawn(move || server.del("a"))
    };
    assert_eq!(z.answer(""), Got::Del("a".into()));
    assert!(deleter.join().unwrap().unwrap());
    let uids: Vec<String> = server.workloads().into_iter().map(|w| w.uid).collect();
    assert_eq!(uids, ["b", "c"]);
}

#[test]
fn a_nack_fails_the_add_and_the_newest_connection_gets_adds() {
    let (_dir, path) = socket_path("z.sock");
    let server = ZdsServer::listen(&path).unwrap();
    let old = Ztunnel::connect(&path);
    assert_eq!(old.answer(""), Got::SnapshotSent);
    wait_until("the first connection", || server.connected());
    let new = Ztunnel::connect(&path);
    assert_eq!(new.answer(""), Got::SnapshotSent);
    wait_until("both connections", || {
        server.shared.state().connections.len() == 2
            && server
                .shared
                .state()
                .connections
                .iter()
                .all(|c| c.ready.load(Ordering::Acquire))
    });

    let adder = {
        let server = server.clone();
        std::thread::spawn(move || server.add(pod("x", Some("/proc/self/ns/net"))))
    };
    assert!(matches!(
        new.answer("failure to start proxy"),
        Got::Add { .. }
    ));
    match adder.join().unwrap() {
        Err(ZdsError::Nack { uid, reason }) => {
            assert_eq!(uid, "x");
            assert_eq!(reason, "failure to start proxy");
        }
        other => panic!("expected a NACK, got {other:?}"),
    }
    // A Del goes to both.
    let deleter = {
        let server = server.clone();
        std::thread::spawn(move || server.del("x"))
    };
    assert_eq!(new.answer(""), Got::Del("x".into()));
    assert_eq!(old.answer(""), Got::Del("x".into()));
    assert!(deleter.join().unwrap().unwrap());
}

#[test]
fn an_oversized_message_or_a_hang_up_ends_the_connection() {
    let (_dir, path) = socket_path("z.sock");
    let server = ZdsServer::listen(&path).unwrap();
    let z = Ztunnel::connect(&path);
    assert_eq!(z.answer(""), Got::SnapshotSent);
    wait_until("the connection", || server.connected());
    // ztunnel never speaks first after its hello; a packet longer than 1024 bytes is refused.
    let long = ZdsHello { version: 1 };
    let mut bytes = prost::Message::encode_to_vec(&long);
    bytes.resize(2000, 0);
    nix::sys::socket::send(
        z.fd.as_raw_fd(),
        &bytes,
        nix::sys::socket::MsgFlags::empty(),
    )
    .unwrap();
    wait_until("the connection to be dropped", || !server.connected());

    let z2 = Ztunnel::connect(&path);
    assert_eq!(z2.answer(""), Got::SnapshotSent);
    wait_until("the second connection", || server.connected());
    drop(z2);
    wait_until("the hang-up to be noticed", || !server.connected());
    assert!(matches!(
        server.add(pod("late", Some("/proc/self/ns/net"))),
        Err(ZdsError::NoZtunnel(_))
    ));
}

#[test]
fn a_workload_argument_has_five_fields() {
    let w = Workload::parse("u1,shop,web,web-sa,/run/netns/web").unwrap();
    assert_eq!(
        (w.uid.as_str(), w.namespace.as_str(), w.name.as_str()),
        ("u1", "shop", "web")
    );
    assert_eq!(w.service_account, "web-sa");
    assert_eq!(w.netns, Some(PathBuf::from("/run/netns/web")));
    assert!(
        Workload::parse("u1,shop,web,/run/netns/web")
            .unwrap_err()
            .contains("5 fields")
    );
    assert!(
        Workload::parse("u1,,web,sa,/n")
            .unwrap_err()
            .contains("empty")
    );
}

#[test]
fn a_closed_server_holds_ztunnel_until_it_knows_its_pods() {
    let (_dir, path) = socket_path("z.sock");
    let server = ZdsServer::listen_closed(&path).unwrap();
    assert!(!server.is_open());
    // ztunnel connects at once (the agent just restarted); nothing is sent to it yet.
    let z = Ztunnel::connect(&path);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!server.connected());
    // The pods the agent knows, one whose netns is gone: a Keep, so ztunnel keeps its proxy.
    let _ = server.add(pod("a", Some("/proc/self/ns/net")));
    let _ = server.add(pod("gone", Some("/nonexistent/netns")));
    server.open();
    assert_eq!(
        z.answer(""),
        Got::Add {
            uid: "a".into(),
            name: "pod-a".into(),
            netns_fd: true
        }
    );
    assert_eq!(z.answer(""), Got::Keep("gone".into()));
    assert_eq!(z.answer(""), Got::SnapshotSent);
    wait_until("the connection", || server.connected());
}
