//! Pods on this node that should be captured and are not, by `namespace/name`: only the running
//! agent knows them (its last reconcile), so `check` asks it for `/debug/pods` at its `listen`
//! address, on the node's loopback.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    time::Duration,
};

use super::{DOC_PODS, Found, Item};
use crate::agent::{
    http::{DebugPods, PodRef},
    listen::Listen,
    settings::Settings,
};

/// Connecting gets this long: the agent is on this node.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The answer: naming an unenrolled pod may cost the agent one list of the API's (10 s at most).
const READ_TIMEOUT: Duration = Duration::from_secs(15);
/// Pods named on the line; the count says how many more.
const SHOWN: usize = 5;

/// Where this node's agent answers: its own address, or the loopback of each family for
/// `:PORT` and an unspecified address.
pub fn agent_addrs(listen: Listen) -> Vec<SocketAddr> {
    match listen {
        Listen::AllAddresses(port) => vec![
            SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            SocketAddr::from((Ipv6Addr::LOCALHOST, port)),
        ],
        Listen::Addr(a) if a.ip().is_unspecified() => {
            let lo = match a.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            };
            vec![SocketAddr::new(lo, a.port())]
        }
        Listen::Addr(a) => vec![a],
    }
}

/// `GET /debug/pods` from the first address that answers.
pub fn fetch(addrs: &[SocketAddr]) -> Result<DebugPods, String> {
    let mut errors = Vec::new();
    for a in addrs {
        match get(*a) {
            Ok(p) => return Ok(p),
            Err(e) => errors.push(format!("{a}: {e}")),
        }
    }
    Err(errors.join("; "))
}

fn get(addr: SocketAddr) -> Result<DebugPods, String> {
    let mut s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(READ_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(CONNECT_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET /debug/pods HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    parse_response(&raw)
}

/// The body of an HTTP/1.1 answer with a `Content-Length` (hyper's for a full body).
pub fn parse_response(raw: &[u8]) -> Result<DebugPods, String> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or("no HTTP answer".to_owned())?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) == Some("404") {
        return Err("the agent has no /debug/pods (a build older than this check)".into());
    }
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!("the agent answered {status}"));
    }
    serde_json::from_str(body).map_err(|e| format!("the agent's /debug/pods: {e}"))
}

fn label(p: &PodRef) -> String {
    match (&p.pod, &p.netns) {
        (Some(pod), _) => pod.clone(),
        (None, Some(netns)) => format!("netns {netns}"),
        (None, None) => format!("netns cookie {}", p.netns_cookie),
    }
}

/// ✖ when a live pod netns is not captured: up to [`SHOWN`] named, and the count.
pub fn judge(p: &DebugPods) -> Found {
    let counts = format!(
        "{} enrolled, {} skipped by the plugin's rules, {} let start uncaptured (FAIL_OPEN)",
        p.enrolled.len(),
        p.skipped.len(),
        p.failopen
    );
    if p.unenrolled.is_empty() {
        return Ok(format!("no pod left uncaptured: {counts}"));
    }
    let mut names: Vec<String> = p.unenrolled.iter().take(SHOWN).map(label).collect();
    if p.unenrolled.len() > SHOWN {
        names.push(format!("and {} more", p.unenrolled.len() - SHOWN));
    }
    let hint = if p.repair {
        "repair could not enrol them (see the agent's log and the pods' Events); deleting a pod \
         recreates it through the CNI chain"
    } else {
        "repair is off, so these are every uncaptured pod netns, meshed or not: turn repair on \
         (it enrols meshed pods in place and skips the others), or delete the meshed ones"
    };
    Err((
        format!(
            "{} pods not captured: {}; {counts}",
            p.unenrolled.len(),
            names.join(", ")
        ),
        hint.into(),
    ))
}

pub(super) fn item(s: &Settings) -> Item {
    let addrs = agent_addrs(s.listen);
    match fetch(&addrs) {
        Ok(p) if p.reconciles == 0 => Item::warn(
            "pods",
            DOC_PODS,
            "the agent has not reconciled yet: no pods to judge".into(),
            "run the check again in a few seconds",
        ),
        // A drain takes pods out on purpose.
        Ok(DebugPods {
            draining: Some(status),
            ..
        }) => Item::warn(
            "pods",
            DOC_PODS,
            format!("uninstall requested: {status}"),
            "unset uninstall-requested to install again",
        ),
        Ok(p) => Item::new("pods", DOC_PODS, judge(&p)),
        Err(e) => Item::warn(
            "pods",
            DOC_PODS,
            format!("the agent is not reachable ({e})"),
            format!(
                "only the running agent knows which pods it left uncaptured: is it running, \
                 with listen {}?",
                s.listen
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn netns(cookie: u64, pod: Option<&str>) -> PodRef {
        PodRef {
            netns_cookie: cookie,
            netns: Some(format!("/run/netns/cni-{cookie}")),
            pod: pod.map(str::to_owned),
            reason: None,
        }
    }

    #[test]
    fn uncaptured_pods_fail_by_name() {
        let mut p = DebugPods {
            reconciles: 1,
            repair: true,
            enrolled: vec![netns(1, Some("shop/web"))],
            ..DebugPods::default()
        };
        assert!(judge(&p).unwrap().contains("1 enrolled"));
        p.unenrolled = (10..17)
            .map(|c| netns(c, (c % 2 == 0).then_some("shop/db")))
            .collect();
        let (line, hint) = judge(&p).unwrap_err();
        assert!(
            line.starts_with("7 pods not captured: shop/db, netns /run/netns/cni-11"),
            "{line}"
        );
        assert!(line.contains("and 2 more"), "{line}");
        assert!(hint.contains("repair could not"), "{hint}");
        p.repair = false;
        assert!(judge(&p).unwrap_err().1.contains("repair is off"));
    }

    #[test]
    fn the_answer_is_read_and_the_agent_found() {
        let body = serde_json::to_string(&DebugPods {
            reconciles: 3,
            unenrolled: vec![netns(5, Some("shop/web"))],
            ..DebugPods::default()
        })
        .unwrap();
        let raw = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let p = parse_response(raw.as_bytes()).unwrap();
        assert_eq!(p.unenrolled[0].pod.as_deref(), Some("shop/web"));
        let e = parse_response(b"HTTP/1.1 404 Not Found\r\n\r\ntry").unwrap_err();
        assert!(e.contains("older"), "{e}");
        assert_eq!(
            agent_addrs(Listen::parse(":9964").unwrap()),
            [
                "127.0.0.1:9964".parse().unwrap(),
                "[::1]:9964".parse().unwrap()
            ]
        );
        assert_eq!(
            agent_addrs(Listen::parse("0.0.0.0:1").unwrap()),
            ["127.0.0.1:1".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(
            agent_addrs(Listen::parse("10.0.0.1:1").unwrap()),
            ["10.0.0.1:1".parse::<SocketAddr>().unwrap()]
        );
        // Nobody listens on a port just freed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        assert!(fetch(&agent_addrs(Listen::AllAddresses(port))).is_err());
    }
}
