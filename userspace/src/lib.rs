//! sidestep's userspace: loader, pin manager, policy model and enrolment, shared by the
//! `sidestep` CLI/agent and the `sidestep-cni` plugin.

pub mod addrfollow;
pub mod agent;
pub mod btf;
pub mod enroll;
pub mod error;
pub mod features;
pub mod identity;
pub mod loader;
pub mod maps;
pub mod mounts;
pub mod netns;
pub mod pins;
pub mod policy;
mod rtnl;
pub mod stateindex;
pub mod status;
pub mod sys;
pub mod tc;
pub mod tcattach;
pub mod tproxy;
pub mod userns;
pub mod verdictlog;
pub mod zds;
