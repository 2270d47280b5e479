//! What the running kernel offers sidestep, probed by loading a tiny program per question (the
//! way libbpf and bpftool do), not read off the version: distribution kernels backport features
//! and configure some out. Missing requirements fail `sidestep load` with every gap named,
//! before anything is attached, instead of surfacing as a verifier log or, worse, a connection
//! that is not captured.

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};

/// Program types sidestep loads, and the hooks that need them.
const PROGRAM_TYPES: &[(ProgramType, &str)] = &[
    (
        ProgramType::CgroupSockAddr,
        "cgroup connect/sendmsg/recvmsg/getpeername programs",
    ),
    (ProgramType::SockOps, "sock_ops programs"),
    (
        ProgramType::CgroupSockopt,
        "cgroup getsockopt programs (SO_ORIGINAL_DST)",
    ),
    (
        ProgramType::CgroupSkb,
        "cgroup_skb programs (the egress source-route guard)",
    ),
    (ProgramType::SchedClassifier, "tc programs"),
    (ProgramType::SkMsg, "sk_msg programs"),
    (ProgramType::SkLookup, "sk_lookup programs (Linux 5.9)"),
];

const MAP_TYPES: &[(MapType, &str)] = &[
    (MapType::SkStorage, "socket-local storage maps"),
    (MapType::SockHash, "sockhash maps"),
    (MapType::LpmTrie, "LPM trie maps"),
    (MapType::LruHash, "LRU hash maps"),
];

/// Helpers each program type must be allowed to call.
const HELPERS: &[(ProgramType, BpfHelper, &str)] = &[
    (
        ProgramType::CgroupSockAddr,
        BpfHelper::BPF_FUNC_get_netns_cookie,
        "bpf_get_netns_cookie in cgroup sock_addr programs",
    ),
    (
        ProgramType::CgroupSockAddr,
        BpfHelper::BPF_FUNC_sk_storage_get,
        "bpf_sk_storage_get in cgroup sock_addr programs",
    ),
    (
        ProgramType::CgroupSockAddr,
        BpfHelper::BPF_FUNC_skc_to_mptcp_sock,
        "bpf_skc_to_mptcp_sock in cgroup sock_addr programs (an MPTCP app's getpeername)",
    ),
    (
        ProgramType::SockOps,
        BpfHelper::BPF_FUNC_get_netns_cookie,
        "bpf_get_netns_cookie in sock_ops programs",
    ),
    (
        ProgramType::CgroupSockopt,
        BpfHelper::BPF_FUNC_get_netns_cookie,
        "bpf_get_netns_cookie in cgroup sockopt programs",
    ),
    (
        ProgramType::CgroupSkb,
        BpfHelper::BPF_FUNC_skb_load_bytes,
        "bpf_skb_load_bytes in cgroup_skb programs",
    ),
    (
        ProgramType::SkMsg,
        BpfHelper::BPF_FUNC_get_netns_cookie,
        "bpf_get_netns_cookie in sk_msg programs",
    ),
    (
        ProgramType::SchedClassifier,
        BpfHelper::BPF_FUNC_sk_assign,
        "bpf_sk_assign in tc programs",
    ),
    (
        ProgramType::SchedClassifier,
        BpfHelper::BPF_FUNC_skc_lookup_tcp,
        "bpf_skc_lookup_tcp in tc programs",
    ),
    (
        ProgramType::SchedClassifier,
        BpfHelper::BPF_FUNC_skb_vlan_pop,
        "bpf_skb_vlan_pop in tc programs (VLAN tags on re-routed interfaces)",
    ),
    (
        ProgramType::SkLookup,
        BpfHelper::BPF_FUNC_sk_assign,
        "bpf_sk_assign in sk_lookup programs",
    ),
];

/// What the probes found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSupport {
    /// `uname -r`.
    pub release: String,
    /// Requirements the kernel lacks, as sentences for the operator. Empty: sidestep can load.
    pub missing: Vec<String>,
    /// Whether tc programs may call bpf_get_netns_cookie (Linux 6.13): without it, a SYN from off
    /// the node to an address enrolment did not register is left to the pod's sk_lookup program
    /// (the tc program cannot name its pod).
    pub tc_netns_cookie: bool,
}

/// Probes the running kernel. A probe that errs counts as missing: a kernel that cannot answer
/// cannot be trusted with the feature either.
pub fn probe() -> KernelSupport {
    let mut missing = Vec::new();
    for (program_type, what) in PROGRAM_TYPES {
        if !is_program_supported(*program_type).unwrap_or(false) {
            missing.push((*what).to_string());
        }
    }
    for (map_type, what) in MAP_TYPES {
        if !is_map_supported(*map_type).unwrap_or(false) {
            missing.push((*what).to_string());
        }
    }
    for (program_type, helper, what) in HELPERS {
        if !is_helper_supported(*program_type, *helper).unwrap_or(false) {
            missing.push((*what).to_string());
        }
    }
    KernelSupport {
        release: release(),
        missing,
        tc_netns_cookie: tc_netns_cookie(),
    }
}

/// Whether tc programs may call bpf_get_netns_cookie (Linux 6.13).
pub fn tc_netns_cookie() -> bool {
    is_helper_supported(
        ProgramType::SchedClassifier,
        BpfHelper::BPF_FUNC_get_netns_cookie,
    )
    .unwrap_or(false)
}

/// Whether sk_msg programs may call bpf_probe_read_kernel, which the sk_msg back-pressure check
/// needs. Lockdown's confidentiality mode takes it away, and so may an LSM; reading
/// securityfs's lockdown file cannot tell from inside a pod that has no securityfs mounted, and a
/// program calling a helper the kernel refuses fails the whole load.
pub fn sk_msg_reads_kernel() -> bool {
    is_helper_supported(ProgramType::SkMsg, BpfHelper::BPF_FUNC_probe_read_kernel).unwrap_or(false)
}

/// The kernel release, for messages.
pub fn release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into())
}
