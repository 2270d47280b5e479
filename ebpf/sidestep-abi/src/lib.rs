//! The contract between sidestep's BPF programs and its userspace.
//!
//! Every map key and value is `#[repr(C)]`, has no implicit padding, and is shared verbatim by both
//! sides. Addresses are stored in network byte order as IPv6 words; IPv4 addresses use the
//! IPv4-mapped form (`::ffff:a.b.c.d`) so that one code path and one LPM trie serve both families.
//! Ports are stored in host byte order.
#![no_std]

/// Names of the maps in the BPF object. Userspace pins each under `<pin_root>/maps/<name>`.
pub mod map_names {
    pub const POD_POLICY: &str = "SIDESTEP_POD";
    pub const PORT_RULES: &str = "SIDESTEP_PORTS";
    pub const CIDR_RULES: &str = "SIDESTEP_CIDRS";
    pub const COUNTERS: &str = "SIDESTEP_STATS";
    pub const SOCKET_ORIG_DST: &str = "SIDESTEP_ORIG";
    pub const PENDING_ORIG_DST: &str = "SIDESTEP_PEND";
    pub const POD_ADDRESSES: &str = "SIDESTEP_ADDRS";
    pub const SOCKETS: &str = "SIDESTEP_SOCKS";
    pub const LISTENERS: &str = "SIDESTEP_LSTN";
    pub const INTERFACES: &str = "SIDESTEP_IFACES";
    pub const NESTED_LOOKUP: &str = "SIDESTEP_NEST";
    pub const REROUTE_IFACES: &str = "SIDESTEP_RRIF";
    pub const REROUTE_NAT: &str = "SIDESTEP_RNAT";
    pub const POD_IDENTITY: &str = "SIDESTEP_NSID";
    /// sk_msg's sticky "this socket takes the TCP path from now on" flag (socket storage).
    /// Pinned so that an upgrade keeps it: a socket must never go back to redirecting.
    pub const SK_MSG_TCP_ONLY: &str = "SIDESTEP_SKMSG";
    /// aya-log's ring buffer (its name is aya-log's). Pinned so that an upgrade keeps the one the
    /// agent reads.
    pub const LOGS: &str = "AYA_LOGS";
    /// Each pod's source addresses for a captured app's socket (`PodSource`).
    pub const SOURCE_ADDRESSES: &str = "SIDESTEP_SRC";
    /// A multi-homed pod's routes through its other interfaces, with their sources.
    pub const SOURCE_ROUTES: &str = "SIDESTEP_SRCR";
    pub const ALL: [&str; 18] = [
        LOGS,
        SOURCE_ADDRESSES,
        SOURCE_ROUTES,
        SK_MSG_TCP_ONLY,
        POD_IDENTITY,
        REROUTE_IFACES,
        REROUTE_NAT,
        NESTED_LOOKUP,
        LISTENERS,
        INTERFACES,
        SOCKETS,
        POD_ADDRESSES,
        POD_POLICY,
        PORT_RULES,
        CIDR_RULES,
        COUNTERS,
        SOCKET_ORIG_DST,
        PENDING_ORIG_DST,
    ];
}

/// Names of the programs (their Rust function names in the BPF crate).
/// Read-only globals of the BPF object that the loader sets per kernel.
pub mod globals {
    /// `1` when tc programs may call bpf_get_netns_cookie (Linux 6.13+).
    pub const TC_NETNS_COOKIE: &str = "TC_NETNS_COOKIE";
    /// Byte offset of `sk_rmem_alloc` (`sk_backlog.rmem_alloc.counter`) in `struct sock`, from
    /// the running kernel's BTF. `0` (unresolved) makes sk_msg never redirect.
    pub const SK_RMEM_ALLOC_OFFSET: &str = "SK_RMEM_ALLOC_OFFSET";
    /// Byte offset of `sk_redir` in the kernel's `struct sk_msg` (sk_msg's context); `0` as
    /// above.
    pub const SK_MSG_REDIR_OFFSET: &str = "SK_MSG_REDIR_OFFSET";
    /// Byte offset of `sk_rcvbuf` in `struct sock`; `0` as above.
    pub const SK_RCVBUF_OFFSET: &str = "SK_RCVBUF_OFFSET";
    /// The netns cookie of the node's own network namespace (the loader's, which runs there);
    /// `0` (unknown) turns off the recognition of the node's connections to ambient pods.
    pub const NODE_NETNS_COOKIE: &str = "NODE_NETNS_COOKIE";
}

