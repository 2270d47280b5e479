//! `probe ztunnel UDS`: a stand-in for ztunnel in in-pod mode, for the agent's ambient tests. It
//! speaks ZDS as ztunnel does (hello, then an Ack for every request; an Add without exactly one
//! fd is refused), and for each Add it enters the pod's netns from the fd and listens there on
//! 15001, 15006 and 15008 (both families), every socket marked 1337 and transparent as ztunnel's
//! are. It does not proxy: each accepted connection is reported as a JSON line with the workload
//! and what SO_ORIGINAL_DST says, and ZDS events are reported as lines too. When the agent goes
//! away it connects again, keeping its proxies, as ztunnel does.

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::{SocketAddr, TcpListener},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

use nix::{
    sched::{CloneFlags, setns},
    sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket},
};
use sidestep_tests::zds::{self, Request, ZdsHello};

use crate::sock::{json_result, listen_marked, original_dst};

const PORTS: [u16; 3] = [15001, 15006, 15008];
const MARK: i32 = 1337;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub(super) fn run(uds: &Path) -> i32 {
    match serve(uds) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("probe ztunnel: {e:#}");
            1
        }
    }
}

fn connect_agent(uds: &Path) -> anyhow::Result<OwnedFd> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        match connect(fd.as_raw_fd(), &UnixAddr::new(uds)?) {
            Ok(()) => return Ok(fd),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => anyhow::bail!("connecting to {}: {e}", uds.display()),
        }
    }
}

/// Connects again whenever the agent goes away, as ztunnel does; the proxies keep running
/// across connections, and an Add for one that runs is a no-op.
fn serve(uds: &Path) -> anyhow::Result<()> {
    // Listener fds per workload, to close on Del.
    let mut running: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    loop {
        let conn = connect_agent(uds)?;
        zds::send(conn.as_fd(), &ZdsHello { version: 1 })?;
        say(r#"{"zds":"hello"}"#);
        if let Err(e) = serve_connection(&conn, &mut running) {
            say(&format!(r#"{{"zds":"error","error":"{e}"}}"#));
        }
    }
}

fn serve_connection(
    conn: &OwnedFd,
    running: &mut BTreeMap<String, Vec<i32>>,
) -> anyhow::Result<()> {
    while let Some((req, fds)) = zds::recv_request(conn.as_fd())? {
        let answer = match req.payload {
            Some(Request::Add(add)) => {
                let info = add.workload_info.unwrap_or_default();
                say(&format!(
                    r#"{{"zds":"add","uid":"{}","name":"{}","namespace":"{}","sa":"{}","fds":{}}}"#,
                    add.uid,
                    info.name,
                    info.namespace,
                    info.service_account,
                    fds.len()
                ));
                match (fds.len(), running.contains_key(&add.uid)) {
                    (1, true) => String::new(),
                    (1, false) => match start_proxy(&add.uid, &fds[0]) {
                        Ok(listeners) => {
                            running.insert(add.uid, listeners);
                            String::new()
                        }
                        Err(e) => format!("failure to start proxy: {e}"),
                    },
                    (n, _) => format!("an Add needs exactly one fd, got {n}"),
                }
            }
            Some(Request::Keep(k)) => {
                say(&format!(r#"{{"zds":"keep","uid":"{}"}}"#, k.uid));
                String::new()
            }
            Some(Request::Del(d)) => {
                say(&format!(r#"{{"zds":"del","uid":"{}"}}"#, d.uid));
                for fd in running.remove(&d.uid).unwrap_or_default() {
                    // SAFETY: a listening socket this process owns; shutdown ends its accept loop.
                    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                }
                String::new()
            }
            Some(Request::SnapshotSent(_)) => {
                say(r#"{"zds":"snapshot-sent"}"#);
                String::new()
            }
            None => "an empty request".into(),
        };
        zds::send(conn.as_fd(), &zds::ack(&answer))?;
    }
    say(r#"{"zds":"closed"}"#);
    Ok(())
}

/// Enters the netns on a thread of its own (setns is per thread), binds the listeners there,
/// and serves them from threads that keep the sockets, wherever they run.
fn start_proxy(uid: &str, netns: &OwnedFd) -> anyhow::Result<Vec<i32>> {
    let netns = netns.try_clone()?;
    let (tx, rx) = mpsc::channel();
    let uid_owned = uid.to_owned();
    std::thread::spawn(move || {
        let bound = (|| -> anyhow::Result<Vec<TcpListener>> {
            setns(&netns, CloneFlags::CLONE_NEWNET)?;
            let mut out = Vec::new();
            for port in PORTS {
                for addr in [
                    SocketAddr::from(([0, 0, 0, 0], port)),
                    SocketAddr::from(([0u16; 8], port)),
                ] {
                    // Marked before the bind, as ztunnel's in-pod socket factory does: in an
                    // ambient pod only a marked socket may bind these ports.
                    let l = listen_marked(addr, true, true, Some(MARK))?;
                    out.push(l);
                }
            }
            Ok(out)
        })();
        match bound {
            Ok(listeners) => {
                let fds = listeners.iter().map(AsRawFd::as_raw_fd).collect();
                let _ = tx.send(Ok(fds));
                for l in listeners {
                    let uid = uid_owned.clone();
                    std::thread::spawn(move || accept(&uid, &l));
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(10))?
}

fn accept(uid: &str, listener: &TcpListener) {
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    for conn in listener.incoming() {
        let Ok(conn) = conn else {
            return;
        };
        let v4 = original_dst(&conn, libc::SOL_IP);
        let v6 = original_dst(&conn, libc::SOL_IPV6);
        say(&format!(
            r#"{{"workload":"{uid}","listener":"{port}","peer":"{}","local":"{}","orig_v4":{},"orig_v6":{}}}"#,
            conn.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
            conn.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            json_result(&v4),
            json_result(&v6)
        ));
        let mut c = &conn;
        let _ = c.write_all(b"ztunnel\n");
    }
}
