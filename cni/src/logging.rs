//! Logs go to stderr (stdout belongs to the protocol), with `log_file` to a root-only file, and
//! to the node agent's log when it runs ([`agent`]).

pub mod agent;

use std::{
    fs::OpenOptions,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde_json::Value;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

/// The logging fields of the config, read before it is validated so that config errors are
/// logged where the operator configured.
pub fn peek(stdin: &[u8]) -> (Option<String>, Option<PathBuf>) {
    let Ok(v) = serde_json::from_slice::<Value>(stdin) else {
        return (None, None);
    };
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    (
        s("plugin_log_level").or_else(|| s("log_level")),
        // Only a path the validated config would accept: a relative one would be created in
        // whatever directory the runtime started us in, before validation refuses it.
        s("log_file").map(PathBuf::from).filter(|p| p.is_absolute()),
    )
}

/// The state directory the config names (where the agent's log socket is), read as
/// [`peek`] reads: before validation, so that a config error reaches the agent's log too.
pub fn peek_state_dir(stdin: &[u8]) -> PathBuf {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("state_dir")?.as_str().map(PathBuf::from))
        .filter(|p| p.is_absolute())
        .unwrap_or_else(|| PathBuf::from(crate::config::DEFAULT_STATE_DIR))
}

const LEVELS: [&str; 8] = [
    "none", "off", "error", "warn", "warning", "info", "debug", "trace",
];

/// Istio's level names, or tracing's directives (`target=level`, comma-separated). A bare word
/// that is no level would parse as a target name, and log nothing else.
pub fn valid_level(level: &str) -> bool {
    let l = level.to_ascii_lowercase();
    LEVELS.contains(&l.as_str()) || (l.contains('=') && EnvFilter::try_new(&l).is_ok())
}

/// Istio's level names, plus tracing's directives; anything else logs at info (the config
/// check then names the field).
fn filter(level: Option<&str>) -> EnvFilter {
    let level = match level.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") => "info".to_owned(),
        Some(l) if !valid_level(l) => "info".to_owned(),
        Some("none") => "off".to_owned(),
        Some("warning") => "warn".to_owned(),
        Some(l) => l.to_owned(),
    };
    EnvFilter::try_new(&level).unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Sets up the layers; `agent`, when one listens, gets every line the level lets through.
pub fn init(level: Option<&str>, file: Option<&Path>, agent: Option<agent::Sender>) {
    let forward = agent.map(|sender| {
        agent::install(sender);
        agent::Forward.with_filter(filter(level))
    });
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .with_filter(filter(level));
    let file_layer = file.and_then(|path| {
        match OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
        {
            Ok(f) => Some(
                tracing_subscriber::fmt::layer()
                    .with_writer(Mutex::new(f))
                    .with_ansi(false)
                    .with_filter(filter(level)),
            ),
            Err(e) => {
                eprintln!("sidestep-cni: cannot open log_file {}: {e}", path.display());
                None
            }
        }
    });
    let _ = tracing_subscriber::registry()
        .with(stderr)
        .with(file_layer)
        .with(forward)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peeks_both_shapes() {
        let (l, f) = peek(br#"{"plugin_log_level":"debug","log_file":"/tmp/x"}"#);
        assert_eq!(l.as_deref(), Some("debug"));
        assert_eq!(f, Some(PathBuf::from("/tmp/x")));
        assert_eq!(peek(br#"{"log_level":"warn"}"#).0.as_deref(), Some("warn"));
        assert_eq!(peek(b"{"), (None, None));
        for ok in ["debug", "WARNING", "none", "sidestep_cni=debug,info"] {
            assert!(valid_level(ok), "{ok}");
        }
        for bad in ["verbose", "", "debgu"] {
            assert!(!valid_level(bad), "{bad}");
        }
        assert_eq!(peek(br#"{"log_file":"sidestep.log"}"#).1, None);
        assert_eq!(
            peek_state_dir(br#"{"state_dir":"/s"}"#),
            PathBuf::from("/s")
        );
        assert_eq!(
            peek_state_dir(b"{"),
            PathBuf::from(crate::config::DEFAULT_STATE_DIR)
        );
    }

    #[test]
    fn level_names() {
        for l in [
            None,
            Some("none"),
            Some("warning"),
            Some("DEBUG"),
            Some("bogus["),
        ] {
            let _ = filter(l);
        }
    }
}
