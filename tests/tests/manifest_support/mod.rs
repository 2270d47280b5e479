//! What agent_manifests.rs and helm_chart.rs share: the validation tools in a venv from PyPI,
//! YAML loading, kubernetes-validate, and `kubectl kustomize` of deploy/ with components.

#![allow(dead_code)] // each test binary uses its own part

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicUsize, Ordering},
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

pub const TOOLS: [&str; 2] = ["kubernetes-validate==1.37.0", "yamllint==1.38.0"];
/// appArmorProfile (securityContext) exists from 1.30 on.
pub const KUBERNETES: [&str; 2] = ["1.30.0", "1.33.0"];

pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

pub fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    Ok(out)
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The venv's bin directory, with the tools installed; `None` when PyPI is unreachable.
pub fn tools() -> Result<Option<PathBuf>> {
    // The tests of a file run in parallel: one installs, the others wait for it.
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _installing = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("manifest-venv");
    let bin = venv.join("bin");
    let have = |t: &str| {
        Command::new(bin.join(t))
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if have("kubernetes-validate") && have("yamllint") {
        return Ok(Some(bin));
    }
    if !bin.join("pip").exists() {
        let o = run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        ensure!(o.status.success(), "python3 -m venv: {}", text(&o));
    }
    let o = run(Command::new(bin.join("pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .args(TOOLS))?;
    if !o.status.success() {
        let t = text(&o);
        let offline = [
            "Failed to establish a new connection",
            "Temporary failure in name resolution",
            "Network is unreachable",
            "No matching distribution found",
            "Could not fetch URL",
            "connection broken",
            "timed out",
        ];
        if offline.iter().any(|m| t.contains(m)) {
            eprintln!("skipping the manifest validation: PyPI is unreachable ({TOOLS:?}):\n{t}");
            return Ok(None);
        }
        bail!("pip install {TOOLS:?} failed:\n{t}");
    }
    Ok(Some(bin))
}

/// Every document of a YAML file, as JSON (PyYAML from the venv: yamllint depends on it).
pub fn load(bin: &Path, file: &Path) -> Result<Vec<Value>> {
    let o = run(Command::new(bin.join("python"))
        .args([
            "-c",
            "import json,sys,yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(file))?;
    ensure!(o.status.success(), "{}: {}", file.display(), text(&o));
    Ok(serde_json::from_slice(&o.stdout)?)
}

pub fn validate(bin: &Path, version: &str, files: &[PathBuf]) -> Result<Output> {
    run(Command::new(bin.join("kubernetes-validate"))
        .args(["--strict", "--no-warn", "-k", version])
        .args(files))
}

/// `kubectl kustomize` of an overlay of deploy/ with `components`, written to a file of its
/// own under the target directory; `None` without kubectl.
pub fn render(components: &[&str]) -> Result<Option<PathBuf>> {
    // Tests render the same overlay at once: each output gets a name of its own.
    static RENDERED: AtomicUsize = AtomicUsize::new(0);
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let overlay = tempfile::Builder::new()
        .prefix("kustomize-")
        .tempdir_in(tmp)?;
    // kustomize takes no absolute path to a base: climb from the overlay to /.
    let up = "../".repeat(overlay.path().components().count() - 1);
    let rel = |p: &Path| format!("{up}{}", p.display().to_string().trim_start_matches('/'));
    let deploy = deploy_dir().canonicalize()?;
    let listed: String = components
        .iter()
        .map(|c| format!("  - {}\n", rel(&deploy.join("components").join(c))))
        .collect();
    let kustomization = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - {}\ncomponents:\n{listed}",
        rel(&deploy)
    );
    std::fs::write(overlay.path().join("kustomization.yaml"), kustomization)?;
    let o = match Command::new("kubectl")
        .arg("kustomize")
        .arg(overlay.path())
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    ensure!(
        o.status.success(),
        "kubectl kustomize with {components:?}: {}",
        text(&o)
    );
    let name = if components.is_empty() {
        "base".to_owned()
    } else {
        components.join("+")
    };
    let out = tmp.join(format!(
        "rendered-{name}-{}-{}.yaml",
        std::process::id(),
        RENDERED.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&out, &o.stdout)?;
    Ok(Some(out))
}
