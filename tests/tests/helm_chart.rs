//! deploy/helm/sidestep: the chart lints (also `--strict`), renders valid manifests
//! (kubernetes-validate, strict, for the oldest and a current supported Kubernetes) with its
//! defaults, each platform preset and each optional feature, puts each preset's host paths in the
//! DaemonSet and the ConfigMap, and renders what `kubectl kustomize deploy/` renders, object for
//! object and field for field, but for the differences in `ALLOWED_DIFFERENCES`; each feature
//! (repair modes, ambient, readiness taint) renders what kustomize renders with its component.
//!
//! helm comes from `cargo xtask test` (SIDESTEP_HELM: built from the Go module proxy into the
//! e2e component cache). Needs no root.

mod manifest_support;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail, ensure};
use manifest_support::{KUBERNETES, deploy_dir, load, render, run, text, tools, validate};
use serde_json::Value;

/// The release as the comparisons install it: deploy/'s namespace, with the Namespace rendered.
const NAMESPACE: &str = "sidestep-system";

/// What may differ between the chart's defaults and deploy/, and why; everything else must be
/// equal (`comparable` applies exactly these).
const ALLOWED_DIFFERENCES: &[&str] = &[
    // Helm's standard labels, on each object's metadata (not on the pod template or the
    // selector, which stay deploy/'s).
    "metadata.labels: app.kubernetes.io/managed-by, app.kubernetes.io/instance, \
     app.kubernetes.io/version, helm.sh/chart only in the chart's objects",
    // The chart writes the plugin entry from excludeNamespaces with toJson: the same JSON,
    // spaced otherwise.
    "ConfigMap data.plugin-json: compared as JSON, not as text",
    // Monitoring (issue 39) lands in deploy/ separately: until deploy/ has them, the chart may
    // be ahead. Once deploy/ has one, it must be equal.
    "ConfigMap data.metrics-per-pod: only in the chart while deploy/configmap.yaml lacks it",
    "DaemonSet pod template annotations prometheus.io/{scrape,port,path}: only in the chart \
     while deploy/daemonset.yaml lacks them",
];

const HELM_LABELS: [&str; 4] = [
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "helm.sh/chart",
];

/// Each feature: the kustomize component that turns it on in deploy/, and the chart's values
/// that do.
const FEATURES: [(&str, &[&str]); 5] = [
    ("repair-delete", &["repair.deletePods=true"]),
    ("repair-label", &["repair.labelPods=true"]),
    ("readiness-taint", &["readinessTaint.enabled=true"]),
    ("ambient", &["ambient.enabled=true"]),
    (
        MONITORING,
        &[
            "serviceMonitor.enabled=true",
            "prometheusRule.enabled=true",
            "dashboard.enabled=true",
        ],
    ),
];

/// Its objects are the Prometheus Operator's (no schema for kubernetes-validate), and the chart
/// renders them from copies of the component's files.
const MONITORING: &str = "monitoring";

/// Each preset: global.platform, and its CNI bin and conf dirs on the host.
const PRESETS: [(&str, &str, &str); 4] = [
    ("kind", "/opt/cni/bin", "/etc/cni/net.d"),
    (
        "k3s",
        "/var/lib/rancher/k3s/data/cni",
        "/var/lib/rancher/k3s/agent/etc/cni/net.d",
    ),
    ("gke", "/home/kubernetes/bin", "/etc/cni/net.d"),
    ("openshift", "/var/lib/cni/bin", "/etc/kubernetes/cni/net.d"),
];

fn chart_dir() -> PathBuf {
    deploy_dir().join("helm/sidestep")
}

fn helm() -> Result<PathBuf> {
    let Some(helm) = std::env::var_os("SIDESTEP_HELM").filter(|h| !h.is_empty()) else {
        bail!(
            "SIDESTEP_HELM is not set: run this test through `cargo xtask test` (e.g. \
             `cargo xtask test -- -p sidestep-tests --test helm_chart`), which builds helm"
        );
    };
    Ok(PathBuf::from(helm))
}

/// The venv's tools; the comparisons need its YAML loader, so no PyPI is a failure here.
fn venv() -> Result<PathBuf> {
    tools()?.context("PyPI is unreachable: the chart's tests need kubernetes-validate and PyYAML")
}