pub mod program_names {
    pub const CONNECT4: &str = "sidestep_connect4";
    pub const CONNECT6: &str = "sidestep_connect6";
    pub const GETPEERNAME4: &str = "sidestep_getpeername4";
    pub const GETPEERNAME6: &str = "sidestep_getpeername6";
    pub const SOCK_OPS: &str = "sidestep_sockops";
    pub const GETSOCKOPT: &str = "sidestep_getsockopt";
    /// cgroup/setsockopt: refuses source routing (a routing header or IPv4 LSRR/SSRR) on the
    /// sockets of enrolled pods, which would send their packets to a first hop connect never saw.
    pub const SETSOCKOPT: &str = "sidestep_setsockopt";
    /// cgroup_skb egress: drops a packet that carries a loopback address as a source-route
    /// segment (a captured connection's rewritten destination behind a first hop), which
    /// [`SETSOCKOPT`] cannot stop when the route came from a compat setsockopt, from before the
    /// pod's enrolment, or from sendmsg's control data.
    pub const ROUTE_GUARD: &str = "sidestep_route_guard";
    /// cgroup/bind4 and bind6: in an ambient pod, only ztunnel's marked sockets bind its ports.
    pub const BIND4: &str = "sidestep_bind4";
    pub const BIND6: &str = "sidestep_bind6";
    pub const TC_INGRESS: &str = "sidestep_tc_ingress";
    pub const SENDMSG4: &str = "sidestep_sendmsg4";
    pub const SENDMSG6: &str = "sidestep_sendmsg6";
    pub const RECVMSG4: &str = "sidestep_recvmsg4";
    pub const RECVMSG6: &str = "sidestep_recvmsg6";
    pub const SK_MSG: &str = "sidestep_sk_msg";
    pub const SK_LOOKUP: &str = "sidestep_sk_lookup";
    /// tc ingress on a re-routed virtual interface: DNAT of its TCP to the outbound port.
    pub const REROUTE_INGRESS: &str = "sidestep_reroute_in";
    /// tc egress on the same interface: the reverse rewrite of the proxy's replies.
    pub const REROUTE_EGRESS: &str = "sidestep_reroute_eg";
    /// The per-pod sk_lookup program that runs before [`SK_LOOKUP`] in the pod's netns and names
    /// the pod (its netns cookie) in `SIDESTEP_NSID`. Not in the object file: userspace
    /// assembles it per pod (`userspace/src/identity.rs`), so it is never pinned as a program.
    pub const POD_IDENTITY: &str = "sidestep_pod_id";
}

/// Default capacities. Userspace may override them at load time.
pub mod capacity {
    pub const PODS: u32 = 4096;
    /// Pod addresses (dual-stack pods have two).
    pub const ADDRESSES: u32 = 4 * PODS;
    pub const PORT_RULES: u32 = 65536;
    pub const CIDR_RULES: u32 = 65536;
    /// Tuples between the client's SYN and the proxy's accept. Entries live for one handshake.
    pub const PENDING: u32 = 65536;
    /// App and proxy sockets of local redirected connections, for sk_msg (two per connection).
    pub const SOCKETS: u32 = 65536;
    pub const INTERFACES: u32 = 4 * PODS;
    /// Re-routed virtual interfaces, over all pods.
    pub const REROUTE_IFACES: u32 = 4 * PODS;
    /// Routes of multi-homed pods through their other interfaces, over all pods.
    pub const SOURCE_ROUTES: u32 = 4 * PODS;
    /// Connections DNATed on re-routed interfaces (LRU: the oldest are evicted when full).
    pub const REROUTE_NAT: u32 = 65536;
}

