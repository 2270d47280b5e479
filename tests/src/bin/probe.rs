//! A small test client and Envoy-like original-destination proxy. It prints what the socket API
//! reports (peer, local address, SO_ORIGINAL_DST) as JSON lines, so tests assert exact values.
//!
//! ```text
//! probe connect ADDR [--http] [--bind ADDR] [--device IFNAME] [--mark N] [--transparent]
//!     [--timeout-ms N]
//!     connect (from a socket bound to --bind and to --device with SO_BINDTODEVICE first, if
//!     given; within N ms, default 5000) and print {"peer","local","status"}, or
//!     {"error","errno"} when the connect fails
//! probe udp-serve ADDR [--name N]    answer every datagram with "[N: ]reply to <sender>"
//! probe udp-query ADDR [--connect] [--unbound] [--first ADDR] [--mark N]
//!     send one datagram (from a socket never bound, with --unbound; connected to --first
//!     before), print {"from","reply","local"} or {"error","stage"}
//! probe proxy ADDR[,ADDR...] REPORT [--no-forward] [--v6only]
//!     listen on every ADDR (IPv6 ones with IPV6_V6ONLY under --v6only) and accept forever; per
//!     connection append {"listener","peer","local","orig_v4","orig_v6"} to REPORT (`-` for
//!     stdout) and (unless --no-forward) relay to the original destination, asking SOL_IP then
//!     SOL_IPV6 as Envoy does
//! probe tfo ADDR [--data TEXT]       TCP Fast Open: sendto(MSG_FASTOPEN) on a fresh socket, print
//!                                    {"sent","peer","local","reply"}
//! probe connect-sock ADDR [--bind ADDR] [--reuseaddr] [--mark N] [--fill-optmem] [--read]
//!       [--linger0] [--first ADDR] [--timeout-ms N] [--mptcp]
//!     connect a socket prepared first (--fill-optmem: TCP-MD5 keys until net.core.optmem_max is
//!     used up; --first: connect it to ADDR first, expecting that to fail); print
//!     {"peer","local","reply","md5_keys","first_errno","orig_v4"} or {"error","errno","stage"}
//! probe raw                          try raw IPv4/IPv6 and AF_PACKET sockets, print the errnos
//! probe spoof-syn SRC-IP DST        one SYN from a forged source (raw socket, CAP_NET_RAW)
//! probe bind ADDR [--udp] [--mark N] [--listen-after-ms MS]
//!     bind one socket (marked first), report the errno; optionally listen later (probe/bindport.rs)
//! probe srcroute KIND ADDR --via HOP [--after] [--compat] [--wait-file PATH]
//!     connect to ADDR from a socket with a source route through HOP (probe/srcroute.rs)
//! probe hold ADDR                    keep accepted connections open (echo), print accepts and closes
//! probe origdst-echo ADDR[,ADDR...]  answer each connection with its SO_ORIGINAL_DST, then close
//! probe slow-sink ADDR [--sleep-ms N] [--echo]
//!     a sidecar stand-in for sk_msg tests: one connection, read after N ms and check the
//!     counter pattern, or echo (probe/bulk.rs)
//! probe bulk-write ADDR BYTES        write BYTES of the counter pattern as fast as possible
//! probe ping-pong ADDR ROUNDS SIZE   SIZE bytes out and back, ROUNDS times, on one connection
//! probe connect-many ADDR N [--threads T] [--ports P] [--deadline-ms D] [--hold-first ADDR]
//!     N short connections to ADDR's port + i % P, each checked against an origdst-echo answer;
//!     with --hold-first, one connection kept open throughout and its getpeername reported
//! probe istio-validate [--v6] [--timeout-ms N]    Istio's istio-validation (exit 0 or 126)
//! probe linkerd-validate LISTEN CONNECT [--timeout-ms N]
//!                                    Linkerd's linkerd-network-validator (exit 0 or 95)
//! probe ztunnel UDS                  a ztunnel stand-in: ZDS to the agent at UDS, marked
//!                                    listeners in each pod it is given (probe/ztunnel.rs)
//! ```

// A binary's modules would be found beside it in src/bin/ and be taken for binaries themselves,
// hence the explicit paths.
#[path = "probe/bindport.rs"]
mod bindport;
#[path = "probe/bulk.rs"]
mod bulk;
#[path = "probe/bypass.rs"]
mod bypass;
#[path = "probe/craft.rs"]
mod craft;
#[path = "probe/redirect.rs"]
mod redirect;
#[path = "probe/sock.rs"]
mod sock;
#[path = "probe/srcroute.rs"]
mod srcroute;
#[path = "probe/validate.rs"]
mod validate;
#[path = "probe/ztunnel.rs"]
mod ztunnel;

