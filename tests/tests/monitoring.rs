//! deploy/components/monitoring and the agent's /metrics agree:
//!
//! - every metric the PrometheusRule's expressions and the Grafana dashboard's queries name is a
//!   series a real agent exports (counters as `_total`, histograms as `_bucket`, `_sum`,
//!   `_count`), with the labels their selectors match on, and still is with
//!   `metrics-per-pod: false`, which drops every per-pod series (needs root: the agent attaches
//!   at the test's own cgroup and pin root, and enrols a pod);
//! - `promtool check rules` passes on the rule's groups, and `promtool test rules` on alerts that
//!   must fire and alerts that must not. promtool comes from `SIDESTEP_PROMTOOL`, which
//!   `cargo xtask test` sets; without it the test fails rather than skip;
//! - `kubectl kustomize` of deploy/ with the component renders; its core objects pass
//!   kubernetes-validate, and the custom resources (which the validator has no schema for) have
//!   the structure the Prometheus Operator reads, pointing at the agent's metrics port; each
//!   alert's runbook is a heading of docs/TROUBLESHOOTING.md.
//!
//! YAML is read with PyYAML from manifest_support's venv under the target directory (as
//! agent_manifests.rs does); the tests that need it skip, saying so, only when PyPI cannot be
//! reached.

mod agent_support;
mod manifest_support;
#[path = "monitoring/promql.rs"]
mod promql;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use agent_support::{Agent, Dirs, base_args, free_port, meshed, wait_until};
use anyhow::{Context as _, Result, bail, ensure};
use manifest_support::{KUBERNETES, deploy_dir, load, render, run, text, tools, validate};
use promql::{exported, selectors, unexported};
use serde_json::{Value, json};
use sidestep_tests::{TestEnv, skip_unless_root};

fn component_dir() -> PathBuf {
    deploy_dir().join("components/monitoring")
}

fn prometheus_rule(bin: &Path) -> Result<Value> {
    load(bin, &component_dir().join("prometheusrule.yaml"))?
        .into_iter()
        .next()
        .context("prometheusrule.yaml is empty")
}

fn dashboard() -> Result<Value> {
    let path = component_dir().join("dashboard.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(serde_json::from_str(&text)?)
}

/// Every rule of the PrometheusRule: (alert name, rule).
fn rules(rule: &Value) -> Result<Vec<(String, Value)>> {
    let mut out = Vec::new();
    for g in rule["spec"]["groups"].as_array().context("spec.groups")? {
        for r in g["rules"].as_array().context("rules")? {
            let name = r["alert"]
                .as_str()
                .or(r["record"].as_str())
                .context("a rule without alert or record")?;
            out.push((name.to_owned(), r.clone()));
        }
    }
    Ok(out)
}

/// Every PromQL expression of the rule and the dashboard: (where it is, expression).
fn queries(rule: &Value, dash: &Value) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = rules(rule)?
        .into_iter()
        .map(|(name, r)| {
            (
                format!("rule {name}"),
                r["expr"].as_str().unwrap_or("").into(),
            )
        })
        .collect();
    for p in dash["panels"].as_array().context("panels")? {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("panel {}", p["title"]),
                t["expr"].as_str().unwrap_or("").into(),
            ));
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = v["query"]["query"].as_str() {
            out.push((format!("variable {}", v["name"]), q.into()));
        }
    }
    ensure!(
        out.iter().all(|(_, e)| !e.trim().is_empty()),
        "an empty query: {out:?}"
    );
    Ok(out)
}

fn metrics_body(agent: &Agent) -> Result<String> {
    let (code, body) = agent.get("/metrics")?;
    ensure!(code == 200, "/metrics answered {code}: {body}");
    Ok(body)
}

