//! The node's configuration files and command lines. Every path a component would write to by
//! default (/var/lib/containerd, /etc/cni/net.d, /var/lib/kubelet, /var/log/pods, ...) is moved
//! into the scratch directory, and every listener onto 127.0.0.1.

use std::ffi::OsString;
use std::path::PathBuf;

use super::pki::Pki;
use super::state::State;

/// kubelet's node name. With `--kubelet-preferred-address-types Hostname` the apiserver dials
/// it as `localhost:<kubelet port>`, so logs and exec stay on loopback.
pub const NODE_NAME: &str = "localhost";
/// The CNI network's name and the tag on everything else the node names.
pub const NETWORK: &str = "sidestep-e2e";
/// The node's bridge; the test suite's bridges are `ssb*`.
pub const BRIDGE: &str = "sdk8s0";
/// Pods' subnet: outside 10.200.0.0/13, which tests/src/subnet.rs hands to test bridges.
pub const POD_SUBNET: &str = "10.213.0.0/24";
pub const SERVICE_SUBNET: &str = "10.213.128.0/24";
/// The `kubernetes` Service's ClusterIP: the first address of SERVICE_SUBNET.
pub const SERVICE_IP: &str = "10.213.128.1";

/// Paths inside the scratch directory.
pub struct Layout {
    pub dir: PathBuf,
}

impl Layout {
    pub fn at(&self, relative: &str) -> PathBuf {
        self.dir.join(relative)
    }
    pub fn log(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{name}.log"))
    }
    pub fn containerd_socket(&self) -> PathBuf {
        self.at("run/containerd.sock")
    }
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.at("cni/net.d")
    }
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.at("cni/bin")
    }
    pub fn kubelet_root(&self) -> PathBuf {
        self.at("kubelet")
    }
    pub fn pod_logs(&self) -> PathBuf {
        self.at("pod-logs")
    }
    /// Where containerd mounts pod netns (`netns_mounts_under_state_dir`).
    pub fn pod_netns_dir(&self) -> PathBuf {
        self.at("containerd/state/io.containerd.grpc.v1.cri/netns")
    }
}

fn args(list: &[&str]) -> Vec<OsString> {
    list.iter().map(OsString::from).collect()
}

fn flag(name: &str, value: impl AsRef<std::ffi::OsStr>) -> OsString {
    let mut flag = OsString::from(format!("--{name}="));
    flag.push(value.as_ref());
    flag
}

pub fn etcd_args(layout: &Layout, state: &State) -> Vec<OsString> {
    let client = format!("http://127.0.0.1:{}", state.port("etcd"));
    let peer = format!("http://127.0.0.1:{}", state.port("etcd-peer"));
    let mut list = vec![
        flag("name", "e2e"),
        flag("data-dir", layout.at("etcd")),
        flag("listen-client-urls", &client),
        flag("advertise-client-urls", &client),
        flag("listen-peer-urls", &peer),
        flag("initial-advertise-peer-urls", &peer),
        flag("initial-cluster", format!("e2e={peer}")),
    ];
    list.extend(args(&[
        "--initial-cluster-state=new",
        "--quota-backend-bytes=536870912",
        "--log-level=warn",
    ]));
    list
}

pub fn apiserver_args(state: &State, pki: &Pki) -> Vec<OsString> {
    let mut list = vec![
        flag(
            "etcd-servers",
            format!("http://127.0.0.1:{}", state.port("etcd")),
        ),
        flag("secure-port", state.port("apiserver").to_string()),
        flag("tls-cert-file", pki.file("apiserver.crt")),
        flag("tls-private-key-file", pki.file("apiserver.key")),
        flag("client-ca-file", pki.file("ca.crt")),
        flag("service-account-key-file", pki.file("sa.pub")),
        flag("service-account-signing-key-file", pki.file("sa.key")),
        flag(
            "kubelet-client-certificate",
            pki.file("apiserver-kubelet-client.crt"),
        ),
        flag(
            "kubelet-client-key",
            pki.file("apiserver-kubelet-client.key"),
        ),
        flag("kubelet-certificate-authority", pki.file("ca.crt")),
        flag("cert-dir", pki.dir.join("apiserver-generated")),
        flag("service-cluster-ip-range", SERVICE_SUBNET),
    ];
    list.extend(args(&[
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        // The reconciler would write the `kubernetes` Endpoints with the advertise address,
        // and Endpoints validation rejects loopback.
        "--endpoint-reconciler-type=none",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--kubelet-preferred-address-types=Hostname",
        "--allow-privileged=true",
        "--profiling=false",
        "--etcd-prefix=/sidestep-e2e",
    ]));
    list
}

