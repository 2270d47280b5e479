//! `sidestep-cni` as a runtime runs it: found by `type` in CNI_PATH, CNI_* environment, the
//! network configuration (with prevResult and runtimeConfig) on stdin, a result or a spec error on
//! stdout. Against real pinned programs in a private cgroup and pin root. Needs root.

// A test target's modules resolve beside it, not in a directory of its name.
#[path = "cni_plugin/budget.rs"]
mod budget;
#[path = "cni_plugin/corpus.rs"]
mod corpus;
#[path = "cni_plugin/hostile.rs"]
mod hostile;
#[path = "cni_plugin/sandbox.rs"]
mod sandbox;

use std::{fs, os::unix::fs::PermissionsExt, process::Command};

use anyhow::{Context as _, Result, ensure};
use serde_json::{Value, json};
use sidestep_tests::{netns, skip_unless_root};

use sandbox::{Sandbox, bin_dir, call, cmd_env, cni, expect_err, expect_ok, run};

#[test]
fn lifecycle_add_check_del_gc_status_version() {
    if skip_unless_root("lifecycle_add_check_del_gc_status_version") {
        return;
    }
    lifecycle().unwrap();
}

fn lifecycle() -> Result<()> {
    // The plugin runs on the node, whatever its C library: xtask builds it static, as it ships.
    if std::env::var_os("SIDESTEP_CNI_BIN").is_some() {
        let bin = sidestep_tests::sidestep::cni_bin();
        let interp = sidestep_tests::sidestep::elf_interpreter(&bin)?;
        ensure!(
            interp.is_none(),
            "{} is dynamically linked (interpreter {interp:?})",
            bin.display()
        );
    }
    let mut sb = Sandbox::new("life")?;
    let a = sb.add_netns("a")?;
    let conf = sb.conf("1.1.0");

    let v = cni(
        &sb,
        &[("CNI_COMMAND", "VERSION")],
        br#"{"cniVersion":"0.4.0"}"#,
    )?;
    expect_ok(&v, "VERSION")?;
    ensure!(v.json["cniVersion"] == "0.4.0");
    ensure!(v.json["supportedVersions"] == json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]));

    // Not loaded yet: STATUS says unavailable, ADD says try again later and names pin_root.
    let status_env = [("CNI_COMMAND", "STATUS")];
    expect_err(
        &cni(&sb, &status_env, &serde_json::to_vec(&conf)?)?,
        50,
        "STATUS",
    )?;
    let o = call(&sb, "ADD", "c1", &a, &conf)?;
    expect_err(&o, 11, "ADD before load")?;
    ensure!(
        o.json["msg"]
            .as_str()
            .unwrap()
            .contains(&*sb.pin_root.to_string_lossy())
    );
    ensure!(sb.state_files().is_empty());

    sb.load()?;
    let o = cni(&sb, &status_env, &serde_json::to_vec(&conf)?)?;
    expect_ok(&o, "STATUS")?;
    ensure!(o.json.is_null(), "STATUS prints nothing: {}", o.json);

    let cookie = netns::cookie(&a)?;
    for round in 0..2 {
        let o = call(&sb, "ADD", "c1", &a, &conf)?;
        expect_ok(&o, "ADD")?;
        ensure!(
            o.json == conf["prevResult"],
            "ADD output {} != prevResult",
            o.json
        );
        ensure!(
            sb.pods()? == [cookie],
            "round {round}: pods {:?}",
            sb.pods()?
        );
        // The default hook: the netns's sk_lookup link, no tc link.
        ensure!(
            sb.pod_links() == [format!("sklookup/{cookie}")],
            "links {:?}",
            sb.pod_links()
        );
        // The record, and its entry in the netns-cookie index.
        let files: Vec<String> = sb.state_files().into_keys().collect();
        ensure!(
            files
                == [
                    "c1@eth0.json".to_owned(),
                    format!("cookies/{cookie}/c1@eth0")
                ],
            "{files:?}"
        );
    }
    let rec_path = sb.state_dir().join("c1@eth0.json");
    ensure!(fs::metadata(&rec_path)?.permissions().mode() & 0o777 == 0o600);
    ensure!(fs::metadata(sb.state_dir())?.permissions().mode() & 0o777 == 0o700);
    let rec: Value = serde_json::from_slice(&fs::read(&rec_path)?)?;
    ensure!(
        rec["netnsCookie"] == cookie && rec["podNamespace"] == "shop",
        "{rec}"
    );
    ensure!(rec["policy"]["podIPs"] == json!(["10.254.0.9"]), "{rec}");

    expect_ok(&call(&sb, "CHECK", "c1", &a, &conf)?, "CHECK")?;
    // Break the attachment behind the plugin's back: CHECK must notice, ADD repairs it.
    run(Command::new(bin_dir().join("sidestep"))
        .args(["unenroll", "--netns"])
        .arg(&a)
        .arg("--pin-root")
        .arg(&sb.pin_root))?;
    let o = call(&sb, "CHECK", "c1", &a, &conf)?;
    expect_err(&o, 104, "CHECK after unenroll")?;
    expect_ok(&call(&sb, "ADD", "c1", &a, &conf)?, "ADD repair")?;
    expect_ok(&call(&sb, "CHECK", "c1", &a, &conf)?, "CHECK repaired")?;

    for _ in 0..2 {
        let o = call(&sb, "DEL", "c1", &a, &conf)?;
        expect_ok(&o, "DEL")?;
        ensure!(o.json.is_null());
        ensure!(sb.pods()?.is_empty() && sb.pod_links().is_empty() && sb.state_files().is_empty());
    }

    // DEL after the netns is gone uses the record's cookie.
    expect_ok(&call(&sb, "ADD", "c1", &a, &conf)?, "ADD")?;
    sb.del_netns(&a)?;
    expect_ok(&call(&sb, "DEL", "c1", &a, &conf)?, "DEL without netns")?;
    ensure!(sb.pods()?.is_empty() && sb.pod_links().is_empty() && sb.state_files().is_empty());

    // GC keeps what the runtime lists and removes the rest.
    let b = sb.add_netns("b")?;
    let c = sb.add_netns("c")?;
    expect_ok(&call(&sb, "ADD", "keep", &b, &conf)?, "ADD keep")?;
    // Its own address: a live pod's address is never taken over.
    let mut other_ip = conf.clone();
    other_ip["prevResult"]["ips"][0]["address"] = json!("10.254.0.10/24");
    let o = call(&sb, "ADD", "stale", &c, &conf)?;
    expect_err(&o, 11, "ADD with the address of a live pod")?;
    ensure!(
        o.json["msg"]
            .as_str()
            .is_some_and(|m| m.contains("10.254.0.9")),
        "the refusal names the address: {}",
        o.json
    );
    ensure!(
        sb.pods()? == [netns::cookie(&b)?],
        "a refused ADD enrolled: {:?}",
        sb.pods()?
    );
    expect_ok(&call(&sb, "ADD", "stale", &c, &other_ip)?, "ADD stale")?;
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "keep", "ifname": "eth0"}]);
    gc.as_object_mut().unwrap().remove("prevResult");
    expect_ok(
        &cni(&sb, &[("CNI_COMMAND", "GC")], &serde_json::to_vec(&gc)?)?,
        "GC",
    )?;
    ensure!(
        sb.pods()? == [netns::cookie(&b)?],
        "after GC: {:?}",
        sb.pods()?
    );
    let keep = format!("cookies/{}/keep@eth0", netns::cookie(&b)?);
    ensure!(
        sb.state_files()
            .keys()
            .eq([keep.as_str(), "keep@eth0.json"]),
        "{:?}",
        sb.state_files().keys()
    );
    // The pods below use the same address one at a time; keep's comes back further down.
    expect_ok(&call(&sb, "DEL", "keep", &b, &conf)?, "DEL keep")?;

    // inbound_hook tc: a TCX link on eth0 beside the netns's sk_lookup link, and CHECK
    // verifies both.
    let d = sb.add_netns("d")?;
    let mut tc = conf.clone();
    tc["inbound_hook"] = json!("tc");
    let d_cookie = netns::cookie(&d)?;
    let before = sb.pod_links();
    expect_ok(&call(&sb, "ADD", "tc", &d, &tc)?, "ADD tc")?;
    ensure!(sb.pods()?.contains(&d_cookie));
    let mut want = before.clone();
    want.extend([
        format!("sklookup/{d_cookie}"),
        format!("tc/{d_cookie}/eth0"),
    ]);
    want.sort();
    ensure!(sb.pod_links() == want, "links {:?}", sb.pod_links());
    let rec: Value = serde_json::from_slice(&fs::read(sb.state_dir().join("tc@eth0.json"))?)?;
    ensure!(rec["policy"]["inboundHook"] == "tc", "{rec}");
    expect_ok(&call(&sb, "CHECK", "tc", &d, &tc)?, "CHECK tc")?;
    let tc_pin = sb
        .pin_root
        .join("links/tc")
        .join(d_cookie.to_string())
        .join("eth0");
    fs::remove_file(&tc_pin)?;
    let o = call(&sb, "CHECK", "tc", &d, &tc)?;
    expect_err(&o, 104, "CHECK without the tc link")?;
    ensure!(
        o.json["msg"].as_str().unwrap_or("").contains("tc program"),
        "{}",
        o.json
    );
    // And without the sk_lookup link (the default hook's only link).
    expect_ok(&call(&sb, "ADD", "tc", &d, &tc)?, "ADD tc repair")?;
    let skl_pin = sb
        .pin_root
        .join("links/sklookup")
        .join(d_cookie.to_string());
    fs::remove_file(&skl_pin)?;
    let o = call(&sb, "CHECK", "tc", &d, &tc)?;
    expect_err(&o, 104, "CHECK without the sk_lookup link")?;
    ensure!(
        o.json["msg"].as_str().unwrap_or("").contains("sk_lookup"),
        "{}",
        o.json
    );
    expect_ok(&call(&sb, "DEL", "tc", &d, &tc)?, "DEL tc")?;
    ensure!(!sb.pods()?.contains(&d_cookie) && sb.pod_links() == before);

    // An ADD into a netns whose inbound port already listens (a running pod: `podman network
    // connect`): the sk_lookup hook would never learn that listener, so the plugin takes tc.
    let r = sb.add_netns("r")?;
    let r_cookie = netns::cookie(&r)?;
    let listener = listen_in(&r, 15006)?;
    expect_ok(
        &call(&sb, "ADD", "running", &r, &conf)?,
        "ADD into a running pod",
    )?;
    let rec: Value = serde_json::from_slice(&fs::read(sb.state_dir().join("running@eth0.json"))?)?;
    ensure!(rec["policy"]["inboundHook"] == "tc", "{rec}");
    ensure!(
        sb.pod_links().contains(&format!("tc/{r_cookie}/eth0")),
        "links {:?}",
        sb.pod_links()
    );
    expect_ok(&call(&sb, "CHECK", "running", &r, &conf)?, "CHECK running")?;
    expect_ok(&call(&sb, "DEL", "running", &r, &conf)?, "DEL running")?;
    drop(listener);

    // A re-routed virtual interface through the plugin: its two links, which CHECK verifies;
    // without the interface, ADD fails naming it and changes nothing.
    let v = sb.add_netns("v")?;
    let vname = v.file_name().unwrap().to_string_lossy().into_owned();
    for args in [
        vec!["link", "add", "vm0", "type", "veth", "peer", "name", "vm0p"],
        vec!["addr", "add", "192.0.2.1/24", "dev", "vm0"],
        vec!["link", "set", "vm0", "up"],
    ] {
        run(Command::new("ip").args(["-n", vname.as_str()]).args(args))?;
    }
    let mut rr = conf.clone();
    rr["runtimeConfig"]["io.kubernetes.cri.pod-annotations"]["istio.io/reroute-virtual-interfaces"] =
        json!("vm0");
    let v_cookie = netns::cookie(&v)?;
    expect_ok(&call(&sb, "ADD", "rr", &v, &rr)?, "ADD re-route")?;
    let rr_dir = sb.pin_root.join("links/tc").join(v_cookie.to_string());
    let egress = rr_dir.join("vm0:reroute-egress");
    ensure!(
        rr_dir.join("vm0:reroute-ingress").exists() && egress.exists(),
        "re-route links missing"
    );
    expect_ok(&call(&sb, "CHECK", "rr", &v, &rr)?, "CHECK re-route")?;
    let status: Value = serde_json::from_str(&run(Command::new(bin_dir().join("sidestep"))
        .args(["status", "--json", "--pin-root"])
        .arg(&sb.pin_root))?)?;
    ensure!(
        status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["netns_cookie"] == v_cookie && p["rerouted"] == json!(["vm0"])),
        "status does not show vm0 re-routed: {status}"
    );
    fs::remove_file(&egress)?;
    let o = call(&sb, "CHECK", "rr", &v, &rr)?;
    expect_err(&o, 104, "CHECK without a re-route link")?;
    ensure!(
        o.json["msg"]
            .as_str()
            .unwrap_or("")
            .contains("vm0:reroute-egress"),
        "{}",
        o.json
    );
    expect_ok(&call(&sb, "DEL", "rr", &v, &rr)?, "DEL re-route")?;
    ensure!(!sb.pods()?.contains(&v_cookie) && !rr_dir.exists());
    let before = (sb.pods()?, sb.pod_links(), sb.state_files());
    let mut missing = rr.clone();
    missing["runtimeConfig"]["io.kubernetes.cri.pod-annotations"]["istio.io/reroute-virtual-interfaces"] =
        json!("vm1");
    let o = call(&sb, "ADD", "rr", &v, &missing)?;
    ensure!(
        !o.ok && o.json["msg"].as_str().unwrap_or("").contains("vm1"),
        "ADD with a missing re-routed interface: {}",
        o.json
    );
    ensure!((sb.pods()?, sb.pod_links(), sb.state_files()) == before);

    // No annotations from the runtime: the pod is read from the (stand-in) Kubernetes API.
    let pod = json!({
        "metadata": {"name": "web", "namespace": "shop",
                     "annotations": {"sidecar.istio.io/status": sandbox::STATUS}},
        "spec": {"containers": [{"name": "web"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"],
                 "securityContext": {"runAsUser": 1500, "runAsGroup": 1501}}]},
        "status": {"podIP": "10.254.0.9"}
    });
    let mut api = conf.clone();
    api.as_object_mut().unwrap().remove("runtimeConfig");
    api["kubernetes"] = json!({"kubeconfig": sb.api_server(Some(pod))?,
                               "pod_read_retries": 3, "pod_read_interval_ms": 20});
    expect_ok(&call(&sb, "ADD", "api", &c, &api)?, "ADD via the API")?;
    let rec: Value = serde_json::from_slice(&fs::read(sb.state_dir().join("api@eth0.json"))?)?;
    ensure!(
        rec["policy"]["proxyUid"] == 1500 && rec["policy"]["proxyGid"] == 1501,
        "{rec}"
    );
    expect_ok(&call(&sb, "CHECK", "api", &c, &api)?, "CHECK via the API")?;
    expect_ok(&call(&sb, "DEL", "api", &c, &api)?, "DEL via the API")?;
    // The API is down: the ADD fails after its bounded retries and changes nothing.
    api["kubernetes"]["kubeconfig"] = json!(sb.api_server(None)?);
    let before = (sb.pods()?, sb.state_files());
    let o = call(&sb, "ADD", "api", &c, &api)?;
    expect_err(&o, 102, "ADD with the API down")?;
    ensure!(
        o.json["msg"].as_str().unwrap().contains("after 3 tries"),
        "{}",
        o.json
    );
    ensure!((sb.pods()?, sb.state_files()) == before);

    // Older versions: prevResult printed back in that version; CHECK refused before 0.4.0.
    let old = sb.conf("0.3.1");
    let o = call(&sb, "ADD", "keep", &b, &old)?;
    expect_ok(&o, "ADD 0.3.1")?;
    ensure!(o.json == old["prevResult"], "{}", o.json);
    let v040 = sb.conf("0.4.0");
    let o = call(&sb, "ADD", "keep", &b, &v040)?;
    expect_ok(&o, "ADD 0.4.0")?;
    ensure!(o.json == v040["prevResult"]);
    expect_ok(&call(&sb, "CHECK", "keep", &b, &v040)?, "CHECK 0.4.0")?;

    // After an uninstall, pods can still be deleted.
    sb.unload()?;
    expect_ok(&call(&sb, "DEL", "keep", &b, &conf)?, "DEL after unload")?;
    ensure!(sb.state_files().is_empty());

    // FAIL_OPEN with nothing loaded: the pod starts, a marker is left for the agent.
    let mut open = conf.clone();
    open["fail_strategy"] = json!("FAIL_OPEN");
    let o = call(&sb, "ADD", "c9", &b, &open)?;
    expect_ok(&o, "ADD FAIL_OPEN")?;
    ensure!(o.json == conf["prevResult"]);
    ensure!(
        o.stderr.contains("WITHOUT traffic capture") && o.stderr.contains("shop/web"),
        "{}",
        o.stderr
    );
    ensure!(sb.state_files().keys().eq(["failopen/c9@eth0.json"]));
    expect_ok(&call(&sb, "DEL", "c9", &b, &open)?, "DEL FAIL_OPEN")?;
    ensure!(sb.state_files().is_empty());
    Ok(())
}

