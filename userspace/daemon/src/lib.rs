//! The `sidestep` daemon and command line: the node agent (`agent`), the pod address follower,
//! Istio ambient's ZDS server for ztunnel and the verdict log reader. It runs for the node's
//! lifetime; everything it changes in the kernel goes through the `sidestep` library, as the
//! plugin's changes do.

pub mod addrfollow;
pub mod agent;
pub mod check;
pub mod cli;
pub mod verdictlog;
pub mod zds;
