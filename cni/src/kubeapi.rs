//! Reading the pod from the Kubernetes API with the kube crate, through the kubeconfig named in
//! the plugin config (the agent writes it from its service account).
//!
//! Each attempt loads the kubeconfig afresh: on a new node the plugin can run before the agent
//! has written it, and the retry loop in [`crate::podsource`] then picks it up.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::Value;

use crate::{mesh::Identity, podsource::PodReader};

pub struct KubeReader {
    kubeconfig: PathBuf,
    timeout: Duration,
}

impl KubeReader {
    /// `timeout` bounds each attempt: connect, request and response together.
    pub fn new(kubeconfig: &Path, timeout: Duration) -> Self {
        Self {
            kubeconfig: kubeconfig.to_path_buf(),
            timeout,
        }
    }

    async fn get(&self, id: &Identity) -> Result<Pod, String> {
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
        Api::<Pod>::namespaced(client, &id.namespace)
            .get(&id.name)
            .await
            .map_err(|e| e.to_string())
    }
}

impl PodReader for KubeReader {
    fn read(&self, id: &Identity) -> Result<Value, String> {
        // Built per attempt, so invocations that never read the API never start one.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start an async runtime: {e}"))?;
        let pod = rt
            .block_on(async { tokio::time::timeout(self.timeout, self.get(id)).await })
            .map_err(|_| format!("no answer from the API server within {:?}", self.timeout))??;
        serde_json::to_value(pod).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests;
