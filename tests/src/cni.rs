//! Executing CNI plugins the way a runtime (libcni) does: environment variables in, network
//! configuration on stdin, a Result (or an Error) as JSON on stdout.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::util::output_within;

/// The CNI spec version used for every configuration.
pub const CNI_VERSION: &str = "1.0.0";

/// Debian's containernetworking-plugins directory.
pub const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";

/// A plugin killed after this long is reported as hung.
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);

/// One plugin invocation.
#[derive(Clone, Debug)]
pub struct Invocation<'a> {
    /// `ADD`, `DEL`, `CHECK`, `VERSION`, ...
    pub command: &'a str,
    pub container_id: &'a str,
    pub netns: &'a Path,
    pub ifname: &'a str,
    /// `CNI_ARGS`, e.g. `IgnoreUnknown=1;K8S_POD_NAME=x`.
    pub args: &'a str,
    /// Directories searched for the plugin binary, passed as `CNI_PATH`.
    pub plugin_dirs: &'a [PathBuf],
}

/// Finds the binary for `type_` in `dirs`.
pub fn find_plugin(dirs: &[PathBuf], type_: &str) -> Result<PathBuf> {
    dirs.iter()
        .map(|d| d.join(type_))
        .find(|p| p.is_file())
        .with_context(|| {
            format!("CNI plugin {type_:?} not found in {dirs:?} (is containernetworking-plugins installed? `cargo xtask setup`)")
        })
}

/// Runs the plugin named by `conf["type"]` with `conf` on stdin.
///
/// Returns the parsed stdout (`Value::Null` when empty, as for DEL). A non-zero exit becomes an
/// error carrying the plugin's CNI error JSON and stderr.
pub fn exec(inv: &Invocation<'_>, conf: &Value) -> Result<Value> {
    let type_ = conf["type"]
        .as_str()
        .context("plugin configuration has no \"type\"")?;
    let bin = find_plugin(inv.plugin_dirs, type_)?;
    let cni_path = std::env::join_paths(inv.plugin_dirs).context("CNI_PATH")?;
    let stdin = serde_json::to_vec(conf)?;
    let mut cmd = Command::new(&bin);
    cmd.env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("CNI_COMMAND", inv.command)
        .env("CNI_CONTAINERID", inv.container_id)
        .env("CNI_NETNS", inv.netns)
        .env("CNI_IFNAME", inv.ifname)
        .env("CNI_ARGS", inv.args)
        .env("CNI_PATH", cni_path);
    let Some(out) = output_within(&mut cmd, Some(&stdin), PLUGIN_TIMEOUT)? else {
        bail!(
            "CNI {} {type_} hung for {PLUGIN_TIMEOUT:?}; killed",
            inv.command
        );
    };
    let (status, stdout, stderr) = (out.status, out.stdout, out.stderr);
    let stdout_s = String::from_utf8_lossy(&stdout);
    if !status.success() {
        bail!(
            "CNI {} {type_} (container {}, ifname {}) failed ({status}): {}{}",
            inv.command,
            inv.container_id,
            inv.ifname,
            stdout_s.trim(),
            if stderr.is_empty() {
                String::new()
            } else {
                format!("; stderr: {}", String::from_utf8_lossy(&stderr).trim())
            }
        );
    }
    if stdout_s.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&stdout_s).with_context(|| {
        format!(
            "CNI {} {type_}: bad JSON on stdout: {stdout_s}",
            inv.command
        )
    })
}

/// `plugin` completed as a runtime hands it to the binary: with `cniVersion`, the network
/// `name`, and `prevResult` / `runtimeConfig` when given.
pub fn plugin_conf(
    network: &str,
    plugin: &Value,
    prev_result: Option<&Value>,
    runtime_config: Option<&Value>,
) -> Value {
    let mut conf = plugin.clone();
    if let Some(obj) = conf.as_object_mut() {
        obj.insert("cniVersion".into(), json!(CNI_VERSION));
        obj.insert("name".into(), json!(network));
        if let Some(prev) = prev_result.filter(|p| !p.is_null()) {
            obj.insert("prevResult".into(), prev.clone());
        }
        if let Some(rc) = runtime_config {
            obj.insert("runtimeConfig".into(), rc.clone());
        }
    }
    conf
}