/// An attachment whose interface holds more addresses than one pod registers (its netns
/// flooded before a re-ADD): the record names only the addresses the ADD registered, so CHECK
/// passes and the record stays small.
#[test]
fn a_flooded_attachment_records_what_it_registered() {
    if skip_unless_root("a_flooded_attachment_records_what_it_registered") {
        return;
    }
    flooded_attachment().unwrap();
}

fn flooded_attachment() -> Result<()> {
    let mut sb = Sandbox::new("flood")?;
    let a = sb.add_netns("a")?;
    let conf = sb.conf("1.1.0");
    sb.load()?;
    let name = a.file_name().unwrap().to_string_lossy().into_owned();
    let batch = sb.state_dir().with_file_name("flood.batch");
    let lines: String = (0..100)
        .map(|i| format!("addr add 10.251.0.{i}/32 dev eth0\n"))
        .collect();
    fs::write(&batch, lines)?;
    run(Command::new("ip").args(["-n", &name, "-batch"]).arg(&batch))?;
    expect_ok(&call(&sb, "ADD", "c1", &a, &conf)?, "ADD")?;
    let rec: Value = serde_json::from_slice(&fs::read(sb.state_dir().join("c1@eth0.json"))?)?;
    let recorded = rec["netnsKeys"]["interfaceAddresses"]
        .as_array()
        .map_or(0, Vec::len);
    // userspace/src/limits.rs, MAX_POD_ADDRESSES.
    ensure!(
        (1..=64).contains(&recorded),
        "{recorded} interface addresses recorded"
    );
    expect_ok(&call(&sb, "CHECK", "c1", &a, &conf)?, "CHECK")?;
    expect_ok(&call(&sb, "DEL", "c1", &a, &conf)?, "DEL")?;
    ensure!(sb.pods()?.is_empty(), "after DEL: {:?}", sb.pods()?);
    Ok(())
}

