//! Kubernetes, etcd, containerd and the pause binary (and, through tools.rs, helm and promtool),
//! built with Go from the module proxy into a cache outside the checkout, keyed by version, so a
//! fresh clone on the same machine (CI's) does not rebuild them. Each build writes into a
//! temporary directory and renames it into place, so an interrupted build never looks complete.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::{CONTAINERD_VERSION, ETCD_VERSION, KUBERNETES_VERSION};
use crate::cmd::Cmd;

/// The commands the multi-call Kubernetes binary answers to, by the name it is called as.
pub const KUBERNETES_COMMANDS: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubectl",
];
const CONTAINERD_COMMANDS: &[&str] = &["containerd", "containerd-shim-runc-v2", "ctr"];
/// Our own pause image's version: bump it when `PAUSE_MAIN` changes.
pub const PAUSE_VERSION: &str = "1";

/// Where the built binaries are; each directory holds the commands by their usual names.
pub struct Built {
    pub kubernetes_bin: PathBuf,
    pub etcd_bin: PathBuf,
    pub containerd_bin: PathBuf,
    pub pause: PathBuf,
    /// The helm binary, for the helm install scenario.
    pub helm: PathBuf,
}

impl Built {
    pub fn kube(&self, command: &str) -> PathBuf {
        self.kubernetes_bin.join(command)
    }

