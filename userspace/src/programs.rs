//! Which program goes where: the cgroup hooks attached once per installation, the programs
//! attached per pod inside its netns, and the ones attached to a map. The loader attaches by
//! these lists, the pin layout and status read them, and none of those needs the loader itself.

use aya_obj::generated::bpf_attach_type;
use sidestep_abi::program_names;

/// A program attached once per installation, at a cgroup.
#[derive(Debug, Clone, Copy)]
pub struct CgroupProgram {
    pub name: &'static str,
    /// Stable link pin name, also what `sidestep status` prints.
    pub attach_point: &'static str,
    pub attach_type: bpf_attach_type,
}

pub const CGROUP_PROGRAMS: [CgroupProgram; 14] = [
    CgroupProgram {
        name: program_names::CONNECT4,
        attach_point: "connect4",
        attach_type: bpf_attach_type::BPF_CGROUP_INET4_CONNECT,
    },
    CgroupProgram {
        name: program_names::CONNECT6,
        attach_point: "connect6",
        attach_type: bpf_attach_type::BPF_CGROUP_INET6_CONNECT,
    },
    CgroupProgram {
        name: program_names::GETPEERNAME4,
        attach_point: "getpeername4",
        attach_type: bpf_attach_type::BPF_CGROUP_INET4_GETPEERNAME,
    },
    CgroupProgram {
        name: program_names::GETPEERNAME6,
        attach_point: "getpeername6",
        attach_type: bpf_attach_type::BPF_CGROUP_INET6_GETPEERNAME,
    },
    CgroupProgram {
        name: program_names::SENDMSG4,
        attach_point: "sendmsg4",
        attach_type: bpf_attach_type::BPF_CGROUP_UDP4_SENDMSG,
    },
    CgroupProgram {
        name: program_names::SENDMSG6,
        attach_point: "sendmsg6",
        attach_type: bpf_attach_type::BPF_CGROUP_UDP6_SENDMSG,
    },
    CgroupProgram {
        name: program_names::RECVMSG4,
        attach_point: "recvmsg4",
        attach_type: bpf_attach_type::BPF_CGROUP_UDP4_RECVMSG,
    },
    CgroupProgram {
        name: program_names::RECVMSG6,
        attach_point: "recvmsg6",
        attach_type: bpf_attach_type::BPF_CGROUP_UDP6_RECVMSG,
    },
    CgroupProgram {
        name: program_names::SOCK_OPS,
        attach_point: "sockops",
        attach_type: bpf_attach_type::BPF_CGROUP_SOCK_OPS,
    },
    CgroupProgram {
        name: program_names::GETSOCKOPT,
        attach_point: "getsockopt",
        attach_type: bpf_attach_type::BPF_CGROUP_GETSOCKOPT,
    },
    CgroupProgram {
        name: program_names::SETSOCKOPT,
        attach_point: "setsockopt",
        attach_type: bpf_attach_type::BPF_CGROUP_SETSOCKOPT,
    },
    // Before bind4/6: `PinLayout::is_loaded` looks for the last link, which an installation
    // from before this program has too, so pods keep being enrolled while it upgrades.
    CgroupProgram {
        name: program_names::ROUTE_GUARD,
        attach_point: "egress",
        attach_type: bpf_attach_type::BPF_CGROUP_INET_EGRESS,
    },
    CgroupProgram {
        name: program_names::BIND4,
        attach_point: "bind4",
        attach_type: bpf_attach_type::BPF_CGROUP_INET4_BIND,
    },
    CgroupProgram {
        name: program_names::BIND6,
        attach_point: "bind6",
        attach_type: bpf_attach_type::BPF_CGROUP_INET6_BIND,
    },
];

/// Programs attached per pod (inside its netns) rather than at the cgroup.
pub const POD_PROGRAMS: [&str; 4] = [
    program_names::TC_INGRESS,
    program_names::SK_LOOKUP,
    program_names::REROUTE_INGRESS,
    program_names::REROUTE_EGRESS,
];

/// Programs attached to a map rather than a hook.
pub const MAP_PROGRAMS: [&str; 1] = [program_names::SK_MSG];
