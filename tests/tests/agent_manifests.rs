//! deploy/: every manifest passes yamllint and kubernetes-validate (strict: an unknown field is
//! an error) for the oldest and a current supported Kubernetes; the kustomization lists them all;
//! the DaemonSet, ConfigMap and ClusterRoles agree with the agent. The plugin has an identity of
//! its own with get on pods and namespaces only, and its token is what the agent gets for the
//! plugin's kubeconfig; the agent's base role has no verb that changes a pod or a node, and each
//! component under deploy/components/ (rendered with `kubectl kustomize`) sets its mode and adds
//! exactly the verbs that mode uses. The tools come from PyPI into a
//! venv under the target directory; the test skips, saying so, only when PyPI cannot be reached.
//! Needs no root.

mod manifest_support;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, ensure};
use manifest_support::{KUBERNETES, deploy_dir, load, render, run, text, tools, validate};
use serde_json::{Value, json};

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

#[test]
fn deploy_manifests_are_valid() -> Result<()> {
    let Some(bin) = tools()? else { return Ok(()) };
    let dir = deploy_dir();

    let o = run(Command::new(bin.join("yamllint"))
        .args([
            "--strict",
            "-d",
            // The chart's templates are Go templates, not YAML: helm_chart.rs lints and
            // validates what they render.
            "{extends: default, ignore: '**/helm/sidestep/templates/', \
             rules: {line-length: {max: 100}}}",
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

    identities(&bin, &dir, data, pod)?;
    Ok(())
}

/// The document of `file` with this kind and name.
fn object(bin: &Path, file: &Path, kind: &str, name: &str) -> Result<Value> {
    load(bin, file)?
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .with_context(|| format!("no {kind} {name} in {}", file.display()))
}

/// The agent's rights in the default modes: reading the node's pods and recording Events.
fn agent_base_rules() -> Value {
    json!([
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ])
}

/// The plugin's rights: its ADD reads its pod and the pod's namespace.
fn plugin_rules() -> Value {
    json!([{"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["get"]}])
}

/// Each component: the ConfigMap key and value it sets, and the rules it adds to the agent's.
fn components() -> Vec<(&'static str, (&'static str, &'static str), Value)> {
    vec![
        (
            "repair-delete",
            ("repair-mode", "delete"),
            json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]}]),
        ),
        (
            "repair-label",
            ("repair-mode", "label"),
            json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]),
        ),
        (
            "readiness-taint",
            ("readiness-taint", "true"),
            json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]),
        ),
        (
            "ambient",
            ("ambient", "true"),
            json!([
                {"apiGroups": [""], "resources": ["namespaces"],
                 "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
            ]),
        ),
    ]
}

/// Whether any rule grants a verb that changes pods or nodes.
fn changes_pods_or_nodes(rules: &Value) -> bool {
    rules.as_array().into_iter().flatten().any(|r| {
        let has = |k: &str, v: &str| r[k].as_array().is_some_and(|a| a.iter().any(|x| x == v));
        ["pods", "pods/status", "nodes", "*"]
            .iter()
            .any(|res| has("resources", res))
            && [
                "patch",
                "update",
                "delete",
                "deletecollection",
                "create",
                "*",
            ]
            .iter()
            .any(|verb| has("verbs", verb))
    })
}

