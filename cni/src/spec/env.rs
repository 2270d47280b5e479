//! The CNI_* environment, validated per command the way libcni's skel does, so a runtime gets the
//! same code 4 for the same mistake from every plugin in its chain.

use std::{collections::BTreeMap, path::PathBuf};

use super::{CniError, Command, code};

/// The parameters of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    pub command: Command,
    pub container_id: Option<String>,
    pub netns: Option<PathBuf>,
    pub ifname: Option<String>,
    pub args: CniArgs,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs(pub BTreeMap<String, String>);

impl CniArgs {
    /// `K=V;K=V`. A pair without `=` is an error (as in libcni); empty segments are not.
    pub fn parse(text: &str) -> Result<Self, CniError> {
        let mut map = BTreeMap::new();
        for pair in text.split(';').filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| {
                CniError::new(
                    code::INVALID_ENV,
                    format!("CNI_ARGS: invalid pair {pair:?}"),
                )
                .details("CNI_ARGS is KEY=VALUE pairs separated by ';'")
            })?;
            map.insert(k.trim().to_owned(), v.trim().to_owned());
        }
        Ok(Self(map))
    }

    /// A non-empty value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

fn missing(names: &[&str]) -> CniError {
    CniError::new(
        code::INVALID_ENV,
        format!("required env variables [{}] missing", names.join(",")),
    )
}

/// CNI's rule for container IDs and network names.
pub fn valid_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// The kernel's rule for interface names (dev_valid_name).
pub fn valid_ifname(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("interface name is empty".into());
    }
    if s.len() > 15 {
        return Err(format!("interface name {s:?} is longer than 15 bytes"));
    }
    if s == "." || s == ".." {
        return Err(format!("interface name {s:?} is not allowed"));
    }
    if s.chars().any(|c| c == '/' || c == ':' || c.is_whitespace()) {
        return Err(format!(
            "interface name {s:?} contains '/', ':' or whitespace"
        ));
    }
    Ok(())
}

impl CniEnv {
    /// Reads the environment through `get` (std::env::var in the binary, a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, CniError> {
        let var = |name: &str| get(name).filter(|v| !v.is_empty());
        let command: Command = var("CNI_COMMAND")
            .ok_or_else(|| missing(&["CNI_COMMAND"]))?
            .parse()?;
        let container_id = var("CNI_CONTAINERID");
        let netns = var("CNI_NETNS").map(PathBuf::from);
        let ifname = var("CNI_IFNAME");
        let args = CniArgs::parse(&var("CNI_ARGS").unwrap_or_default())?;

        let (need_id, need_netns, need_ifname) = match command {
            Command::Add | Command::Check => (true, true, true),
            Command::Del => (true, false, true),
            Command::Status | Command::Gc | Command::Version => (false, false, false),
        };
        let mut absent = Vec::new();
        if need_id && container_id.is_none() {
            absent.push("CNI_CONTAINERID");
        }
        if need_netns && netns.is_none() {
            absent.push("CNI_NETNS");
        }
        if need_ifname && ifname.is_none() {
            absent.push("CNI_IFNAME");
        }
        if !absent.is_empty() {
            return Err(missing(&absent));
        }
        if let Some(id) = container_id.as_deref().filter(|_| need_id)
            && !valid_name(id)
        {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("CNI_CONTAINERID {id:?} has invalid characters"),
            )
            .details(
                "a container ID starts with a letter or digit, then letters, digits, '_', '.', '-'",
            ));
        }
        if let Some(name) = ifname.as_deref().filter(|_| need_ifname) {
            valid_ifname(name)
                .map_err(|e| CniError::new(code::INVALID_ENV, format!("CNI_IFNAME: {e}")))?;
        }
        Ok(Self {
            command,
            container_id,
            netns,
            ifname,
            args,
        })
    }

    /// The attachment's identity. Only called for commands that required both.
    pub fn attachment(&self) -> (&str, &str) {
        (
            self.container_id.as_deref().unwrap_or_default(),
            self.ifname.as_deref().unwrap_or_default(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<CniEnv, CniError> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        CniEnv::from_lookup(|k| map.get(k).cloned())
    }

    const ADD: &[(&str, &str)] = &[
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/run/netns/x"),
        ("CNI_IFNAME", "eth0"),
        (
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=default",
        ),
    ];

    #[test]
    fn full_add_env() {
        let e = env(ADD).unwrap();
        assert_eq!(e.command, Command::Add);
        assert_eq!(e.args.get("K8S_POD_NAME"), Some("web"));
        assert_eq!(e.args.get("IgnoreUnknown"), Some("1"));
        assert_eq!(e.attachment(), ("abc123", "eth0"));
    }

    #[test]
    fn missing_variables_are_named() {
        let e = env(&[("CNI_COMMAND", "ADD")]).unwrap_err();
        assert_eq!(e.code, code::INVALID_ENV);
        assert!(
            e.msg.contains("CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME"),
            "{}",
            e.msg
        );
        let e = env(&[]).unwrap_err();
        assert!(e.msg.contains("CNI_COMMAND"));
        // DEL does not need the netns; VERSION needs nothing.
        env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "a"),
            ("CNI_IFNAME", "eth0"),
        ])
        .unwrap();
        env(&[("CNI_COMMAND", "VERSION")]).unwrap();
        env(&[("CNI_COMMAND", "GC")]).unwrap();
    }

    #[test]
    fn invalid_values() {
        let mut bad = ADD.to_vec();
        bad[1] = ("CNI_CONTAINERID", "-leading-dash");
        assert_eq!(env(&bad).unwrap_err().code, code::INVALID_ENV);
        let mut bad = ADD.to_vec();
        bad[3] = ("CNI_IFNAME", "a-very-long-interface");
        assert!(env(&bad).unwrap_err().msg.contains("longer than 15"));
        let mut bad = ADD.to_vec();
        bad[3] = ("CNI_IFNAME", "et:h0");
        assert_eq!(env(&bad).unwrap_err().code, code::INVALID_ENV);
        let mut bad = ADD.to_vec();
        bad[4] = ("CNI_ARGS", "K8S_POD_NAME");
        assert!(env(&bad).unwrap_err().msg.contains("invalid pair"));
        let mut bad = ADD.to_vec();
        bad[0] = ("CNI_COMMAND", "REMOVE");
        assert!(env(&bad).unwrap_err().msg.contains("REMOVE"));
    }

    #[test]
    fn args_tolerate_empty_segments_and_values() {
        let a = CniArgs::parse("A=1;;B=;C=x=y").unwrap();
        assert_eq!(a.get("A"), Some("1"));
        assert_eq!(a.get("B"), None);
        assert_eq!(a.get("C"), Some("x=y"));
    }
}
