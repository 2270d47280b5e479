//! A real libcni runtime: podman with its CNI backend creates pods on a conflist of bridge +
//! host-local, portmap, then sidestep-cni. Podman passes only K8S_POD_NAME, so the plugin's
//! `policy` enrols the pod. An HAProxy sidecar container (UID 1337) and an app container share
//! the pod; the app's requests go through the sidecar to an nginx server, and fail with the
//! sidecar stopped. `podman pod rm -f` leaves nothing behind.
//! Needs root; skips when podman is not installed.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{
    Node, NodeOptions, PodOptions, TestEnv, cgroup2_mount, nginx,
    podman::{self, Podman, Sidecar},
    sidestep::Loaded,
    skip_unless_root, url,
};

const APP_UID: u32 = 1000;

fn enrolled(loaded: &Loaded) -> Result<Vec<u64>> {
    Ok(loaded.status()?["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["netns_cookie"].as_u64())
        .collect())
}

/// The state records in `dir`; the invocation log (`timings`) that every call appends to is
/// not one.
fn files_in(dir: &std::path::Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "json"))
                .collect()
        })
        .unwrap_or_default()
}

/// The request failed to connect (curl exit 7): the connect was redirected to the sidecar
/// port where nothing listens. Any other failure (a timeout, a crash) is not capture.
fn refused(res: Result<String>, what: &str) -> Result<()> {
    match res {
        Ok(body) => anyhow::bail!("{what}: the request went through: {body:?}"),
        Err(e) if format!("{e:#}").contains("exit status: 7") => Ok(()),
        Err(e) => Err(e.context(format!("{what}: expected curl exit 7 (could not connect)"))),
    }
}

fn bridge_ports(bridge: &str) -> Result<usize> {
    let out = std::process::Command::new("ip")
        .args(["-o", "link", "show", "master", bridge])
        .output()?;
    ensure!(out.status.success(), "ip link show master {bridge}");
    Ok(String::from_utf8_lossy(&out.stdout).lines().count())
}

