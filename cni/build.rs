//! The plugin is linked as a fixed-address executable (no PIE), as Go builds the reference CNI
//! plugins: a PIE's ~22,000 relative relocations are applied at every start, and writing them
//! costs ~100 copy-on-write page faults, about 0.2 ms of each ADD and DEL (docs/BENCHMARKS.md).
//! The plugin is a short-lived process started by the runtime; the agent stays a PIE.
fn main() {
    println!("cargo::rustc-link-arg-bin=sidestep-cni=-no-pie");
}
