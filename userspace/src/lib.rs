//! sidestep's core library: the loader, pins, maps, policy model, enrolment and network
//! namespaces, shared by the `sidestep` command and agent (`sidestep-daemon`, in `daemon/`) and
//! the `sidestep-cni` plugin. Nothing here runs an async runtime or talks to the API server, so
//! the short-lived plugin links only what an ADD needs.

pub mod btf;
pub mod enroll;
pub mod error;
pub mod features;
pub mod identity;
pub mod limits;
pub mod links;
pub mod loader;
pub mod maps;
pub mod mounts;
pub mod netns;
pub mod pins;
pub mod podlinks;
pub mod policy;
pub mod programs;
mod rtnl;
pub mod statedir;
pub mod status;
pub mod sys;
pub mod tcattach;
pub mod tproxy;
pub mod userns;