#[test]
fn rules_and_dashboard_name_what_the_agent_exports() -> Result<()> {
    if skip_unless_root("rules_and_dashboard_name_what_the_agent_exports") {
        return Ok(());
    }
    let Some(bin) = tools()? else { return Ok(()) };
    let queries = queries(&prometheus_rule(&bin)?, &dashboard()?)?;
    // What the issue asks the alerts and the dashboard to show is there.
    let all: BTreeSet<String> = queries
        .iter()
        .flat_map(|(_, e)| selectors(e).into_iter().map(|s| s.0))
        .collect();
    for want in [
        "sidestep_ready",
        "sidestep_pods_enrolled",
        "sidestep_pods_unenrolled",
        "sidestep_pod_capacity",
        "sidestep_cni_failopen_pods",
        "sidestep_cni_operations_total",
        "sidestep_cni_operation_duration_seconds_bucket",
        "sidestep_reconciles_total",
        "sidestep_repaired_pods_total",
    ] {
        ensure!(all.contains(want), "neither rules nor dashboard use {want}");
    }

    let env = TestEnv::new("monitoring")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let args = base_args(&env, &d, port);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let node = d.node(&env, "10-test.conflist")?;
    // One enrolled pod for the per-pod families, one failed ADD for the `code` label.
    let pod = node.add_pod_with("mon0", meshed())?;
    agent_support::failing_add(&d, &d.entry("10-test.conflist")?, "monitoring-bad-netns")?;
    let code_series = r#"sidestep_cni_operations_total{command="ADD",result="error",code="8"}"#;
    wait_until(
        "a failure's code in /metrics",
        Duration::from_secs(10),
        || Ok(metrics_body(&agent)?.contains(code_series)),
    )?;
    let body = metrics_body(&agent)?;
    let have = exported(&body);
    ensure!(
        have.keys()
            .any(|k| k.starts_with("sidestep_pod_redirected")),
        "no per-pod series with a pod enrolled:\n{body}"
    );
    let bad = unexported(&queries, &have);
    ensure!(
        bad.is_empty(),
        "the monitoring component names what the agent does not export:\n{}\n\nexported: {:?}",
        bad.join("\n"),
        have.keys().collect::<Vec<_>>()
    );
    // None of them is a per-pod series, which metrics-per-pod: false drops.
    for name in &all {
        ensure!(
            !have.get(name).is_some_and(|l| l.contains("netns_cookie")),
            "{name} is a per-pod series: gone with metrics-per-pod: false"
        );
    }
    eprintln!(
        "{} queries, {} metrics, all exported",
        queries.len(),
        all.len()
    );

    // The same agent without per-pod series: the rules and the dashboard still work, and no
    // series names a pod.
    agent.child.terminate(Duration::from_secs(10))?;
    let mut args = args;
    args.extend(["--metrics-per-pod".into(), "false".into()]);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let body = metrics_body(&agent)?;
    let have = exported(&body);
    let bad = unexported(&queries, &have);
    ensure!(
        bad.is_empty(),
        "with metrics-per-pod: false:\n{}",
        bad.join("\n")
    );
    for (name, labels) in &have {
        ensure!(
            !labels.contains("netns_cookie") && !name.starts_with("sidestep_pod_redirected"),
            "a per-pod series with metrics-per-pod: false: {name} {labels:?}"
        );
    }
    ensure!(
        body.lines().any(|l| l == "sidestep_pods_enrolled 1"),
        "the node's figures went too:\n{body}"
    );

    node.remove_pod(&pod)?;
    agent.child.terminate(Duration::from_secs(10))?;
    agent_support::uninstall(&env, &d)?;
    Ok(())
}

/// promtool, from `SIDESTEP_PROMTOOL`.
fn promtool() -> Result<PathBuf> {
    let Some(p) = std::env::var_os("SIDESTEP_PROMTOOL") else {
        bail!(
            "SIDESTEP_PROMTOOL is not set: run this test through `cargo xtask test`, which builds \
             promtool (github.com/prometheus/prometheus cmd/promtool) and sets it"
        );
    };
    let p = PathBuf::from(p);
    ensure!(p.is_file(), "SIDESTEP_PROMTOOL={} is no file", p.display());
    Ok(p)
}