pub mod defaults {
    pub const PROXY_UID: u32 = 1337;
    pub const PROXY_GID: u32 = 1337;
    pub const OUTBOUND_PORT: u16 = 15001;
    pub const INBOUND_PORT: u16 = 15006;
    pub const DNS_PORT: u16 = 15053;
    /// HBONE; never captured in either direction.
    pub const TUNNEL_PORT: u16 = 15008;
    /// Inbound ports that Istio never captures whatever the annotations say.
    pub const ALWAYS_EXCLUDED_INBOUND: [u16; 4] = [15008, 15020, 15021, 15090];
    /// TPROXY mode: the mark on the proxy's transparent connections to its app (Istio's
    /// InboundTProxyMark). The app's replies carry it too, and the pod's policy route
    /// (`fwmark 1337 lookup 133`, `local default dev lo table 133`) brings them back to the proxy.
    pub const TPROXY_MARK: u32 = 1337;
    /// TPROXY mode: the routing table of that policy route (Istio's InboundTProxyRouteTable).
    pub const TPROXY_ROUTE_TABLE: u32 = 133;
    /// `::6`, the IPv6 inbound passthrough source (the twin of 127.0.0.6), as octets: enrolment
    /// adds it to the pod's `lo` as istio-iptables does.
    pub const PASSTHROUGH_V6: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6];
}

/// Istio ambient mode (`flags::AMBIENT`): the constants of istio-cni's in-pod rules
/// (`cni/pkg/config`), which an unmodified ztunnel relies on. ztunnel runs in its own pod and
/// opens its listeners inside each ambient pod's netns (15001 outbound, 15006 inbound plaintext,
/// 15008 HBONE, 15053 DNS), marking every socket it makes there; the mark, not a UID, tells its
/// traffic apart. In ambient mode `PodPolicy::proxy_uid` holds [`MARK`] and `proxy_gid` [`MARK_MASK`].
pub mod ambient {
    /// ztunnel's `PACKET_MARK` (Istio's InpodMark).
    pub const MARK: u32 = 0x539;
    pub const MARK_MASK: u32 = 0xfff;
    /// Istio's InpodTProxyMark, a connmark there: the mark that routes the app's replies on a
    /// connection ztunnel opened from the client's own address back to ztunnel. sidestep sets it
    /// on ztunnel's socket at connect; `tcp_fwmark_accept` carries it to the app's socket.
    pub const CONN_MARK: u32 = 0x111;
    /// Istio's RouteTableInbound and the priority of its `ip rule` (`fwmark 0x111/0xfff`).
    pub const ROUTE_TABLE: u32 = 100;
    pub const RULE_PRIORITY: u32 = 32764;
    /// The source kubelet's probes are SNATed to on the node (HOST_PROBE_SNAT_IP): never
    /// captured inbound, and replies to it never captured outbound.
    pub const PROBE_SNAT_V4: [u8; 4] = [169, 254, 7, 127];
    pub const PROBE_SNAT_V6: [u8; 16] = [
        0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        0xff,
    ];
    /// The only inbound port ambient never captures (ztunnel's HBONE listener).
    pub const EXCLUDED_INBOUND: [u16; 1] = [15008];
}

