//! Inbound capture is netns-wide (Istio's `-A PREROUTING -p tcp -j ISTIO_INBOUND` has no `-i`
//! and no `-d`): an address enrolment never saw, such as the IPv6 link-local of eth0 or an
//! address added after enrolment, is captured like the pod IP, with both inbound hooks. Needs
//! root; skips otherwise.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use sidestep_tests::{Node, NodeOptions, Spawn, TestEnv, sidestep::Loaded, skip_unless_root};

const APP_UID: u32 = 1000;
const PROXY_UID: u32 = 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

#[test]
fn addresses_enrolment_never_saw_are_captured_with_sk_lookup() -> Result<()> {
    if skip_unless_root("addresses_enrolment_never_saw_are_captured_with_sk_lookup") {
        return Ok(());
    }
    unseen_addresses_are_captured("sk_lookup")
}

#[test]
fn addresses_enrolment_never_saw_are_captured_with_tc() -> Result<()> {
    if skip_unless_root("addresses_enrolment_never_saw_are_captured_with_tc") {
        return Ok(());
    }
    unseen_addresses_are_captured("tc")
}

fn unseen_addresses_are_captured(hook: &str) -> Result<()> {
    let env = TestEnv::new(&format!("nswide-{}", &hook[..2]))?;
    let node = Node::new(&env, NodeOptions::dual_stack())?;
    let server = node.add_pod("server")?;
    let outsider = node.add_pod("outsider")?;
    let loaded = Loaded::load(&env)?;
    // Enrolled with its pod IP alone, as a runtime reports it.
    loaded.enroll(
        &server,
        &["--inbound-hook", hook, "--pod-ip", &server.ipv4.to_string()],
    )?;
    // The proxy's IPv6 passthrough source, as istio-iptables adds it (`ip -6 addr add ::6/128
    // dev lo`): nothing in the test adds it.
    ensure!(
        server
            .ip(&["-6", "addr", "show", "dev", "lo"])?
            .contains("::6/128"),
        "{hook}: enrolment did not add ::6/128 to the pod's lo"
    );
    let proxy = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "[::]:15006", "-", "--no-forward"])
            .user(PROXY_UID, PROXY_UID),
    )?;
    // The app listens on every address: anything that is not captured reaches it.
    let _app = server.spawn(
        &env,
        Spawn::new(&[probe(), "proxy", "[::]:8080", "-", "--no-forward"]).user(APP_UID, APP_UID),
    )?;
    std::thread::sleep(Duration::from_millis(300));

    // An address added after enrolment (DHCP, SLAAC, another plugin).
    let octets = server.ipv4.octets();
    let late = std::net::Ipv4Addr::new(octets[0], octets[1], octets[2], 200);
    server.ip(&["addr", "add", &format!("{late}/32"), "dev", "eth0"])?;
    // The outsider's eth0 is on the same bridge: its link-local route reaches the server's.
    let scope = outsider
        .ip(&["-o", "link", "show", "eth0"])?
        .split(':')
        .next()
        .context("no ifindex")?
        .trim()
        .to_string();
    let ll = server.link_local("eth0")?.to_string();
    let targets = [
        (
            late.to_string(),
            SocketAddr::new(late.into(), 8080).to_string(),
        ),
        (ll.clone(), format!("[{ll}%{scope}]:8080")),
    ];
    for (_, target) in &targets {
        let out = outsider.run(&env, APP_UID, &[probe(), "connect", target])?;
        ensure!(
            out.status.success(),
            "{hook}: connect to {target} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    let seen: Vec<Value> = proxy
        .stdout()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    for (ip, target) in &targets {
        // getsockname at the proxy is the original destination.
        ensure!(
            seen.iter().any(|l| l["local"]
                .as_str()
                .is_some_and(|a| a.contains(ip.as_str()) && a.ends_with(":8080"))),
            "{hook}: the proxy never accepted the connection to {target} (it reached the app \
             around the proxy); the proxy saw {seen:?}"
        );
    }
    Ok(())
}

/// The sk_lookup links attach to the netns the plugin opened and checked, not to whatever its
/// path names by the time it attaches: here the path is bind-mounted over with another netns
/// while the plugin is stopped between the two.
#[test]
fn sk_lookup_attaches_to_the_netns_that_was_checked() -> Result<()> {
    use sidestep_tests::faults::{Plugin, bpftool};
    if skip_unless_root("sk_lookup_attaches_to_the_netns_that_was_checked") {
        return Ok(());
    }
    let env = TestEnv::new("nswide-fd")?;
    let loaded = Loaded::load(&env)?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let plugin = Plugin::new(&env, loaded.pin_root());
    let pod = node.add_pod("app")?;
    let inode = |p: &std::path::Path| -> Result<u64> {
        use std::os::unix::fs::MetadataExt as _;
        Ok(std::fs::metadata(p)?.ino())
    };
    let checked = inode(pod.netns_path())?;
    let cookie = pod.netns_cookie()?;
    let decoy_name = format!("sidestep-{}-decoy", env.id());
    let decoy = sidestep_tests::netns::create(&decoy_name)?;
    let swapped = std::cell::Cell::new(false);
    let out = plugin.paused("ADD", &pod, "enroll:before-sk-lookup", || {
        run_cmd(&[
            "mount",
            "--bind",
            &decoy.display().to_string(),
            &pod.netns_path().display().to_string(),
        ])?;
        swapped.set(true);
        Ok(())
    });
    let restore = || {
        if swapped.get() {
            let _ = run_cmd(&["umount", &pod.netns_path().display().to_string()]);
        }
        let _ = sidestep_tests::netns::delete(&decoy_name);
    };
    let result = (|| -> Result<()> {
        let out = out?;
        ensure!(
            out.status.success(),
            "ADD failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for dir in ["sklookup", "podid"] {
            let pin = loaded
                .pin_root()
                .join("links")
                .join(dir)
                .join(cookie.to_string());
            let link = bpftool(&["link", "show", "pinned", &pin.display().to_string()])?;
            ensure!(
                link["netns_ino"] == checked,
                "the {dir} link is attached to netns {}, not the checked {checked}: {link}",
                link["netns_ino"]
            );
        }
        Ok(())
    })();
    restore();
    let _ = plugin.run("DEL", &pod, None);
    result
}

fn run_cmd(argv: &[&str]) -> Result<String> {
    let out = std::process::Command::new(argv[0])
        .args(&argv[1..])
        .output()?;
    ensure!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