/// An annotation template with the labels and the value filled in, as Prometheus renders the
/// few forms the rules use.
fn render_annotation(template: &str, labels: &Value, value: &str, percentage: &str) -> String {
    let mut s = template
        .replace("{{ $value | humanizePercentage }}", percentage)
        .replace("{{ $value }}", value);
    if let Some(m) = labels.as_object() {
        for (k, v) in m {
            s = s.replace(&format!("{{{{ $labels.{k} }}}}"), v.as_str().unwrap_or(""));
        }
    }
    s
}

/// The expected alert of `alert` with these series labels: the rule's labels added, its
/// annotations rendered.
fn expected_alert(
    rules: &[(String, Value)],
    alert: &str,
    labels: Value,
    value: &str,
    percentage: &str,
) -> Result<Value> {
    let rule = &rules
        .iter()
        .find(|(n, _)| n == alert)
        .with_context(|| format!("no alert {alert}"))?
        .1;
    let mut exp_labels = labels.clone();
    for (k, v) in rule["labels"].as_object().into_iter().flatten() {
        exp_labels[k] = v.clone();
    }
    let annotations: serde_json::Map<String, Value> = rule["annotations"]
        .as_object()
        .context("annotations")?
        .iter()
        .map(|(k, t)| {
            let t = t.as_str().unwrap_or("");
            (
                k.clone(),
                json!(render_annotation(t, &labels, value, percentage)),
            )
        })
        .collect();
    Ok(json!({"exp_labels": exp_labels, "exp_annotations": annotations}))
}