/// `PodPolicy::flags` bits.
pub mod flags {
    /// Inbound TCP is captured (includeInboundPorts is not empty).
    pub const INBOUND: u32 = 1 << 0;
    /// includeInboundPorts is `*`: every port not excluded is captured.
    pub const INBOUND_ALL_PORTS: u32 = 1 << 1;
    /// Outbound capture is on (includeOutboundIPRanges or includeOutboundPorts not empty).
    pub const OUTBOUND: u32 = 1 << 2;
    /// The pod has excludeOutboundPorts entries, so connect must consult `SIDESTEP_PORTS`.
    pub const HAS_OUT_PORT_EXCLUDES: u32 = 1 << 3;
    /// The pod has includeOutboundPorts entries.
    pub const HAS_OUT_PORT_INCLUDES: u32 = 1 << 4;
    /// The pod has excludeOutboundIPRanges entries.
    pub const HAS_OUT_CIDR_EXCLUDES: u32 = 1 << 5;
    /// DNS (port 53) capture to `dns_port`.
    pub const DNS_CAPTURE: u32 = 1 << 6;
    /// Inbound interception mode TPROXY (the app sees the real client address).
    pub const TPROXY: u32 = 1 << 7;
    /// The proxy's connections to its own pod IP go back through the inbound listener.
    pub const HAIRPIN: u32 = 1 << 8;
    /// Capture IPv6 outbound too. Istio captures IPv6 only when the pod has an IPv6 address.
    pub const IPV6: u32 = 1 << 9;
    /// App <-> proxy data on loopback goes socket to socket with sk_msg, skipping the TCP stack.
    pub const SK_MSG: u32 = 1 << 10;
    /// includeOutboundIPRanges is `*`: the include trie need not be consulted.
    pub const OUTBOUND_ALL_RANGES: u32 = 1 << 11;
    /// Inbound capture is sk_lookup's alone (no tc program), so it also counts passed SYNs.
    pub const INBOUND_SK_LOOKUP: u32 = 1 << 12;
    /// Inbound capture covers the whole netns: sk_lookup captures on every interface that
    /// `SIDESTEP_IFACES` does not mark excluded, whatever the address. Enrolments by older
    /// versions lack it; sk_lookup then captures only on the interfaces they listed.
    pub const NETNS_WIDE: u32 = 1 << 13;
    /// The pod has excluded interfaces (`excludeInterfaces`): connect consults the pod's route
    /// entries in `SIDESTEP_CIDRS` and the socket's bound device (Istio's `-o <nic> -j RETURN`).
    pub const HAS_EXCLUDED_IFACES: u32 = 1 << 14;
    /// The programs log each verdict for this pod through aya-log (`sidestep.io/debug`). Off,
    /// it costs one flag test per decision.
    pub const DEBUG: u32 = 1 << 15;
    /// Istio ambient mode: the proxy is ztunnel, known by its socket mark (`ambient::MARK`),
    /// and the decision is istio-cni's in-pod ruleset (docs/ARCHITECTURE.md, "Ambient mode").
    pub const AMBIENT: u32 = 1 << 16;
    /// IPv4 `route_localnet` was on in the pod's netns at enrolment (`conf/all`, `conf/default` or
    /// an interface's): the kernel then takes a loopback source from the wire, so sk_lookup
    /// trusts a loopback source only with sock_ops' record of the pod's own connect.
    pub const ROUTE_LOCALNET: u32 = 1 << 17;
}

/// Which rule decided a connect or an inbound SYN, as the debug log reports it. The numbered
/// ones are the rules of istio-iptables' ISTIO_OUTPUT chain (ISTIO-CAPTURE.md), so a debug line
/// names the same rule an operator would find in `iptables-save`.
pub mod rule {
    pub const END_OF_CHAIN: u16 = 0;
    pub const OUT_EXCLUDED_PORT: u16 = 1;
    pub const INBOUND_PASSTHROUGH: u16 = 2;
    pub const PROXY_UID_HAIRPIN: u16 = 3;
    pub const LOOPBACK_RETURN: u16 = 4;
    pub const PROXY_UID: u16 = 5;
    pub const PROXY_GID_HAIRPIN: u16 = 6;
    pub const PROXY_GID: u16 = 8;
    pub const DNS: u16 = 9;
    pub const OUT_EXCLUDED_CIDR: u16 = 11;
    pub const OUT_INCLUDED_PORT: u16 = 12;
    pub const OUT_INCLUDED_CIDR: u16 = 13;
    /// Not in the chain: no ip6tables rules for a pod without IPv6.
    pub const NO_IPV6: u16 = 100;
    /// `-o <nic> -j RETURN` of excludeInterfaces.
    pub const EXCLUDED_INTERFACE: u16 = 101;
    /// Neither TCP nor DNS, or outbound capture off.
    pub const NOT_CAPTURED_PROTOCOL: u16 = 102;
    /// TPROXY mode: the proxy's transparent connection to its app.
    pub const TPROXY_PASSTHROUGH: u16 = 103;
    /// A socket bound to a loopback address calling a destination off the pod: refused. The
    /// kernel refuses it too unless `route_localnet` is on (kube-proxy turns it on), and then
    /// Istio's `-o lo -s 127.0.0.6` RETURN does not match it, so nothing may pass it.
    pub const LOOPBACK_SOURCE_OFF_POD: u16 = 104;
    /// Ambient: the rules of istio-cni's in-pod ISTIO_OUTPUT chain (nat), numbered in order.
    pub const AMBIENT_PROBE_REPLY: u16 = 111;
    pub const AMBIENT_DNS_UDP: u16 = 112;
    pub const AMBIENT_DNS_TCP: u16 = 113;
    pub const AMBIENT_CONN_MARK: u16 = 114;
    pub const AMBIENT_LOOPBACK: u16 = 115;
    pub const AMBIENT_OUTBOUND: u16 = 116;
    /// Ambient: ztunnel's own socket (its mark), or the end of the chain.
    pub const AMBIENT_ZTUNNEL: u16 = 117;
    /// Ambient: ztunnel's connection to its pod's app from the client's address.
    pub const AMBIENT_ORIG_SRC: u16 = 118;
    /// Inbound: the port is captured (ISTIO_INBOUND).
    pub const IN_CAPTURED_PORT: u16 = 200;
    /// Inbound: excluded port, or not in includeInboundPorts.
    pub const IN_PORT_NOT_CAPTURED: u16 = 201;
    /// Inbound: arrived on an excluded interface.
    pub const IN_EXCLUDED_INTERFACE: u16 = 202;
    /// Inbound: captured, but no proxy listener to hand it to, so refused.
    pub const IN_NO_LISTENER: u16 = 203;
    /// Ambient inbound: from the probe SNAT address (kubelet's probes), never captured.
    pub const IN_PROBE_SOURCE: u16 = 204;
    /// Ambient inbound: from a socket of the node's own netns (kubelet's probes), never captured.
    pub const IN_NODE_SOCKET: u16 = 205;