/// The two identities: the agent's (base rules only) and the plugin's (get on pods and
/// namespaces), each bound to its own service account, and the plugin's token mounted where the
/// agent reads it for the plugin's kubeconfig.
fn identities(
    bin: &Path,
    dir: &Path,
    data: &serde_json::Map<String, Value>,
    pod: &Value,
) -> Result<()> {
    let roles = dir.join("clusterrole.yaml");
    let agent = object(bin, &roles, "ClusterRole", "sidestep-agent")?;
    ensure!(
        agent["rules"] == agent_base_rules(),
        "the agent's base role: {}",
        agent["rules"]
    );
    ensure!(
        !changes_pods_or_nodes(&agent["rules"]),
        "the agent's base role changes pods or nodes: {}",
        agent["rules"]
    );
    let plugin = object(bin, &roles, "ClusterRole", "sidestep-cni")?;
    ensure!(
        plugin["rules"] == plugin_rules(),
        "the plugin's role: {}",
        plugin["rules"]
    );
    let bindings = dir.join("clusterrolebinding.yaml");
    for name in ["sidestep-agent", "sidestep-cni"] {
        let b = object(bin, &bindings, "ClusterRoleBinding", name)?;
        ensure!(
            b["roleRef"]["name"] == name
                && b["subjects"]
                    == json!([{"kind": "ServiceAccount", "name": name,
                               "namespace": "sidestep-system"}]),
            "binding {name}: {b}"
        );
    }
    let accounts = dir.join("serviceaccount.yaml");
    object(bin, &accounts, "ServiceAccount", "sidestep-agent")?;
    object(bin, &accounts, "ServiceAccount", "sidestep-cni")?;
    let secret = object(bin, &accounts, "Secret", "sidestep-cni-token")?;
    ensure!(
        secret["type"] == "kubernetes.io/service-account-token"
            && secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
                == "sidestep-cni",
        "the plugin's token Secret: {secret}"
    );
    ensure!(pod["serviceAccountName"] == "sidestep-agent");
    // The agent reads the plugin's token where the DaemonSet mounts that Secret.
    let volume = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["secret"]["secretName"] == "sidestep-cni-token")
        .context("no volume of the sidestep-cni-token Secret")?;
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["name"] == volume["name"])
        .context("the sidestep-cni-token volume is not mounted")?;
    ensure!(
        data.get("cni-service-account-dir") == Some(&mount["mountPath"]),
        "cni-service-account-dir {:?}, the Secret is at {}",
        data.get("cni-service-account-dir"),
        mount["mountPath"]
    );
    Ok(())
}

#[test]
fn deploy_components_grant_exactly_what_their_mode_uses() -> Result<()> {
    let Some(bin) = tools()? else { return Ok(()) };
    let dir = deploy_dir();
    // Every component is in the table below, and nothing else is under deploy/components but
    // monitoring, which changes no setting and no right (tests/tests/monitoring.rs renders it).
    let mut found: Vec<String> = std::fs::read_dir(dir.join("components"))
        .context("deploy/components")?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != "monitoring")
        .collect();
    found.sort();
    let mut known: Vec<&str> = components().iter().map(|c| c.0).collect();
    known.sort_unstable();
    ensure!(
        found == known,
        "deploy/components has {found:?}, the test knows {known:?}"
    );

    let rendered = |names: &[&str]| -> Result<Option<(PathBuf, Vec<Value>)>> {
        let Some(path) = render(names)? else {
            return Ok(None);
        };
        let docs = load(&bin, &path)?;
        Ok(Some((path, docs)))
    };
    let find = |docs: &[Value], kind: &str, name: &str| -> Result<Value> {
        docs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
            .with_context(|| format!("no {kind} {name} rendered"))
    };
    let Some((_, base)) = rendered(&[])? else {
        eprintln!("skipping the components: no kubectl to render them with");
        return Ok(());
    };
    let base_data = find(&base, "ConfigMap", "sidestep-config")?["data"].clone();
    ensure!(base_data["repair-mode"] == "repair");
    ensure!(find(&base, "ClusterRole", "sidestep-agent")?["rules"] == agent_base_rules());

    for (name, (key, value), added) in components() {
        let (path, docs) = rendered(&[name])?.context("kubectl went away")?;
        for k in KUBERNETES {
            let o = validate(&bin, k, std::slice::from_ref(&path))?;
            ensure!(
                o.status.success(),
                "kubernetes-validate {k} of deploy/ with {name}:\n{}",
                text(&o)
            );
        }
        let data = &find(&docs, "ConfigMap", "sidestep-config")?["data"];
        ensure!(data[key] == value, "{name}: {key} is {}", data[key]);
        // Nothing else in the ConfigMap changes.
        let mut rest = data.clone();
        rest[key] = base_data[key].clone();
        ensure!(
            rest == base_data,
            "{name} changes more of the ConfigMap than {key}"
        );
        let mut want = agent_base_rules();
        want.as_array_mut()
            .context("rules")?
            .extend(added.as_array().cloned().unwrap_or_default());
        let rules = &find(&docs, "ClusterRole", "sidestep-agent")?["rules"];
        ensure!(
            *rules == want,
            "{name}: the agent's rules are {rules}, want {want}"
        );
        // The plugin's rights are the same whatever the agent's mode.
        ensure!(
            find(&docs, "ClusterRole", "sidestep-cni")?["rules"] == plugin_rules(),
            "{name} changes the plugin's role"
        );
        eprintln!("{name}: {key}={value}, adds {added}");
    }
    // The repair modes' verbs stay apart: without a component, no pod is deleted or labelled.
    ensure!(!changes_pods_or_nodes(
        &find(&base, "ClusterRole", "sidestep-agent")?["rules"]
    ));
    Ok(())
}