fn set_args(sets: &[&str]) -> Vec<String> {
    sets.iter()
        .flat_map(|s| ["--set".to_owned(), (*s).to_owned()])
        .collect()
}

/// `helm template` of the chart with `sets`, in deploy/'s namespace, written to a file of its
/// own; the error has helm's output.
fn helm_template(sets: &[&str]) -> Result<PathBuf> {
    let o = helm_template_output(sets)?;
    ensure!(o.status.success(), "helm template {sets:?}:\n{}", text(&o));
    let out = tempfile::Builder::new()
        .prefix("helm-")
        .suffix(".yaml")
        .tempfile_in(env!("CARGO_TARGET_TMPDIR"))?
        .into_temp_path()
        .keep()?;
    std::fs::write(&out, &o.stdout)?;
    Ok(out)
}

fn helm_template_output(sets: &[&str]) -> Result<std::process::Output> {
    run(Command::new(helm()?)
        .args(["template", "sidestep"])
        .arg(chart_dir())
        .args(["--namespace", NAMESPACE])
        .args(set_args(sets)))
}

/// The documents of a rendered file, empty ones (Helm's skipped templates) left out.
fn objects(bin: &Path, file: &Path) -> Result<Vec<Value>> {
    Ok(load(bin, file)?
        .into_iter()
        .filter(|o| !o.is_null())
        .collect())
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Result<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .with_context(|| format!("no {kind} {name} rendered"))
}

