//! Every map the programs share. BTF map definitions, so `bpftool map dump` prints field names.

use aya_ebpf::{
    btf_maps::{HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, SkStorage, SockHash},
    macros::btf_map,
};
use sidestep_abi::{
    CidrKey, Counters, InterfaceKey, ListenerKey, OrigDst, PodPolicy, PodSource, PortKey,
    RerouteIf, RerouteIfKey, TupleKey, capacity,
};

/// Enrolment: a netns with no entry here is never touched.
#[btf_map]
pub static SIDESTEP_POD: HashMap<u64, PodPolicy, { capacity::PODS as usize }> = HashMap::new();

/// Pod address (IPv6 words, IPv4 mapped) -> netns cookie, for tc ingress, which cannot trust the
/// netns cookie of an skb that still carries its sender's socket.
#[btf_map]
pub static SIDESTEP_ADDRS: HashMap<[u32; 4], u64, { capacity::ADDRESSES as usize }> =
    HashMap::new();

/// Netns cookie -> the address a captured app socket is bound to before it goes to the proxy on
/// loopback (see connect.rs). No entry: a pod enrolled by an older version; its sockets keep the
/// loopback source.
#[btf_map]
pub static SIDESTEP_SRC: HashMap<u64, PodSource, { capacity::PODS as usize }> = HashMap::new();

/// A multi-homed pod's routes through interfaces other than its source address's:
/// (cookie, `cidr_list::SOURCE`, destination prefix) -> that interface's address of the family.
#[btf_map]
pub static SIDESTEP_SRCR: LpmTrie<CidrKey, [u32; 4], { capacity::SOURCE_ROUTES as usize }> =
    LpmTrie::new();

#[btf_map]
pub static SIDESTEP_PORTS: HashMap<PortKey, u8, { capacity::PORT_RULES as usize }> = HashMap::new();

#[btf_map]
pub static SIDESTEP_CIDRS: LpmTrie<CidrKey, u8, { capacity::CIDR_RULES as usize }> = LpmTrie::new();

#[btf_map]
pub static SIDESTEP_STATS: PerCpuHashMap<u64, Counters, { capacity::PODS as usize }> =
    PerCpuHashMap::new();

/// The original destination of a redirected socket, on both the app's and the proxy's end.
/// Socket-local storage: the kernel frees it with the socket, so it cannot leak.
#[btf_map]
pub static SIDESTEP_ORIG: SkStorage<OrigDst> = SkStorage::new();

/// sk_msg's sticky switch: a socket with an entry here never has its messages redirected again
/// (see `skmsg.rs`). Socket-local storage, freed with the socket.
#[btf_map]
pub static SIDESTEP_SKMSG: SkStorage<u32> = SkStorage::new();

/// Hand-over from the redirected connect to the proxy's accepted socket, keyed by the 4-tuple both
/// ends share. An entry lives from the client's SYN until the proxy's socket is established or the
/// client socket closes; LRU bounds it when neither happens. (The claim into the accepted
/// socket's storage costs an allocation per connection but ties the record to the socket's
/// lifetime; see docs/ARCHITECTURE.md, outbound data flow, step 3.)
#[btf_map]
pub static SIDESTEP_PEND: LruHashMap<TupleKey, OrigDst, { capacity::PENDING as usize }> =
    LruHashMap::new();

/// Both ends of each local app <-> proxy connection of a pod with sk_msg on, keyed by the
/// connection as that socket sees it (`client_*` = local end). The kernel removes a socket when
/// it closes.
#[btf_map]
pub static SIDESTEP_SOCKS: SockHash<TupleKey, { capacity::SOCKETS as usize }> = SockHash::new();

/// Each enrolled pod's inbound proxy listeners, added by sockops when they listen.
#[btf_map]
pub static SIDESTEP_LSTN: SockHash<ListenerKey, { capacity::PODS as usize * 2 }> = SockHash::new();

/// The interfaces each pod captures inbound on (those carrying the tc program).
#[btf_map]
pub static SIDESTEP_IFACES: HashMap<InterfaceKey, u8, { capacity::INTERFACES as usize }> =
    HashMap::new();

/// Per CPU: non-zero while tc ingress runs its own socket lookups. bpf_skc_lookup_tcp falls back
/// to a listener lookup, which runs the pod's sk_lookup program inside tc's call; that nested run
/// must not steer or count the SYN a second time (tc decides it).
#[btf_map]
pub static SIDESTEP_NEST: PerCpuArray<u32, 1> = PerCpuArray::new();

/// Per CPU: the netns cookie that the pod's identity program (`sidestep_pod_id`, assembled per
/// pod by userspace and attached before `sidestep_sk_lookup` in the pod's netns) wrote just
/// before `sidestep_sk_lookup` runs in the same array run. sk_lookup programs have no netns
/// helper, and a destination address names the pod only for the addresses enrolment saw; this
/// names it for every address. The reader clears it, so a stale value is never taken for the
/// next lookup's.
#[btf_map]
pub static SIDESTEP_NSID: PerCpuArray<u64, 1> = PerCpuArray::new();

/// Re-routed virtual interfaces: (ifindex, MAC) -> owning pod and the addresses to DNAT to.
#[btf_map]
pub static SIDESTEP_RRIF: HashMap<RerouteIfKey, RerouteIf, { capacity::REROUTE_IFACES as usize }> =
    HashMap::new();

/// Connections DNATed on a re-routed interface, keyed as the proxy's accepted socket sees them
/// (pod cookie, client, interface address, client port, outbound port) -> original destination.
/// A new SYN on the same key overwrites; LRU evicts the rest.
#[btf_map]
pub static SIDESTEP_RNAT: LruHashMap<TupleKey, OrigDst, { capacity::REROUTE_NAT as usize }> =
    LruHashMap::new();

/// Looks up (and with `init`, creates) the original destination stored on any socket pointer the
/// verifier accepts for sk_storage: the `sk` of a sock_addr, sock_ops or sockopt context.
///
/// # Safety
/// `sk` must be a socket pointer from the current program's context, already checked non-null.
#[inline(always)]
pub unsafe fn socket_orig_dst(
    sk: *mut core::ffi::c_void,
    init: Option<&mut OrigDst>,
) -> *mut OrigDst {
    // The map's address is what the loader relocates to the map; aya keeps `as_ptr` crate-private.
    let map = core::ptr::from_ref(&SIDESTEP_ORIG).cast_mut().cast();
    let (value, flags) = match init {
        Some(v) => (
            core::ptr::from_mut(v).cast(),
            aya_ebpf::bindings::BPF_SK_STORAGE_GET_F_CREATE as u64,
        ),
        None => (core::ptr::null_mut(), 0),
    };
    // SAFETY: `map` is an sk_storage map and `sk` a socket, as the caller guarantees.
    unsafe { aya_ebpf::helpers::generated::bpf_sk_storage_get(map, sk, value, flags) }.cast()
}