    /// The rule's name, for logs.
    pub const fn name(rule: u16) -> &'static str {
        match rule {
            END_OF_CHAIN => "end of ISTIO_OUTPUT",
            OUT_EXCLUDED_PORT => "excludeOutboundPorts",
            INBOUND_PASSTHROUGH => "inbound passthrough source",
            PROXY_UID_HAIRPIN => "proxy UID to its own pod",
            LOOPBACK_RETURN => "loopback",
            PROXY_UID => "proxy UID",
            PROXY_GID_HAIRPIN => "proxy GID to its own pod",
            PROXY_GID => "proxy GID",
            DNS => "DNS capture",
            OUT_EXCLUDED_CIDR => "excludeOutboundIPRanges",
            OUT_INCLUDED_PORT => "includeOutboundPorts",
            OUT_INCLUDED_CIDR => "includeOutboundIPRanges",
            NO_IPV6 => "no IPv6 capture",
            LOOPBACK_SOURCE_OFF_POD => "loopback source to an address off the pod",
            EXCLUDED_INTERFACE => "excludeInterfaces",
            NOT_CAPTURED_PROTOCOL => "protocol not captured",
            TPROXY_PASSTHROUGH => "TPROXY passthrough",
            AMBIENT_PROBE_REPLY => "ambient: to the probe SNAT address",
            AMBIENT_DNS_UDP => "ambient: DNS over UDP",
            AMBIENT_DNS_TCP => "ambient: DNS over TCP",
            AMBIENT_CONN_MARK => "ambient: ztunnel connection mark",
            AMBIENT_LOOPBACK => "ambient: over lo",
            AMBIENT_OUTBOUND => "ambient: outbound to ztunnel",
            AMBIENT_ZTUNNEL => "ambient: ztunnel's own socket",
            AMBIENT_ORIG_SRC => "ambient: ztunnel to its app from the client address",
            IN_CAPTURED_PORT => "inbound port captured",
            IN_PORT_NOT_CAPTURED => "inbound port not captured",
            IN_EXCLUDED_INTERFACE => "excludeInterfaces (inbound)",
            IN_NO_LISTENER => "inbound port captured, no proxy listener: refused",
            IN_PROBE_SOURCE => "ambient: from the probe SNAT address",
            IN_NODE_SOCKET => "ambient: from a socket of the node",
            _ => "unknown rule",
        }
    }
}

/// Per-pod policy, keyed by network-namespace cookie (`u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodPolicy {
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub dns_port: u16,
    pub _reserved: u16,
    pub flags: u32,
}

/// `PortKey::direction` values.
pub mod port_list {
    pub const OUTBOUND_EXCLUDE: u32 = 0;
    pub const OUTBOUND_INCLUDE: u32 = 1;
    pub const INBOUND_EXCLUDE: u32 = 2;
    pub const INBOUND_INCLUDE: u32 = 3;
}

/// Key of `SIDESTEP_PORTS`. The value is a `u8` that is always 1: presence is the rule.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortKey {
    pub netns_cookie: u64,
    pub list: u32,
    pub port: u32,
}

