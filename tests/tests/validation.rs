//! The meshes' validation init containers, which istio-cni and linkerd-cni inject into every pod
//! and which keep the pod in Init when capture is not in place: Istio's `istio-validation` (as the
//! proxy UID it dials 127.0.0.6:15002 and needs that connection at its own 15001/15006 listener
//! with SO_ORIGINAL_DST port 15002; exit 126 otherwise) and Linkerd's `linkerd-network-validator`
//! (as UID 65534 it dials 1.1.1.1:20001 and needs its own 4140 listener to answer; exit 95). The
//! probe binary implements both contracts (tests/src/bin/probe/validate.rs).
//!
//! Each Istio case runs twice: in a pod made through the CNI chain with sidestep, and in a pod
//! with Istio's own iptables rules for the same annotations, the oracle (which also proves the
//! validator implementation passes where Istio's pods pass). Needs root; skips otherwise.

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{
    Node, NodeOptions, Pod, PodOptions, TestEnv,
    istio_iptables::{IstioCapture, Mode},
    parity::Oracle,
    sidestep::{Loaded, cni_chain, cni_plugin_dir},
    skip_unless_root,
};

const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
const PROXY_UID: u32 = 1337;
const LINKERD_VALIDATOR_UID: u32 = 65534;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

/// One pod kind an operator meets, with the validator run in it.
struct Case {
    name: &'static str,
    annotations: Value,
    oracle: IstioCapture,
    v6: bool,
}

fn istio_cases() -> Vec<Case> {
    let v6 = IstioCapture {
        ipv6: true,
        ..IstioCapture::default()
    };
    vec![
        Case {
            name: "default",
            annotations: json!({}),
            oracle: v6.clone(),
            v6: false,
        },
        Case {
            name: "no-inbound",
            annotations: json!({"traffic.sidecar.istio.io/includeInboundPorts": ""}),
            oracle: IstioCapture {
                include_inbound_ports: String::new(),
                ..v6.clone()
            },
            v6: false,
        },
        // The validator tests the family of the pod's first address: [::1] -> [::6]:15002 on an
        // IPv6-primary pod.
        Case {
            name: "ipv6",
            annotations: json!({}),
            oracle: v6.clone(),
            v6: true,
        },
        Case {
            name: "tproxy",
            annotations: json!({"sidecar.istio.io/interceptionMode": "TPROXY"}),
            oracle: IstioCapture {
                mode: Mode::Tproxy,
                ..v6.clone()
            },
            v6: false,
        },
    ]
}

/// Runs the Istio validator in `pod` as the proxy; returns (exit code, stderr).
fn istio_validate(env: &TestEnv, pod: &Pod, v6: bool) -> Result<(i32, String)> {
    let mut argv = vec![probe(), "istio-validate"];
    if v6 {
        argv.push("--v6");
    }
    let out = pod.run(env, PROXY_UID, &argv)?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn istio_validation_passes_where_istios_rules_pass() -> Result<()> {
    if skip_unless_root("istio_validation_passes_where_istios_rules_pass") {
        return Ok(());
    }
    let env = TestEnv::new("validation")?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let meshed_node = Node::new(
        &env,
        NodeOptions {
            dual_stack: true,
            chain: cni_chain(loaded.pin_root(), &state_dir),
            plugin_dirs: vec![cni_plugin_dir(&env)?],
        },
    )?;
    let oracle_node = Node::new(&env, NodeOptions::dual_stack())?;
    let mut failures = Vec::new();
    for case in istio_cases() {
        let mut annotations = case.annotations.clone();
        annotations["sidecar.istio.io/status"] = json!(STATUS);
        let pod = meshed_node.add_pod_with(
            case.name,
            PodOptions {
                runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": annotations})),
                ..Default::default()
            },
        )?;
        let twin = oracle_node.add_pod(&format!("{}-ipt", case.name))?;
        if case.name == "default" {
            // Without any capture the validator must fail, with the code repair looks for.
            let (code, _) = istio_validate(&env, &twin, false)?;
            ensure!(
                code == 126,
                "an uncaptured pod passed istio-validation: {code}"
            );
        }
        let mut oracle = Oracle::new(&twin);
        oracle.apply(&case.oracle)?;
        let (istio_code, istio_err) = istio_validate(&env, &twin, case.v6)?;
        ensure!(
            istio_code == 0,
            "{}: the validator fails under Istio's own rules (exit {istio_code}): {istio_err}",
            case.name
        );
        let (code, err) = istio_validate(&env, &pod, case.v6)?;
        if code != 0 {
            failures.push(format!("{}: exit {code}: {err}", case.name));
        }
        oracle.clear()?;
    }
    ensure!(
        failures.is_empty(),
        "istio-validation fails under sidestep where it passes under Istio's rules:\n{}",
        failures.join("\n")
    );
    Ok(())
}

#[test]
fn linkerd_network_validator_passes() -> Result<()> {
    if skip_unless_root("linkerd_network_validator_passes") {
        return Ok(());
    }
    let env = TestEnv::new("validation-l5d")?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let mut chain = cni_chain(loaded.pin_root(), &state_dir);
    chain[1]["mesh"] = json!("linkerd");
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack: true,
            chain,
            plugin_dirs: vec![cni_plugin_dir(&env)?],
        },
    )?;
    let pod = node.add_pod_with(
        "meshed",
        PodOptions {
            runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": {
                "linkerd.io/proxy-version": "edge-26.8.1",
            }})),
            ..Default::default()
        },
    )?;
    let out = pod.run(
        &env,
        LINKERD_VALIDATOR_UID,
        &[probe(), "linkerd-validate", "0.0.0.0:4140", "1.1.1.1:20001"],
    )?;
    ensure!(
        out.status.code() == Some(0),
        "linkerd-network-validator: exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    // The contract cuts both ways: in a pod that is not captured the same validator fails with
    // its own exit code.
    let plain = node.add_pod_with(
        "plain",
        PodOptions {
            runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": {}})),
            ..Default::default()
        },
    )?;
    let out = plain.run(
        &env,
        LINKERD_VALIDATOR_UID,
        &[
            probe(),
            "linkerd-validate",
            "0.0.0.0:4140",
            "1.1.1.1:20001",
            "--timeout-ms",
            "2000",
        ],
    )?;
    ensure!(
        out.status.code() == Some(95),
        "an uncaptured pod passed the validator: {:?}",
        out.status.code()
    );
    Ok(())
}