/// Root in a pod floods a second attachment's interface (`net1`) between the attachment's
/// primary plugin and sidestep-cni: more addresses than one pod registers. The second ADD must
/// keep the first attachment's pod IP registered (it names the pod for tc ingress and for the
/// hairpin decision) rather than fill the pod's share with the flood.
#[test]
fn a_flooded_second_attachment_keeps_the_first_ones_pod_ip() {
    if skip_unless_root("a_flooded_second_attachment_keeps_the_first_ones_pod_ip") {
        return;
    }
    flooded_second_attachment().unwrap();
}

fn flooded_second_attachment() -> Result<()> {
    let mut sb = Sandbox::new("flood2")?;
    // Not "a": the host end of the veth is named after it, and tests run at once.
    let a = sb.add_netns("f2")?;
    sb.load()?;
    let name = a.file_name().unwrap().to_string_lossy().into_owned();
    let eth0_ip: std::net::Ipv4Addr = "10.254.0.9".parse()?;
    run(Command::new("ip").args(["-n", &name, "addr", "add", "10.254.0.9/24", "dev", "eth0"]))?;
    let eth0_conf = sb.conf("1.1.0");
    expect_ok(&call(&sb, "ADD", "c1", &a, &eth0_conf)?, "ADD eth0")?;

    // A veth pair inside the netns: this kernel has no dummy links.
    run(Command::new("ip").args([
        "-n", &name, "link", "add", "net1", "type", "veth", "peer", "name", "net1p",
    ]))?;
    run(Command::new("ip").args(["-n", &name, "link", "set", "net1", "up"]))?;
    let batch = sb.state_dir().with_file_name("flood2.batch");
    let mut lines = String::from("addr add 10.253.0.9/24 dev net1\n");
    for i in 0..100 {
        lines += &format!("addr add 10.251.0.{i}/32 dev net1\n");
    }
    fs::write(&batch, lines)?;
    run(Command::new("ip").args(["-n", &name, "-batch"]).arg(&batch))?;
    let mut net1_conf = eth0_conf.clone();
    net1_conf["prevResult"]["interfaces"] = json!([{"name": "net1", "sandbox": "/run/netns/x"}]);
    net1_conf["prevResult"]["ips"] = json!([{"address": "10.253.0.9/24", "interface": 0}]);
    let ns = a.to_string_lossy();
    let mut env = cmd_env("ADD", "c1", &ns);
    for (k, v) in &mut env {
        if *k == "CNI_IFNAME" {
            *v = "net1";
        }
    }
    let added = cni(&sb, &env, &serde_json::to_vec(&net1_conf)?)?;
    expect_ok(&added, "ADD net1")?;

    let cookie = *sb.pods()?.first().context("the pod is not enrolled")?;
    let held: Vec<Value> = sidestep_tests::faults::bpftool(&[
        "map",
        "dump",
        "pinned",
        &sb.pin_root
            .join("maps/SIDESTEP_ADDRS")
            .display()
            .to_string(),
    ])?
    .as_array()
    .cloned()
    .unwrap_or_default()
    .into_iter()
    .filter(|e| e["formatted"]["value"] == cookie)
    .collect();
    // The key is the address's four words as the programs read them: v4-mapped, network order.
    let word = u64::from(u32::from_ne_bytes(eth0_ip.octets()));
    ensure!(
        held.iter().any(|e| e["formatted"]["key"][3] == word),
        "eth0's pod IP {eth0_ip} is no longer registered after net1's ADD ({} addresses held)",
        held.len()
    );
    // userspace/src/limits.rs, MAX_POD_ADDRESSES (plus net1's own pod IP).
    ensure!(held.len() <= 65, "{} addresses held", held.len());

    let mut del = env.clone();
    del[0].1 = "DEL";
    expect_ok(
        &cni(&sb, &del, &serde_json::to_vec(&net1_conf)?)?,
        "DEL net1",
    )?;
    expect_ok(&call(&sb, "DEL", "c1", &a, &eth0_conf)?, "DEL eth0")?;
    ensure!(sb.pods()?.is_empty(), "after both DELs: {:?}", sb.pods()?);
    Ok(())
}

