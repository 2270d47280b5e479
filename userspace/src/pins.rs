//! The pin layout under a pin root. Operators find everything of one installation here:
//!
//! ```text
//! <pin_root>/maps/<MAP_NAME>       every map
//! <pin_root>/progs/<program_name>  every program
//! <pin_root>/links/<attach_point>  one cgroup link per program (connect4, sockops, ...)
//! <pin_root>/build/<version>-<hash> an empty directory: the build that last loaded the programs
//! ```

use std::path::{Path, PathBuf};

pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/sidestep";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn maps_dir(&self) -> PathBuf {
        self.root.join("maps")
    }
    pub fn progs_dir(&self) -> PathBuf {
        self.root.join("progs")
    }
    pub fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }
    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }
    pub fn program(&self, name: &str) -> PathBuf {
        self.progs_dir().join(name)
    }
    /// Holds one empty directory named after the build that last loaded or upgraded the
    /// programs ([`crate::loader::build_marker`]): nothing else pinned says which build runs.
    pub fn build_dir(&self) -> PathBuf {
        self.root.join("build")
    }
    pub fn cgroup_link(&self, attach_point: &str) -> PathBuf {
        self.links_dir().join(attach_point)
    }
    /// A pod's tc and re-route link pins: `links/tc/<netns cookie>/<ifname>` (and
    /// `<ifname>` plus a re-route suffix).
    pub fn pod_links_dir(&self, netns_cookie: u64) -> PathBuf {
        self.links_dir().join("tc").join(netns_cookie.to_string())
    }
    /// A pod's shared sk_lookup link.
    pub fn sk_lookup_pin(&self, netns_cookie: u64) -> PathBuf {
        self.links_dir()
            .join("sklookup")
            .join(netns_cookie.to_string())
    }
    /// Whether a load finished here: the maps are pinned, and so is the last cgroup link a load
    /// creates. A load killed half-way does not count, so the plugin answers "try again later"
    /// instead of enrolling pods into a half-attached data path.
    pub fn is_loaded(&self) -> bool {
        let programs = crate::programs::CGROUP_PROGRAMS;
        let last = programs[programs.len() - 1].attach_point;
        self.map(sidestep_abi::map_names::POD_POLICY).exists() && self.cgroup_link(last).exists()
    }
}

/// Pin-name suffixes of a re-routed interface's two links, beside the inbound links in
/// `<pin_root>/links/tc/<netns cookie>/`. An interface name cannot contain ':', so the pins never
/// clash with an inbound link's (bpffs refuses '.' in names).
pub const REROUTE_INGRESS_SUFFIX: &str = ":reroute-ingress";
pub const REROUTE_EGRESS_SUFFIX: &str = ":reroute-egress";

/// Whether a pin name under a pod's tc link directory is a re-route link.
pub fn is_reroute_pin(name: &str) -> bool {
    name.ends_with(REROUTE_INGRESS_SUFFIX) || name.ends_with(REROUTE_EGRESS_SUFFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_paths_are_stable() {
        let l = PinLayout::new("/sys/fs/bpf/x");
        assert_eq!(
            l.map("SIDESTEP_POD"),
            Path::new("/sys/fs/bpf/x/maps/SIDESTEP_POD")
        );
        assert_eq!(
            l.cgroup_link("connect4"),
            Path::new("/sys/fs/bpf/x/links/connect4")
        );
        assert_eq!(l.program("p"), Path::new("/sys/fs/bpf/x/progs/p"));
    }
}