    /// Each component's own report of its version, so the output shows what really ran.
    pub fn print_versions(&self) -> Result<()> {
        let lines = [
            ("kubernetes", self.kube("kubelet"), "--version"),
            ("etcd", self.etcd_bin.join("etcd"), "--version"),
            (
                "containerd",
                self.containerd_bin.join("containerd"),
                "--version",
            ),
            ("runc", PathBuf::from("/usr/sbin/runc"), "--version"),
            ("helm", self.helm.clone(), "version"),
        ];
        println!("\ncomponent versions");
        for (name, program, flag) in lines {
            let out = Cmd::new(&program).arg(flag).read()?;
            let first = out.lines().next().unwrap_or("").trim();
            println!("  {name:<12} {first}");
        }
        let cni = Cmd::new("dpkg-query")
            .args(["-W", "-f=${Version}", "containernetworking-plugins"])
            .read()
            .unwrap_or_else(|_| "unknown".into());
        println!(
            "  {:<12} containernetworking-plugins {cni} (Debian)",
            "cni plugins"
        );
        println!("  {:<12} {}", "go", go_version()?);
        Ok(())
    }
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/sidestep/e2e`: outside the checkout, so it survives a fresh
/// clone; SIDESTEP_E2E_CACHE moves it.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("SIDESTEP_E2E_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
        });
    base.join("sidestep/e2e")
}

pub fn build_all() -> Result<Built> {
    println!("e2e component cache: {}", cache_root().display());
    println!("go: {}", go_version()?);
    Ok(Built {
        kubernetes_bin: cached("kubernetes", KUBERNETES_VERSION, build_kubernetes)?,
        etcd_bin: cached("etcd", ETCD_VERSION, build_etcd)?,
        containerd_bin: cached("containerd", CONTAINERD_VERSION, build_containerd)?,
        pause: cached("pause", PAUSE_VERSION, build_pause)?.join("pause"),
        helm: super::tools::helm()?,
    })
}

fn go_version() -> Result<String> {
    Ok(Cmd::new("go")
        .arg("version")
        .hint("install Go 1.26 or newer (Kubernetes 1.37's modules need it)")
        .read()?
        .trim()
        .to_owned())
}

/// `<cache>/<name>-<version>/bin`, built by `build(src, bin)` unless a complete build is there.
pub(super) fn cached(
    name: &str,
    version: &str,
    build: fn(&Path, &Path) -> Result<()>,
) -> Result<PathBuf> {
    let dir = cache_root().join(format!("{name}-{version}"));
    let bin = dir.join("bin");
    let stamp = dir.join("built");
    // Test runs of other checkouts on this machine share the cache: one builds, the others wait
    // for it (and then find it built) instead of removing each other's half-built tree.
    fs::create_dir_all(&dir)?;
    let lock_path = cache_root().join(format!("{name}-{version}.lock"));
    let lock = fs::File::create(&lock_path)
        .with_context(|| format!("creating {}", lock_path.display()))?;
    if lock.try_lock().is_err() {
        println!("{name} {version}: another xtask is building it; waiting");
        lock.lock()
            .with_context(|| format!("locking {}", lock_path.display()))?;
    }
    if stamp.is_file() && bin.is_dir() {
        let note = fs::read_to_string(&stamp).unwrap_or_default();
        println!(
            "{name} {version}: cached in {} ({})",
            dir.display(),
            note.trim()
        );
        return Ok(bin);
    }
    let src = dir.join("src");
    let staging = dir.join("bin.partial");
    for stale in [&src, &staging, &bin] {
        if stale.exists() {
            fs::remove_dir_all(stale).with_context(|| format!("removing {}", stale.display()))?;
        }
    }
    fs::create_dir_all(&src)?;
    fs::create_dir_all(&staging)?;
    println!("{name} {version}: building in {}", dir.display());
    let start = Instant::now();
    build(&src, &staging).with_context(|| format!("building {name} {version}"))?;
    fs::rename(&staging, &bin)?;
    let secs = start.elapsed().as_secs_f64();
    println!("{name} {version}: built in {secs:.0} s");
    fs::write(
        &stamp,
        format!("built in {secs:.0} s by {}\n", go_version()?),
    )?;
    Ok(bin)
}

/// A `go` command for our builds: the machine's own toolchain (a go.mod that names a newer Go
/// must not make it download one), static binaries, and a build cache of our own so the build
/// times measured here do not depend on what else was built on the machine.
fn go(src: &Path) -> Cmd {
    Cmd::new("nice")
        .args(["-n", "10", "go"])
        .current_dir(src)
        .env("GOTOOLCHAIN", "local")
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-buildvcs=false")
        .env("GOCACHE", cache_root().join("go-build"))
}

/// `go build -trimpath -ldflags '-s -w STAMP' -o OUT PACKAGES`, timed.
pub(super) fn go_build(src: &Path, stamp: &str, out: &Path, packages: &[&str]) -> Result<()> {
    go_build_tagged(src, "", stamp, out, packages)
}

/// `go_build` with `-tags TAGS` (comma-separated; none when empty).
pub(super) fn go_build_tagged(
    src: &Path,
    tags: &str,
    stamp: &str,
    out: &Path,
    packages: &[&str],
) -> Result<()> {
    let start = Instant::now();
    go(src)
        .args(["build", "-trimpath"])
        .args((!tags.is_empty()).then(|| format!("-tags={tags}")))
        .arg("-ldflags")
        .arg(format!("-s -w {stamp}").trim())
        .arg("-o")
        .arg(out)
        .args(packages)
        .hint("see the Go errors above")
        .run()?;
    println!("  go build: {:.0} s", start.elapsed().as_secs_f64());
    Ok(())
}

pub(super) fn go_mod_tidy(src: &Path) -> Result<()> {
    let start = Instant::now();
    go(src)
        .args(["mod", "tidy"])
        .hint("is the Go module proxy reachable? (go env GOPROXY)")
        .run()?;
    println!("  go mod tidy: {:.0} s", start.elapsed().as_secs_f64());
    Ok(())
}

// --- Kubernetes ---------------------------------------------------------------------------

/// One main for the five commands, chosen by the name it is called as (the old hyperkube's
/// trick): one link instead of five. Each case is upstream's own `cmd/<name>/<name>.go`.
const KUBERNETES_MAIN: &str = r#"// Generated by cargo xtask e2e: the five Kubernetes commands in one binary, chosen by argv[0].
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	_ "time/tzdata" // for CronJob time zones, as upstream's kube-apiserver and kcm

	_ "k8s.io/client-go/plugin/pkg/client/auth"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	switch name := filepath.Base(os.Args[0]); name {
	case "kube-apiserver":
		os.Exit(cli.Run(apiserver.NewAPIServerCommand()))
	case "kube-controller-manager":
		os.Exit(cli.Run(controllermanager.NewControllerManagerCommand()))
	case "kube-scheduler":
		os.Exit(cli.Run(scheduler.NewSchedulerCommand()))
	case "kubelet":
		os.Exit(cli.Run(kubelet.NewKubeletCommand(context.Background())))
	case "kubectl":
		logs.GlogSetter(kubectlcmd.GetLogVerbosity(os.Args)) // nolint:errcheck
		if err := cli.RunNoErrOutput(kubectlcmd.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
	default:
		fmt.Fprintf(os.Stderr, "%s: call me as kube-apiserver, kube-controller-manager, kube-scheduler, kubelet or kubectl\n", name)
		os.Exit(2)
	}
}
"#;

/// Writes the consumer module: upstream's go.mod replaces every `k8s.io/*` staging module with
/// `./staging/...`, which a consumer cannot see, so each is pinned to its published
/// `v0.<minor>.<patch>`. The list is read from upstream's go.mod because it grows between
/// releases (1.37 has cri-streaming and streaming, which the 1.36 list lacked).
fn write_kubernetes_module(src: &Path) -> Result<String> {
    let module = format!("k8s.io/kubernetes@{KUBERNETES_VERSION}");
    let download = go(src)
        .args(["mod", "download", "-json", &module])
        .hint("is the Go module proxy reachable? (go env GOPROXY)")
        .capture()?;
    let info: serde_json::Value = serde_json::from_str(&download)
        .with_context(|| format!("reading `go mod download -json {module}`"))?;
    let field = |key: &str| -> Result<String> {
        match info.get(key).and_then(|v| v.as_str()) {
            Some(v) => Ok(v.to_owned()),
            None => bail!("`go mod download -json {module}` has no {key}: {download}"),
        }
    };
    let upstream = fs::read_to_string(field("GoMod")?)?;
    let released: serde_json::Value = serde_json::from_str(&fs::read_to_string(field("Info")?)?)?;
    let build_date = released["Time"].as_str().unwrap_or("").to_owned();

    let staging_version = staging_version(KUBERNETES_VERSION)?;
    let staging = staging_modules(&upstream);
    if staging.is_empty() {
        bail!("no `k8s.io/X => ./staging/...` replace lines in {module}'s go.mod");
    }
    println!(
        "  {} staging modules pinned to {staging_version}",
        staging.len()
    );
    let mut gomod = String::from(
        "// Generated by cargo xtask e2e from k8s.io/kubernetes's go.mod.\n\
         module sidestep.invalid/e2e/kubernetes\n\n",
    );
    // Upstream's language version and GODEBUG defaults apply only in the main module: copy them
    // so the commands behave as upstream's own builds do.
    for line in upstream.lines() {
        if line.starts_with("go ") || line.starts_with("godebug ") {
            gomod.push_str(line);
            gomod.push('\n');
        }
    }
    gomod.push_str(&format!(
        "\nrequire k8s.io/kubernetes {KUBERNETES_VERSION}\n\nreplace (\n"
    ));
    for name in &staging {
        gomod.push_str(&format!("\t{name} => {name} {staging_version}\n"));
    }
    gomod.push_str(")\n");
    fs::write(src.join("go.mod"), gomod)?;
    fs::write(src.join("main.go"), KUBERNETES_MAIN)?;
    Ok(build_date)
}

/// `v1.37.2` -> `v0.37.2`: the staging modules' tag for a Kubernetes release.
fn staging_version(kubernetes: &str) -> Result<String> {
    match kubernetes.strip_prefix("v1.") {
        Some(rest) => Ok(format!("v0.{rest}")),
        None => bail!("unexpected Kubernetes version {kubernetes}: want v1.N.M"),
    }
}

/// The module paths that upstream's go.mod replaces with a directory under ./staging.
fn staging_modules(gomod: &str) -> Vec<String> {
    gomod
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let line = line.strip_prefix("replace ").unwrap_or(line);
            let (from, to) = line.split_once("=>")?;
            let from = from.trim();
            (from.starts_with("k8s.io/") && to.trim().starts_with("./staging/"))
                .then(|| from.to_owned())
        })
        .collect()
}

/// `-X` flags for what upstream's hack/lib/version.sh stamps, so `--version` and kubectl's skew
/// check see a real version instead of `v0.0.0-master+$Format`.
fn kubernetes_version_stamp(build_date: &str) -> Result<String> {
    let minor = KUBERNETES_VERSION
        .split('.')
        .nth(1)
        .context("Kubernetes version without a minor")?;
    let mut stamp = String::new();
    for package in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        for (var, value) in [
            ("gitVersion", KUBERNETES_VERSION),
            ("gitMajor", "1"),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
            ("buildDate", build_date),
        ] {
            stamp.push_str(&format!(" -X {package}.{var}={value}"));
        }
    }
    Ok(stamp)
}

fn build_kubernetes(src: &Path, bin: &Path) -> Result<()> {
    let build_date = write_kubernetes_module(src)?;
    go_mod_tidy(src)?;
    let multi = bin.join("kubernetes");
    go_build(src, &kubernetes_version_stamp(&build_date)?, &multi, &["."])?;
    for command in KUBERNETES_COMMANDS {
        std::os::unix::fs::symlink("kubernetes", bin.join(command))?;
    }
    Ok(())
}

/// The measurement behind the multi-call choice: the five upstream `cmd/` packages built as
/// five binaries, from the multi-call build's tidied go.mod and go.sum (so every dependency has
/// the same version: an untidied go.mod selects others, and that alone recompiles for minutes)
/// and from an empty build cache of their own, as the multi-call build's first run was.
pub fn build_kubernetes_separately() -> Result<()> {
    let multi_src = cache_root().join(format!("kubernetes-{KUBERNETES_VERSION}/src"));
    let dir = cache_root().join(format!("kubernetes-{KUBERNETES_VERSION}-separate"));
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    let (src, bin, gocache) = (dir.join("src"), dir.join("bin"), dir.join("go-build"));
    // Its own cache, in the directory removed at the end.
    fs::create_dir_all(&bin)?;
    fs::create_dir_all(&src)?;
    let build_date = write_kubernetes_module(&src)?;
    for file in ["go.mod", "go.sum"] {
        fs::copy(multi_src.join(file), src.join(file))
            .with_context(|| format!("{file} of the multi-call build (run `e2e build` first)"))?;
    }
    let packages: Vec<String> = KUBERNETES_COMMANDS
        .iter()
        .map(|c| format!("k8s.io/kubernetes/cmd/{c}"))
        .collect();
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    let start = Instant::now();
    go(&src)
        .env("GOCACHE", &gocache)
        .args(["build", "-trimpath", "-ldflags"])
        .arg(format!("-s -w{}", kubernetes_version_stamp(&build_date)?))
        .arg("-o")
        .arg(format!("{}/", bin.display()))
        .args(&packages)
        .run()?;
    let secs = start.elapsed().as_secs_f64();
    let mut bytes = 0;
    for entry in fs::read_dir(&bin)? {
        bytes += entry?.metadata()?.len();
    }
    println!(
        "kubernetes {KUBERNETES_VERSION}: five separate binaries, {} MB in all, built in {secs:.0} s (empty build cache)",
        bytes / 1_000_000
    );
    // A measurement only: `up` uses the multi-call binary, so keep none of it.
    fs::remove_dir_all(&dir)?;
    Ok(())
}

// --- etcd, containerd, pause --------------------------------------------------------------

pub(super) fn write_module(
    src: &Path,
    name: &str,
    requires: &[(&str, &str)],
    files: &[(&str, &str)],
) -> Result<()> {
    let mut gomod = format!(
        "// Generated by cargo xtask e2e.\nmodule sidestep.invalid/e2e/{name}\n\ngo 1.26.0\n"
    );
    for (module, version) in requires {
        gomod.push_str(&format!("\nrequire {module} {version}\n"));
    }
    fs::write(src.join("go.mod"), gomod)?;
    for (file, text) in files {
        fs::write(src.join(file), text)?;
    }
    Ok(())
}

/// etcd's own main is `etcdmain.Main(os.Args)` in the root module; the server module has it.
const ETCD_MAIN: &str = "// Generated by cargo xtask e2e.\npackage main\n\nimport (\n\t\"os\"\n\n\t\"go.etcd.io/etcd/server/v3/etcdmain\"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n";

fn build_etcd(src: &Path, bin: &Path) -> Result<()> {
    write_module(
        src,
        "etcd",
        &[("go.etcd.io/etcd/server/v3", ETCD_VERSION)],
        &[("main.go", ETCD_MAIN)],
    )?;
    go_mod_tidy(src)?;
    go_build(src, "", &bin.join("etcd"), &["."])
}

/// Keeps the three commands' packages in go.mod and go.sum through `go mod tidy`.
const CONTAINERD_TOOLS: &str = "//go:build tools\n\n// Generated by cargo xtask e2e.\npackage tools\n\nimport (\n\t_ \"github.com/containerd/containerd/v2/cmd/containerd\"\n\t_ \"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2\"\n\t_ \"github.com/containerd/containerd/v2/cmd/ctr\"\n)\n";

fn build_containerd(src: &Path, bin: &Path) -> Result<()> {
    write_module(
        src,
        "containerd",
        &[("github.com/containerd/containerd/v2", CONTAINERD_VERSION)],
        &[("tools.go", CONTAINERD_TOOLS)],
    )?;
    go_mod_tidy(src)?;
    let packages: Vec<String> = CONTAINERD_COMMANDS
        .iter()
        .map(|c| format!("github.com/containerd/containerd/v2/cmd/{c}"))
        .collect();
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    // Without cgo, btrfs is left out, so no headers are needed.
    let stamp =
        format!("-X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}");
    // A trailing slash makes `-o` a directory for the three commands.
    let out = format!("{}/", bin.display());
    go_build(src, &stamp, Path::new(&out), &packages)
}

/// The sandbox's process: sleeps until SIGTERM or SIGINT, and reaps children, which matters
/// when a pod shares its PID namespace and the pause process is its init.
const PAUSE_MAIN: &str = r#"// Generated by cargo xtask e2e: the pod sandbox's pause process.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
"#;

fn build_pause(src: &Path, bin: &Path) -> Result<()> {
    write_module(src, "pause", &[], &[("main.go", PAUSE_MAIN)])?;
    go_build(src, "", &bin.join("pause"), &["."])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_modules_come_from_the_replace_block() {
        let gomod = "module k8s.io/kubernetes\n\nreplace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\tk8s.io/streaming => ./staging/src/k8s.io/streaming\n\tgithub.com/x/y => github.com/x/y v1.0.0\n)\nreplace k8s.io/kms => ./staging/src/k8s.io/kms\n";
        assert_eq!(
            staging_modules(gomod),
            ["k8s.io/api", "k8s.io/streaming", "k8s.io/kms"]
        );
        assert_eq!(staging_version("v1.37.2").unwrap(), "v0.37.2");
        assert!(staging_version("v2.0.0").is_err());
    }
}
