//! Where pod data comes from: runtimeConfig's annotations when the runtime passes them, else the
//! Kubernetes API through a [`PodReader`], tried a bounded number of times (the pod object can
//! lag behind the sandbox being created).

use std::thread;

use serde_json::Value;

use crate::{
    config::{KubernetesConfig, PluginConfig, PodSourceChoice},
    mesh::Identity,
    pod::PodInfo,
};

/// One attempt at reading a Pod object as the API serves it.
pub trait PodReader {
    fn read(&self, id: &Identity) -> Result<Value, String>;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodReadError {
    #[error(
        "pod {pod} cannot be read: the runtime passed no pod annotations (declare the \
         io.kubernetes.cri.pod-annotations capability) and the config has no \
         kubernetes.kubeconfig (or pod_source is \"annotations\")"
    )]
    NoSource { pod: String },
    #[error("pod {pod} cannot be read from the Kubernetes API after {tries} tries: {last}")]
    Api {
        pod: String,
        tries: u32,
        last: String,
    },
}

/// A reader for configs without a way to the API; every read fails with the reason.
pub struct Unavailable(pub String);

impl PodReader for Unavailable {
    fn read(&self, _: &Identity) -> Result<Value, String> {
        Err(self.0.clone())
    }
}

/// Reads with `retries` tries, `interval` apart. Any failure is retried, as istio-cni does: a
/// pod can be briefly invisible, and an API server briefly away.
pub fn read_with_retries(
    reader: &dyn PodReader,
    id: &Identity,
    k: &KubernetesConfig,
) -> Result<PodInfo, PodReadError> {
    let mut last = String::new();
    for attempt in 1..=k.pod_read_retries {
        match reader
            .read(id)
            .and_then(|v| PodInfo::from_api_json(&v).map_err(|e| e.to_string()))
        {
            Ok(pod) => return Ok(pod),
            Err(e) => {
                tracing::debug!(pod = %id, attempt, error = %e, "reading the pod failed");
                last = e;
            }
        }
        if attempt < k.pod_read_retries {
            thread::sleep(k.pod_read_interval);
        }
    }
    Err(PodReadError::Api {
        pod: id.to_string(),
        tries: k.pod_read_retries,
        last,
    })
}

/// Where the pod data of an ADD came from, for its log line and its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceUsed {
    Api,
    Annotations,
    /// The API did not answer within the retry budget; the runtime's annotations decided.
    AnnotationsAfterApiFailure,
}

impl SourceUsed {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Annotations => "annotations",
            Self::AnnotationsAfterApiFailure => "annotations-fallback",
        }
    }
}

