//! The per-pod verdict log: pods with `flags::DEBUG` (annotation `sidestep.io/debug: "true"`, or
//! `sidestep debug --netns`) have every connect and inbound SYN decision logged by the BPF
//! programs through aya-log, as `key=value` fields. This module turns the flag on and off in place
//! and reads the lines back; the agent forwards them to its log with the pod's name.
//!
//! The ring buffer (`AYA_LOGS`) is pinned with the other maps, so a reader keeps reading across an
//! upgrade; after an unload and a new load it must open the new one ([`VerdictReader::is_current`]).

use std::{
    net::IpAddr,
    os::fd::AsFd,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use aya_log::EbpfLogger;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use sidestep_abi::{flags, map_names, program_names, redirect_kind, rule};

use sidestep::{error::MapsError, maps::PolicyMaps, netns::Netns, pins::PinLayout};

#[derive(Debug, thiserror::Error)]
pub enum VerdictLogError {
    #[error(
        "no sidestep programs with a verdict log are pinned under {0} (run `sidestep load`, or \
         upgrade: programs loaded by a version without the log have none)"
    )]
    NotLoaded(PathBuf),
    #[error("opening the verdict log of the pinned programs: {0}")]
    Open(#[from] aya_log::Error),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Netns(#[from] sidestep::error::NetnsError),
    #[error("{path} (netns cookie {cookie}) is not enrolled under this pin root")]
    NotEnrolled { path: PathBuf, cookie: u64 },
}

/// Turns the pod's verdict log on or off in place; returns its netns cookie. A re-enrolment (a
/// CNI ADD, a repair) writes the policy's own setting again: the annotation is the lasting form.
pub fn set_debug(pin_root: &Path, netns: &Path, on: bool) -> Result<u64, VerdictLogError> {
    let cookie = Netns::open(netns)?.cookie()?;
    let mut maps = PolicyMaps::open(pin_root)?;
    if !maps.set_pod_flag(cookie, flags::DEBUG, on)? {
        return Err(VerdictLogError::NotEnrolled {
            path: netns.to_owned(),
            cookie,
        });
    }
    Ok(cookie)
}

/// Which decision a line reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A connect from the pod (cgroup connect4/6).
    Connect,
    /// A new inbound connection (sk_lookup).
    Inbound,
}

/// One decision, as the BPF programs logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerdictLine {
    pub direction: Direction,
    pub netns_cookie: u64,
    pub dst: IpAddr,
    pub port: u16,
    /// The connecting process's UID (connect only).
    pub uid: Option<u32>,
    /// 0 passed, else a `redirect_kind`.
    pub kind: u16,
    /// A `sidestep_abi::rule`.
    pub rule: u16,
}

impl VerdictLine {
    /// Parses a line of the BPF programs' format (`sidestep_ebpf::debuglog`); None for anything
    /// else, so a foreign or newer line is skipped rather than misread.
    pub fn parse(message: &str) -> Option<Self> {
        let mut words = message.split_whitespace();
        let direction = match words.next()? {
            "connect" => Direction::Connect,
            "inbound" => Direction::Inbound,
            _ => return None,
        };
        let (mut netns, mut dst, mut port, mut uid, mut kind, mut rule) =
            (None, None, None, None, None, None);
        for word in words {
            let (key, value) = word.split_once('=')?;
            match key {
                "netns" => netns = Some(value.parse().ok()?),
                // IPv4 arrives in IPv4-mapped form, as the maps keep it.
                "dst" => dst = Some(value.parse::<IpAddr>().ok()?.to_canonical()),
                "port" => port = Some(value.parse().ok()?),
                "uid" => uid = Some(value.parse().ok()?),
                "kind" => kind = Some(value.parse().ok()?),
                "rule" => rule = Some(value.parse().ok()?),
                _ => return None,
            }
        }
        if direction == Direction::Connect && uid.is_none() {
            return None;
        }
        Some(Self {
            direction,
            netns_cookie: netns?,
            dst: dst?,
            port: port?,
            uid,
            kind: kind?,
            rule: rule?,
        })
    }

    /// What happened, in an operator's words.
    pub fn outcome(&self) -> &'static str {
        match (self.kind, self.rule) {
            (_, rule::IN_NO_LISTENER) => "refused",
            (redirect_kind::REFUSED, _) => "refused",
            (0, _) => "passed",
            (redirect_kind::OUTBOUND, _) => "redirected to the outbound port",
            (redirect_kind::INBOUND, _) => "redirected to the inbound port",
            (redirect_kind::DNS, _) => "redirected to the DNS port",
            (redirect_kind::TPROXY_PASSTHROUGH, _) => "passed, marked for TPROXY",
            _ => "redirected",
        }
    }

    /// One sentence: what connected where, what happened and which rule decided.
    pub fn describe(&self) -> String {
        let to = match self.dst {
            IpAddr::V4(a) => format!("{a}:{}", self.port),
            IpAddr::V6(a) => format!("[{a}]:{}", self.port),
        };
        let what = match (self.direction, self.uid) {
            (Direction::Connect, Some(uid)) => format!("connect to {to} by uid {uid}"),
            _ => format!("inbound connection to {to}"),
        };
        format!(
            "{what}: {} (rule {}: {})",
            self.outcome(),
            self.rule,
            rule::name(self.rule)
        )
    }
}