/// `CidrKey::list` values.
pub mod cidr_list {
    pub const OUTBOUND_EXCLUDE: u32 = 0;
    pub const OUTBOUND_INCLUDE: u32 = 1;
    /// The pod's routes, for a pod with excluded interfaces: value `route_via::*`. The longest
    /// prefix covering a destination tells whether its route leaves through an excluded
    /// interface, as the `-o <nic>` match of istio-iptables sees it.
    pub const ROUTE: u32 = 2;
    /// `SIDESTEP_SRCR` keys: a route of the pod through an interface other than the one of its
    /// source address (`PodSource`), with that interface's address as the value.
    pub const SOURCE: u32 = 3;
}

/// Values of `SIDESTEP_CIDRS` entries in the `cidr_list::ROUTE` list.
pub mod route_via {
    pub const EXCLUDED: u8 = 1;
    pub const OTHER: u8 = 2;
}

/// Bits of `CidrKey` that precede the address: cookie (64) and list (32).
pub const CIDR_KEY_FIXED_BITS: u32 = 96;

/// Data part of an `SIDESTEP_CIDRS` LPM-trie key. Only 4-byte alignment, because the kernel requires
/// the data to follow the 4-byte prefix length with no padding. The value is a `u8` set to 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CidrKey {
    /// The netns cookie as two native-endian words; all 64 bits always take part in the match.
    pub netns_cookie: [u32; 2],
    /// Big-endian so that the trie compares the list id byte-wise as one unit.
    pub list_be: u32,
    /// IPv6 address, or an IPv4 address in IPv4-mapped form, in network byte order.
    pub addr: [u8; 16],
}

impl CidrKey {
    pub const fn new(netns_cookie: u64, list: u32, addr: [u8; 16]) -> Self {
        Self {
            netns_cookie: [netns_cookie as u32, (netns_cookie >> 32) as u32],
            list_be: list.to_be(),
            addr,
        }
    }
}

/// `OrigDst::kind` values.
pub mod redirect_kind {
    pub const OUTBOUND: u16 = 1;
    pub const INBOUND: u16 = 2;
    pub const DNS: u16 = 3;
    /// Not redirected: the TPROXY-mode proxy's transparent connection to its app, recorded so
    /// that sk_lookup recognises its SYN (a foreign source arriving over lo) and leaves it alone.
    pub const TPROXY_PASSTHROUGH: u16 = 4;
    /// A connection that arrived on a re-routed virtual interface, DNATed to the outbound port.
    pub const REROUTE: u16 = 5;
    /// Not redirected: a connection from a socket of the node's own netns (kubelet's probes) to
    /// an ambient pod, recorded when its SYN is about to leave, so that the pod's inbound
    /// capture leaves it to the app, as istio-cni's `--socket-exists` SNAT on the node does.
    pub const NODE_SOCKET: u16 = 6;
    /// Not a redirect: the connect or datagram fails with EPERM (a verdict only, never stored).
    pub const REFUSED: u16 = 7;
    /// Not redirected: an IPv6 connection from a pod to one of its own addresses (from that
    /// address, another of the pod's, or ::6), recorded when its SYN is about to leave. The
    /// kernel reports such a SYN on the address's interface rather than on lo, so only this
    /// record tells it from a SYN with a forged source from off the pod (IPv6, unlike IPv4,
    /// accepts local sources from the wire), which must be captured as Istio's PREROUTING does.
    pub const LOCAL_SELF: u16 = 8;
}

/// What the socket's peer really was before sidestep redirected it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrigDst {
    /// IPv6 words in network byte order; IPv4 in IPv4-mapped form.
    pub addr: [u32; 4],
    /// Network byte order, as sockaddr carries it.
    pub port_be: u16,
    /// `redirect_kind`.
    pub kind: u16,
    /// `AF_INET` or `AF_INET6`: which `SO_ORIGINAL_DST` level answers for this connection.
    pub family: u16,
    /// `socket_side`: whose socket this record is on.
    pub side: u16,
}

/// `OrigDst::side` values.
pub mod socket_side {
    /// The app's connecting socket: getpeername reports the original destination.
    pub const CLIENT: u16 = 0;
    /// The proxy's accepted socket: getpeername reports the real peer.
    pub const ACCEPTED: u16 = 1;
}

