//! The agent's CNI side, with the real binary: a lone .conf wrapped into a .conflist with its
//! mode, the plugin installed, the kubeconfig written 0600 from the plugin's own token (never
//! the agent's) and rewritten on its rotation, /readyz following the configuration, another
//! CNI's rewrites repaired within a second and exactly once, SIGTERM leaving everything in
//! place, and a bad setting named. Needs root.

mod agent_support;

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    time::{Duration, Instant},
};

use agent_support::{Agent, Dirs, base_args, free_port, wait_until};
use anyhow::{Result, ensure};
use serde_json::json;
use sidestep_tests::{TestEnv, sidestep::cni_bin, skip_unless_root};

fn mode(p: &std::path::Path) -> u32 {
    fs::metadata(p)
        .map(|m| m.permissions().mode() & 0o777)
        .unwrap_or(0)
}

#[test]
fn agent_keeps_the_cni_configuration() -> Result<()> {
    if skip_unless_root("agent_keeps_the_cni_configuration") {
        return Ok(());
    }
    let env = TestEnv::new("agent-cni")?;
    let d = Dirs::new(&env)?;
    let port = free_port()?;
    let mut agent = Agent::start(&env, &base_args(&env, &d, port), port)?;

    // Up, but not ready: no primary CNI configuration yet.
    wait_until("/healthz", Duration::from_secs(20), || {
        agent.child.ensure_running()?;
        Ok(agent.get("/healthz").is_ok_and(|(c, _)| c == 200))
    })?;
    let (code, body) = agent.get("/readyz")?;
    ensure!(
        code == 503 && body.contains("no sidestep entry"),
        "{code} {body}"
    );

    // The primary CNI writes a lone .conf: it becomes a .conflist with the entry, mode kept.
    let conf = d.conf.join("10-flannel.conf");
    fs::write(
        &conf,
        json!({"cniVersion": "0.3.1", "name": "cbr0", "type": "flannel",
               "delegate": {"isDefaultGateway": true}})
        .to_string(),
    )?;
    fs::set_permissions(&conf, fs::Permissions::from_mode(0o640))?;
    let list = d.conf.join("10-flannel.conflist");
    wait_until("the wrapped conflist", Duration::from_secs(2), || {
        Ok(list.exists() && !conf.exists())
    })?;
    ensure!(mode(&list) == 0o640, "mode {:o}", mode(&list));
    ensure!(d.entries_in("10-flannel.conflist")? == 1);
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&list)?)?;
    ensure!(
        v["plugins"][0]["type"] == "flannel" && v["cniVersion"] == "0.3.1",
        "{v}"
    );
    let entry = d.entry("10-flannel.conflist")?;
    ensure!(entry["pin_root"] == json!(env.pin_root()), "{entry}");
    ensure!(
        entry["kubernetes"]["kubeconfig"] == json!(d.kubeconfig()),
        "{entry}"
    );
    agent.wait_ready(Duration::from_secs(5))?;

    // The plugin is installed under its type, as a copy of sidestep-cni.
    let installed = d.bin.join("sidestep");
    ensure!(fs::read(&installed)? == fs::read(cni_bin())?);
    ensure!(mode(&installed) == 0o755);

    // The kubeconfig: 0600, from the plugin's own service account token (sidestep-cni: get on
    // pods and namespaces), never the agent's, whose rights go further; rewritten when the
    // plugin's token changes (kubelet swaps the file by rename).
    let kc = d.kubeconfig();
    let text = fs::read_to_string(&kc)?;
    ensure!(mode(&kc) == 0o600, "kubeconfig mode {:o}", mode(&kc));
    ensure!(
        text.contains("token: \"cni-token-1\"") && text.contains("https://127.0.0.1:6443"),
        "{text}"
    );
    ensure!(
        !text.contains("agent-token"),
        "the plugin's kubeconfig carries the agent's token:\n{text}"
    );
    fs::write(d.cni_sa.join(".token.new"), "cni-token-2")?;
    fs::rename(d.cni_sa.join(".token.new"), d.cni_sa.join("token"))?;
    wait_until("the rotated token", Duration::from_secs(3), || {
        Ok(fs::read_to_string(&kc)?.contains("token: \"cni-token-2\""))
    })?;
    // The agent's own token rotating changes nothing on the node.
    fs::write(d.sa.join("token"), "agent-token-2")?;
    std::thread::sleep(Duration::from_millis(500));
    ensure!(!fs::read_to_string(&kc)?.contains("agent-token"));

    // Another CNI rewrites its file without our entry, by rename and in place: the entry is
    // back within a second, once, with one write each time.
    let base = json!({"cniVersion": "0.3.1", "name": "cbr0",
                      "plugins": [{"type": "flannel", "delegate": {"isDefaultGateway": true}},
                                  {"type": "portmap", "capabilities": {"portMappings": true}}]});
    let writes = |a: &Agent| a.metric("sidestep_cni_config_writes_total");
    let before = writes(&agent)?;
    for i in 0..4 {
        let text = serde_json::to_vec_pretty(&base)?;
        let start = Instant::now();
        if i % 2 == 0 {
            let tmp = d.conf.join(".flannel.tmp");
            fs::write(&tmp, &text)?;
            fs::rename(&tmp, &list)?;
        } else {
            fs::write(&list, &text)?;
        }
        wait_until("re-insertion", Duration::from_secs(1), || {
            Ok(d.entries_in("10-flannel.conflist").unwrap_or(0) == 1)
        })?;
        let took = start.elapsed();
        std::thread::sleep(Duration::from_millis(1500));
        ensure!(d.entries_in("10-flannel.conflist")? == 1, "duplicate entry");
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&list)?)?;
        let types: Vec<&str> = v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["type"].as_str())
            .collect();
        ensure!(types == ["flannel", "portmap", "sidestep"], "{types:?}");
        let now = writes(&agent)?;
        ensure!(
            now == before + f64::from(i + 1),
            "rewrite {i}: {now} writes, want {}",
            before + f64::from(i + 1)
        );
        eprintln!("rewrite {i}: sidestep back after {took:?}");
    }

    // SIGTERM: the agent exits 0 and leaves programs, config, binary and kubeconfig in place.
    let st = agent.child.terminate(Duration::from_secs(10))?;
    ensure!(st.success(), "agent exited {st}: {}", agent.log());
    ensure!(d.entries_in("10-flannel.conflist")? == 1);
    ensure!(installed.exists() && kc.exists());
    ensure!(
        agent_support::attachments(&env)?.len() >= 10,
        "links gone after SIGTERM"
    );

    // A bad setting stops the agent at once, naming it.
    let mut args = base_args(&env, &d, port);
    args.extend(["--cni-mode".into(), "sideways".into()]);
    let mut bad = Agent::start(&env, &args, port)?;
    let st = bad
        .child
        .wait_timeout(Duration::from_secs(10))?
        .ok_or_else(|| anyhow::anyhow!("agent with a bad setting kept running"))?;
    ensure!(!st.success());
    let err = bad.child.stderr();
    ensure!(
        err.contains("setting cni-mode") && err.contains("sideways"),
        "{err}"
    );

    agent_support::uninstall(&env, &d)?;
    ensure!(d.entries_in("10-flannel.conflist")? == 0);
    Ok(())
}
