//! TCP counters of a pod's netns (`/proc/thread-self/net/{netstat,sockstat}` read from a thread
//! inside it), to show why a connection-setup figure is what it is: SYN retransmissions and
//! TIME_WAIT sockets.

use std::collections::BTreeMap;
use std::fs;
use std::net::Ipv4Addr;

use anyhow::{Context, Result};

use crate::pod::Pod;

/// Every counter of /proc/net/netstat or /proc/net/snmp text (per group, a header line of names,
/// then a line of values with the same `Prefix:`), named `Prefix:Name`, e.g.
/// `TcpExt:DelayedACKs`.
pub fn parse_all(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut lines = text.lines();
    while let (Some(names), Some(values)) = (lines.next(), lines.next()) {
        let mut names = names.split_whitespace();
        let mut values = values.split_whitespace();
        let (Some(prefix), Some(prefix_again)) = (names.next(), values.next()) else {
            continue;
        };
        if prefix != prefix_again {
            continue;
        }
        for (name, value) in names.zip(values) {
            if let Ok(v) = value.parse() {
                out.insert(format!("{prefix}{name}"), v);
            }
        }
    }
    out
}

/// One counter of /proc/net/netstat or /proc/net/snmp text, e.g. `("TcpExt:", "TW")`.
pub fn parse_netstat(text: &str, prefix: &str, key: &str) -> Option<u64> {
    parse_all(text).get(&format!("{prefix}{key}")).copied()
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

/// The counters of the per-round table: what might make a new-connection round slow. All but
/// `sockstat_tw` only grow, and a round shows their deltas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetupCounters {
    /// TcpExt TCPSynRetrans.
    pub syn_retrans: u64,
    /// TcpExt ListenDrops: SYNs or completed handshakes a listener dropped (any reason).
    pub listen_drops: u64,
    /// TcpExt ListenOverflows: of those, the accept queue was full.
    pub listen_overflows: u64,
    /// TcpExt TW: TIME_WAIT sockets that ended by their timer.
    pub tw: u64,
    /// TcpExt TWRecycled: TIME_WAIT sockets a new connection took over.
    pub tw_recycled: u64,
    /// TcpExt TCPTimeWaitOverflow: TIME_WAIT sockets not made (tcp_max_tw_buckets reached).
    pub tw_overflow: u64,
    /// sockstat `tw`: TIME_WAIT sockets now (a level, not a counter).
    pub sockstat_tw: u64,
    /// nf_conntrack `insert_failed`, summed over CPUs: a new entry lost a race to an equal
    /// tuple (with NAT, a clash); None when the netns has no conntrack statistics.
    pub ct_insert_failed: Option<u64>,
    /// nf_conntrack `drop`: packets dropped because of that or a full table.
    pub ct_drop: Option<u64>,
}

fn opt_sum(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        _ => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    }
}

impl SetupCounters {
    pub fn plus(self, o: Self) -> Self {
        Self {
            syn_retrans: self.syn_retrans + o.syn_retrans,
            listen_drops: self.listen_drops + o.listen_drops,
            listen_overflows: self.listen_overflows + o.listen_overflows,
            tw: self.tw + o.tw,
            tw_recycled: self.tw_recycled + o.tw_recycled,
            tw_overflow: self.tw_overflow + o.tw_overflow,
            sockstat_tw: self.sockstat_tw + o.sockstat_tw,
            ct_insert_failed: opt_sum(self.ct_insert_failed, o.ct_insert_failed),
            ct_drop: opt_sum(self.ct_drop, o.ct_drop),
        }
    }

    /// The counters' growth since `earlier`; `sockstat_tw` is this reading's level.
    pub fn since(self, earlier: Self) -> Self {
        let d = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b.unwrap_or(0)));
        Self {
            syn_retrans: self.syn_retrans.saturating_sub(earlier.syn_retrans),
            listen_drops: self.listen_drops.saturating_sub(earlier.listen_drops),
            listen_overflows: self
                .listen_overflows
                .saturating_sub(earlier.listen_overflows),
            tw: self.tw.saturating_sub(earlier.tw),
            tw_recycled: self.tw_recycled.saturating_sub(earlier.tw_recycled),
            tw_overflow: self.tw_overflow.saturating_sub(earlier.tw_overflow),
            sockstat_tw: self.sockstat_tw,
            ct_insert_failed: d(self.ct_insert_failed, earlier.ct_insert_failed),
            ct_drop: d(self.ct_drop, earlier.ct_drop),
        }
    }
}

