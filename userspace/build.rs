//! Embeds the BPF object that `cargo xtask build-ebpf` produced.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=SIDESTEP_BPF_OBJECT");
    let object = std::env::var_os("SIDESTEP_BPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bpf/sidestep.bpf.o")
        });
    if !object.is_file() {
        eprintln!(
            "sidestep: BPF object {} not found; build with `cargo xtask build`",
            object.display()
        );
        std::process::exit(1);
    }
    println!("cargo:rerun-if-changed={}", object.display());
    println!(
        "cargo:rustc-env=SIDESTEP_BPF_OBJECT_PATH={}",
        object.display()
    );
}