#[test]
fn chart_lints_with_every_preset_and_feature() -> Result<()> {
    let helm = helm()?;
    let mut cases: Vec<Vec<String>> = vec![Vec::new()];
    for (platform, _, _) in PRESETS {
        cases.push(vec![format!("global.platform={platform}")]);
    }
    for (_, sets) in FEATURES {
        cases.push(sets.iter().map(|s| (*s).to_owned()).collect());
    }
    cases.push(vec![
        "serviceMonitor.enabled=true".into(),
        "prometheusRule.enabled=true".into(),
        "namespace.create=true".into(),
    ]);
    for sets in &cases {
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        for strict in [false, true] {
            let o = run(Command::new(&helm)
                .arg("lint")
                .args(strict.then_some("--strict"))
                .arg(chart_dir())
                .args(set_args(&sets)))?;
            ensure!(
                o.status.success() && text(&o).contains("0 chart(s) failed"),
                "helm lint{} {sets:?}:\n{}",
                if strict { " --strict" } else { "" },
                text(&o)
            );
        }
    }
    // A lint that passes means something: it fails a chart with a broken template.
    let broken = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    copy_dir(&chart_dir(), broken.path())?;
    let cm = broken.path().join("templates/configmap.yaml");
    let template = std::fs::read_to_string(&cm)?;
    std::fs::write(&cm, template.replace("{{- range $key", "{{- rang $key"))?;
    let o = run(Command::new(&helm).arg("lint").arg(broken.path()))?;
    ensure!(!o.status.success(), "helm lint passed a broken template");
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

#[test]
fn chart_renders_valid_manifests_with_each_platforms_paths() -> Result<()> {
    let bin = venv()?;
    let mut cases: Vec<(String, Vec<&str>)> = vec![("defaults".into(), vec![])];
    for (name, sets) in FEATURES.iter().filter(|f| f.0 != MONITORING) {
        cases.push(((*name).into(), sets.to_vec()));
    }
    cases.push(("namespace".into(), vec!["namespace.create=true"]));
    let platforms: Vec<String> = PRESETS
        .iter()
        .map(|(p, _, _)| format!("global.platform={p}"))
        .collect();
    for (set, (platform, _, _)) in platforms.iter().zip(PRESETS) {
        cases.push((platform.into(), vec![set.as_str()]));
    }
    for (name, sets) in &cases {
        let rendered = helm_template(sets)?;
        for k in KUBERNETES {
            let o = validate(&bin, k, std::slice::from_ref(&rendered))?;
            ensure!(
                o.status.success(),
                "kubernetes-validate {k} of the chart ({name}, {sets:?}):\n{}",
                text(&o)
            );
        }
    }

    for ((platform, bin_dir, conf_dir), set) in PRESETS.iter().zip(&platforms) {
        let docs = objects(&bin, &helm_template(&[set])?)?;
        let host_paths = host_paths(find(&docs, "DaemonSet", "sidestep-agent")?)?;
        ensure!(
            host_paths.get("cni-bin").map(String::as_str) == Some(*bin_dir)
                && host_paths.get("cni-net").map(String::as_str) == Some(*conf_dir),
            "{platform}: the DaemonSet's CNI hostPaths are {host_paths:?}, want {bin_dir} and \
             {conf_dir}"
        );
        let data = &find(&docs, "ConfigMap", "sidestep-config")?["data"];
        ensure!(
            data["host-cni-conf-dir"] == *conf_dir,
            "{platform}: host-cni-conf-dir is {}",
            data["host-cni-conf-dir"]
        );
        let quota = docs.iter().any(|o| o["kind"] == "ResourceQuota");
        ensure!(
            quota == (*platform == "gke"),
            "{platform}: ResourceQuota {quota}"
        );
        let se_linux = &find(&docs, "DaemonSet", "sidestep-agent")?["spec"]["template"]["spec"]["containers"]
            [0]["securityContext"]["seLinuxOptions"];
        ensure!(
            (se_linux["type"] == "spc_t") == (*platform == "openshift"),
            "{platform}: seLinuxOptions {se_linux}"
        );
    }
    // An explicit directory wins over the preset.
    let docs = objects(
        &bin,
        &helm_template(&["global.platform=k3s", "cniConfDir=/srv/cni"])?,
    )?;
    let paths = host_paths(find(&docs, "DaemonSet", "sidestep-agent")?)?;
    ensure!(paths["cni-net"] == "/srv/cni" && paths["cni-bin"] == PRESETS[1].1);

    // Mistakes fail the render, saying what is wrong.
    for (sets, says) in [
        (&["global.platform=eks"][..], "platform"),
        (&["repair.deletPods=true"][..], "deletPods"),
        (
            &["repair.deletePods=true", "repair.labelPods=true"][..],
            "exclude each other",
        ),
    ] {
        let o = helm_template_output(sets)?;
        ensure!(
            !o.status.success() && text(&o).contains(says),
            "helm template {sets:?} should fail naming {says}:\n{}",
            text(&o)
        );
    }
    Ok(())
}

/// The DaemonSet's hostPath volumes, by volume name.
fn host_paths(ds: &Value) -> Result<std::collections::BTreeMap<String, String>> {
    Ok(ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .context("volumes")?
        .iter()
        .filter_map(|v| {
            Some((
                v["name"].as_str()?.to_owned(),
                v["hostPath"]["path"].as_str()?.to_owned(),
            ))
        })
        .collect())
}

#[test]
fn chart_defaults_render_what_kustomize_renders() -> Result<()> {
    let bin = venv()?;
    compare(&bin, &[], &[])
}

#[test]
fn chart_features_render_what_kustomize_renders_with_their_components() -> Result<()> {
    let bin = venv()?;
    // Every component of deploy/ has its feature here.
    let mut found: Vec<String> = std::fs::read_dir(deploy_dir().join("components"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    let mut known: Vec<&str> = FEATURES.iter().map(|f| f.0).collect();
    known.sort_unstable();
    ensure!(
        found == known,
        "deploy/components has {found:?}, the test knows {known:?}"
    );
    let mut failures = Vec::new();
    // The chart's copies of the monitoring component's files are the component's, byte for
    // byte: copy them again after changing deploy/components/monitoring.
    let copies = chart_dir().join("files/monitoring");
    for entry in std::fs::read_dir(&copies)? {
        let name = entry?.file_name();
        let original = deploy_dir().join("components/monitoring").join(&name);
        if std::fs::read(copies.join(&name))? != std::fs::read(&original)? {
            let name = name.to_string_lossy();
            failures.push(format!(
                "deploy/helm/sidestep/files/monitoring/{name} differs from \
                 deploy/components/monitoring/{name}: copy it again"
            ));
        }
    }
    for (component, sets) in FEATURES {
        if let Err(e) = compare(&bin, &[component], sets) {
            failures.push(format!("{component}: {e:#}"));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// The chart with `sets` against `kubectl kustomize` of deploy/ with `components`.
fn compare(bin: &Path, components: &[&str], sets: &[&str]) -> Result<()> {
    let kustomized =
        render(components)?.context("kubectl is needed to render deploy/ (kubectl kustomize)")?;
    let kustomized = objects(bin, &kustomized)?;
    let mut sets = sets.to_vec();
    sets.push("namespace.create=true");
    let charted = objects(bin, &helm_template(&sets)?)?;

    let key = |o: &Value| {
        format!(
            "{}/{}",
            o["kind"].as_str().unwrap_or("?"),
            o["metadata"]["name"].as_str().unwrap_or("?")
        )
    };
    let mut want: Vec<String> = kustomized.iter().map(key).collect();
    let mut have: Vec<String> = charted.iter().map(key).collect();
    want.sort();
    have.sort();
    ensure!(
        want == have,
        "the chart renders {have:?}, kustomize {want:?}"
    );
    let mut differences = Vec::new();
    for expected in &kustomized {
        let actual = charted
            .iter()
            .find(|o| key(o) == key(expected))
            .context("matched above")?;
        let (actual, expected) = comparable(actual, expected)?;
        diff(&key(&expected), &actual, &expected, &mut differences);
    }
    ensure!(
        differences.is_empty(),
        "the chart differs from deploy/ (allowed: {ALLOWED_DIFFERENCES:#?}):\n  {}",
        differences.join("\n  ")
    );
    Ok(())
}

/// The chart's object and deploy/'s with exactly `ALLOWED_DIFFERENCES` taken out.
fn comparable(chart: &Value, deploy: &Value) -> Result<(Value, Value)> {
    let (mut chart, mut deploy) = (chart.clone(), deploy.clone());
    if let Some(labels) = chart["metadata"]["labels"].as_object_mut() {
        for label in HELM_LABELS {
            labels.remove(label);
        }
    }
    if chart["kind"] == "ConfigMap" {
        for o in [&mut chart, &mut deploy] {
            if let Some(entry) = o["data"]["plugin-json"].as_str() {
                let parsed: Value =
                    serde_json::from_str(entry).context("plugin-json is not JSON")?;
                o["data"]["plugin-json"] = parsed;
            }
        }
        if deploy["data"].get("metrics-per-pod").is_none()
            && let Some(data) = chart["data"].as_object_mut()
        {
            data.remove("metrics-per-pod");
        }
    }
    if chart["kind"] == "DaemonSet" {
        let metadata = "/spec/template/metadata";
        let deploy_annotations = deploy
            .pointer(&format!("{metadata}/annotations"))
            .cloned()
            .unwrap_or(Value::Null);
        if let Some(template) = chart.pointer_mut(metadata).and_then(Value::as_object_mut)
            && let Some(annotations) = template
                .get_mut("annotations")
                .and_then(Value::as_object_mut)
        {
            for name in [
                "prometheus.io/scrape",
                "prometheus.io/port",
                "prometheus.io/path",
            ] {
                if deploy_annotations.get(name).is_none() {
                    annotations.remove(name);
                }
            }
            if annotations.is_empty() {
                template.remove("annotations");
            }
        }
    }
    Ok((chart, deploy))
}

/// Every path where `have` and `want` differ, with both values.
fn diff(path: &str, have: &Value, want: &Value, out: &mut Vec<String>) {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => {
            let mut keys: Vec<&String> = h.keys().chain(w.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let (hv, wv) = (
                    h.get(k).unwrap_or(&Value::Null),
                    w.get(k).unwrap_or(&Value::Null),
                );
                diff(&format!("{path}.{k}"), hv, wv, out);
            }
        }
        (Value::Array(h), Value::Array(w)) if h.len() == w.len() => {
            for (i, (hv, wv)) in h.iter().zip(w).enumerate() {
                diff(&format!("{path}[{i}]"), hv, wv, out);
            }
        }
        _ if have != want => out.push(format!(
            "{path}: chart {}, deploy/ {}",
            shortened(have),
            shortened(want)
        )),
        _ => {}
    }
}

/// A value for a difference's line: a dashboard's JSON would bury the other lines.
fn shortened(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(120) {
        Some((cut, _)) => format!("{}... ({} chars)", &text[..cut], text.len()),
        None => text,
    }
}
