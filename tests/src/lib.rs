//! Test topology for sidestep: real network namespaces, a real CNI bridge, real HAProxy and
//! nginx, all on one machine and all removed on drop (also when the test panics).
//!
//! ```no_run
//! use sidestep_tests::{Node, NodeOptions, TestEnv, haproxy, nginx, http_get, url};
//! # fn main() -> anyhow::Result<()> {
//! let env = TestEnv::new("outbound")?;                 // cgroup + pin root + scratch dir
//! let node = Node::new(&env, NodeOptions::dual_stack())?;
//! let client = node.add_pod("client")?;
//! let server = node.add_pod("server")?;
//! let _web = nginx::Server::start(&env, &server, 80)?;
//! let _proxy = haproxy::Sidecar::start(&env, &client, Default::default())?;
//! let body = http_get(&env, &client, 1000, &url(server.ipv4.into(), 80, "/"))?;
//! assert_eq!(body, nginx::body_for("server"));
//! # Ok(()) }
//! ```
//!
//! Declare the [`TestEnv`] first so it drops last: process guards, then the node (CNI DEL,
//! netns, bridge), then the env (kills what is left in the cgroup, removes pins and cgroup).
//!
//! Everything needs root; tests call [`skip_unless_root`] first.

pub mod bench;
pub mod cgroup;
pub mod cni;
pub mod env;
pub mod faults;
pub mod haproxy;
pub mod istio_ambient;
pub mod istio_iptables;
pub mod istio_nftables;
pub mod loadgen;
pub mod net;
pub mod netns;
pub mod nginx;
pub mod node;
pub mod parity;
pub mod pod;
pub mod podapi;
pub mod podman;
pub mod process;
pub mod sidestep;
mod subnet;
pub mod sweep;
mod util;
pub mod wire;
pub mod zds;

pub use cgroup::{Cgroup, cgroup2_mount};
pub use env::TestEnv;
pub use net::{http_get, listening_sockets, tcp_connect, url, wait_for_tcp, wait_listening};
pub use node::{Node, NodeOptions};
pub use pod::{Pod, PodOptions};
pub use process::{ChildGuard, Spawn};

/// Whether the effective UID is 0.
pub fn running_as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Prints a skip notice and returns true when not root. Use as
/// `ip -batch` lines adding `count` host routes (/32) in `prefix`.0.0/16 through `dev`.
pub fn host_routes(count: u32, prefix: &str, dev: &str) -> String {
    (0..count)
        .map(|i| format!("route add {prefix}.{}.{}/32 dev {dev}\n", i / 256, i % 256))
        .collect()
}

/// `if skip_unless_root("my_test") { return; }`.
pub fn skip_unless_root(test: &str) -> bool {
    if running_as_root() {
        return false;
    }
    eprintln!("skipping {test}: needs root (netns, cgroups, CNI plugins)");
    true
}

/// How many times slower than a real CPU this machine runs the tests: `SIDESTEP_TEST_TIME_SCALE`,
/// which `cargo xtask test --kernel` sets for VMs under TCG (emulated CPUs, 20-50x slower); one
/// elsewhere. A deadline that states a product claim ("repaired within 2 s") is multiplied by
/// it, so the claim is proven on the host and the behaviour (not the speed) in the VMs.
pub fn time_scale() -> u32 {
    std::env::var("SIDESTEP_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|s| *s >= 1)
        .unwrap_or(1)
}

/// `d` times [`time_scale`].
pub fn scaled(d: std::time::Duration) -> std::time::Duration {
    d * time_scale()
}

/// Whether a network interface exists in the root netns.
pub fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}
