//! Re-routed virtual interfaces (`istio.io/reroute-virtual-interfaces`, formerly
//! `traffic.sidecar.istio.io/kubevirtInterfaces`): TCP arriving on such an interface goes to the
//! proxy's outbound listener, whatever its destination, as istio-iptables'
//! `-i <nic> [-d <include cidr>] -j ISTIO_REDIRECT` does.
//!
//! Topology: a subject pod made by the CNI chain gets an extra veth `vm0` (192.168.77.1/24,
//! fd77::1/64) whose far end sits in a third netns playing the VM (192.168.77.2, fd77::2, default
//! routes via the pod). A second pod is the remote server.
//!
//! - `reroute_matches_istios_ruleset`: a differential table, every scenario under Istio's real
//!   ruleset (the oracle) and under sidestep, printed with both columns and asserted equal (or
//!   under rule G, or at the exact outcome of a marked intended difference). Besides plain
//!   connects it has IPv6 connections with extension headers, fragmented SYNs and SYNs behind
//!   two VLAN 0 tags (which the kernel strips around tc); the pod
//!   forwards there, so a packet sidestep let through uncaptured would reach the server.
//! - `vm_reaches_remote_nginx_through_the_proxy`: an unmodified HAProxy (IPv4) and an Envoy-like
//!   forwarding proxy (IPv4 and IPv6) as UID 1337 end to end, also after an upgrade (load
//!   again); outside the include ranges the VM reaches the server directly; with no listener the
//!   connection is refused (never bypasses); unenrolment leaves no links or map entries; a listed
//!   interface that does not exist fails the enrolment and leaves nothing.
//! - `interfaces_sharing_ifindex_and_mac_are_refused`: the data path finds a re-routed interface
//!   by (ifindex, MAC); a second pod with the same pair fails its enrolment, the first keeps it.
//!
//! Needs root; skips otherwise.

// A test target's modules resolve beside it, not in a directory of its name.
#[path = "reroute/table.rs"]
mod table;
#[path = "reroute/vm.rs"]
mod vm;

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, Spawn, TestEnv, haproxy, netns, nginx,
    parity::{Listeners, Names, Oracle, render_table},
    sidestep::Loaded,
    skip_unless_root, wait_for_tcp,
};

use table::{
    Case, Craft, Intended, Seen, Verdict, crafted, istio_capture, judge, mark, observe,
    observe_crafted, reroute_policy, sidestep_args,
};
use vm::{Vm, ok_200};

const IFACE: &str = "vm0";
const GW4: &str = "192.168.77.1";
const GW6: &str = "fd77::1";
const APP_UID: u32 = 1000;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