#[test]
fn promtool_checks_and_unit_tests_the_rules() -> Result<()> {
    let promtool = promtool()?;
    let Some(bin) = tools()? else { return Ok(()) };
    let rule = prometheus_rule(&bin)?;
    let dir = tempfile::Builder::new()
        .prefix("promtool-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    // A rule file is the PrometheusRule's spec (JSON is YAML).
    let rules_file = dir.path().join("rules.yaml");
    std::fs::write(&rules_file, serde_json::to_string_pretty(&rule["spec"])?)?;
    let o = run(Command::new(&promtool)
        .arg("check")
        .arg("rules")
        .arg(&rules_file))?;
    ensure!(o.status.success(), "promtool check rules:\n{}", text(&o));
    let all = rules(&rule)?;
    ensure!(
        text(&o).contains(&format!("SUCCESS: {} rules found", all.len())),
        "{}",
        text(&o)
    );
    // The check does catch a broken expression.
    let mut broken = rule["spec"].clone();
    broken["groups"][0]["rules"][0]["expr"] = json!("sum by (node (sidestep_ready");
    let broken_file = dir.path().join("broken.yaml");
    std::fs::write(&broken_file, broken.to_string())?;
    let o = run(Command::new(&promtool)
        .arg("check")
        .arg("rules")
        .arg(&broken_file))?;
    ensure!(!o.status.success(), "a broken rule passed: {}", text(&o));

    // Two nodes, a minute apart: n1 is in trouble, n2 is not.
    let target = |node: &str| {
        json!({"node": node, "job": "sidestep-agent", "namespace": "sidestep-system",
               "pod": format!("sidestep-agent-{node}"), "instance": format!("{node}:9964")})
    };
    let series = |name: &str, node: &str, extra: &[(&str, &str)], values: &str| {
        let mut labels = target(node);
        for (k, v) in extra {
            labels[*k] = json!(v);
        }
        let inner: Vec<String> = labels
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        json!({"series": format!("{name}{{{}}}", inner.join(", ")), "values": values})
    };
    let ops = "sidestep_cni_operations_total";
    let add_error = |code| [("command", "ADD"), ("result", "error"), ("code", code)];
    let add_ok = [("command", "ADD"), ("result", "ok")];
    let input = json!([
        series("sidestep_ready", "n1", &[], "0x30"),
        series("sidestep_ready", "n2", &[], "1x30"),
        series("sidestep_pods_enrolled", "n1", &[], "3700x30"),
        series("sidestep_pod_capacity", "n1", &[], "4096x30"),
        series("sidestep_pods_enrolled", "n2", &[], "100x30"),
        series("sidestep_pod_capacity", "n2", &[], "4096x30"),
        series("sidestep_cni_failopen_pods", "n1", &[], "0x30"),
        series("sidestep_cni_failopen_pods", "n2", &[], "0x30"),
        // n1: half of the ADDs fail with code 100, one a minute.
        series(ops, "n1", &add_error("100"), "0+1x30"),
        series(ops, "n1", &add_ok, "0+1x30"),
        // n2: many ADDs, one lone failure with code 11.
        series(ops, "n2", &add_error("11"), "0x10 1x20"),
        series(ops, "n2", &add_ok, "0+10x30"),
    ]);
    let fires = |alert: &str, node: &str, extra: &[(&str, &str)], value: &str, pct: &str| {
        // The CNI alert sums by node, command and code; the others keep the series' labels.
        let mut labels = if alert == "SidestepCniErrors" {
            json!({"node": node})
        } else {
            target(node)
        };
        for (k, v) in extra {
            labels[*k] = json!(v);
        }
        expected_alert(&all, alert, labels, value, pct)
    };
    let tests = json!({
        "rule_files": [rules_file],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": input,
            "alert_rule_test": [
                // Not ready for 3 minutes: not yet (for: 5m).
                {"eval_time": "3m", "alertname": "SidestepAgentNotReady", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "SidestepAgentNotReady",
                 "exp_alerts": [fires("SidestepAgentNotReady", "n1", &[], "0", "")?]},
                {"eval_time": "10m", "alertname": "SidestepPodMapNearlyFull",
                 "exp_alerts": [fires("SidestepPodMapNearlyFull", "n1", &[], "", "90.33%")?]},
                {"eval_time": "25m", "alertname": "SidestepCniErrors",
                 "exp_alerts": [fires("SidestepCniErrors", "n1",
                                      &[("command", "ADD"), ("code", "100")], "", "50%")?]},
                {"eval_time": "25m", "alertname": "SidestepFailOpenPods", "exp_alerts": []},
                {"eval_time": "25m", "alertname": "SidestepPodsUnenrolled", "exp_alerts": []},
            ],
        }],
    });
    let tests_file = dir.path().join("tests.yaml");
    std::fs::write(&tests_file, serde_json::to_string_pretty(&tests)?)?;
    let o = run(Command::new(&promtool)
        .arg("test")
        .arg("rules")
        .arg(&tests_file))?;
    ensure!(
        o.status.success(),
        "promtool test rules:\n{}\n{}",
        text(&o),
        serde_json::to_string_pretty(&tests)?
    );
    Ok(())
}

/// GitHub's anchor of a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// `FULL_AT_PERCENT` of `sidestep check` (`sidestep_daemon::check::FULL_AT_PERCENT`), read from
/// its source: check.rs or a module of it.
fn full_at_percent() -> Result<u64> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../userspace/daemon/src");
    let mut files = vec![src.join("check.rs")];
    if let Ok(dir) = std::fs::read_dir(src.join("check")) {
        files.extend(dir.flatten().map(|e| e.path()));
    }
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|x| x == "rs"))
    {
        let text = std::fs::read_to_string(f)?;
        if let Some(line) = text.lines().find(|l| l.contains("const FULL_AT_PERCENT")) {
            let v = line.split('=').nth(1).context("FULL_AT_PERCENT")?;
            return Ok(v.trim().trim_end_matches(';').parse()?);
        }
    }
    bail!("no FULL_AT_PERCENT in {files:?}")
}