/// Columns `names` of /proc/net/stat/nf_conntrack (a header, then one line of hex values per
/// CPU), each summed over the CPUs.
pub fn parse_conntrack_stat(text: &str, names: &[&str]) -> Option<Vec<u64>> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split_whitespace().collect();
    let idx: Vec<usize> = names
        .iter()
        .map(|n| header.iter().position(|h| h == n))
        .collect::<Option<_>>()?;
    let mut sums = vec![0u64; names.len()];
    for line in lines {
        let f: Vec<&str> = line.split_whitespace().collect();
        for (sum, &i) in sums.iter_mut().zip(&idx) {
            *sum += u64::from_str_radix(f.get(i)?, 16).ok()?;
        }
    }
    Some(sums)
}

/// The [`SetupCounters`] of `pod`'s netns now. The conntrack statistics are the netns's own
/// (the kernel keeps them per netns), read like the rest from a thread inside it; they are
/// absent where the conntrack module is not loaded.
pub fn setup_counters(pod: &Pod) -> Result<SetupCounters> {
    let ext = parse_all(&read_in(pod, "netstat")?);
    let sock = read_in(pod, "sockstat")?;
    let ct = read_in(pod, "stat/nf_conntrack")
        .ok()
        .and_then(|t| parse_conntrack_stat(&t, &["insert_failed", "drop"]));
    let get = |k: &str| {
        ext.get(&format!("TcpExt:{k}"))
            .copied()
            .with_context(|| format!("no TcpExt {k}"))
    };
    Ok(SetupCounters {
        syn_retrans: get("TCPSynRetrans")?,
        listen_drops: get("ListenDrops")?,
        listen_overflows: get("ListenOverflows")?,
        tw: get("TW")?,
        tw_recycled: get("TWRecycled")?,
        tw_overflow: get("TCPTimeWaitOverflow")?,
        sockstat_tw: parse_sockstat_tw(&sock).context("no TCP tw in sockstat")?,
        ct_insert_failed: ct.as_ref().map(|v| v[0]),
        ct_drop: ct.as_ref().map(|v| v[1]),
    })
}

/// Every counter of `/proc/net/netstat` and `/proc/net/snmp` in `pod`'s netns (see
/// [`parse_all`]), for the diagnostic dump of `SIDESTEP_BENCH_NSTAT=1`.
pub fn all_counters(pod: &Pod) -> Result<BTreeMap<String, u64>> {
    let mut out = parse_all(&read_in(pod, "netstat")?);
    out.extend(parse_all(&read_in(pod, "snmp")?));
    Ok(out)
}

