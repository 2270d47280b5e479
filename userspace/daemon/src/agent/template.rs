//! The plugin entry the agent puts into the conflist: a JSON object with placeholders for the
//! node's values, filled in inside JSON strings (so a value never breaks the JSON).

use serde_json::{Map, Value};

/// The entry used when neither `plugin-template` nor `plugin-json` is set.
pub const DEFAULT_TEMPLATE: &str = r#"{
  "type": "sidestep",
  "pin_root": "__PIN_ROOT__",
  "state_dir": "__STATE_DIR__",
  "log_level": "__LOG_LEVEL__",
  "pod_namespace": "__POD_NAMESPACE__",
  "pod_source": "auto",
  "capabilities": { "io.kubernetes.cri.pod-annotations": true },
  "kubernetes": { "kubeconfig": "__KUBECONFIG_FILEPATH__" }
}"#;

/// Every placeholder and what it stands for.
pub const PLACEHOLDERS: [(&str, &str); 7] = [
    ("__PIN_ROOT__", "the pin root"),
    ("__STATE_DIR__", "the plugin's state directory"),
    (
        "__KUBECONFIG_FILEPATH__",
        "the kubeconfig's path on the host",
    ),
    ("__LOG_LEVEL__", "cni-log-level"),
    ("__NODE_NAME__", "node-name"),
    ("__POD_NAMESPACE__", "pod-namespace (the agent's namespace)"),
    ("__CNI_NET_DIR__", "the CNI conf directory on the host"),
];

/// The node's values for the placeholders, in [`PLACEHOLDERS`] order.
#[derive(Debug, Clone, Default)]
pub struct Values {
    pub pin_root: String,
    pub state_dir: String,
    pub kubeconfig: String,
    pub log_level: String,
    pub node_name: String,
    pub pod_namespace: String,
    pub cni_net_dir: String,
}

impl Values {
    fn get(&self, placeholder: &str) -> Option<&str> {
        Some(match placeholder {
            "__PIN_ROOT__" => &self.pin_root,
            "__STATE_DIR__" => &self.state_dir,
            "__KUBECONFIG_FILEPATH__" => &self.kubeconfig,
            "__LOG_LEVEL__" => &self.log_level,
            "__NODE_NAME__" => &self.node_name,
            "__POD_NAMESPACE__" => &self.pod_namespace,
            "__CNI_NET_DIR__" => &self.cni_net_dir,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PluginTemplate {
    raw: Map<String, Value>,
    plugin_type: String,
}

/// `__NAME__` tokens in a string.
fn tokens(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("__") {
        let after = &rest[start + 2..];
        let Some(len) = after.find("__") else { break };
        let name = &after[..len];
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') {
            out.push(&rest[start..start + 2 + len + 2]);
            rest = &after[len + 2..];
        } else {
            rest = &rest[start + 1..];
        }
    }
    out
}

fn walk_strings(v: &Value, f: &mut impl FnMut(&str) -> Result<(), String>) -> Result<(), String> {
    match v {
        Value::String(s) => f(s),
        Value::Array(a) => a.iter().try_for_each(|x| walk_strings(x, f)),
        Value::Object(o) => o.iter().try_for_each(|(k, x)| {
            f(k)?;
            walk_strings(x, f)
        }),
        _ => Ok(()),
    }
}

fn fill(v: &Value, values: &Values) -> Value {
    let sub = |s: &str| {
        let mut out = s.to_owned();
        for (p, _) in PLACEHOLDERS {
            if out.contains(p) {
                out = out.replace(p, values.get(p).unwrap_or_default());
            }
        }
        out
    };
    match v {
        Value::String(s) => Value::String(sub(s)),
        Value::Array(a) => Value::Array(a.iter().map(|x| fill(x, values)).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (sub(k), fill(x, values))).collect())
        }
        other => other.clone(),
    }
}

impl PluginTemplate {
    /// Checks the template: a JSON object, a `type` that can name a binary, known placeholders.
    pub fn parse(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let Value::Object(raw) = v else {
            return Err("the plugin entry must be a JSON object".into());
        };
        let plugin_type = match raw.get("type") {
            Some(Value::String(t))
                if !t.is_empty()
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) =>
            {
                t.clone()
            }
            Some(t) => return Err(format!("\"type\" {t} cannot name a plugin binary")),
            None => return Err("the plugin entry has no \"type\"".into()),
        };
        walk_strings(&Value::Object(raw.clone()), &mut |s| {
            for t in tokens(s) {
                if !PLACEHOLDERS.iter().any(|(p, _)| *p == t) {
                    let known: Vec<&str> = PLACEHOLDERS.iter().map(|(p, _)| *p).collect();
                    return Err(format!(
                        "unknown placeholder {t}; known: {}",
                        known.join(", ")
                    ));
                }
            }
            Ok(())
        })?;
        Ok(Self { raw, plugin_type })
    }

    /// The entry's `mesh` preset, when it names one.
    pub fn mesh(&self) -> Option<&str> {
        self.raw.get("mesh").and_then(Value::as_str)
    }

    pub fn plugin_type(&self) -> &str {
        &self.plugin_type
    }

    /// The entry with the node's values. Empty optional fields (`kubernetes.kubeconfig` with no
    /// service account) are left empty; the plugin treats them as unset.
    pub fn render(&self, values: &Values) -> Value {
        fill(&Value::Object(self.raw.clone()), values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_template_renders() {
        let t = PluginTemplate::parse(DEFAULT_TEMPLATE).unwrap();
        assert_eq!(t.plugin_type(), "sidestep");
        let v = t.render(&Values {
            pin_root: "/sys/fs/bpf/x".into(),
            kubeconfig: "/etc/cni/net.d/\"odd\"".into(),
            ..Values::default()
        });
        assert_eq!(v["pin_root"], "/sys/fs/bpf/x");
        assert_eq!(v["kubernetes"]["kubeconfig"], "/etc/cni/net.d/\"odd\"");
        assert_eq!(v["capabilities"]["io.kubernetes.cri.pod-annotations"], true);
    }

    #[test]
    fn bad_templates_are_named() {
        let e = PluginTemplate::parse(r#"{"type":"sidestep","x":"__NOPE__"}"#).unwrap_err();
        assert!(e.contains("__NOPE__"), "{e}");
        assert!(PluginTemplate::parse("[1]").unwrap_err().contains("object"));
        assert!(
            PluginTemplate::parse(r#"{"a":1}"#)
                .unwrap_err()
                .contains("type")
        );
        assert!(PluginTemplate::parse(r#"{"type":"../x"}"#).is_err());
        assert!(PluginTemplate::parse("{").unwrap_err().contains("JSON"));
        // Double underscores that are not placeholders are fine.
        PluginTemplate::parse(r#"{"type":"s","x":"a__b","y":"__lower__"}"#).unwrap();
    }

    #[test]
    fn tokens_inside_strings() {
        assert_eq!(tokens("a__PIN_ROOT__/b__X__"), ["__PIN_ROOT__", "__X__"]);
        assert!(tokens("no tokens").is_empty());
    }
}
