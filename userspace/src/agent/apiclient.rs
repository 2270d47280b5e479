//! One way to build an API client from a kubeconfig file, for everything the agent asks the API:
//! the pod watch, repair's list, its events, deletes and labels, and the readiness taint.

use std::{path::Path, time::Duration};

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};

/// A client for the cluster `kubeconfig` names; `timeout` bounds connecting and each read (a
/// watch, which waits for events, passes `None`). Errors name the file.
pub async fn client(kubeconfig: &Path, timeout: Option<Duration>) -> Result<Client, String> {
    let shown = kubeconfig.display();
    let kc = Kubeconfig::read_from(kubeconfig).map_err(|e| format!("kubeconfig {shown}: {e}"))?;
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("kubeconfig {shown}: {e}"))?;
    if timeout.is_some() {
        config.connect_timeout = timeout;
        config.read_timeout = timeout;
    }
    Client::try_from(config).map_err(|e| format!("kubeconfig {shown}: {e}"))
}
