//! Where pod data comes from: runtimeConfig's annotations when the runtime passes them, else the
//! Kubernetes API through a [`PodReader`], tried a bounded number of times (the pod object can
//! lag behind the sandbox being created).

use std::thread;

use serde_json::Value;

use crate::{
    config::{KubernetesConfig, PluginConfig},
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
         io.kubernetes.cri.pod-annotations capability) and the config has no kubernetes.kubeconfig"
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

/// The pod's data from whichever source this invocation has.
pub fn pod_info(
    cfg: &PluginConfig,
    id: &Identity,
    reader: &dyn PodReader,
) -> Result<PodInfo, PodReadError> {
    if let Some(annotations) = &cfg.pod_annotations {
        return Ok(PodInfo::from_annotations(
            &id.name,
            &id.namespace,
            annotations.clone(),
        ));
    }
    if cfg.kubernetes.kubeconfig.is_none() {
        return Err(PodReadError::NoSource {
            pod: id.to_string(),
        });
    }
    read_with_retries(reader, id, &cfg.kubernetes)
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