/// kube-controller-manager and kube-scheduler: HTTPS health on a loopback port, no leader
/// election (one node, one of each).
pub fn control_plane_args(name: &str, state: &State, pki: &Pki, layout: &Layout) -> Vec<OsString> {
    let user = if name == "kube-scheduler" {
        "scheduler"
    } else {
        "controller-manager"
    };
    let kubeconfig = pki.kubeconfig(user);
    let mut list = vec![
        flag("kubeconfig", &kubeconfig),
        flag("authentication-kubeconfig", &kubeconfig),
        flag("authorization-kubeconfig", &kubeconfig),
        flag("secure-port", state.port(name).to_string()),
        flag("cert-dir", layout.at(name)),
    ];
    list.extend(args(&["--bind-address=127.0.0.1", "--leader-elect=false"]));
    if name == "kube-controller-manager" {
        // Signs the tokens of the controllers' own service accounts and publishes the CA as
        // the kube-root-ca.crt ConfigMap.
        list.extend([
            flag("service-account-private-key-file", pki.file("sa.key")),
            flag("root-ca-file", pki.file("ca.crt")),
            // Its default, /usr/libexec/kubernetes/kubelet-plugins/volume/exec, is created at start.
            flag(
                "flex-volume-plugin-dir",
                layout.at("kube-controller-manager/flexvolume"),
            ),
            flag("cluster-signing-cert-file", pki.file("ca.crt")),
            flag("cluster-signing-key-file", pki.file("ca.key")),
        ]);
        list.extend(args(&["--use-service-account-credentials=true"]));
    }
    list
}

pub fn containerd_config(layout: &Layout) -> String {
    let d = |p: &str| layout.at(p).display().to_string();
    format!(
        r#"# Written by cargo xtask e2e: everything containerd keeps is under the scratch directory.
version = 3
root = "{root}"
state = "{state}"
temp = "{temp}"

[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{pause}'

[plugins.'io.containerd.cri.v1.runtime']
  disable_apparmor = true
  # This machine's root lacks CAP_SYS_RESOURCE, so runc cannot lower a sandbox's
  # oom_score_adj to kubelet's -998 ("nsexec: failed to update /proc/self/oom_score_adj:
  # Permission denied"): keep every pod's at or above containerd's own.
  restrict_oom_score_adj = true
  # Pod netns under the state directory, not /var/run/netns among other users' netns.
  netns_mounts_under_state_dir = true
  enable_cdi = false
  cdi_spec_dirs = []
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '/usr/sbin/runc'
        Root = '{runc_root}'
        # kubelet runs the cgroupfs driver: PID 1 is not systemd here.
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{cni_bin}', '/usr/lib/cni']
    conf_dir = '{cni_conf}'
    max_conf_num = 1
    # No loopback plugin call, so no libcni cache entry in /var/lib/cni for `lo`.
    use_internal_loopback = true

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'

[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.internal.v1.opt']
  path = '{opt}'
"#,
        root = d("containerd/root"),
        state = d("containerd/state"),
        temp = d("containerd/tmp"),
        socket = layout.containerd_socket().display(),
        pause = super::images::pause_image(),
        runc_root = d("containerd/runc"),
        cni_bin = layout.cni_bin_dir().display(),
        cni_conf = layout.cni_conf_dir().display(),
        opt = d("containerd/opt"),
    )
}

/// The base chain a cluster's primary plugin would leave: bridge + host-local + portmap, with
/// its own bridge, subnet and IPAM directory. `ipMasq: false`: nothing is NATed out of the
/// machine.
pub fn cni_conflist(layout: &Layout) -> String {
    serde_json::to_string_pretty(&serde_json::json!({
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": layout.at("cni/ipam"),
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    }))
    .expect("a literal JSON value serialises")
}

pub fn kubelet_config(layout: &Layout, state: &State, pki: &Pki) -> String {
    format!(
        r#"# Written by cargo xtask e2e.
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
tlsCertFile: {crt}
tlsPrivateKeyFile: {key}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: Webhook}}
containerRuntimeEndpoint: unix://{socket}
# This host's cgroups are hybrid: kubelet runs in v1 mode, which 1.35+ refuses by default.
failCgroupV1: false
cgroupDriver: cgroupfs
# Every pod cgroup below the node's own subtree, never at a hierarchy's root.
cgroupRoot: {cgroup_root}
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
failSwapOn: false
podLogsDir: {pod_logs}
volumePluginDir: {plugins}
# The images exist only locally; a collected image cannot be pulled back.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# The disk is shared with other builds: evict only when it is really full.
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
resolvConf: ""
clusterDomain: cluster.local
serializeImagePulls: false
# ConfigMap volumes follow a change at the pod's next sync (1 min by default): the uninstall
# scenario waits for uninstall-requested to reach the agent's volume.
syncFrequency: 10s
# The restart scenario counts a sidecar's log lines, one per call: keep them in one file.
containerLogMaxSize: 200Mi
"#,
        port = state.port("kubelet"),
        healthz = state.port("kubelet-healthz"),
        crt = pki.file("kubelet-serving.crt").display(),
        key = pki.file("kubelet-serving.key").display(),
        ca = pki.file("ca.crt").display(),
        socket = layout.containerd_socket().display(),
        cgroup_root = pods_cgroup(state),
        pod_logs = layout.pod_logs().display(),
        plugins = layout.at("kubelet-plugins").display(),
    )
}

