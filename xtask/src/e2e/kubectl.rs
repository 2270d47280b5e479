//! kubectl with the node's admin kubeconfig, and the few waits the scenarios need.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::cmd::Cmd;

#[derive(Clone)]
pub struct Kubectl {
    pub bin: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    /// Run kubectl; stdout on success, an error with its stderr otherwise.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        self.command()
            .args(["--request-timeout=30s"])
            .args(args)
            .read()
    }

    /// Run kubectl with no request timeout: for `exec` of a load that runs longer.
    pub fn run_unbounded(&self, args: &[&str]) -> Result<String> {
        self.command().args(args).read()
    }

    fn command(&self) -> Cmd {
        Cmd::new(&self.bin)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
    }

    /// `kubectl apply -f` of `yaml`, kept as `<manifests>/<name>.yaml` for a look afterwards.
    pub fn apply(&self, manifests: &Path, name: &str, yaml: &str) -> Result<()> {
        let file = manifests.join(format!("{name}.yaml"));
        fs::write(&file, yaml)?;
        self.run(&["apply", "-f", &file.display().to_string()])?;
        Ok(())
    }

    /// A jsonpath field of one object.
    pub fn field(&self, kind_name: &str, namespace: &str, path: &str) -> Result<String> {
        let out = self.run(&[
            "get",
            kind_name,
            "-n",
            namespace,
            "-o",
            &format!("jsonpath={path}"),
        ])?;
        Ok(out.trim().to_owned())
    }

    /// Wait for `pod` to be Ready; on timeout, fail with `kubectl describe` in the error.
    pub fn wait_pod_ready(&self, namespace: &str, pod: &str, timeout: Duration) -> Result<()> {
        let waited = self.run(&[
            "wait",
            "-n",
            namespace,
            "--for=condition=Ready",
            &format!("pod/{pod}"),
            &format!("--timeout={}s", timeout.as_secs()),
        ]);
        if let Err(e) = waited {
            let describe = self
                .run(&["describe", "pod", "-n", namespace, pod])
                .unwrap_or_default();
            bail!("pod {namespace}/{pod} is not Ready: {e:#}\n{describe}");
        }
        Ok(())
    }

    /// Poll until `done` holds or `timeout` passes; the error names `what`.
    pub fn poll(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Self) -> Result<bool>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut last = None;
        loop {
            match done(self) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last = Some(e),
            }
            if start.elapsed() > timeout {
                let why = last.map(|e| format!(": {e:#}")).unwrap_or_default();
                bail!("{what}: not within {} s{why}", timeout.as_secs());
            }
            sleep(Duration::from_millis(500));
        }
    }
}
