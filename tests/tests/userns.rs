//! User-namespaced pods (`hostUsers: false`): the pod's netns belongs to a user namespace that
//! maps the pod's IDs 0..65536 to the host's 100000..165536, so its proxy, UID 1337 inside, is
//! UID 101337 to the kernel. istio-iptables' `--uid-owner 1337` is translated by the kernel
//! through the netns's user namespace, so the proxy's own connections are never captured again;
//! sidestep translates the same way at enrolment. Needs root; skips otherwise.

use std::net::SocketAddr;

use anyhow::{Result, ensure};
use serde_json::Value;
use sidestep_tests::{
    Node, NodeOptions, PodOptions, Spawn, TestEnv, sidestep::Loaded, skip_unless_root,
    wait_listening,
};

const BASE: u32 = 100_000;
/// The app and the proxy as the kernel sees them: 1000 and 1337 inside the pod.
const APP_HOST_UID: u32 = BASE + 1000;
const PROXY_HOST_UID: u32 = BASE + 1337;

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_probe")
}

fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn the_proxy_uid_is_matched_inside_the_pods_user_namespace() -> Result<()> {
    if skip_unless_root("the_proxy_uid_is_matched_inside_the_pods_user_namespace") {
        return Ok(());
    }
    let env = TestEnv::new("userns")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let client = node.add_pod_with(
        "client",
        PodOptions {
            userns: Some((BASE, 65_536)),
            ..Default::default()
        },
    )?;
    let server = node.add_pod("server")?;
    let loaded = Loaded::load(&env)?;
    loaded.enroll(&client, &[])?;
    let listen = |pod: &sidestep_tests::Pod, addr: &str, uid: u32| {
        let mut guard = pod.spawn(
            &env,
            Spawn::new(&[probe(), "proxy", addr, "-", "--no-forward"]).user(uid, uid),
        )?;
        wait_listening(
            &mut guard,
            &[addr.parse::<SocketAddr>()?],
            std::time::Duration::from_secs(10),
        )?;
        anyhow::Ok(guard)
    };
    let proxy = listen(&client, "127.0.0.1:15001", PROXY_HOST_UID)?;
    let target = SocketAddr::new(server.ipv4.into(), 8080).to_string();
    let backend = listen(&server, "0.0.0.0:8080", 0)?;
    let connect = |uid: u32| -> Result<()> {
        let out = client.run(&env, uid, &[probe(), "connect", &target])?;
        ensure!(
            out.status.success(),
            "connect as {uid}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    let seen = || (lines(&proxy.stdout()).len(), lines(&backend.stdout()).len());
    let wait_change = |before: (usize, usize)| {
        for _ in 0..100 {
            if seen() != before {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        seen()
    };

    // The app (1000 inside) is captured.
    let before = seen();
    connect(APP_HOST_UID)?;
    let after = wait_change(before);
    ensure!(
        after == (before.0 + 1, before.1),
        "the app's connection was not captured: proxy/backend {before:?} -> {after:?}"
    );
    // The proxy (1337 inside) goes out directly: no loop back into itself.
    let before = seen();
    connect(PROXY_HOST_UID)?;
    let after = wait_change(before);
    ensure!(
        after == (before.0, before.1 + 1),
        "the proxy's own connection was captured again (a loop): proxy/backend {before:?} -> \
         {after:?}"
    );
    let status = loaded.status()?;
    let cookie = client.netns_cookie()?;
    let pod = status["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["netns_cookie"] == cookie)
        .cloned()
        .unwrap_or_default();
    ensure!(
        pod["policy"]["proxy_uid"] == PROXY_HOST_UID,
        "the pod entry's proxy UID is not the host's view of 1337: {pod}"
    );
    Ok(())
}

/// A user namespace that does not map the proxy's UID: no process there can be the proxy, so
/// the enrolment fails naming the ID, and nothing is enrolled (Istio's `--uid-owner` rule
/// cannot be installed in such a netns either).
#[test]
fn an_unmapped_proxy_uid_fails_the_enrolment() -> Result<()> {
    if skip_unless_root("an_unmapped_proxy_uid_fails_the_enrolment") {
        return Ok(());
    }
    let env = TestEnv::new("userns-unmapped")?;
    let node = Node::new(&env, NodeOptions::ipv4_only())?;
    let pod = node.add_pod_with(
        "small",
        PodOptions {
            userns: Some((200_000, 1000)),
            ..Default::default()
        },
    )?;
    let loaded = Loaded::load(&env)?;
    let err = loaded
        .enroll(&pod, &[])
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    ensure!(
        err.contains("uid 1337 is not mapped") && err.contains("0 200000 1000"),
        "enrolment with an unmapped proxy UID: {err:?}"
    );
    ensure!(
        loaded.status()?["pods"]
            .as_array()
            .is_none_or(|p| p.is_empty()),
        "a refused enrolment left a pod entry"
    );
    Ok(())
}
