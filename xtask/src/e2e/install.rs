//! Installing sidestep on the node as an operator would: images imported into containerd (no
//! registry), then `kubectl apply -k` of an overlay of deploy/ that changes only what a real
//! node's operator changes (image names, the node's CNI and state paths, the API address with
//! no kube-proxy, and the cgroup the programs attach to).

use std::fs;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::images::{self, ImageSpec};
use super::node::Running;
use crate::cmd::Cmd;

pub const AGENT_IMAGE: &str = "localhost/sidestep:e2e";
/// The "next release" a rollout moves to: the same files under another tag.
pub const AGENT_IMAGE_NEXT: &str = "localhost/sidestep:e2e-next";
pub const APP_IMAGE: &str = "localhost/sidestep/app:e2e";
pub const PROXY_IMAGE: &str = "localhost/sidestep/proxy:e2e";

/// The agent's pin root: its own, never the default /sys/fs/bpf/sidestep that a real install
/// on this machine (or the tests) would use. `down` removes it.
pub const PIN_ROOT: &str = "/sys/fs/bpf/sidestep-e2e";

pub const NAMESPACE: &str = "sidestep-system";
/// The agent's pods, as deploy/daemonset.yaml labels them.
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/name=sidestep-agent";

/// The project's binaries that go into the images.
pub struct Binaries {
    /// The agent and CLI.
    pub sidestep: PathBuf,
    /// The CNI plugin, linked statically: it runs on the host.
    pub plugin: PathBuf,
    /// The test client, servers and ztunnel stand-in (tests/src/bin/probe.rs).
    pub probe: PathBuf,
}

/// Tag the agent image under `name` too, as a new release would arrive.
pub fn import_agent_as(node: &Running, name: &str) -> Result<()> {
    Cmd::new(node.built.containerd_bin.join("ctr"))
        .arg("--address")
        .arg(node.layout.containerd_socket())
        .args([
            "-n",
            "k8s.io",
            "images",
            "tag",
            "--force",
            AGENT_IMAGE,
            name,
        ])
        .read()?;
    Ok(())
}

/// Build the agent, app and proxy images from this machine's files and import them.
pub fn images(node: &Running, bins: &Binaries) -> Result<()> {
    let busybox = which("busybox").context("busybox not found (Debian package busybox)")?;
    let haproxy = which("haproxy").context("haproxy not found (Debian package haproxy)")?;
    let shell_applets = ["sh", "sleep", "cat", "ls", "wget", "nc"]
        .iter()
        .map(|a| (format!("/bin/{a}"), "busybox".to_owned()))
        .collect::<Vec<_>>();
    let specs = [
        // deploy/Containerfile's final stage, assembled here: its FROM lines name registries.
        ImageSpec {
            name: AGENT_IMAGE.into(),
            files: vec![
                (bins.sidestep.clone(), "/usr/local/bin/sidestep".into()),
                (bins.plugin.clone(), "/opt/cni/bin/sidestep-cni".into()),
            ],
            symlinks: Vec::new(),
            dirs: Vec::new(),
            entrypoint: vec!["/usr/local/bin/sidestep".into()],
            cmd: vec!["agent".into()],
            user: "0:0".into(),
        },
        ImageSpec {
            name: APP_IMAGE.into(),
            files: vec![
                (bins.probe.clone(), "/usr/local/bin/probe".into()),
                (busybox.clone(), "/bin/busybox".into()),
            ],
            symlinks: shell_applets.clone(),
            dirs: Vec::new(),
            entrypoint: vec!["/usr/local/bin/probe".into()],
            cmd: Vec::new(),
            user: "1000:1000".into(),
        },
        // Debian's HAProxy, unmodified, with its libraries; pods run it as UID 1337.
        ImageSpec {
            name: PROXY_IMAGE.into(),
            files: vec![
                (haproxy, "/usr/sbin/haproxy".into()),
                (busybox, "/bin/busybox".into()),
            ],
            symlinks: shell_applets,
            dirs: vec!["/var/lib/haproxy".into()],
            entrypoint: vec!["/usr/sbin/haproxy".into()],
            cmd: vec!["-db".into(), "-f".into(), "/etc/haproxy/haproxy.cfg".into()],
            user: "1337:1337".into(),
        },
    ];
    let ctr = node.built.containerd_bin.join("ctr");
    let socket = node.layout.containerd_socket();
    for spec in &specs {
        let archive = images::archive(&node.layout.at("images"), spec)?;
        let size = fs::metadata(&archive)?.len();
        images::import(&ctr, &socket, &archive)?;
        fs::remove_file(&archive)?;
        println!("  imported {} ({:.1} MB)", spec.name, size as f64 / 1e6);
    }
    Ok(())
}