/// kubelet's `cgroupRoot`: `<node cgroup>/pods`.
pub fn pods_cgroup(state: &State) -> String {
    format!("{}/pods", state.cgroup)
}

pub fn kubelet_args(layout: &Layout, pki: &Pki) -> Vec<OsString> {
    vec![
        flag("config", layout.at("kubelet.yaml")),
        flag("kubeconfig", pki.kubeconfig("kubelet")),
        flag("root-dir", layout.kubelet_root()),
        flag("hostname-override", NODE_NAME),
    ]
}

/// A pod that only runs the pause image: enough to show scheduling, the sandbox, CNI ADD and
/// a container start.
pub fn smoke_pod() -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: smoke\n  namespace: default\nspec:\n  terminationGracePeriodSeconds: 2\n  containers:\n  - name: pause\n    image: {}\n    imagePullPolicy: Never\n",
        super::images::pause_image()
    )
}

/// Directories outside the scratch directory that kubelet or containerd create at hard-coded
/// paths: removed by `down` when they did not exist before `up` (and are empty by then).
pub const HOST_DIRS: &[&str] = &[
    // kubelet's links to the pod logs in podLogsDir.
    "/var/log/containers",
    // The shims' sockets, in /run/containerd/s whatever containerd's state directory.
    "/run/containerd",
    // libcni's result cache.
    "/var/lib/cni",
    "/var/lib/cni/results",
    // kubelet's device-plugin socket: a constant in the device plugin API, not below --root-dir.
    "/var/lib/kubelet",
    "/var/lib/kubelet/device-plugins",
    // kube-controller-manager's flex volume default; moved by a flag, listed in case.
    "/usr/libexec/kubernetes",
];

/// Files the node leaves in HOST_DIRS: removed by `down` when their directory did not exist
/// before `up` (so no other kubelet can own them).
pub const HOST_FILES: &[&str] = &[
    "/var/lib/kubelet/device-plugins/kubelet.sock",
    "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint",
];

pub fn path_list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> (Layout, State, Pki) {
        let dir = PathBuf::from("/tmp/node-under-test");
        let mut state = State {
            dir: dir.clone(),
            cgroup: "/session/sidestep-e2e".into(),
            ..State::default()
        };
        state.ports.insert("kubelet".into(), 4242);
        let pki = Pki {
            dir: dir.join("pki"),
        };
        (Layout { dir }, state, pki)
    }

    /// Nothing the node writes may land in the host's own containerd, CNI or kubelet paths,
    /// which podman and other tests on this machine use.
    #[test]
    fn every_path_is_inside_the_scratch_directory() {
        let (layout, state, pki) = fixture();
        let containerd = containerd_config(&layout);
        for host_path in [
            "/var/lib/containerd",
            "/etc/cni/net.d",
            "/opt/cni/bin",
            "/run/containerd",
        ] {
            // Quoted: the scratch directory's own `.../run/containerd.sock` must not match.
            for quote in ['"', '\''] {
                assert!(
                    !containerd.contains(&format!("{quote}{host_path}")),
                    "containerd config names {host_path}"
                );
            }
        }
        assert!(containerd.contains("netns_mounts_under_state_dir = true"));
        assert!(containerd.contains("restrict_oom_score_adj = true"));
        let kubelet = kubelet_config(&layout, &state, &pki);
        assert!(kubelet.contains("cgroupRoot: /session/sidestep-e2e/pods\n"));
        assert!(kubelet.contains("failCgroupV1: false\n"));
        assert!(kubelet.contains("address: 127.0.0.1\n"));
        assert!(!kubelet.contains("/var/lib/kubelet"));
        let conflist = cni_conflist(&layout);
        assert!(conflist.contains("/tmp/node-under-test/cni/ipam"));
        assert!(conflist.contains(BRIDGE));
    }
}
