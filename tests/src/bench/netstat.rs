//! TCP counters of a pod's netns (`/proc/thread-self/net/{netstat,sockstat}` read from a thread
//! inside it), to show why a connection-setup figure is what it is: SYN retransmissions and
//! TIME_WAIT sockets.

use std::fs;

use anyhow::{Context, Result};

use crate::pod::Pod;

/// A `TcpExt:` counter from /proc/net/netstat text (a header line of names, then a line of
/// values).
pub fn parse_netstat(text: &str, prefix: &str, key: &str) -> Option<u64> {
    let mut lines = text.lines().filter(|l| l.starts_with(prefix));
    let names = lines.next()?;
    let values = lines.next()?;
    let i = names.split_whitespace().position(|n| n == key)?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// `tw` of the `TCP:` line of /proc/net/sockstat.
pub fn parse_sockstat_tw(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("TCP:"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    let i = f.iter().position(|x| *x == "tw")?;
    f.get(i + 1)?.parse().ok()
}

fn read_in(pod: &Pod, file: &str) -> Result<String> {
    let path = format!("/proc/thread-self/net/{file}");
    pod.in_netns(|| fs::read_to_string(&path))?
        .with_context(|| format!("read {path} in pod {}", pod.name))
}

/// Connection-setup counters of one netns (or a sum of several).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpCounters {
    /// TcpExt TCPSynRetrans: SYN and SYN-ACK retransmissions.
    pub syn_retrans: u64,
    /// Tcp AttemptFails: connects that went from SYN-SENT or SYN-RECV to CLOSED (e.g. a reset).
    pub attempt_fails: u64,
    /// Tcp OutRsts: resets sent.
    pub out_rsts: u64,
}

impl TcpCounters {
    pub fn plus(self, o: Self) -> Self {
        Self {
            syn_retrans: self.syn_retrans + o.syn_retrans,
            attempt_fails: self.attempt_fails + o.attempt_fails,
            out_rsts: self.out_rsts + o.out_rsts,
        }
    }

    /// `self - earlier`, saturating.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            syn_retrans: self.syn_retrans.saturating_sub(earlier.syn_retrans),
            attempt_fails: self.attempt_fails.saturating_sub(earlier.attempt_fails),
            out_rsts: self.out_rsts.saturating_sub(earlier.out_rsts),
        }
    }
}

/// The counters of `pod`'s netns now.
pub fn tcp_counters(pod: &Pod) -> Result<TcpCounters> {
    let ext = read_in(pod, "netstat")?;
    let snmp = read_in(pod, "snmp")?;
    Ok(TcpCounters {
        syn_retrans: parse_netstat(&ext, "TcpExt:", "TCPSynRetrans")
            .context("no TcpExt TCPSynRetrans")?,
        attempt_fails: parse_netstat(&snmp, "Tcp:", "AttemptFails")
            .context("no Tcp AttemptFails")?,
        out_rsts: parse_netstat(&snmp, "Tcp:", "OutRsts").context("no Tcp OutRsts")?,
    })
}

/// TIME_WAIT sockets in this netns now.
pub fn time_wait(pod: &Pod) -> Result<u64> {
    let t = read_in(pod, "sockstat")?;
    parse_sockstat_tw(&t).context("no TCP tw in sockstat")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters() {
        let n = "TcpExt: SyncookiesSent TCPSynRetrans TW\nTcpExt: 0 17 5\nIpExt: InNoRoutes\nIpExt: 3\n";
        assert_eq!(
            parse_netstat(
                "Tcp: RtoAlgorithm AttemptFails\nTcp: 1 4\n",
                "Tcp:",
                "AttemptFails"
            ),
            Some(4)
        );
        assert_eq!(parse_netstat(n, "TcpExt:", "TCPSynRetrans"), Some(17));
        assert_eq!(parse_netstat(n, "TcpExt:", "Nope"), None);
        let s =
            "sockets: used 5\nTCP: inuse 3 orphan 0 tw 5420 alloc 4 mem 1\nUDP: inuse 0 mem 0\n";
        assert_eq!(parse_sockstat_tw(s), Some(5420));
    }
}
