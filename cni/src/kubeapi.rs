//! Reading the pod from the Kubernetes API with the kube crate, through the kubeconfig named in
//! the plugin config (the agent writes it from its service account).
//!
//! Each attempt loads the kubeconfig afresh: on a new node the plugin can run before the agent
//! has written it, and the retry loop in [`crate::podsource`] then picks it up.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::Value;

use crate::{mesh::Identity, podsource::PodReader};

pub struct KubeReader {
    kubeconfig: PathBuf,
    timeout: Duration,
    /// Also GET the pod's namespace for its labels (ambient's namespace selector), as
    /// istio-cni's plugin does when ambient is enabled.
    namespace_labels: bool,
}

impl KubeReader {
    /// `timeout` bounds each attempt: connect, request and response together.
    pub fn new(kubeconfig: &Path, timeout: Duration) -> Self {
        Self {
            kubeconfig: kubeconfig.to_path_buf(),
            timeout,
            namespace_labels: false,
        }
    }

    pub fn with_namespace_labels(mut self, on: bool) -> Self {
        self.namespace_labels = on;
        self
    }

    async fn get(&self, id: &Identity) -> Result<Value, String> {
        let shown = self.kubeconfig.display();
        let kc = Kubeconfig::read_from(&self.kubeconfig)
            .map_err(|e| format!("kubeconfig {shown}: {e}"))?;
        let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| format!("kubeconfig {shown}: {e}"))?;
        config.connect_timeout = Some(self.timeout);
        config.read_timeout = Some(self.timeout);
        config.write_timeout = Some(self.timeout);
        let client = Client::try_from(config).map_err(|e| format!("kubeconfig {shown}: {e}"))?;
        let pod = Api::<Pod>::namespaced(client.clone(), &id.namespace)
            .get(&id.name)
            .await
            .map_err(|e| e.to_string())?;
        let mut value = serde_json::to_value(pod).map_err(|e| e.to_string())?;
        if self.namespace_labels {
            let ns = Api::<Namespace>::all(client)
                .get(&id.namespace)
                .await
                .map_err(|e| format!("namespace {}: {e}", id.namespace))?;
            let labels = serde_json::to_value(ns.metadata.labels.unwrap_or_default())
                .map_err(|e| e.to_string())?;
            if let Some(obj) = value.as_object_mut() {
                obj.insert(crate::pod::NAMESPACE_LABELS_KEY.into(), labels);
            }
        }
        Ok(value)
    }
}

impl PodReader for KubeReader {
    fn read(&self, id: &Identity) -> Result<Value, String> {
        // Built per attempt, so invocations that never read the API never start one.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start an async runtime: {e}"))?;
        rt.block_on(async { tokio::time::timeout(self.timeout, self.get(id)).await })
            .map_err(|_| format!("no answer from the API server within {:?}", self.timeout))?
    }
}

#[cfg(test)]
mod tests;