/// Collects what aya-log decodes; the reader drains it after each flush.
#[derive(Clone, Default)]
struct Collected(Arc<Mutex<Vec<String>>>);

impl log::Log for Collected {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(record.args().to_string());
    }
    fn flush(&self) {}
}

/// Reads the verdict lines of the programs pinned under a pin root.
pub struct VerdictReader {
    logger: EbpfLogger<Collected>,
    collected: Collected,
    layout: PinLayout,
    map_id: Option<u32>,
}

impl VerdictReader {
    pub fn open(pin_root: &Path) -> Result<Self, VerdictLogError> {
        let layout = PinLayout::new(pin_root);
        // The pinned sk_lookup program writes the log, so the ring buffer is among its maps.
        let program =
            aya::programs::ProgramInfo::from_pin(layout.program(program_names::SK_LOOKUP))
                .map_err(|_| VerdictLogError::NotLoaded(pin_root.to_owned()))?;
        let collected = Collected::default();
        let logger = EbpfLogger::init_from_id_with_logger(program.id(), collected.clone())
            .map_err(|e| match e {
                aya_log::Error::MapNotFound => VerdictLogError::NotLoaded(pin_root.to_owned()),
                other => VerdictLogError::Open(other),
            })?;
        let map_id = pinned_log_id(&layout);
        Ok(Self {
            logger,
            collected,
            layout,
            map_id,
        })
    }

    /// Waits up to `timeout` for lines and returns those that parse (the others are dropped: a
    /// newer program's format this version does not know).
    pub fn next_lines(&mut self, timeout: Duration) -> Vec<VerdictLine> {
        let millis = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(self.logger.as_fd(), PollFlags::POLLIN)];
        // EINTR and the like just mean "nothing yet": the caller calls again.
        let _ = poll(&mut fds, PollTimeout::from(millis));
        self.logger.flush();
        let lines = std::mem::take(
            &mut *self
                .collected
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        lines.iter().filter_map(|l| VerdictLine::parse(l)).collect()
    }

    /// Whether the pinned ring buffer is still the one this reader reads (an unload and a new
    /// load pin a new one).
    pub fn is_current(&self) -> bool {
        self.map_id.is_some() && pinned_log_id(&self.layout) == self.map_id
    }
}

fn pinned_log_id(layout: &PinLayout) -> Option<u32> {
    aya::maps::MapInfo::from_pin(layout.map(map_names::LOGS))
        .ok()
        .map(|i| i.id())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn a_connect_line_parses_and_names_its_rule() {
        let line = VerdictLine::parse(
            "connect netns=4097 dst=::ffff:10.0.0.9 port=80 uid=1000 kind=1 rule=13",
        )
        .unwrap();
        assert_eq!(line.direction, Direction::Connect);
        assert_eq!(line.netns_cookie, 4097);
        assert_eq!(line.dst, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9)));
        assert_eq!(
            line.describe(),
            "connect to 10.0.0.9:80 by uid 1000: redirected to the outbound port \
             (rule 13: includeOutboundIPRanges)"
        );
    }

    #[test]
    fn an_inbound_line_parses_without_a_uid() {
        let line =
            VerdictLine::parse("inbound netns=7 dst=fd00::2 port=8080 kind=0 rule=201").unwrap();
        assert_eq!(line.uid, None);
        assert_eq!(
            line.describe(),
            "inbound connection to [fd00::2]:8080: passed (rule 201: inbound port not captured)"
        );
        let refused =
            VerdictLine::parse("inbound netns=7 dst=fd00::2 port=80 kind=2 rule=203").unwrap();
        assert_eq!(refused.outcome(), "refused");
    }

    #[test]
    fn foreign_or_broken_lines_are_skipped() {
        for bad in [
            "hello",
            "connect netns=1 dst=10.0.0.1 port=80 kind=1 rule=13",
            "connect netns=x dst=10.0.0.1 port=80 uid=0 kind=1 rule=13",
            "inbound netns=1 dst=10.0.0.1 port=80 kind=0 rule=1 extra=2",
            "inbound netns=1 dst=10.0.0.1 port=80 kind=0",
        ] {
            assert_eq!(VerdictLine::parse(bad), None, "{bad}");
        }
    }
}