#[test]
fn bad_input_corpus_changes_nothing() {
    if skip_unless_root("bad_input_corpus_changes_nothing") {
        return;
    }
    corpus::corpus().unwrap();
}

/// A TCP listener on `port` inside the netns at `path`, made on a thread that enters it (the
/// socket stays in that netns).
fn listen_in(path: &std::path::Path, port: u16) -> Result<std::net::TcpListener> {
    let ns = fs::File::open(path)?;
    std::thread::spawn(move || -> Result<std::net::TcpListener> {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
        Ok(std::net::TcpListener::bind(("0.0.0.0", port))?)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("listener thread panicked"))?
}

/// Run by hand, with no command or with `--help`, the plugin says what it is and which CNI
/// versions it speaks (on stderr, as the reference plugins' skel does), and reads no stdin.
#[test]
fn run_by_hand_it_names_itself_and_its_versions() -> Result<()> {
    for args in [&[][..], &["--help"][..]] {
        let out = Command::new(sidestep_tests::sidestep::cni_bin())
            .args(args)
            .env_clear()
            .stdin(std::process::Stdio::null())
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        ensure!(out.stdout.is_empty(), "{args:?}: stdout is the protocol's");
        ensure!(err.starts_with("sidestep-cni "), "{args:?}: {err}");
        ensure!(
            err.contains("CNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"),
            "{args:?}: {err}"
        );
    }
    Ok(())
}