#[test]
fn podman_pods_through_sidestep_cni() -> Result<()> {
    if skip_unless_root("podman_pods_through_sidestep_cni") {
        return Ok(());
    }
    if let Some(why) = podman::missing() {
        eprintln!("skipping podman_pods_through_sidestep_cni: {why}");
        return Ok(());
    }
    // What a killed run of this test left (podman pods of its storage), before the env's
    // sweep deletes that storage.
    podman::sweep_stale();
    // Drop order is the reverse: podman pods, then the node (its pods, the bridge), then the
    // programs, then the env.
    let env = TestEnv::new("podman")?;
    let loaded = Loaded::load(&env)?;
    let state_dir = env.tmp_dir().join("cni-state");
    let cni_log = env.tmp_dir().join("sidestep-cni.log");
    let plugins = sidestep_tests::sidestep::cni_plugin_dir(&env)?;
    let node = Node::new(
        &env,
        NodeOptions {
            dual_stack: false,
            chain: vec![
                json!({"type": "portmap", "capabilities": {"portMappings": true}, "snat": false}),
                json!({
                    "type": "sidestep",
                    "pin_root": loaded.pin_root(),
                    "state_dir": state_dir,
                    "log_file": cni_log,
                    "capabilities": {"io.kubernetes.cri.pod-annotations": true},
                    // Podman gives no Kubernetes identity: enrol with Istio's defaults.
                    "policy": {},
                }),
            ],
            plugin_dirs: vec![plugins.clone()],
        },
    )?;
    // The server: a plain pod on the same bridge, through the same chain. It has a Kubernetes
    // identity and no sidecar.istio.io/status, so sidestep-cni skips it.
    let server = node.add_pod_with(
        "server",
        PodOptions {
            runtime_config: Some(json!({"io.kubernetes.cri.pod-annotations": {}})),
            ..Default::default()
        },
    )?;
    let web = nginx::Server::start(&env, &server, 80)?;
    ensure!(
        enrolled(&loaded)?.is_empty(),
        "the plain server pod was enrolled"
    );
    let ports_before = bridge_ports(node.bridge())?;

    let podman = Podman::new(&env, &[plugins])?;
    let network = podman.add_network(&node.conflist())?;
    let cni_log_tail = || std::fs::read_to_string(&cni_log).unwrap_or_default();
    let pod = podman
        .create_pod("shop", &network)
        .with_context(|| format!("sidestep-cni log:\n{}", cni_log_tail()))?;
    ensure!(
        node.subnet_v4().contains(&pod.ipv4),
        "pod IP {} not in {}",
        pod.ipv4,
        node.subnet_v4()
    );

    // Enrolled at CNI ADD, with the pod IP from prevResult.
    let cookie = pod.netns_cookie()?;
    ensure!(
        enrolled(&loaded)? == [cookie],
        "{}\nsidestep-cni log:\n{}",
        loaded.status()?,
        cni_log_tail()
    );
    let records = files_in(&state_dir);
    ensure!(records.len() == 1, "state records: {records:?}");
    let rec: Value = serde_json::from_slice(&std::fs::read(&records[0])?)?;
    ensure!(
        rec["netnsCookie"] == cookie
            && rec["policy"]["podIPs"] == json!([pod.ipv4.to_string()])
            && rec["policy"]["proxyUid"] == 1337,
        "{rec}"
    );
    // The attachment is podman's: CNI_CONTAINERID is the infra container, CNI_NETNS podman's
    // netns, and there is no Kubernetes namespace.
    ensure!(
        rec["containerID"] == pod.infra_id.as_str()
            && rec["netns"] == pod.netns_path.display().to_string()
            && rec["network"] == network.as_str()
            && rec["podNamespace"].is_null(),
        "{rec}"
    );
    // The plugin's default inbound hook: the netns's sk_lookup link, no tc link.
    let lookup = loaded.pin_root().join("links/sklookup");
    ensure!(
        std::fs::read_dir(&lookup)?.count() == 1 && lookup.join(cookie.to_string()).exists(),
        "no sk_lookup link for the pod's netns"
    );
    let tc = loaded.pin_root().join("links/tc");
    ensure!(
        std::fs::read_dir(&tc).map_or(0, |d| d.count()) == 0,
        "a tc link was made"
    );

    // The app container, in the env's cgroup (below --cgroup-parent) and the pod's netns.
    let app = podman.run_detached(&pod, "shop-app", APP_UID, APP_UID, &["sleep", "3600"])?;
    let app_pid = podman.pid(&app)?;
    let cg = std::fs::read_to_string(format!("/proc/{app_pid}/cgroup"))?;
    let cg2 = cg
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("no cgroup2 line")?;
    ensure!(
        cgroup2_mount()?
            .join(cg2.trim_start_matches('/'))
            .starts_with(env.cgroup_path()),
        "app container in cgroup {cg2}, not under {}",
        env.cgroup_path().display()
    );
    ensure!(
        std::fs::read_link(format!("/proc/{app_pid}/ns/net"))?
            == std::fs::read_link(format!("/proc/{}/ns/net", podman.pid(&pod.infra_id)?))?,
        "the app container does not share the pod's netns"
    );

    let target = url(server.ipv4.into(), 80, "/");
    // Captured with no sidecar up: the connect goes to 127.0.0.1:15001, where nothing listens.
    refused(
        podman.http_get(&app, APP_UID, &target),
        "captured, no sidecar",
    )?;
    ensure!(web.access_log().is_empty(), "{}", web.access_log());

    let sidecar = Sidecar::start(&podman, &pod, Default::default())?;
    let proxy_pid = podman.pid(&sidecar.container)?;
    let status = std::fs::read_to_string(format!("/proc/{proxy_pid}/status"))?;
    ensure!(
        status.lines().any(|l| l.starts_with("Uid:\t1337\t")),
        "haproxy is not running as 1337: {status}"
    );
    for _ in 0..3 {
        let body = podman.http_get(&app, APP_UID, &target)?;
        ensure!(body == nginx::body_for("server"), "{body:?}");
    }
    let dst = format!("{}:80", server.ipv4);
    sidecar.wait_log(&podman, &["be=outbound_orig", &dst], Duration::from_secs(5))?;
    let lines = sidecar
        .log(&podman)
        .lines()
        .filter(|l| l.contains("be=outbound_orig") && l.contains(&dst))
        .count();
    ensure!(lines == 3, "{lines} of 3 requests in the sidecar log");
    // nginx saw HAProxy's connections, from the pod's address.
    let access = web.access_log();
    ensure!(
        access.lines().count() == 3
            && access
                .lines()
                .all(|l| l.starts_with(&format!("{}:", pod.ipv4))),
        "{access}"
    );
    let counters = loaded
        .counters(cookie)?
        .context("the pod's counters are gone")?;
    ensure!(
        counters["redirected_outbound"].as_u64() >= Some(3)
            && counters["orig_dst_hits"].as_u64() >= Some(3),
        "{counters}"
    );

    // Capture is real: with HAProxy stopped, the request cannot leave the pod.
    podman.stop(&sidecar.container)?;
    refused(podman.http_get(&app, APP_UID, &target), "sidecar stopped")?;
    ensure!(
        web.access_log().lines().count() == 3,
        "{}",
        web.access_log()
    );

    // `podman pod rm -f` runs CNI DEL through the chain: nothing is left.
    podman.remove_pod(&pod)?;
    ensure!(podman.pod_names()?.is_empty(), "{:?}", podman.pod_names()?);
    ensure!(
        podman.container_ids()?.is_empty(),
        "{:?}",
        podman.container_ids()?
    );
    let status = loaded.status()?;
    ensure!(
        status["pods"].as_array().map(Vec::len) == Some(0),
        "{status}"
    );
    let links = std::fs::read_dir(&lookup).map_or(0, |d| d.count());
    ensure!(links == 0, "{links} sk_lookup links left");
    let records = files_in(&state_dir);
    ensure!(records.is_empty(), "state records left: {records:?}");
    ensure!(
        !pod.netns_path.exists(),
        "netns {} left",
        pod.netns_path.display()
    );
    let cache = podman.cni_cache_files(&pod);
    ensure!(cache.is_empty(), "libcni cache left: {cache:?}");
    let ipam = node.bridge_plugin()["ipam"]["dataDir"]
        .as_str()
        .map(PathBuf::from)
        .context("ipam dataDir")?;
    let reservation = ipam.join(&network).join(pod.ipv4.to_string());
    ensure!(
        !reservation.exists(),
        "host-local still holds {}",
        reservation.display()
    );
    ensure!(
        bridge_ports(node.bridge())? == ports_before,
        "the pod's veth is still on the bridge"
    );
    // The plain server is untouched by all this.
    ensure!(enrolled(&loaded)?.is_empty());
    Ok(())
}
