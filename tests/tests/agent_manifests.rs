//! deploy/: every manifest passes yamllint and kubernetes-validate (strict: an unknown field is
//! an error) for the oldest and a current supported Kubernetes; the kustomization lists them all;
//! the DaemonSet, ConfigMap and ClusterRole agree with the agent. The tools come from PyPI into a
//! venv under the target directory; the test skips, saying so, only when PyPI cannot be reached.
//! Needs no root.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

const TOOLS: [&str; 2] = ["kubernetes-validate==1.37.0", "yamllint==1.38.0"];
/// appArmorProfile (securityContext) exists from 1.30 on.
const KUBERNETES: [&str; 2] = ["1.30.0", "1.33.0"];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    Ok(out)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The venv's bin directory, with the tools installed; `None` when PyPI is unreachable.
fn tools() -> Result<Option<PathBuf>> {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("manifest-venv");
    let bin = venv.join("bin");
    let have = |t: &str| {
        Command::new(bin.join(t))
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if have("kubernetes-validate") && have("yamllint") {
        return Ok(Some(bin));
    }
    if !bin.join("pip").exists() {
        let o = run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        ensure!(o.status.success(), "python3 -m venv: {}", text(&o));
    }
    let o = run(Command::new(bin.join("pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .args(TOOLS))?;
    if !o.status.success() {
        let t = text(&o);
        let offline = [
            "Failed to establish a new connection",
            "Temporary failure in name resolution",
            "Network is unreachable",
            "No matching distribution found",
            "Could not fetch URL",
            "connection broken",
            "timed out",
        ];
        if offline.iter().any(|m| t.contains(m)) {
            eprintln!("skipping the manifest validation: PyPI is unreachable ({TOOLS:?}):\n{t}");
            return Ok(None);
        }
        bail!("pip install {TOOLS:?} failed:\n{t}");
    }
    Ok(Some(bin))
}

fn manifests() -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(deploy_dir())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    v.sort();
    ensure!(v.len() >= 6, "manifests: {v:?}");
    Ok(v)
}

/// Every document of a YAML file, as JSON (PyYAML from the venv: yamllint depends on it).
fn load(bin: &Path, file: &Path) -> Result<Vec<Value>> {
    let o = run(Command::new(bin.join("python"))
        .args([
            "-c",
            "import json,sys,yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(file))?;
    ensure!(o.status.success(), "{}: {}", file.display(), text(&o));
    Ok(serde_json::from_slice(&o.stdout)?)
}

fn validate(bin: &Path, version: &str, files: &[PathBuf]) -> Result<Output> {
    run(Command::new(bin.join("kubernetes-validate"))
        .args(["--strict", "--no-warn", "-k", version])
        .args(files))
}

#[test]
fn deploy_manifests_are_valid() -> Result<()> {
    let Some(bin) = tools()? else { return Ok(()) };
    let dir = deploy_dir();

    let o = run(Command::new(bin.join("yamllint"))
        .args([
            "--strict",
            "-d",
            "{extends: default, rules: {line-length: {max: 100}}}",
        ])
        .arg(&dir))?;
    ensure!(o.status.success(), "yamllint:\n{}", text(&o));

    let files = manifests()?;
    for k in KUBERNETES {
        let o = validate(&bin, k, &files)?;
        ensure!(o.status.success(), "kubernetes-validate {k}:\n{}", text(&o));
    }
    // The validator does catch a misspelt field (so a pass above means something).
    let broken = Path::new(env!("CARGO_TARGET_TMPDIR")).join("broken-daemonset.yaml");
    let ds = std::fs::read_to_string(dir.join("daemonset.yaml"))?;
    std::fs::write(&broken, ds.replace("hostNetwork:", "hostNetwrok:"))?;
    ensure!(!validate(&bin, KUBERNETES[1], &[broken])?.status.success());

    // The kustomization names exactly the manifests, and the image the DaemonSet uses.
    let kust = &load(&bin, &dir.join("kustomization.yaml"))?[0];
    let mut listed: Vec<String> = kust["resources"]
        .as_array()
        .context("resources")?
        .iter()
        .filter_map(|r| r.as_str().map(str::to_owned))
        .collect();
    listed.sort();
    let mut names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    ensure!(
        listed == names,
        "kustomization lists {listed:?}, deploy/ has {names:?}"
    );

    let ds = &load(&bin, &dir.join("daemonset.yaml"))?[0];
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    ensure!(kust["images"][0]["name"] == c["image"], "image name");
    ensure!(pod["hostNetwork"] == true && pod["priorityClassName"] == "system-node-critical");
    ensure!(pod["tolerations"][0]["operator"] == "Exists");
    ensure!(c["readinessProbe"]["httpGet"]["path"] == "/readyz");
    ensure!(c["livenessProbe"]["httpGet"]["path"] == "/healthz");
    ensure!(c["securityContext"]["privileged"] == false);
    let host_paths: Vec<&str> = pod["volumes"]
        .as_array()
        .context("volumes")?
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    for p in [
        "/opt/cni/bin",
        "/etc/cni/net.d",
        "/sys/fs/bpf",
        "/sys/fs/cgroup",
        "/proc",
        "/var/run/sidestep",
    ] {
        ensure!(host_paths.contains(&p), "no hostPath {p}: {host_paths:?}");
    }

    // The ConfigMap's keys are the agent's settings, and the probes reach its listen: its port,
    // and every address (the probes GET the pod IP, IPv4 or IPv6) unless they name a host.
    let cm = &load(&bin, &dir.join("configmap.yaml"))?[0];
    let data = cm["data"].as_object().context("data")?;
    let listen = data["listen"].as_str().context("listen")?;
    let (addr, port) = listen.rsplit_once(':').context("listen has no port")?;
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &c[probe]["httpGet"];
        ensure!(get["port"] == port.parse::<u64>()?, "{probe} port");
        let host = get["host"].as_str().unwrap_or_default();
        ensure!(
            addr.is_empty() || addr.trim_matches(['[', ']']) == host,
            "{probe} GETs the pod IP, which listen {listen} does not cover; use :{port}, or \
             give the probe that host"
        );
    }
    let help =
        run(Command::new(sidestep_tests::sidestep::sidestep_bin()).args(["agent", "--help"]))?;
    let help = text(&help);
    for key in data.keys() {
        ensure!(
            help.contains(&format!("--{key} "))
                || help.contains(&format!("--{key}\n"))
                || help.contains(&format!("--{key} <")),
            "ConfigMap key {key} is no agent setting"
        );
    }
    let entry: Value = serde_json::from_str(data["plugin-json"].as_str().context("plugin-json")?)?;
    ensure!(entry["type"] == "sidestep");

    // One image: multi-stage, the target architecture as a build argument, a minimal final
    // stage holding the agent and the plugin where the DaemonSet and the agent expect them.
    let cf = std::fs::read_to_string(dir.join("Containerfile"))?;
    let stages = cf.lines().filter(|l| l.starts_with("FROM ")).count();
    ensure!(
        stages >= 2 && cf.contains("ARG TARGETARCH"),
        "Containerfile stages"
    );
    let last = cf.lines().rfind(|l| l.starts_with("FROM ")).unwrap_or("");
    ensure!(last.contains("distroless"), "final stage: {last}");
    ensure!(cf.contains("/usr/local/bin/sidestep\n") || cf.contains("/usr/local/bin/sidestep\r"));
    ensure!(cf.contains("/opt/cni/bin/sidestep-cni"));
    // The plugin runs on the host, whose C library may be older than the image's.
    ensure!(
        cf.lines()
            .any(|l| l.contains("crt-static") && l.contains("relocation-model=static")),
        "the Containerfile does not link the plugin statically"
    );
    ensure!(
        c["lifecycle"]["preStop"]["exec"]["command"][0] == "/usr/local/bin/sidestep",
        "preStop"
    );

    let role = &load(&bin, &dir.join("clusterrole.yaml"))?[0];
    // Exactly what the code uses: pods read and watched, patched and deleted by repair's label
    // and delete modes; events created; nodes read and patched (the readiness taint); in ambient
    // mode, namespaces read and watched and the pods' status patched (the redirection
    // annotation).
    ensure!(
        role["rules"]
            == serde_json::json!([
                {"apiGroups": [""], "resources": ["pods"],
                 "verbs": ["get", "list", "watch", "patch", "delete"]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                {"apiGroups": [""], "resources": ["namespaces"],
                 "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
            ]),
        "{}",
        role["rules"]
    );
    Ok(())
}
