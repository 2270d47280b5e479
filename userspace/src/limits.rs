//! How much of a pod goes into the maps every pod of the node shares. Root in a pod can add
//! thousands of addresses and routes, and its annotations can list thousands of ports and CIDRs;
//! a full shared map would fail other pods' ADDs. Every per-pod cap of a shared map is here, for
//! the policy parser and enrolment alike.

/// The most addresses one pod holds in `SIDESTEP_ADDRS` (enrolment's and the address follower's
/// together). The addresses come from the pod netns, where an app with CAP_NET_ADMIN can add
/// thousands, and the map is shared by every pod of the node: a full map would fail other pods'
/// ADDs. An address left out fails closed: the app calling it is captured to the outbound port
/// (Istio would leave that call to the pod itself), and a SYN to it is steered by the pod's own
/// sk_lookup program, which names its pod without the map.
pub const MAX_POD_ADDRESSES: usize = 64;

/// The most interfaces an enrolment captures when not told which (`sidestep enroll` without
/// `--interface`: every interface but lo). Each is a `SIDESTEP_IFACES` entry and, with the tc
/// hook, a TCX link; a netns with more is refused rather than enrolled in part. The plugin
/// always names its attachment's interface.
pub const MAX_UNNAMED_INTERFACES: usize = 32;

/// The most routes of one pod in the `cidr_list::ROUTE` list of `SIDESTEP_CIDRS` (`-o <nic>` for
/// excluded interfaces).
pub const MAX_EXCLUSION_ROUTES: usize = 256;

/// The pods of one node the rule budgets below are sized for: kubelet's default `maxPods`.
pub const BUDGETED_PODS: usize = 110;

/// The most `SIDESTEP_PORTS` entries one pod's policy writes: its four port lists together
/// (inbound include and exclude, outbound include and exclude), each port of an expanded range
/// (Linkerd's `4000-4100`) an entry, the fixed exclusions (Istio's 15008, 15020, 15021, 15090)
/// included. The map holds 65,536 entries for the whole node:
///
/// ```text
/// 65,536 / 110 pods = 595 per pod, rounded down to 512
/// 110 pods x 512    = 56,320, leaving 9,216 spare
/// ```
///
/// A default Istio pod writes 5. Past 128 pods the budget alone no longer guarantees room: a
/// node of 1,000 pods stays within the map while they average at most 65 entries each.
pub const MAX_POD_PORT_RULES: usize = 512;

/// The most `SIDESTEP_CIDRS` entries one pod's policy writes: its outbound include and exclude
/// IP ranges, with the `::/0` a `*` writes. The same map holds the pod's routes for excluded
/// interfaces ([`MAX_EXCLUSION_ROUTES`]), so a pod's share is both:
///
/// ```text
/// 65,536 / 110 pods  = 595 per pod
/// 595 - 256 routes   = 339 for the policy, rounded down to 256
/// 110 pods x (256 + 256) = 56,320, leaving 9,216 spare
/// ```
///
/// A default Istio pod writes 1. A node of 1,000 pods stays within the map while they average
/// at most 65 entries each.
pub const MAX_POD_CIDR_RULES: usize = 256;

const _: () = assert!(
    BUDGETED_PODS * MAX_POD_PORT_RULES <= sidestep_abi::capacity::PORT_RULES as usize,
    "a full node of pods at their port budget overflows SIDESTEP_PORTS"
);
const _: () = assert!(
    BUDGETED_PODS * (MAX_POD_CIDR_RULES + MAX_EXCLUSION_ROUTES)
        <= sidestep_abi::capacity::CIDR_RULES as usize,
    "a full node of pods at their CIDR budget overflows SIDESTEP_CIDRS"
);
