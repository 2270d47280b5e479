//! The bad-input corpus: each case must give a spec error with the expected code, a non-zero
//! exit, and leave the pod map, the per-pod links and the state directory exactly as they were.

use anyhow::{Result, bail, ensure};
use serde_json::{Value, json};

use super::hostile;
use super::sandbox::{STATUS, Sandbox, call, cmd_env, cni, expect_err, expect_ok};

pub fn with(mut v: Value, path: &[&str], val: Value) -> Value {
    let mut cur = &mut v;
    for k in &path[..path.len() - 1] {
        cur = &mut cur[*k];
    }
    if val.is_null() {
        cur.as_object_mut().unwrap().remove(path[path.len() - 1]);
    } else {
        cur[path[path.len() - 1]] = val;
    }
    v
}

pub fn annotated(conf: &Value, extra: Value) -> Value {
    let mut a = json!({"sidecar.istio.io/status": STATUS});
    for (k, v) in extra.as_object().unwrap() {
        a[k] = v.clone();
    }
    with(
        conf.clone(),
        &["runtimeConfig", "io.kubernetes.cri.pod-annotations"],
        a,
    )
}

/// One case: its name, the CNI_* environment, stdin and the error code it must give.
pub type Env = Vec<(&'static str, String)>;
pub type Case = (&'static str, Env, Vec<u8>, u64);

pub fn b(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// `command` for the attachment `cid`@eth0 in `ns`, with the pod's Kubernetes identity.
pub fn env_for(command: &str, cid: &str, ns: &str) -> Env {
    cmd_env(command, cid, ns)
        .into_iter()
        .map(|(k, v)| (k, v.to_owned()))
        .collect()
}

/// ADD of the attachment "bad" in `ns`.
pub fn add(ns: &str) -> Env {
    env_for("ADD", "bad", ns)
}

/// `cmd` of "bad" in `ns`, with `k` set to `v` (removed when `v` is empty).
pub fn env_with(cmd: &str, ns: &str, k: &'static str, v: &str) -> Env {
    let mut e = env_for(cmd, "bad", ns);
    e.retain(|(key, _)| *key != k);
    if !v.is_empty() {
        e.push((k, v.to_owned()));
    }
    e
}

pub fn corpus() -> Result<()> {
    let mut sb = Sandbox::new("bad")?;
    sb.load()?;
    let good = sb.add_netns("g")?;
    let fresh = sb.add_netns("f")?;
    let conf = sb.conf("1.0.0");
    // An enrolled pod that no bad input may disturb.
    expect_ok(&call(&sb, "ADD", "good", &good, &conf)?, "ADD good")?;
    let (pods0, links0, files0) = (sb.pods()?, sb.pod_links(), sb.state_files());
    ensure!(pods0.len() == 1);

    let f = fresh.to_string_lossy().into_owned();
    let g = good.to_string_lossy().into_owned();
    let set = |path: &[&str], val: Value| b(&with(conf.clone(), path, val));
    let ips = |val: Value| set(&["prevResult", "ips"], val);
    let ann = |extra: Value| b(&annotated(&conf, extra));
    let mut cases: Vec<Case> = vec![
        // Broken JSON.
        ("empty stdin", add(&f), b"".to_vec(), 6),
        (
            "truncated",
            add(&f),
            br#"{"cniVersion":"1.0.0","#.to_vec(),
            6,
        ),
        ("open brace", add(&f), b"{".to_vec(), 6),
        ("array", add(&f), b"[]".to_vec(), 6),
        ("null", add(&f), b"null".to_vec(), 6),
        ("string", add(&f), b"\"conf\"".to_vec(), 6),
        (
            "trailing garbage",
            add(&f),
            [b(&conf), b"}".to_vec()].concat(),
            6,
        ),
        ("binary", add(&f), vec![0xff, 0xfe, 0x00, 0x01], 6),
        (
            "single quotes",
            add(&f),
            b"{'cniVersion':'1.0.0'}".to_vec(),
            6,
        ),
        (
            "missing comma",
            add(&f),
            br#"{"cniVersion":"1.0.0" "name":"x"}"#.to_vec(),
            6,
        ),
        // Missing fields.
        (
            "no cniVersion",
            add(&f),
            set(&["cniVersion"], Value::Null),
            1,
        ),
        ("no name", add(&f), set(&["name"], Value::Null), 7),
        ("empty name", add(&f), set(&["name"], json!("")), 7),
        ("bad name", add(&f), set(&["name"], json!("a b")), 7),
        ("no type", add(&f), set(&["type"], Value::Null), 7),
        // Unknown versions, and commands the version lacks.
        (
            "version 0.1.0",
            add(&f),
            set(&["cniVersion"], json!("0.1.0")),
            1,
        ),
        (
            "version 0.2.0",
            add(&f),
            set(&["cniVersion"], json!("0.2.0")),
            1,
        ),
        (
            "version 1.2.0",
            add(&f),
            set(&["cniVersion"], json!("1.2.0")),
            1,
        ),
        (
            "version 2.0.0",
            add(&f),
            set(&["cniVersion"], json!("2.0.0")),
            1,
        ),
        (
            "version latest",
            add(&f),
            set(&["cniVersion"], json!("latest")),
            1,
        ),
        (
            "version number",
            add(&f),
            set(&["cniVersion"], json!(1.0)),
            7,
        ),
        (
            "CHECK in 0.3.1",
            env_with("CHECK", &g, "X", ""),
            b(&sb.conf("0.3.1")),
            1,
        ),
        (
            "STATUS in 1.0.0",
            env_with("STATUS", &g, "X", ""),
            b(&conf),
            1,
        ),
        (
            "GC in 0.4.0",
            env_with("GC", &g, "X", ""),
            b(&sb.conf("0.4.0")),
            1,
        ),
        // Malformed prevResult.
        ("ips not array", add(&f), ips(json!({})), 6),
        (
            "address without prefix",
            add(&f),
            ips(json!([{"address": "10.1.1.1"}])),
            6,
        ),
        (
            "address not IP",
            add(&f),
            ips(json!([{"address": "ten/8"}])),
            6,
        ),
        (
            "version in 1.0.0 ips",
            add(&f),
            ips(json!([{"version": "4", "address": "10.1.1.1/24"}])),
            6,
        ),
        (
            "0.4.0 ips without version",
            add(&f),
            b(&with(
                sb.conf("0.4.0"),
                &["prevResult", "ips"],
                json!([{"address": "10.1.1.1/24"}]),
            )),
            6,
        ),
        (
            "interface index past end",
            add(&f),
            ips(json!([{"address": "10.1.1.1/24", "interface": 5}])),
            6,
        ),
        (
            "interfaces not objects",
            add(&f),
            set(&["prevResult", "interfaces"], json!(["eth0"])),
            6,
        ),
        (
            "route without dst",
            add(&f),
            set(&["prevResult", "routes"], json!([{"gw": "10.0.0.1"}])),
            6,
        ),
        (
            "dns not object",
            add(&f),
            set(&["prevResult", "dns"], json!("8.8.8.8")),
            6,
        ),
        (
            "prevResult string",
            add(&f),
            set(&["prevResult"], json!("ok")),
            6,
        ),
        (
            "prevResult 0.4.0 under 1.0.0",
            add(&f),
            set(&["prevResult", "cniVersion"], json!("0.4.0")),
            1,
        ),
        // Bad plugin config values.
        (
            "relative pin_root",
            add(&f),
            set(&["pin_root"], json!("bpf/x")),
            7,
        ),
        ("unknown mesh", add(&f), set(&["mesh"], json!("consul")), 7),
        (
            "bad fail_strategy",
            add(&f),
            set(&["fail_strategy"], json!("OPEN")),
            7,
        ),
        (
            "policy port 70000",
            add(&f),
            set(&["policy"], json!({"outboundPort": 70000})),
            7,
        ),
        (
            "policy CIDR /33",
            add(&f),
            set(
                &["policy"],
                json!({"excludeOutboundIPRanges": "10.0.0.0/33"}),
            ),
            7,
        ),
        (
            "policy uid -1",
            add(&f),
            set(&["policy"], json!({"proxyUid": -1})),
            7,
        ),
        ("annotation not string", add(&f), ann(json!({"x": 1})), 7),
        // Bad annotation values.
        (
            "inbound port 70000",
            add(&f),
            ann(json!({"traffic.sidecar.istio.io/includeInboundPorts": "70000"})),
            101,
        ),
        (
            "outbound CIDR /33",
            add(&f),
            ann(json!({"traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/33"})),
            101,
        ),
        (
            "outbound port word",
            add(&f),
            ann(json!({"traffic.sidecar.istio.io/excludeOutboundPorts": "http"})),
            101,
        ),
        (
            "interception NONE",
            add(&f),
            ann(json!({"sidecar.istio.io/interceptionMode": "NONE"})),
            101,
        ),
        (
            "bad interface name",
            add(&f),
            ann(json!({"traffic.sidecar.istio.io/excludeInterfaces": "a/b"})),
            101,
        ),
        (
            "status not JSON",
            add(&f),
            ann(json!({"sidecar.istio.io/status": "{"})),
            101,
        ),
        (
            "linkerd uid -1",
            add(&f),
            b(&with(
                annotated(
                    &conf,
                    json!({"linkerd.io/proxy-version": "stable", "config.linkerd.io/proxy-uid": "-1"}),
                ),
                &["mesh"],
                json!("linkerd"),
            )),
            101,
        ),
        (
            "kuma uid -1",
            add(&f),
            b(&with(
                annotated(
                    &conf,
                    json!({"kuma.io/sidecar-injected": "true", "kuma.io/sidecar-uid": "-1"}),
                ),
                &["mesh"],
                json!("kuma"),
            )),
            101,
        ),
        // The netns and the environment.
        (
            "missing netns",
            env_with("ADD", &f, "CNI_NETNS", ""),
            b(&conf),
            4,
        ),
        (
            "nonexistent netns",
            add("/run/netns/sidestep-test-does-not-exist"),
            b(&conf),
            8,
        ),
        ("host netns (pid 1)", add("/proc/1/ns/net"), b(&conf), 8),
        ("host netns (self)", add("/proc/self/ns/net"), b(&conf), 8),
        ("netns is a file", add("/etc/hostname"), b(&conf), 8),
        (
            "CHECK host netns",
            env_with("CHECK", "/proc/1/ns/net", "X", ""),
            b(&conf),
            8,
        ),
        (
            "missing container id",
            env_with("ADD", &f, "CNI_CONTAINERID", ""),
            b(&conf),
            4,
        ),
        (
            "bad container id",
            env_with("ADD", &f, "CNI_CONTAINERID", "-x"),
            b(&conf),
            4,
        ),
        (
            "missing ifname",
            env_with("ADD", &f, "CNI_IFNAME", ""),
            b(&conf),
            4,
        ),
        (
            "ifname too long",
            env_with("ADD", &f, "CNI_IFNAME", "eth0-much-too-long"),
            b(&conf),
            4,
        ),
        (
            "CNI_ARGS bad pair",
            env_with("ADD", &f, "CNI_ARGS", "K8S_POD_NAME"),
            b(&conf),
            4,
        ),
        (
            "unknown command",
            env_with("REMOVE", &f, "X", ""),
            b(&conf),
            4,
        ),
        (
            "lower-case command",
            env_with("add", &f, "X", ""),
            b(&conf),
            4,
        ),
        // No command at all is not an error: the plugin names itself and its versions, as the
        // reference plugins do (`run_by_hand_it_names_itself_and_its_versions`).
    ];
    // The same bad inputs against the enrolled pod's own netns must not unenrol it.
    cases.push((
        "bad annotation on enrolled netns",
        add(&g),
        ann(json!({"traffic.sidecar.istio.io/includeInboundPorts": "0"})),
        101,
    ));
    cases.push(("broken JSON on enrolled netns", add(&g), b"{".to_vec(), 6));
    cases.extend(hostile::cases(&sb, &conf, &f, &g));
    ensure!(cases.len() >= 80, "only {} cases", cases.len());
    let mut names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        bail!("case {:?} is listed twice", w[0]);
    }

    let mut failures = Vec::new();
    for (name, env, stdin, code) in &cases {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let result = cni(&sb, &env, stdin).and_then(|o| expect_err(&o, *code, name));
        let unchanged = (sb.pods()?, sb.pod_links(), sb.state_files())
            == (pods0.clone(), links0.clone(), files0.clone())
            && sb.cwd_files().is_empty();
        match (result, unchanged) {
            (Ok(()), true) => {}
            (Err(e), _) => failures.push(format!("{name}: {e:#}")),
            (Ok(()), false) => failures.push(format!(
                "{name}: changed the pod map, links, state or working directory ({:?})",
                sb.cwd_files()
            )),
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} of {} cases failed:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }
    println!(
        "{} bad-input cases: each a spec error with its code, a non-zero exit, and no change",
        cases.len()
    );
    expect_ok(&call(&sb, "DEL", "good", &good, &conf)?, "DEL good")?;
    ensure!(sb.pods()?.is_empty() && sb.state_files().is_empty());
    Ok(())
}