/// The counters that grew from `before` to `after`, as `Name=delta` separated by spaces.
pub fn grown(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> String {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| format!("{k}={d}"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// TIME_WAIT sockets in this netns now.
pub fn time_wait(pod: &Pod) -> Result<u64> {
    let t = read_in(pod, "sockstat")?;
    parse_sockstat_tw(&t).context("no TCP tw in sockstat")
}

/// TIME_WAIT sockets in `/proc/net/tcp` text whose remote end is `remote` (any port).
pub fn parse_time_wait_to(tcp: &str, remote: Ipv4Addr) -> u64 {
    // The kernel prints an address as its network-order bytes read as a native u32, in hex.
    let want = format!("{:08X}", u32::from_ne_bytes(remote.octets()));
    let time_wait = |line: &&str| {
        let mut f = line.split_whitespace().skip(2);
        let (Some(rem), Some(state)) = (f.next(), f.next()) else {
            return false;
        };
        state == "06" && rem.split_once(':').is_some_and(|(addr, _)| addr == want)
    };
    tcp.lines().skip(1).filter(time_wait).count() as u64
}

/// TIME_WAIT sockets in `pod`'s netns whose remote end is `remote`.
pub fn time_wait_to(pod: &Pod, remote: Ipv4Addr) -> Result<u64> {
    Ok(parse_time_wait_to(&read_in(pod, "tcp")?, remote))
}

/// How many ports `connect()` tries before it turns to the other half of `ip_local_port_range`
/// text ("low high"): `__inet_hash_connect` walks the ports of one parity first (the other is
/// left to `bind()`), so a destination whose TIME_WAIT sockets fill that half makes every
/// connect to it walk all of it.
pub fn parse_first_searched_ports(range: &str) -> Option<u64> {
    let mut f = range.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(low)), Some(Ok(high))) = (f.next(), f.next()) else {
        return None;
    };
    let ports = (high + 1).checked_sub(low)?;
    Some((ports & !1) / 2)
}

/// [`parse_first_searched_ports`] of `pod`'s netns (the sysctl is per netns).
pub fn first_searched_ports(pod: &Pod) -> Result<u64> {
    let path = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = pod
        .in_netns(|| fs::read_to_string(path))?
        .with_context(|| format!("read {path} in pod {}", pod.name))?;
    parse_first_searched_ports(&text).with_context(|| format!("{path}: {text:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_this_machines_counters() {
        let ext = parse_all(&fs::read_to_string("/proc/net/netstat").unwrap());
        let snmp = parse_all(&fs::read_to_string("/proc/net/snmp").unwrap());
        assert!(ext.contains_key("TcpExt:TCPSynRetrans"), "{ext:?}");
        assert!(ext.contains_key("IpExt:InOctets"), "{ext:?}");
        assert!(snmp.contains_key("Tcp:AttemptFails"), "{snmp:?}");
        assert!(snmp.contains_key("Udp:InDatagrams"), "{snmp:?}");
    }

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
        assert_eq!(parse_all(n).get("IpExt:InNoRoutes"), Some(&3));
        let before = parse_all(n);
        let after = parse_all("TcpExt: SyncookiesSent TCPSynRetrans TW\nTcpExt: 0 19 5\n");
        assert_eq!(grown(&before, &after), "TcpExt:TCPSynRetrans=2");
        let s =
            "sockets: used 5\nTCP: inuse 3 orphan 0 tw 5420 alloc 4 mem 1\nUDP: inuse 0 mem 0\n";
        assert_eq!(parse_sockstat_tw(s), Some(5420));
        let ct = "entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop\n\
                  00000004  00000000 00000000 00000000 00000003 00000000 00000000 00000000 00000000 0000000a 00000001 00000000\n\
                  00000004  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000006 00000002 00000000\n";
        assert_eq!(
            parse_conntrack_stat(ct, &["insert_failed", "drop"]),
            Some(vec![16, 3])
        );
        assert_eq!(parse_conntrack_stat(ct, &["nope"]), None);
        let a = SetupCounters {
            syn_retrans: 5,
            sockstat_tw: 100,
            ct_drop: Some(4),
            ..Default::default()
        };
        let b = SetupCounters {
            syn_retrans: 2,
            sockstat_tw: 900,
            ct_drop: Some(1),
            ..Default::default()
        };
        let d = a.since(b);
        assert_eq!((d.syn_retrans, d.sockstat_tw, d.ct_drop), (3, 100, Some(3)));
        assert_eq!(d.ct_insert_failed, None);
        assert_eq!(a.plus(b).ct_drop, Some(5));
    }

    #[test]
    fn time_wait_to_one_address() {
        // 10.88.0.7 is 0700580A; state 06 is TIME_WAIT, 01 ESTABLISHED.
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                   0: 0600580A:8C2E 0700580A:0050 06 00000000:00000000 03:00000F2A 00000000     0        0 0 3 0000000000000000\n\
                   1: 0600580A:8C30 0700580A:3AA6 06 00000000:00000000 03:00000F2A 00000000     0        0 0 3 0000000000000000\n\
                   2: 0600580A:8C32 0700580A:0050 01 00000000:00000000 00:00000000 00000000  1000        0 1 1 0000000000000000\n\
                   3: 0100007F:8C34 0100007F:3A99 06 00000000:00000000 03:00000F2A 00000000     0        0 0 3 0000000000000000\n\
                   4: 0600580A:8C36 0800580A:0050 06 00000000:00000000 03:00000F2A 00000000     0        0 0 3 0000000000000000\n";
        assert_eq!(parse_time_wait_to(tcp, Ipv4Addr::new(10, 88, 0, 7)), 2);
        assert_eq!(parse_time_wait_to(tcp, Ipv4Addr::LOCALHOST), 1);
        assert_eq!(parse_time_wait_to(tcp, Ipv4Addr::new(10, 88, 0, 9)), 0);
        // The parse must match what this machine prints for its own loopback sockets.
        let here = fs::read_to_string("/proc/net/tcp").unwrap();
        assert!(
            here.lines()
                .skip(1)
                .all(|l| l.split_whitespace().count() >= 4)
        );
    }

    #[test]
    fn first_searched_half_of_the_port_range() {
        // Linux's default range: 28,232 ports, 14,116 of one parity.
        assert_eq!(parse_first_searched_ports("32768\t60999\n"), Some(14_116));
        assert_eq!(parse_first_searched_ports("1024 1025"), Some(1));
        assert_eq!(parse_first_searched_ports("1024 1026"), Some(1));
        assert_eq!(parse_first_searched_ports("60999 32768"), None);
        assert_eq!(parse_first_searched_ports("x"), None);
    }
}