/// The pod's data from the source `pod_source` picks (see [`PodSourceChoice`]).
pub fn pod_info(
    cfg: &PluginConfig,
    id: &Identity,
    reader: &dyn PodReader,
) -> Result<(PodInfo, SourceUsed), PodReadError> {
    let from_annotations = || {
        cfg.pod_annotations
            .as_ref()
            .map(|a| PodInfo::from_annotations(&id.name, &id.namespace, a.clone()))
    };
    let use_api = cfg.kubernetes.kubeconfig.is_some()
        && match cfg.pod_source {
            PodSourceChoice::Annotations => false,
            PodSourceChoice::PreferAnnotations => cfg.pod_annotations.is_none(),
            PodSourceChoice::Auto | PodSourceChoice::Api => true,
        };
    if !use_api {
        return from_annotations()
            .map(|p| (p, SourceUsed::Annotations))
            .ok_or_else(|| PodReadError::NoSource {
                pod: id.to_string(),
            });
    }
    match read_with_retries(reader, id, &cfg.kubernetes) {
        Ok(pod) => Ok((pod, SourceUsed::Api)),
        Err(e) if cfg.pod_source == PodSourceChoice::Auto => match from_annotations() {
            Some(pod) => {
                tracing::warn!(
                    "{e}; deciding from the runtime's annotations instead (the proxy \
                     container's securityContext and env are not seen)"
                );
                Ok((pod, SourceUsed::AnnotationsAfterApiFailure))
            }
            None => Err(e),
        },
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::{cell::Cell, time::Duration};

    use super::*;
    use serde_json::json;

    struct Flaky {
        fail_first: u32,
        calls: Cell<u32>,
    }

    impl PodReader for Flaky {
        fn read(&self, id: &Identity) -> Result<Value, String> {
            self.calls.set(self.calls.get() + 1);
            if self.calls.get() <= self.fail_first {
                return Err("connection refused".into());
            }
            Ok(json!({"metadata": {"name": id.name, "namespace": id.namespace}}))
        }
    }

    fn id() -> Identity {
        Identity {
            name: "web".into(),
            namespace: "shop".into(),
        }
    }

    fn fast(retries: u32) -> KubernetesConfig {
        KubernetesConfig {
            kubeconfig: Some("/k".into()),
            pod_read_retries: retries,
            pod_read_interval: Duration::from_millis(1),
            ..KubernetesConfig::default()
        }
    }

    #[test]
    fn retries_until_the_pod_is_read() {
        let r = Flaky {
            fail_first: 2,
            calls: Cell::new(0),
        };
        let pod = read_with_retries(&r, &id(), &fast(3)).unwrap();
        assert_eq!(pod.name, "web");
        assert_eq!(r.calls.get(), 3);
    }

    fn plugin_config(extra: serde_json::Value) -> PluginConfig {
        let mut v = json!({"cniVersion": "1.0.0", "name": "n", "type": "sidestep",
                           "kubernetes": {"kubeconfig": "/k", "pod_read_retries": 2,
                                          "pod_read_interval_ms": 1}});
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        PluginConfig::parse(&serde_json::to_vec(&v).unwrap(), crate::spec::Command::Add).unwrap()
    }

    fn with_annotations() -> serde_json::Value {
        json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"a": "b"}}})
    }

    fn auto(mut extra: serde_json::Value) -> serde_json::Value {
        extra["pod_source"] = json!("auto");
        extra
    }

    #[test]
    fn prefer_annotations_skips_the_api_when_the_runtime_passed_them() {
        let up = Flaky {
            fail_first: 0,
            calls: Cell::new(0),
        };
        let prefer = |mut extra: serde_json::Value| {
            extra["pod_source"] = json!("prefer-annotations");
            plugin_config(extra)
        };
        let (_, source) = pod_info(&prefer(with_annotations()), &id(), &up).unwrap();
        assert_eq!(source, SourceUsed::Annotations);
        assert_eq!(up.calls.get(), 0);
        let (_, source) = pod_info(&prefer(json!({})), &id(), &up).unwrap();
        assert_eq!(source, SourceUsed::Api);
    }

    #[test]
    fn the_default_reads_the_api_even_with_annotations() {
        let up = Flaky {
            fail_first: 0,
            calls: Cell::new(0),
        };
        let cfg = plugin_config(with_annotations());
        assert_eq!(cfg.pod_source, PodSourceChoice::Auto);
        let (_, source) = pod_info(&cfg, &id(), &up).unwrap();
        assert_eq!(source, SourceUsed::Api);
        assert_eq!(up.calls.get(), 1);
    }

    #[test]
    fn auto_reads_the_api_first_when_a_kubeconfig_is_set() {
        let up = Flaky {
            fail_first: 0,
            calls: Cell::new(0),
        };
        let (pod, source) = pod_info(&plugin_config(auto(with_annotations())), &id(), &up).unwrap();
        assert_eq!(
            (source, pod.source),
            (SourceUsed::Api, crate::pod::PodSource::Api)
        );
        assert_eq!(up.calls.get(), 1);
    }

    #[test]
    fn annotations_are_the_fallback_only_in_auto() {
        let down = || Flaky {
            fail_first: 100,
            calls: Cell::new(0),
        };
        let r = down();
        let (_, source) = pod_info(&plugin_config(auto(with_annotations())), &id(), &r).unwrap();
        assert_eq!(source, SourceUsed::AnnotationsAfterApiFailure);
        assert_eq!(r.calls.get(), 2, "the whole retry budget is spent first");
        // No annotations to fall back to: the API's error.
        let r = down();
        let e = pod_info(&plugin_config(auto(json!({}))), &id(), &r).unwrap_err();
        assert!(matches!(e, PodReadError::Api { tries: 2, .. }), "{e}");
        // pod_source api: no fallback.
        let mut cfg = with_annotations();
        cfg["pod_source"] = json!("api");
        let e = pod_info(&plugin_config(cfg), &id(), &down()).unwrap_err();
        assert!(matches!(e, PodReadError::Api { .. }), "{e}");
    }

    #[test]
    fn pod_source_annotations_never_calls_the_api() {
        let r = Flaky {
            fail_first: 0,
            calls: Cell::new(0),
        };
        let mut cfg = with_annotations();
        cfg["pod_source"] = json!("annotations");
        let (pod, source) = pod_info(&plugin_config(cfg), &id(), &r).unwrap();
        assert_eq!(source, SourceUsed::Annotations);
        assert_eq!(pod.source, crate::pod::PodSource::RuntimeAnnotations);
        assert_eq!(r.calls.get(), 0);
        let e = pod_info(
            &plugin_config(json!({"pod_source": "annotations"})),
            &id(),
            &r,
        )
        .unwrap_err();
        assert!(matches!(e, PodReadError::NoSource { .. }), "{e}");
    }

    #[test]
    fn pod_source_api_needs_a_kubeconfig() {
        let v =
            json!({"cniVersion": "1.0.0", "name": "n", "type": "sidestep", "pod_source": "api"});
        let e = PluginConfig::parse(&serde_json::to_vec(&v).unwrap(), crate::spec::Command::Add)
            .unwrap_err();
        assert!(e.to_string().contains("pod_source"), "{e}");
    }

    #[test]
    fn gives_up_after_the_bound() {
        let r = Flaky {
            fail_first: 10,
            calls: Cell::new(0),
        };
        let e = read_with_retries(&r, &id(), &fast(4)).unwrap_err();
        assert_eq!(r.calls.get(), 4);
        assert!(
            e.to_string().contains("after 4 tries: connection refused"),
            "{e}"
        );
    }
}