#[test]
fn monitoring_component_renders_and_points_at_the_agent() -> Result<()> {
    let Some(bin) = tools()? else { return Ok(()) };
    let dir = component_dir();
    let o = run(Command::new(bin.join("yamllint"))
        .args([
            "--strict",
            "-d",
            "{extends: default, rules: {line-length: {max: 100}}}",
        ])
        .arg(&dir))?;
    ensure!(o.status.success(), "yamllint:\n{}", text(&o));
    let Some(rendered) = render(&["monitoring"])? else {
        eprintln!("skipping the rendering: no kubectl");
        return Ok(());
    };
    let tmp = tempfile::Builder::new()
        .prefix("monitoring-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let docs = load(&bin, &rendered)?;
    let find = |kind: &str, name: &str| -> Result<&Value> {
        docs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .with_context(|| format!("no {kind} {name} rendered"))
    };

    // The core objects pass the validator; it has no schema for the Operator's resources.
    let (custom, core): (Vec<&Value>, Vec<&Value>) = docs.iter().partition(|d| {
        d["apiVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("monitoring.coreos.com/"))
    });
    let kinds: BTreeSet<&str> = custom.iter().filter_map(|d| d["kind"].as_str()).collect();
    ensure!(
        kinds == BTreeSet::from(["PrometheusRule", "ServiceMonitor"]),
        "custom resources: {kinds:?}"
    );
    let core_file = tmp.path().join("core.yaml");
    let core_text: String = core.iter().map(|d| format!("---\n{d}\n")).collect();
    std::fs::write(&core_file, core_text)?;
    for k in KUBERNETES {
        let o = validate(&bin, k, std::slice::from_ref(&core_file))?;
        ensure!(o.status.success(), "kubernetes-validate {k}:\n{}", text(&o));
    }

    // Everything points at the agent's metrics port: the ConfigMap's listen, the DaemonSet's
    // port and annotations, the Service, the ServiceMonitor.
    let cm = find("ConfigMap", "sidestep-config")?;
    let listen = cm["data"]["listen"].as_str().context("listen")?;
    let port: u64 = listen.rsplit_once(':').context("listen")?.1.parse()?;
    let ds = find("DaemonSet", "sidestep-agent")?;
    let template = &ds["spec"]["template"];
    let annotations = &template["metadata"]["annotations"];
    ensure!(
        annotations["prometheus.io/scrape"] == "true"
            // A string: annotations hold nothing else.
            && annotations["prometheus.io/port"]
                .as_str()
                .and_then(|p| p.parse::<u64>().ok())
                == Some(port)
            && annotations["prometheus.io/path"] == "/metrics",
        "the DaemonSet's scrape annotations: {annotations}"
    );
    let container_port = template["spec"]["containers"][0]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["containerPort"] == port)
        .with_context(|| format!("the agent's container has no port {port}"))?;
    let svc = find("Service", "sidestep-agent-metrics")?;
    let svc_port = &svc["spec"]["ports"][0];
    ensure!(
        svc_port["port"] == port && svc_port["targetPort"] == container_port["name"],
        "the Service's port {svc_port}, the container's {container_port}"
    );
    let pod_labels = template["metadata"]["labels"]
        .as_object()
        .context("labels")?;
    let svc_selector = svc["spec"]["selector"].as_object().context("selector")?;
    ensure!(
        svc_selector
            .iter()
            .all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the Service selects {svc_selector:?}, the agent's pods are {pod_labels:?}"
    );
    let sm = find("ServiceMonitor", "sidestep-agent")?;
    ensure!(sm["apiVersion"] == "monitoring.coreos.com/v1");
    ensure!(sm["metadata"]["namespace"] == svc["metadata"]["namespace"]);
    let sm_selector = sm["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("ServiceMonitor selector")?;
    ensure!(
        sm_selector
            .iter()
            .all(|(k, v)| svc["metadata"]["labels"][k] == *v),
        "the ServiceMonitor selects {sm_selector:?}, the Service is {}",
        svc["metadata"]["labels"]
    );
    let endpoint = &sm["spec"]["endpoints"][0];
    ensure!(
        endpoint["port"] == svc_port["name"] && endpoint["path"] == "/metrics",
        "ServiceMonitor endpoint {endpoint}"
    );
    // The node label the rules and the dashboard group by.
    ensure!(
        endpoint["relabelings"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["targetLabel"] == "node"
                && r["sourceLabels"] == json!(["__meta_kubernetes_pod_node_name"])),
        "no node label: {endpoint}"
    );
    // The job label the rules' `up` selects.
    let job_label = sm["spec"]["jobLabel"].as_str().context("jobLabel")?;
    ensure!(svc["metadata"]["labels"][job_label] == "sidestep-agent");

    // The rules: each alert with a severity, a summary, a description and a runbook that is a
    // heading of docs/TROUBLESHOOTING.md.
    let pr = find("PrometheusRule", "sidestep-agent")?;
    ensure!(pr["apiVersion"] == "monitoring.coreos.com/v1");
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/TROUBLESHOOTING.md"),
    )?;
    let anchors: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| anchor(h.trim_start_matches('#')))
        .collect();
    let rules = rules(pr)?;
    ensure!(rules.len() >= 5, "{} rules", rules.len());
    let mut used = Vec::new();
    for (name, r) in &rules {
        ensure!(name.starts_with("Sidestep"), "alert {name}");
        ensure!(r["labels"]["severity"].is_string(), "{name}: no severity");
        for key in ["summary", "description"] {
            ensure!(
                r["annotations"][key].as_str().is_some_and(|s| s.len() > 10),
                "{name}: no {key}"
            );
        }
        let url = r["annotations"]["runbook_url"]
            .as_str()
            .with_context(|| format!("{name}: no runbook_url"))?;
        let (page, fragment) = url.split_once('#').context("runbook_url without anchor")?;
        ensure!(page.ends_with("/docs/TROUBLESHOOTING.md"), "{name}: {url}");
        ensure!(
            anchors.contains(fragment),
            "{name}: #{fragment} is no heading of docs/TROUBLESHOOTING.md"
        );
        used.push(format!("{name}: #{fragment}"));
    }
    eprintln!("runbooks:\n{}", used.join("\n"));
    // The pod-map alert fires where `sidestep check` fails.
    let full = &rules
        .iter()
        .find(|(n, _)| n == "SidestepPodMapNearlyFull")
        .context("SidestepPodMapNearlyFull")?
        .1["expr"];
    let threshold = format!(">= {}", full_at_percent()? as f64 / 100.0);
    ensure!(
        full.as_str().is_some_and(|e| e.contains(&threshold)),
        "SidestepPodMapNearlyFull {full} is not at {threshold} (FULL_AT_PERCENT)"
    );

    // The dashboard: the ConfigMap the Grafana sidecar loads holds dashboard.json as is.
    let dash_cm = find("ConfigMap", "sidestep-dashboard")?;
    ensure!(
        dash_cm["metadata"]["labels"]["grafana_dashboard"] == "1",
        "the dashboard's labels: {}",
        dash_cm["metadata"]["labels"]
    );
    let data = dash_cm["data"].as_object().context("data")?;
    ensure!(
        data.len() == 1,
        "dashboard ConfigMap keys: {:?}",
        data.keys()
    );
    let (key, body) = data.iter().next().context("data")?;
    ensure!(key.ends_with(".json"), "{key}");
    let dash: Value = serde_json::from_str(body.as_str().context("dashboard text")?)?;
    ensure!(
        dash == dashboard()?,
        "the ConfigMap's dashboard is not dashboard.json"
    );
    let titles: Vec<String> = dash["panels"]
        .as_array()
        .context("panels")?
        .iter()
        .map(|p| p["title"].as_str().unwrap_or("").to_lowercase())
        .collect();
    for want in [
        "enrolled",
        "cni operations",
        "latency",
        "fail-open",
        "map fill",
        "reconcile",
        "ready",
    ] {
        ensure!(
            titles.iter().any(|t| t.contains(want)),
            "no panel about {want}: {titles:?}"
        );
    }
    let mut ids = BTreeSet::new();
    for p in dash["panels"].as_array().into_iter().flatten() {
        ensure!(
            ids.insert(p["id"].to_string()),
            "panel id {} twice",
            p["id"]
        );
        ensure!(
            p["datasource"]["uid"] == "${datasource}",
            "panel {} has no datasource variable",
            p["title"]
        );
    }
    Ok(())
}