/// Key of `SIDESTEP_PEND`: a TCP connection as both of its ends see it, client first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TupleKey {
    pub netns_cookie: u64,
    pub client_addr: [u32; 4],
    pub server_addr: [u32; 4],
    pub client_port: u16,
    pub server_port: u16,
    pub _reserved: u32,
}

impl TupleKey {
    /// The connection from `client` (address, port) to `server` in the netns `netns_cookie`.
    #[inline(always)]
    pub const fn new(netns_cookie: u64, client: ([u32; 4], u16), server: ([u32; 4], u16)) -> Self {
        Self {
            netns_cookie,
            client_addr: client.0,
            server_addr: server.0,
            client_port: client.1,
            server_port: server.1,
            _reserved: 0,
        }
    }
}

/// Key of `SIDESTEP_LSTN`: a pod's inbound proxy listener, per address family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    pub netns_cookie: u64,
    pub family: u32,
    pub port: u32,
}

/// Values of `SIDESTEP_IFACES`.
pub mod iface_kind {
    /// The interface carries the pod's tc ingress program.
    pub const TC: u8 = 1;
    /// `excludeInterfaces` (or a re-routed interface): inbound on it is never captured, and
    /// neither is outbound routed out of it.
    pub const EXCLUDED: u8 = 2;
    /// A re-routed virtual interface: inbound on it is not captured (its tc programs DNAT it to
    /// the outbound port instead); outbound routed out of it is.
    pub const REROUTED: u8 = 3;
}

/// Key of `SIDESTEP_IFACES`: an interface of a pod that the data path treats specially (value:
/// an `iface_kind`). Every other interface of a `NETNS_WIDE` pod is captured by sk_lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InterfaceKey {
    pub netns_cookie: u64,
    pub ifindex: u32,
    pub _reserved: u32,
}

/// Key of `SIDESTEP_RRIF`: a re-routed virtual interface, as a packet on it names it (the
/// device's ifindex and its MAC address: destination on ingress, source on egress). The netns
/// cookie cannot key it: on ingress `bpf_get_netns_cookie` answers for the sender's socket when
/// the skb still carries one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RerouteIfKey {
    pub ifindex: u32,
    pub mac: [u8; 6],
    pub _reserved: u16,
}

/// `RerouteIf::flags` bits.
pub mod reroute_flags {
    /// `addr4` holds the interface's primary IPv4 address.
    pub const HAS_V4: u32 = 1 << 0;
    /// `addr6` holds the interface's first IPv6 address.
    pub const HAS_V6: u32 = 1 << 1;
    /// includeOutboundIPRanges is `*`: every destination is re-routed.
    pub const ALL_RANGES: u32 = 1 << 2;
}

/// Value of `SIDESTEP_RRIF`: the pod that owns the interface and the addresses REDIRECT would
/// DNAT to (the interface's first IPv4 and first IPv6 address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RerouteIf {
    pub netns_cookie: u64,
    /// IPv4-mapped.
    pub addr4: [u32; 4],
    pub addr6: [u32; 4],
    /// `reroute_flags`.
    pub flags: u32,
    pub _reserved: u32,
}

/// Value of `SIDESTEP_SRC`, keyed by netns cookie: the address connect4/6 bind a captured app
/// socket to before sending it to the proxy on loopback, so that the app's `getsockname` and the
/// proxy's `getpeername` show the pod's address, as under REDIRECT (which leaves the source the
/// route chose for the original destination). All-zero words: none of that family (the socket
/// then keeps the loopback source the kernel picks).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSource {
    /// IPv4-mapped.
    pub addr4: [u32; 4],
    pub addr6: [u32; 4],
    /// `pod_source_flags`.
    pub flags: u32,
    pub _reserved: u32,
}

/// Bits of `PodSource::flags`.
pub mod pod_source_flags {
    /// The pod has routes through other interfaces in `SIDESTEP_SRCR`: look the destination up
    /// there first (a multi-homed pod, e.g. Multus's `net1`).
    pub const ROUTES: u32 = 1 << 0;
}

