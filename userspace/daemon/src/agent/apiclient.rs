//! One way to build the agent's API client, for everything the agent asks the API: the pod
//! watch, repair's list, its events, deletes and labels, the readiness taint, and ambient mode's
//! reads and annotations.
//!
//! The agent asks with its own service account, never with the kubeconfig it writes for the
//! plugin: that one carries the plugin's token (`get` on pods and namespaces, nothing else), and
//! the agent's token, whose verbs depend on the repair mode, never goes onto the node.

use std::{
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};

/// Whose credentials the agent's API requests carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiAccess {
    /// A kubeconfig file (`api-kubeconfig`).
    Kubeconfig(PathBuf),
    /// The agent's own service account: the token and CA files in `dir` (`service-account-dir`),
    /// for the API at `server`. The client re-reads the token file, which kubelet rotates.
    ServiceAccount { server: String, dir: PathBuf },
}

impl fmt::Display for ApiAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kubeconfig(p) => write!(f, "kubeconfig {}", p.display()),
            Self::ServiceAccount { dir, .. } => write!(f, "service account {}", dir.display()),
        }
    }
}

impl ApiAccess {
    /// The kubeconfig to build a client from: the file, or one made in memory that names the
    /// service account's files (so no token is copied anywhere).
    fn kubeconfig(&self) -> Result<Kubeconfig, String> {
        match self {
            Self::Kubeconfig(path) => {
                Kubeconfig::read_from(path).map_err(|e| format!("{self}: {e}"))
            }
            Self::ServiceAccount { server, dir } => {
                Kubeconfig::from_yaml(&service_account_kubeconfig(server, dir))
                    .map_err(|e| format!("{self}: {e}"))
            }
        }
    }
}

/// A kubeconfig naming the service account's token and CA files.
pub fn service_account_kubeconfig(server: &str, dir: &Path) -> String {
    // serde_json quoting is valid YAML quoting for these scalars.
    let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
    format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: local\n  \
           cluster:\n    \
             server: {}\n    \
             certificate-authority: {}\n\
         users:\n\
         - name: sidestep-agent\n  \
           user:\n    \
             tokenFile: {}\n\
         contexts:\n\
         - name: sidestep-agent\n  \
           context:\n    \
             cluster: local\n    \
             user: sidestep-agent\n\
         current-context: sidestep-agent\n",
        q(server),
        q(&dir.join("ca.crt").display().to_string()),
        q(&dir.join("token").display().to_string()),
    )
}

/// A client for the cluster `access` names; `timeout` bounds connecting and each read (a
/// watch, which waits for events, passes `None`). Errors name the credentials.
pub async fn client(access: &ApiAccess, timeout: Option<Duration>) -> Result<Client, String> {
    let kc = access.kubeconfig()?;
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("{access}: {e}"))?;
    if timeout.is_some() {
        config.connect_timeout = timeout;
        config.read_timeout = timeout;
    }
    Client::try_from(config).map_err(|e| format!("{access}: {e}"))
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    /// A self-signed CA certificate (no key kept), standing in for the cluster's.
    const CA: &str = "-----BEGIN CERTIFICATE-----
MIIBjjCCATOgAwIBAgIUJXfoEgKwsR34QPqXgnM7k24oTsQwCgYIKoZIzj0EAwIw
GzEZMBcGA1UEAwwQc2lkZXN0ZXAtdGVzdC1jYTAgFw0yNjEyMDcwODAxMzhaGA8y
MTI2MTExMzA4MDEzOFowGzEZMBcGA1UEAwwQc2lkZXN0ZXAtdGVzdC1jYTBZMBMG
ByqGSM49AgEGCCqGSM49AwEHA0IABEDciDdBby88KOWxRUQigsIZr4+GuBUnbaIz
1DKPJJ26LgWqMRvdhZVZKEDnib/jVSg2I0iBpjZpeGmsn6XJiTCjUzBRMB0GA1Ud
DgQWBBQ/lQTbltoWbcpmrQh7N523Sqp/ajAfBgNVHSMEGDAWgBQ/lQTbltoWbcpm
rQh7N523Sqp/ajAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0kAMEYCIQDM
NfFzFIQHjNktUw1YLg34HaHE1AzRq2RwOtt/l9jBYAIhALNayqbMjJjcb0VNYnlP
JAeUWIuIkYXdU/Q2WJe+TTQs
-----END CERTIFICATE-----\n";

    #[test]
    fn a_client_is_built_from_the_service_accounts_files() {
        let dir = tempfile::tempdir().unwrap();
        let access = ApiAccess::ServiceAccount {
            server: "https://127.0.0.1:6443".into(),
            dir: dir.path().to_path_buf(),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        fs::write(dir.path().join("ca.crt"), CA).unwrap();
        let Err(e) = rt.block_on(client(&access, None)) else {
            panic!("a client without a token file");
        };
        assert!(e.starts_with("service account "), "{e}");
        fs::write(dir.path().join("token"), "agent-token").unwrap();
        rt.block_on(client(&access, None)).unwrap();
    }

    #[test]
    fn the_service_account_kubeconfig_names_files_and_holds_no_token() {
        let dir = Path::new("/var/run/secrets/kubernetes.io/serviceaccount");
        let text = service_account_kubeconfig("https://[fd00::1]:443", dir);
        let kc = Kubeconfig::from_yaml(&text).unwrap();
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(
            user.token_file.as_deref(),
            Some("/var/run/secrets/kubernetes.io/serviceaccount/token")
        );
        assert!(user.token.is_none());
        let cluster = kc.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://[fd00::1]:443"));
        assert_eq!(
            cluster.certificate_authority.as_deref(),
            Some("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
        );
    }
}