/// What the overlay turns on beyond deploy/'s base.
#[derive(Clone, Copy, Default)]
pub struct OverlayOptions {
    /// deploy/components/ambient.
    pub ambient: bool,
    /// deploy/components/readiness-taint.
    pub readiness_taint: bool,
    /// The negative control: the agent chains the plugin into a conflist the runtime never
    /// reads, and repair is off, so nothing captures the pods.
    pub without_sidestep: bool,
}

/// Write the overlay under `<dir>/overlay` and return its directory.
pub fn write_overlay(node: &Running, options: OverlayOptions) -> Result<PathBuf> {
    let dir = node.layout.at("overlay");
    fs::create_dir_all(&dir)?;
    let deploy = crate::paths::workspace().join("deploy");
    let base = relative_path(&dir, &deploy)?;
    let mut components = String::new();
    for (on, name) in [
        (options.ambient, "ambient"),
        (options.readiness_taint, "readiness-taint"),
    ] {
        if on {
            components += &format!("  - {base}/components/{name}\n");
        }
    }
    if !components.is_empty() {
        components = format!("components:\n{components}");
    }
    fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "# Written by cargo xtask e2e: deploy/ as this node's operator would install it.\n\
             apiVersion: kustomize.config.k8s.io/v1beta1\n\
             kind: Kustomization\n\
             resources:\n  - {base}\n\
             {components}\
             # deploy/ names its image {name}:<release>; this node has it as :{tag}.\n\
             images:\n  - name: {name}\n    newTag: {tag}\n\
             patches:\n  - path: node-paths.yaml\n  - path: node-config.yaml\n",
            name = AGENT_IMAGE.rsplit_once(':').map_or(AGENT_IMAGE, |(n, _)| n),
            tag = AGENT_IMAGE.rsplit_once(':').map_or("latest", |(_, t)| t),
        ),
    )?;
    let scratch = node.layout.dir.display().to_string();
    let netns = node.layout.pod_netns_dir().display().to_string();
    let conf_dir = if options.without_sidestep {
        // A copy of the node's conflist for the agent to chain into, which containerd never
        // reads: the node's own stays without sidestep's entry.
        let unread = node.layout.at("cni/net.d-unread");
        fs::create_dir_all(&unread)?;
        for entry in fs::read_dir(node.layout.cni_conf_dir())? {
            let path = entry?.path();
            if let Some(name) = path.file_name() {
                fs::copy(&path, unread.join(name))?;
            }
        }
        unread
    } else {
        node.layout.cni_conf_dir()
    };
    fs::write(
        dir.join("node-paths.yaml"),
        format!(
            r#"# This node's paths: containerd's CNI dirs and pod netns dir are under the scratch
# directory, and so is the plugin's state (mounted at the same path in the agent, since the
# plugin on the host and the agent read the same records). No kube-proxy runs: the API is
# reached at the apiserver's own loopback address (the agent uses the host network).
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: sidestep-agent
  namespace: {NAMESPACE}
spec:
  template:
    spec:
      containers:
        - name: agent
          env:
            - name: KUBERNETES_SERVICE_HOST
              value: "127.0.0.1"
            - name: KUBERNETES_SERVICE_PORT
              value: "{port}"
          volumeMounts:
            - name: state
              mountPath: {scratch}/sidestep
            - name: netns
              mountPath: {netns}
              readOnly: true
              mountPropagation: HostToContainer
      volumes:
        - name: cni-bin
          hostPath:
            path: {bin}
        - name: cni-net
          hostPath:
            path: {conf}
        - name: netns
          hostPath:
            path: {netns}
        - name: state
          hostPath:
            path: {scratch}/sidestep
        - name: ztunnel
          hostPath:
            path: {scratch}/ztunnel
"#,
            port = node.apiserver_port,
            bin = node.layout.cni_bin_dir().display(),
            conf = conf_dir.display(),
        ),
    )?;
    let cgroup2 = cgroup2_mount()?;
    let attach = super::host::join_cgroup(&cgroup2, &node.pods_cgroup);
    let repair = if options.without_sidestep {
        "false"
    } else {
        "true"
    };
    fs::write(
        dir.join("node-config.yaml"),
        format!(
            r#"# The cgroup the programs attach to is kubelet's pod cgroup in this node's cgroup2
# hierarchy (hybrid host: cgroup2 at /sys/fs/cgroup/unified), never the machine's root.
apiVersion: v1
kind: ConfigMap
metadata:
  name: sidestep-config
  namespace: {NAMESPACE}
data:
  host-cni-conf-dir: {conf}
  cgroup: /host{attach}
  pin-root: {PIN_ROOT}
  state-dir: {scratch}/sidestep/cni
  netns-dirs: {netns}
  log-format: text
  reconcile-interval: 5s
  repair: "{repair}"
"#,
            conf = conf_dir.display(),
            attach = attach.display(),
        ),
    )?;
    Ok(dir)
}