/// Per-pod, per-CPU counters, keyed by netns cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub redirected_outbound: u64,
    pub redirected_inbound: u64,
    pub passed_outbound: u64,
    pub passed_inbound: u64,
    pub dns_redirected: u64,
    pub orig_dst_hits: u64,
    pub orig_dst_misses: u64,
    /// Messages sk_msg handed straight to the peer socket.
    pub sk_msg_redirects: u64,
    /// Sockets sk_msg switched to the TCP path for good: the peer's queue was over the cap, or
    /// the peer was not in the sockhash.
    pub sk_msg_fallbacks: u64,
}

impl Counters {
    pub fn add(&mut self, other: &Counters) {
        self.redirected_outbound += other.redirected_outbound;
        self.redirected_inbound += other.redirected_inbound;
        self.passed_outbound += other.passed_outbound;
        self.passed_inbound += other.passed_inbound;
        self.dns_redirected += other.dns_redirected;
        self.orig_dst_hits += other.orig_dst_hits;
        self.orig_dst_misses += other.orig_dst_misses;
        self.sk_msg_redirects += other.sk_msg_redirects;
        self.sk_msg_fallbacks += other.sk_msg_fallbacks;
    }
}

/// Linux constants the programs and tests both need.
pub mod linux {
    pub const AF_INET: u16 = 2;
    pub const AF_INET6: u16 = 10;
    pub const SOL_IP: i32 = 0;
    pub const SOL_IPV6: i32 = 41;
    /// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
    pub const SO_ORIGINAL_DST: i32 = 80;
    pub const ENOENT: i32 = 2;
    pub const SOCK_STREAM: u32 = 1;
    pub const SOCK_DGRAM: u32 = 2;
    pub const IPPROTO_TCP: u32 = 6;
    pub const IPPROTO_UDP: u32 = 17;
    pub const SOL_SOCKET: i32 = 1;
    pub const SO_MARK: i32 = 36;
    /// SOL_IP: the IPv4 options every packet of the socket carries.
    pub const IP_OPTIONS: i32 = 4;
    /// SOL_IPV6: RFC 2292's sticky packet options, a control-message buffer (it may hold a
    /// routing header).
    pub const IPV6_2292PKTOPTIONS: i32 = 6;
    /// SOL_IPV6: the sticky routing header (RFC 3542); a type-4 segment routing header needs no
    /// privilege.
    pub const IPV6_RTHDR: i32 = 57;
    /// IPv4 loose and strict source route options (RFC 791).
    pub const IPOPT_LSRR: u8 = 0x83;
    pub const IPOPT_SSRR: u8 = 0x89;
    pub const IPOPT_END: u8 = 0;
    pub const IPOPT_NOOP: u8 = 1;
    /// The longest IPv4 options block.
    pub const MAX_IPOPTLEN: usize = 40;
}

/// The IPv4-mapped IPv6 form of an IPv4 address given in network byte order.
#[inline(always)]
pub const fn v4_mapped(ip4_be: u32) -> [u32; 4] {
    [0, 0, 0xffff_u32.to_be(), ip4_be]
}

/// Whether the words are an IPv4-mapped IPv6 address.
#[inline(always)]
pub const fn is_v4_mapped(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == 0xffff_u32.to_be()
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: each type is #[repr(C)], Copy, has no padding and no invalid bit patterns.
    unsafe impl aya::Pod for PodPolicy {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PortKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CidrKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for OrigDst {}
    // SAFETY: as above.
    unsafe impl aya::Pod for TupleKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Counters {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ListenerKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for InterfaceKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RerouteIfKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RerouteIf {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PodSource {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(size_of::<PodPolicy>(), 20);
        assert_eq!(size_of::<PortKey>(), 16);
        assert_eq!(size_of::<CidrKey>(), 28);
        assert_eq!(align_of::<CidrKey>(), 4);
        assert_eq!(size_of::<OrigDst>(), 24);
        assert_eq!(size_of::<TupleKey>(), 48);
        assert_eq!(size_of::<Counters>(), 72);
        assert_eq!(size_of::<RerouteIfKey>(), 12);
        assert_eq!(size_of::<RerouteIf>(), 48);
    }

    #[test]
    fn v4_mapped_round_trip() {
        let ip = u32::from_ne_bytes([10, 1, 2, 3]);
        let mapped = v4_mapped(ip);
        assert!(is_v4_mapped(&mapped));
        assert_eq!(mapped[3], ip);
        assert!(!is_v4_mapped(&[0, 0, 0, 1u32.to_be()]));
    }
}
