//! Files the agent puts on the host: the plugin binary and the plugin's kubeconfig.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use base64::Engine as _;

use super::conflist::{file_mode, write_atomic};

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("setting cni-binary: cannot read the plugin binary {path}: {source}")]
    ReadBinary { path: PathBuf, source: io::Error },
    #[error("cannot install {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
    #[error(
        "cannot read the plugin's {what} at {path}: {source}. In a cluster the agent writes the \
         plugin's kubeconfig from the sidestep-cni service account's token (get on pods and \
         namespaces), never from its own: mount the sidestep-cni-token Secret there \
         (deploy/serviceaccount.yaml, deploy/daemonset.yaml), or set cni-service-account-dir to \
         where it is mounted"
    )]
    PluginServiceAccount {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

fn write_err(path: &Path) -> impl FnOnce(super::conflist::ConfError) -> InstallError + '_ {
    move |e| InstallError::Write {
        path: path.to_path_buf(),
        source: io::Error::other(e),
    }
}

/// Copies `source` to `dest` (mode 0755) through a temporary file and a rename, so a runtime
/// that executes the plugin at that moment runs the old binary or the new one, never a partial
/// one (and a running binary is never written to: no ETXTBSY). Returns whether it wrote.
pub fn install_binary(source: &Path, dest: &Path) -> Result<bool, InstallError> {
    let new = fs::read(source).map_err(|e| InstallError::ReadBinary {
        path: source.to_path_buf(),
        source: e,
    })?;
    if fs::read(dest).is_ok_and(|old| old == new) && file_mode(dest) == Some(0o755) {
        return Ok(false);
    }
    write_atomic(dest, &new, 0o755).map_err(write_err(dest))?;
    Ok(true)
}

pub fn remove_file(path: &Path) -> Result<bool, InstallError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(InstallError::Remove {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The API server's address from KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT, as every
/// pod has them; `None` when not running in a cluster (no KUBERNETES_SERVICE_HOST).
pub fn api_server_from_env() -> Option<String> {
    let host = std::env::var("KUBERNETES_SERVICE_HOST")
        .ok()
        .filter(|h| !h.is_empty())?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Some(format!("https://{host}:{port}"))
}

/// What the plugin's kubeconfig is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccount {
    pub server: String,
    pub token: String,
    pub ca: Vec<u8>,
}

impl ServiceAccount {
    /// The plugin's service account token from `dir`, for the API at [`api_server_from_env`];
    /// `None` when not running in a cluster.
    pub fn plugins_from_env(dir: &Path) -> Result<Option<Self>, InstallError> {
        api_server_from_env()
            .map(|server| Self::plugins(dir, server))
            .transpose()
    }

    /// Reads `token` and `ca.crt` from `dir`, where the plugin's `kubernetes.io/service-account-token`
    /// Secret is mounted.
    pub fn plugins(dir: &Path, server: String) -> Result<Self, InstallError> {
        let read = |what: &'static str, name: &str| {
            let path = dir.join(name);
            fs::read(&path).map_err(|source| InstallError::PluginServiceAccount {
                what,
                path,
                source,
            })
        };
        let token = String::from_utf8_lossy(&read("token", "token")?)
            .trim()
            .to_owned();
        if token.is_empty() {
            return Err(InstallError::PluginServiceAccount {
                what: "token",
                path: dir.join("token"),
                source: io::Error::other(
                    "it is empty (the token controller has not filled the Secret yet)",
                ),
            });
        }
        let ca = read("CA certificate", "ca.crt")?;
        Ok(Self { server, token, ca })
    }

    /// The kubeconfig text (YAML, the shape kubectl writes).
    pub fn kubeconfig(&self) -> String {
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca);
        // serde_json quoting is valid YAML quoting for these scalars.
        let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
        format!(
            "# Written by the sidestep agent from the plugin's own service account token (sidestep-cni);\n\
             # rewritten when it changes.\n\
             apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: local\n  \
               cluster:\n    \
                 server: {}\n    \
                 certificate-authority-data: {}\n\
             users:\n\
             - name: sidestep-cni\n  \
               user:\n    \
                 token: {}\n\
             contexts:\n\
             - name: sidestep-cni-context\n  \
               context:\n    \
                 cluster: local\n    \
                 user: sidestep-cni\n\
             current-context: sidestep-cni-context\n",
            q(&self.server),
            q(&ca),
            q(&self.token)
        )
    }
}

/// Writes the kubeconfig when its content or mode differs. Returns whether it wrote.
pub fn write_kubeconfig(path: &Path, text: &str, mode: u32) -> Result<bool, InstallError> {
    if fs::read_to_string(path).is_ok_and(|t| t == text) && file_mode(path) == Some(mode) {
        return Ok(false);
    }
    write_atomic(path, text.as_bytes(), mode).map_err(write_err(path))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_atomically_and_only_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::write(&src, b"binary v1").unwrap();
        let dest = dir.path().join("bin/sidestep");
        fs::create_dir(dir.path().join("bin")).unwrap();
        assert!(install_binary(&src, &dest).unwrap());
        assert_eq!(file_mode(&dest), Some(0o755));
        assert!(!install_binary(&src, &dest).unwrap());
        fs::write(&src, b"binary v2").unwrap();
        assert!(install_binary(&src, &dest).unwrap());
        assert_eq!(fs::read(&dest).unwrap(), b"binary v2");
        assert_eq!(fs::read_dir(dir.path().join("bin")).unwrap().count(), 1);
        assert!(remove_file(&dest).unwrap());
        assert!(!remove_file(&dest).unwrap());
    }

    #[test]
    fn kubeconfig_is_private_and_follows_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ZZZ-sidestep-kubeconfig");
        let mut sa = ServiceAccount {
            server: "https://[fd00::1]:443".into(),
            token: "t1".into(),
            ca: b"-----BEGIN CERTIFICATE-----".to_vec(),
        };
        assert!(write_kubeconfig(&path, &sa.kubeconfig(), 0o600).unwrap());
        assert_eq!(file_mode(&path), Some(0o600));
        assert!(!write_kubeconfig(&path, &sa.kubeconfig(), 0o600).unwrap());
        sa.token = "t2".into();
        assert!(write_kubeconfig(&path, &sa.kubeconfig(), 0o600).unwrap());
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("token: \"t2\""), "{text}");
        assert!(text.contains("server: \"https://[fd00::1]:443\""), "{text}");
        assert!(
            text.contains("certificate-authority-data: \"LS0t"),
            "{text}"
        );
    }

    #[test]
    fn the_plugins_token_comes_from_its_own_secret_or_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let cni = dir.path().join("sidestep-cni");
        fs::create_dir(&cni).unwrap();
        let server = "https://10.96.0.1:443".to_owned();
        let e = ServiceAccount::plugins(&cni, server.clone()).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("never from its own") && text.contains("cni-service-account-dir"),
            "{text}"
        );
        fs::write(cni.join("token"), "\n").unwrap();
        fs::write(cni.join("ca.crt"), "-----BEGIN CERTIFICATE-----").unwrap();
        assert!(
            ServiceAccount::plugins(&cni, server.clone())
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        fs::write(cni.join("token"), "cni-token\n").unwrap();
        let sa = ServiceAccount::plugins(&cni, server).unwrap();
        assert_eq!(sa.token, "cni-token");
        assert!(sa.kubeconfig().contains("token: \"cni-token\""));
    }
}