use std::{net::SocketAddr, time::Duration};

use bypass::{SockOptions, connect_many, connect_sock, hold, origdst_echo, raw, tfo};
use redirect::{UdpQuery, connect, proxy, udp_query, udp_serve};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parse = |text: &str| -> SocketAddr {
        text.parse()
            .unwrap_or_else(|_| panic!("probe: {text:?} is not an address: {args:?}"))
    };
    let addr = |i: usize| -> SocketAddr { parse(args.get(i).map(String::as_str).unwrap_or("")) };
    let option = |name: &str| -> Option<&str> {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    let flag = |name: &str| args.iter().any(|a| a == name);
    let code = match args.first().map(String::as_str) {
        Some("connect") => {
            let timeout = option("--timeout-ms")
                .map(|ms| ms.parse().expect("probe: --timeout-ms takes milliseconds"))
                .unwrap_or(5000);
            connect(
                addr(1),
                flag("--http"),
                option("--bind").map(parse),
                option("--device"),
                sock::Identity {
                    mark: option("--mark")
                        .map(|m| m.parse().expect("probe: --mark takes a number")),
                    transparent: flag("--transparent"),
                },
                Duration::from_millis(timeout),
            )
        }
        Some("udp-serve") => udp_serve(
            addr(1),
            option("--name"),
            option("--bind-mark").map(|m| m.parse().expect("probe: --bind-mark takes a number")),
        ),
        Some("udp-query") => udp_query(
            addr(1),
            &UdpQuery {
                connect: flag("--connect"),
                unbound: flag("--unbound"),
                first: option("--first").map(parse),
                mark: option("--mark").map(|m| m.parse().expect("probe: --mark takes a number")),
                fill_optmem: flag("--fill-optmem"),
            },
        ),
        Some("proxy") => {
            let addrs: Vec<SocketAddr> = args
                .get(1)
                .map(String::as_str)
                .unwrap_or("")
                .split(',')
                .map(parse)
                .collect();
            proxy(
                &addrs,
                args.get(2).expect("report path"),
                !flag("--no-forward"),
                flag("--v6only"),
                flag("--transparent"),
                Duration::from_millis(option("--accept-after-ms").map_or(0, |ms| {
                    ms.parse()
                        .expect("probe: --accept-after-ms takes milliseconds")
                })),
                option("--bind-mark")
                    .map(|m| m.parse().expect("probe: --bind-mark takes a number")),
            )
        }
        Some("tfo") => tfo(addr(1), option("--data").unwrap_or("probe-tfo")),
        Some("connect-sock") => connect_sock(
            addr(1),
            &SockOptions {
                bind: option("--bind").map(parse),
                reuseaddr: flag("--reuseaddr"),
                mark: option("--mark").map(|m| m.parse().expect("probe: --mark takes a number")),
                fill_optmem: flag("--fill-optmem"),
                read: flag("--read"),
                linger0: flag("--linger0"),
                first: option("--first").map(parse),
                mptcp: flag("--mptcp"),
                timeout: Duration::from_millis(
                    option("--timeout-ms")
                        .map(|ms| ms.parse().expect("probe: --timeout-ms takes milliseconds"))
                        .unwrap_or(5000),
                ),
            },
        ),
        Some("raw") => raw(),
        Some("bind") => bindport::bind_port(
            addr(1),
            &bindport::BindOptions {
                udp: flag("--udp"),
                mark: option("--mark").map(|m| m.parse().expect("probe: --mark takes a number")),
                listen_after: option("--listen-after-ms").map(|ms| {
                    Duration::from_millis(
                        ms.parse()
                            .expect("probe: --listen-after-ms takes milliseconds"),
                    )
                }),
            },
        ),
        Some("srcroute") => srcroute::srcroute(
            srcroute::Kind::parse(args.get(1).map_or("", String::as_str)),
            addr(2),
            option("--via")
                .and_then(|a| a.parse().ok())
                .expect("probe: srcroute KIND ADDR --via HOP"),
            srcroute::Options {
                after: flag("--after"),
                compat: flag("--compat"),
                wait_file: option("--wait-file").map(Into::into),
            },
        ),
        // Crafted packets (probe/craft.rs documents both).
        Some("connect-ext") => craft::connect_ext(
            addr(1),
            if flag("--hopopts") {
                craft::ExtHeader::HopByHop
            } else {
                craft::ExtHeader::DestOpts
            },
            Duration::from_secs(3),
        ),
        Some("spoof-syn") => craft::spoof_syn(
            args.get(1)
                .and_then(|a| a.parse().ok())
                .expect("probe: spoof-syn SRC-IP DST"),
            addr(2),
        ),
        Some("frag-syn") => craft::frag_syn(
            args.get(1)
                .and_then(|a| a.parse().ok())
                .expect("probe: frag-syn SRC-IP DST"),
            addr(2),
            Duration::from_millis(
                option("--wait-ms")
                    .map(|ms| ms.parse().expect("probe: --wait-ms takes milliseconds"))
                    .unwrap_or(1500),
            ),
        ),
        Some("vlan-syn") => craft::vlan_syn(
            args.get(1)
                .expect("probe: vlan-syn IFACE DST-MAC SRC-IP DST"),
            args.get(2)
                .expect("probe: vlan-syn IFACE DST-MAC SRC-IP DST"),
            args.get(3)
                .and_then(|a| a.parse().ok())
                .expect("probe: vlan-syn IFACE DST-MAC SRC-IP DST"),
            addr(4),
            craft::FrameShape {
                tags: option("--tags")
                    .map_or(2, |n| n.parse().expect("probe: --tags takes a count")),
                outer_ad: flag("--outer-ad"),
                sport: option("--sport").map(|p| p.parse().expect("probe: --sport takes a port")),
            },
            Duration::from_millis(
                option("--wait-ms")
                    .map(|ms| ms.parse().expect("probe: --wait-ms takes milliseconds"))
                    .unwrap_or(1500),
            ),
        ),
        Some("hold") => hold(addr(1)),
        Some("slow-sink") => bulk::slow_sink(
            addr(1),
            Duration::from_millis(
                option("--sleep-ms")
                    .map(|ms| ms.parse().expect("probe: --sleep-ms takes milliseconds"))
                    .unwrap_or(0),
            ),
            flag("--echo"),
        ),
        Some("bulk-write") => bulk::bulk_write(
            addr(1),
            args.get(2)
                .and_then(|n| n.parse().ok())
                .expect("probe: bulk-write ADDR BYTES"),
        ),
        Some("ping-pong") => {
            let n = |i: usize| -> u64 {
                args.get(i)
                    .and_then(|n| n.parse().ok())
                    .expect("probe: ping-pong ADDR ROUNDS SIZE")
            };
            bulk::ping_pong(addr(1), n(2), n(3) as usize)
        }
        Some("origdst-echo") => {
            let addrs: Vec<SocketAddr> = args
                .get(1)
                .map(String::as_str)
                .unwrap_or("")
                .split(',')
                .map(parse)
                .collect();
            origdst_echo(&addrs)
        }
        Some("connect-many") => {
            let num = |name: &str, default: u64| -> u64 {
                option(name)
                    .map(|v| v.parse().expect("probe: a number"))
                    .unwrap_or(default)
            };
            connect_many(
                addr(1),
                args.get(2)
                    .and_then(|n| n.parse().ok())
                    .expect("probe: connect-many ADDR N"),
                num("--threads", 4),
                num("--ports", 1),
                Duration::from_millis(num("--deadline-ms", 30_000)),
                option("--hold-first").map(parse),
            )
        }
        Some("ztunnel") => ztunnel::run(std::path::Path::new(
            args.get(1).map(String::as_str).unwrap_or(""),
        )),
        Some("istio-validate") => validate::istio(
            flag("--v6"),
            Duration::from_millis(
                option("--timeout-ms")
                    .map(|ms| ms.parse().expect("probe: --timeout-ms takes milliseconds"))
                    .unwrap_or(5000),
            ),
        ),
        Some("linkerd-validate") => validate::linkerd(
            addr(1),
            addr(2),
            Duration::from_millis(
                option("--timeout-ms")
                    .map(|ms| ms.parse().expect("probe: --timeout-ms takes milliseconds"))
                    .unwrap_or(10_000),
            ),
        ),
        _ => {
            eprintln!(
                "usage: probe connect ADDR [--http] [--bind ADDR] [--device IFNAME] [--timeout-ms N] | \
                 probe udp-serve ADDR [--name N] | \
                 probe udp-query ADDR [--connect] [--unbound] [--first ADDR] [--mark N] | \
                 probe proxy ADDR[,ADDR...] REPORT [--no-forward] [--v6only] [--accept-after-ms N] | \
                 probe tfo ADDR [--data TEXT] | \
                 probe connect-sock ADDR [--bind ADDR] [--reuseaddr] [--mark N] [--fill-optmem] \
                 [--read] [--linger0] [--timeout-ms N] | probe raw | probe hold ADDR | \
                 probe origdst-echo ADDR[,ADDR...] | \
                 probe connect-many ADDR N [--threads T] [--ports P] [--deadline-ms D] | \
                 probe ztunnel UDS"
            );
            2
        }
    };
    std::process::exit(code);
}