fn run(argv: &[&str]) -> Result<String> {
    let out = Command::new(argv[0]).args(&argv[1..]).output()?;
    ensure!(
        out.status.success(),
        "`{}` failed: {}",
        argv.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn reroute_matches_istios_ruleset() -> Result<()> {
    if skip_unless_root("reroute_matches_istios_ruleset") {
        return Ok(());
    }
    let env = TestEnv::new("reroute-parity")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let subject = node.add_pod("subject")?;
    let server = node.add_pod("server")?;
    let vm = Vm::attach(&subject, "t")?;
    let (s4, s6) = (subject.ipv4, subject.ipv6.context("no IPv6")?);
    let (p4, p6) = (server.ipv4, server.ipv6.context("no IPv6")?);
    let mut names = Names::default();
    names.add(s4.into(), "S4");
    names.add(s6.into(), "S6");
    names.add(p4.into(), "P4");
    names.add(p6.into(), "P6");
    names.add(GW4.parse()?, "G4");
    names.add(GW6.parse()?, "G6");
    // The pod routes what it does not capture, and the server can answer it: a packet let
    // through uncaptured reaches the server and shows up in its counters.
    netns::set_sysctl(&subject.netns_path, "net.ipv4.ip_forward", "1")?;
    netns::set_sysctl(&subject.netns_path, "net.ipv6.conf.all.forwarding", "1")?;
    server.ip(&["route", "add", "192.168.77.0/24", "via", &s4.to_string()])?;
    server.ip(&["-6", "route", "add", "fd77::/64", "via", &s6.to_string()])?;

    let mut listeners = Listeners::default();
    let any4: IpAddr = "0.0.0.0".parse()?;
    let any6: IpAddr = "::".parse()?;
    listeners.start(
        &env,
        probe(),
        Some(&subject),
        1337,
        1337,
        &[SocketAddr::new(any4, 15001), SocketAddr::new(any6, 15001)],
        |_| "15001".into(),
    )?;
    listeners.start(
        &env,
        probe(),
        Some(&subject),
        APP_UID,
        APP_UID,
        &[SocketAddr::new(any4, 8080), SocketAddr::new(any6, 8080)],
        |p| format!("S:{p}"),
    )?;

    let sa = |ip: IpAddr, port| SocketAddr::new(ip, port);
    let default_targets = vec![
        sa(p4.into(), 80),
        sa(p6.into(), 80),
        sa(s4.into(), 8080),
        sa(s6.into(), 8080),
    ];
    let cases = vec![
        Case {
            name: "defaults",
            include: "*".into(),
            exclude: String::new(),
            exclude_ports: "15020".into(),
            targets: default_targets.clone(),
            // ip6tables' `-p tcp` skips Hop-by-Hop and Destination Options headers, and
            // conntrack reassembles fragments before nat: Istio captures all four.
            crafted: vec![
                crafted(Craft::HopOpts, sa(p6.into(), 80)),
                crafted(Craft::DstOpts, sa(p6.into(), 80)),
                mark(
                    crafted(Craft::FragSyn, sa(p4.into(), 80)),
                    Intended::FragmentsDropped,
                ),
                mark(
                    crafted(Craft::FragSyn, sa(p6.into(), 80)),
                    Intended::FragmentsDropped,
                ),
                // netfilter sees the IP packet the stack gets, untagged: Istio captures these.
                crafted(Craft::VlanSyn(2), sa(p4.into(), 80)),
                crafted(Craft::VlanSyn(2), sa(p6.into(), 80)),
                crafted(Craft::VlanSyn(4), sa(p4.into(), 80)),
                crafted(Craft::QinQSyn, sa(p4.into(), 80)),
                mark(
                    crafted(Craft::VlanSyn(6), sa(p4.into(), 80)),
                    Intended::DeepTagsDropped,
                ),
            ],
        },
        Case {
            // PREROUTING's re-route rules come before, and apart from, ISTIO_OUTPUT's exclusions.
            name: "exclude P, port 80",
            include: "*".into(),
            exclude: format!("{p4}/32,{p6}/128"),
            exclude_ports: "80,8080".into(),
            targets: default_targets.clone(),
            crafted: Vec::new(),
        },
        Case {
            name: "include P4 only",
            include: format!("{p4}/32"),
            exclude: String::new(),
            exclude_ports: "15020".into(),
            targets: vec![sa(p4.into(), 80), sa(s4.into(), 8080), sa(s6.into(), 8080)],
            // Outside the include ranges Istio forwards fragments too: sidestep drops only
            // what would be captured.
            crafted: vec![
                crafted(Craft::FragSyn, sa(p6.into(), 80)),
                crafted(Craft::VlanSyn(2), sa(p6.into(), 80)),
            ],
        },
        Case {
            name: "include nothing",
            include: String::new(),
            exclude: String::new(),
            exclude_ports: "15020".into(),
            targets: vec![sa(s4.into(), 8080), sa(s6.into(), 8080)],
            crafted: vec![crafted(Craft::FragSyn, sa(p4.into(), 80))],
        },
    ];

    let policy_file = reroute_policy(&env, &[IFACE])?;
    let loaded = Loaded::load(&env)?;
    // Every row of every case, in the table's order, once per side.
    let run_case = |c: &Case, listeners: &mut Listeners, side: &str| -> Result<Vec<Seen>> {
        let mut seen = Vec::new();
        for t in &c.targets {
            let o = observe(&vm, &names, listeners, *t)
                .with_context(|| format!("{side}, {}: {t}", c.name))?;
            seen.push(Seen::Conn(o));
        }
        for k in &c.crafted {
            seen.push(
                observe_crafted(&vm, &names, listeners, &server, k)
                    .with_context(|| format!("{side}, {}: {}", c.name, k.label(&names)))?,
            );
        }
        Ok(seen)
    };
    let mut ours = Vec::new();
    for c in &cases {
        let args = sidestep_args(c, &policy_file);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        loaded.enroll(&subject, &args)?;
        ours.extend(run_case(c, &mut listeners, "sidestep")?);
        loaded.unenroll(&subject)?;
    }

    let mut oracle = Oracle::new(&subject);
    let mut istio = Vec::new();
    for c in &cases {
        oracle.apply(&istio_capture(c))?;
        istio.extend(run_case(c, &mut listeners, "istio")?);
    }
    oracle.clear()?;

    let mut rows = Vec::new();
    let mut counts = [0usize; 4];
    let mut i = 0;
    for c in &cases {
        let labels = c
            .targets
            .iter()
            .map(|t| (names.addr(*t), None))
            .chain(c.crafted.iter().map(|k| (k.label(&names), k.intended)));
        for (label, intended) in labels {
            let verdict = judge(&istio[i], &ours[i], intended);
            counts[match verdict {
                Verdict::Same => 0,
                Verdict::SameUnderG => 1,
                Verdict::Intended(_) => 2,
                Verdict::Mismatch(_) => 3,
            }] += 1;
            rows.push(vec![
                c.name.to_string(),
                label,
                istio[i].to_string(),
                ours[i].to_string(),
                verdict.to_string(),
            ]);
            i += 1;
        }
    }
    println!(
        "{}",
        render_table(
            &["policy", "VM connects to", "istio-iptables", "sidestep", ""],
            &rows
        )
    );
    println!(
        "{} rows: {} identical, {} identical under rule G, {} intended differences, {} mismatches",
        rows.len(),
        counts[0],
        counts[1],
        counts[2],
        counts[3]
    );
    // The anchor: a captured IPv4 connection looks as REDIRECT makes it look.
    let Seen::Conn(anchor) = &istio[0] else {
        bail!("the first row is not a connection");
    };
    ensure!(
        anchor.accepted == "15001"
            && anchor.local == "G4:15001"
            && anchor.orig_v4 == "P4:80"
            && anchor.app_peer == "P4:80",
        "Istio's ruleset gave {anchor}; the oracle is not what this test assumes"
    );
    println!(
        "G = equal once sidestep's SO_ORIGINAL_DST answer is applied: ENOENT for a connection it \
         did not redirect, where Istio's rules (conntrack on, no NAT) give the socket's own address"
    );
    ensure!(
        counts[3] == 0,
        "sidestep differs from Istio's ruleset (table above)"
    );
    Ok(())
}

/// Entries of a pinned map, by bpftool.
fn map_len(pin_root: &Path, map: &str) -> Result<usize> {
    let path = pin_root.join("maps").join(map);
    let out = run(&[
        "bpftool",
        "-j",
        "map",
        "dump",
        "pinned",
        &path.display().to_string(),
    ])?;
    let v: Value = serde_json::from_str(&out)?;
    Ok(v.as_array().map_or(0, Vec::len))
}

#[test]
fn vm_reaches_remote_nginx_through_the_proxy() -> Result<()> {
    if skip_unless_root("vm_reaches_remote_nginx_through_the_proxy") {
        return Ok(());
    }
    let env = TestEnv::new("reroute-e2e")?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let subject = node.add_pod("subject")?;
    let server = node.add_pod("server")?;
    let vm = Vm::attach(&subject, "e")?;
    let _web = nginx::Server::start(&env, &server, 80)?;
    let (s4, s6) = (subject.ipv4, subject.ipv6.context("no IPv6")?);
    let (p4, p6) = (server.ipv4, server.ipv6.context("no IPv6")?);
    // Without capture the pod routes the VM's traffic, and the server can answer it: a bypass
    // would succeed, so a refused connection below means capture, not a missing route.
    netns::set_sysctl(&subject.netns_path, "net.ipv4.ip_forward", "1")?;
    netns::set_sysctl(&subject.netns_path, "net.ipv6.conf.all.forwarding", "1")?;
    server.ip(&["route", "add", "192.168.77.0/24", "via", &s4.to_string()])?;
    server.ip(&["-6", "route", "add", "fd77::/64", "via", &s6.to_string()])?;

    let loaded = Loaded::load(&env)?;
    let policy_file = reroute_policy(&env, &[IFACE])?;
    let policy_arg = policy_file.display().to_string();
    loaded.enroll(&subject, &["--policy", &policy_arg])?;
    let cookie = subject.netns_cookie()?;
    let links = env.pin_root().join("links/tc").join(cookie.to_string());
    for suffix in [":reroute-ingress", ":reroute-egress"] {
        let pin = links.join(format!("{IFACE}{suffix}"));
        ensure!(pin.exists(), "{} not pinned", pin.display());
    }
    ensure!(!links.join(IFACE).exists(), "{IFACE} got inbound capture");

    // An unmodified HAProxy as UID 1337 follows SO_ORIGINAL_DST (IPv4; HAProxy 2.6 reads an
    // IPv6 original destination from getsockname only). Its outbound frontend binds 0.0.0.0, as
    // Envoy's 15001 listener does: REDIRECT lands on the interface's address, not on loopback.
    {
        let cfg = haproxy::render_config(&haproxy::SidecarConfig::default(), false)
            .replace("bind 127.0.0.1:15001", "bind 0.0.0.0:15001");
        let path = env.tmp_dir().join("haproxy-reroute.cfg");
        std::fs::write(&path, cfg)?;
        let path_s = path.display().to_string();
        let mut haproxy = subject.spawn(
            &env,
            Spawn::new(&["haproxy", "-db", "-f", &path_s]).user(1337, 1337),
        )?;
        sidestep_tests::wait_listening(
            &mut haproxy,
            &["0.0.0.0:15001".parse()?],
            Duration::from_secs(10),
        )?;
        let dst = SocketAddr::new(p4.into(), 80);
        let got = vm.connect(dst, true)?;
        ensure!(
            ok_200(&got) && got["peer"].as_str() == Some(&dst.to_string()),
            "VM -> {dst} through HAProxy: {got}; log {}",
            haproxy.stderr()
        );
        // HAProxy's log: the frontend's address is the original destination it forwarded to.
        // It logs a connection when the connection ends, a moment after the VM saw the answer.
        haproxy.wait_stderr(
            &[
                "outbound client=192.168.77.2:",
                &format!("dst={dst} be=outbound_orig server={dst}"),
            ],
            Duration::from_secs(5),
        )?;
    }

    // Loading again is an upgrade: each pinned link switches to its new program, and the
    // re-route links must get the re-route programs (the connections below go through them).
    let cgroup = env.cgroup_path().display().to_string();
    let root = env.pin_root().display().to_string();
    sidestep_tests::sidestep::sidestep(&["load", "--cgroup", &cgroup, "--pin-root", &root])?;

    let proxy = subject.spawn(
        &env,
        Spawn::new(&[
            probe(),
            "proxy",
            "0.0.0.0:15001,[::]:15001",
            "-",
            "--v6only",
        ])
        .user(1337, 1337),
    )?;
    wait_for_tcp(&subject, "127.0.0.1:15001".parse()?, Duration::from_secs(5))?;
    for (dst, want_local, level) in [
        (
            SocketAddr::new(p4.into(), 80),
            format!("{GW4}:15001"),
            "orig_v4",
        ),
        (
            SocketAddr::new(p6.into(), 80),
            format!("[{GW6}]:15001"),
            "orig_v6",
        ),
    ] {
        let got = vm.connect(dst, true)?;
        ensure!(
            ok_200(&got) && got["peer"].as_str() == Some(&dst.to_string()),
            "VM -> {dst}: {got}"
        );
        let report = proxy.stdout();
        let line: Value = report
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v[level]["addr"].as_str() == Some(&dst.to_string()))
            .with_context(|| format!("the proxy saw no connection to {dst}: {report}"))?;
        ensure!(
            line["local"].as_str() == Some(want_local.as_str()),
            "proxy getsockname for {dst}: {line}"
        );
    }
    let captured = proxy.stdout().lines().count();

    // Outside includeOutboundIPRanges the VM's connection is not captured: it is routed.
    loaded.enroll(
        &subject,
        &[
            "--policy",
            &policy_arg,
            "--include-outbound-ip-ranges",
            &format!("{s4}/32"),
        ],
    )?;
    let got = vm.connect(SocketAddr::new(p4.into(), 80), true)?;
    ensure!(ok_200(&got), "uncaptured: {got}");
    ensure!(
        proxy.stdout().lines().count() == captured,
        "the proxy saw an uncaptured connection: {}",
        proxy.stdout()
    );

    // Captured with no proxy listening: refused, never routed around the proxy.
    loaded.enroll(&subject, &["--policy", &policy_arg])?;
    drop(proxy);
    for dst in [
        SocketAddr::new(p4.into(), 80),
        SocketAddr::new(p6.into(), 80),
    ] {
        let got = vm.connect(dst, true)?;
        ensure!(
            got.get("errno").is_some(),
            "no listener, yet VM -> {dst} connected: {got}"
        );
    }

    // Unenrolment leaves no link and no map entry behind.
    ensure!(map_len(env.pin_root(), "SIDESTEP_RRIF")? == 1);
    ensure!(map_len(env.pin_root(), "SIDESTEP_RNAT")? > 0);
    ensure!(map_len(env.pin_root(), "SIDESTEP_PEND")? > 0);
    loaded.unenroll(&subject)?;
    ensure!(!links.exists(), "links left: {}", links.display());
    // SIDESTEP_PEND too: the refused SYNs above left unclaimed hand-overs.
    for map in ["SIDESTEP_RRIF", "SIDESTEP_RNAT", "SIDESTEP_PEND"] {
        ensure!(map_len(env.pin_root(), map)? == 0, "{map} not empty");
    }

    // A listed interface that does not exist fails the enrolment, and nothing stays.
    let missing = reroute_policy(&env, &["nope0"])?;
    let missing_arg = missing.display().to_string();
    match loaded.enroll(&subject, &["--policy", &missing_arg]) {
        Ok(()) => bail!("enrolment with a missing re-routed interface succeeded"),
        Err(e) => ensure!(format!("{e:#}").contains("nope0"), "{e:#}"),
    }
    ensure!(
        loaded.status()?["pods"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "a pod entry stayed"
    );
    ensure!(!links.exists(), "links left after a failed enrolment");
    ensure!(map_len(env.pin_root(), "SIDESTEP_RRIF")? == 0);
    Ok(())
}

#[test]
fn interfaces_sharing_ifindex_and_mac_are_refused() -> Result<()> {
    if skip_unless_root("interfaces_sharing_ifindex_and_mac_are_refused") {
        return Ok(());
    }
    let env = TestEnv::new("reroute-clash")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let first = node.add_pod("first")?;
    let second = node.add_pod("second")?;
    // The same ifindex and MAC in two pods: the programs could not tell them apart.
    for pod in [&first, &second] {
        pod.ip(&[
            "link",
            "add",
            IFACE,
            "index",
            "4242",
            "address",
            "02:00:00:00:42:42",
            "type",
            "veth",
            "peer",
            "name",
            "vm0peer",
        ])?;
        pod.ip(&["link", "set", IFACE, "up"])?;
    }

    let loaded = Loaded::load(&env)?;
    let policy_file = reroute_policy(&env, &[IFACE])?;
    let policy_arg = policy_file.display().to_string();
    loaded.enroll(&first, &["--policy", &policy_arg])?;
    match loaded.enroll(&second, &["--policy", &policy_arg]) {
        Ok(()) => bail!("a second pod enrolled an interface with the first's ifindex and MAC"),
        Err(e) => ensure!(
            format!("{e:#}").contains(&format!("netns cookie {}", first.netns_cookie()?)),
            "{e:#}"
        ),
    }
    // The failed enrolment left nothing, and took nothing from the first pod.
    let status = loaded.status()?;
    ensure!(
        status["pods"].as_array().map(Vec::len) == Some(1),
        "{status}"
    );
    ensure!(map_len(env.pin_root(), "SIDESTEP_RRIF")? == 1);
    let links = env.pin_root().join("links/tc");
    ensure!(!links.join(second.netns_cookie()?.to_string()).exists());
    ensure!(
        links
            .join(first.netns_cookie()?.to_string())
            .join(format!("{IFACE}:reroute-ingress"))
            .exists()
    );
    Ok(())
}