/// The chart's values for this node: the same changes as the overlay's (image, the node's CNI,
/// netns and state paths, the API address, the cgroup and pin root), written under
/// `<dir>/helm/values.yaml`.
pub fn write_helm_values(node: &Running) -> Result<PathBuf> {
    let dir = node.layout.at("helm");
    fs::create_dir_all(&dir)?;
    let scratch = node.layout.dir.display().to_string();
    let attach = super::host::join_cgroup(&cgroup2_mount()?, &node.pods_cgroup);
    let values = format!(
        r#"# Written by cargo xtask e2e: deploy/helm/sidestep as this node's operator would set it.
image: {AGENT_IMAGE}
cniBinDir: {bin}
cniConfDir: {conf}
cniNetnsDir: {netns}
stateDir: {scratch}/sidestep
ztunnelDir: {scratch}/ztunnel
pinRoot: {PIN_ROOT}
cgroup: /host{attach}
env:
  KUBERNETES_SERVICE_HOST: "127.0.0.1"
  KUBERNETES_SERVICE_PORT: "{port}"
config:
  log-format: text
  reconcile-interval: 5s
"#,
        bin = node.layout.cni_bin_dir().display(),
        conf = node.layout.cni_conf_dir().display(),
        netns = node.layout.pod_netns_dir().display(),
        attach = attach.display(),
        port = node.apiserver_port,
    );
    let file = dir.join("values.yaml");
    fs::write(&file, values)?;
    Ok(file)
}

/// helm with the node's kubeconfig, and its cache, config and data under the scratch directory,
/// so that nothing of it stays on the machine.
pub fn helm(node: &Running) -> Cmd {
    let home = node.layout.at("helm");
    Cmd::new(&node.built.helm)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .arg("--kubeconfig")
        .arg(&node.kubectl.kubeconfig)
}

/// `kubectl apply -k` the overlay.
pub fn apply(node: &Running, overlay: &Path) -> Result<()> {
    let out = node
        .kubectl
        .run(&["apply", "-k", &overlay.display().to_string()])?;
    println!("  {}", out.trim().replace('\n', "\n  "));
    Ok(())
}

pub fn wait_agent_ready(node: &Running, timeout: Duration) -> Result<()> {
    let waited = node.kubectl.run(&[
        "rollout",
        "status",
        "-n",
        NAMESPACE,
        "daemonset/sidestep-agent",
        &format!("--timeout={}s", timeout.as_secs()),
    ]);
    if let Err(e) = waited {
        let logs = node
            .kubectl
            .run(&[
                "logs",
                "-n",
                NAMESPACE,
                "daemonset/sidestep-agent",
                "--tail=40",
            ])
            .unwrap_or_default();
        let describe = node
            .kubectl
            .run(&["describe", "pods", "-n", NAMESPACE])
            .unwrap_or_default();
        bail!("the agent is not Ready: {e:#}\nits log's tail:\n{logs}\n{describe}");
    }
    Ok(())
}

/// The cgroup2 mount point: /sys/fs/cgroup/unified on a hybrid host, /sys/fs/cgroup on a
/// unified one.
pub fn cgroup2_mount() -> Result<PathBuf> {
    super::host::mountinfo()?
        .into_iter()
        .find(|m| m.fstype == "cgroup2")
        .map(|m| m.mount_point)
        .context("no cgroup2 mount on this host")
}

/// `to` relative to `from` (both absolute): kustomize loads bases by relative path.
fn relative_path(from: &Path, to: &Path) -> Result<String> {
    let normal = |p: &Path| -> Result<Vec<String>> {
        p.components()
            .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
            .map(|c| match c {
                Component::Normal(s) => Ok(s.to_string_lossy().into_owned()),
                other => bail!("{} has {other:?}", p.display()),
            })
            .collect()
    };
    let (from, to) = (normal(from)?, normal(to)?);
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut parts = vec!["..".to_owned(); from.len() - common];
    parts.extend(to[common..].iter().cloned());
    Ok(parts.join("/"))
}

fn which(program: &str) -> Option<PathBuf> {
    let out = Cmd::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .read()
        .ok()?;
    let path = PathBuf::from(out.trim());
    path.is_absolute().then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_path_climbs_to_the_common_ancestor() {
        assert_eq!(
            relative_path(
                Path::new("/tmp/e2e/overlay"),
                Path::new("/work/main/deploy")
            )
            .unwrap(),
            "../../../work/main/deploy"
        );
        assert_eq!(
            relative_path(Path::new("/work/main/x"), Path::new("/work/main/deploy")).unwrap(),
            "../deploy"
        );
    }
}
