use std::collections::BTreeMap;

use super::*;

/// containerd 2's form, as cargo xtask e2e writes it (xtask/src/e2e/config.rs).
const V3: &str = r#"
version = 3
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/tmp/node/cni/bin', '/usr/lib/cni']
    conf_dir = '/tmp/node/cni/net.d'
    max_conf_num = 1
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
"#;

/// containerd 1.x's form.
const V2: &str = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/home/kubernetes/bin"
  conf_dir = "/etc/cni/net.d"
"#;

fn files(
    map: &BTreeMap<&str, &str>,
) -> impl Fn(&str) -> Result<Vec<(String, String)>, RuntimeError> {
    move |p: &str| {
        if let Some(dir) = p.strip_suffix("/*.toml") {
            return Ok(map
                .iter()
                .filter(|(k, _)| k.starts_with(dir) && k.ends_with(".toml"))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect());
        }
        map.get(p)
            .map(|t| vec![(p.to_owned(), t.to_string())])
            .ok_or_else(|| RuntimeError::Read {
                path: p.into(),
                reason: "No such file or directory".into(),
            })
    }
}

fn containerd_of(map: &[(&str, &str)]) -> Result<Option<RuntimeDirs>, RuntimeError> {
    let map: BTreeMap<&str, &str> = map.iter().copied().collect();
    containerd_dirs("/etc/containerd/config.toml", &files(&map))
}

#[test]
fn containerd_2_and_1_and_defaults() {
    let d = containerd_of(&[("/etc/containerd/config.toml", V3)])
        .unwrap()
        .unwrap();
    assert_eq!(
        d.bin_dirs,
        [PathBuf::from("/tmp/node/cni/bin"), "/usr/lib/cni".into()]
    );
    assert_eq!(d.conf_dir, Path::new("/tmp/node/cni/net.d"));
    assert!(d.source.contains("io.containerd.cri.v1.runtime"), "{d:?}");

    let d = containerd_of(&[("/etc/containerd/config.toml", V2)])
        .unwrap()
        .unwrap();
    assert_eq!(d.bin_dirs, [PathBuf::from("/home/kubernetes/bin")]);
    assert_eq!(d.conf_dir, Path::new("/etc/cni/net.d"));

    // containerd 2.0's single bin_dir; a table that sets only one of the two.
    let d = containerd_of(&[(
        "/etc/containerd/config.toml",
        "[plugins.'io.containerd.cri.v1.runtime'.cni]\nbin_dir = '/b'\n",
    )])
    .unwrap()
    .unwrap();
    assert_eq!(d.bin_dirs, [PathBuf::from("/b")]);
    assert_eq!(d.conf_dir, Path::new(DEFAULT_CONF_DIR));

    let d = containerd_of(&[("/etc/containerd/config.toml", "version = 3\n")])
        .unwrap()
        .unwrap();
    assert_eq!(d.bin_dirs, [PathBuf::from(DEFAULT_BIN_DIR)]);
    assert_eq!(d.conf_dir, Path::new(DEFAULT_CONF_DIR));
}

#[test]
fn containerd_imports_override_and_docker_s_is_no_runtime() {
    let main = "version = 2\nimports = ['/etc/containerd/conf.d/*.toml']\n\
                [plugins.\"io.containerd.grpc.v1.cri\".cni]\nconf_dir = '/main'\n";
    let d = containerd_of(&[
        ("/etc/containerd/config.toml", main),
        (
            "/etc/containerd/conf.d/10-cni.toml",
            "[plugins.\"io.containerd.grpc.v1.cri\".cni]\nconf_dir = '/imported'\n",
        ),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(d.conf_dir, Path::new("/imported"));
    assert!(d.source.contains("10-cni.toml"), "{d:?}");

    // Docker's containerd: CRI disabled, so it runs no pods.
    let docker = "disabled_plugins = [\"cri\"]\n";
    assert_eq!(
        containerd_of(&[("/etc/containerd/config.toml", docker)]).unwrap(),
        None
    );
    let e = containerd_of(&[("/etc/containerd/config.toml", "[plugins\n")]).unwrap_err();
    assert!(matches!(e, RuntimeError::Parse { .. }), "{e}");
    let e = containerd_of(&[]).unwrap_err();
    assert!(e.to_string().contains("cannot read"), "{e}");
}

#[test]
fn crio_drop_ins_and_flags_win() {
    let conf = "[crio.network]\nnetwork_dir = \"/etc/cni/net.d/\"\nplugin_dirs = [\"/opt/cni/bin/\", \"/usr/libexec/cni\"]\n";
    let drop_in = "[crio.network]\nnetwork_dir = \"/var/lib/cni/net.d\"\n";
    let files = vec![
        ("/etc/crio/crio.conf".to_owned(), conf.to_owned()),
        (
            "/etc/crio/crio.conf.d/10-net.conf".to_owned(),
            drop_in.to_owned(),
        ),
    ];
    let d = crio_dirs(&files, &["crio".into()]).unwrap();
    assert_eq!(d.conf_dir, Path::new("/var/lib/cni/net.d"));
    assert_eq!(
        d.bin_dirs,
        [PathBuf::from("/opt/cni/bin/"), "/usr/libexec/cni".into()]
    );
    let args: Vec<String> = ["crio", "--cni-config-dir=/x", "--cni-plugin-dir", "/y"]
        .map(String::from)
        .into();
    let d = crio_dirs(&files, &args).unwrap();
    assert_eq!(
        (d.conf_dir, d.bin_dirs),
        (PathBuf::from("/x"), vec![PathBuf::from("/y")])
    );
    let d = crio_dirs(&[], &["crio".into()]).unwrap();
    assert_eq!(d.conf_dir, Path::new(DEFAULT_CONF_DIR));
}

#[test]
fn flags_in_every_spelling() {
    let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        flag_values(&a(&["containerd", "-c", "/a.toml"]), &["--config"], &["-c"]),
        ["/a.toml"]
    );
    assert_eq!(
        flag_values(
            &a(&["containerd", "--config=/b.toml"]),
            &["--config"],
            &["-c"]
        ),
        ["/b.toml"]
    );
    assert!(
        flag_values(
            &a(&["containerd", "--log-level", "info"]),
            &["--config"],
            &["-c"]
        )
        .is_empty()
    );
}

#[test]
fn directories_compare_by_identity() {
    let dirs = RuntimeDirs {
        bin_dirs: vec!["/opt/cni/bin".into(), "/usr/lib/cni".into()],
        conf_dir: "/etc/cni/net.d".into(),
        source: "config.toml".into(),
    };
    // The runtime's paths, as the agent sees them through /proc/PID/root.
    let id = |p: &Path| match p.to_str() {
        Some("/usr/lib/cni") => Some((1, 10)),
        Some("/etc/cni/net.d") => Some((1, 20)),
        _ => None,
    };
    let bin = Path::new("/host/opt/cni/bin");
    let conf = Path::new("/host/etc/cni/net.d");
    assert!(
        compare(
            "containerd",
            &dirs,
            &id,
            (bin, Some((1, 10))),
            (conf, Some((1, 20)))
        )
        .is_ok()
    );
    let (line, hint) = compare(
        "containerd",
        &dirs,
        &id,
        (bin, Some((1, 10))),
        (conf, Some((1, 21))),
    )
    .unwrap_err();
    assert!(
        line.contains("/etc/cni/net.d") && line.contains("cni-conf-dir /host/etc/cni/net.d"),
        "{line}"
    );
    assert!(!line.contains("cni-bin-dir"), "{line}");
    assert!(hint.contains("cni-conf-dir"), "{hint}");
    let (line, _) = compare("crio", &dirs, &id, (bin, None), (conf, Some((1, 20)))).unwrap_err();
    assert!(line.contains("cni-bin-dir /host/opt/cni/bin"), "{line}");
}

/// The scan and the read through `<proc>/<pid>/root`, on a made-up proc directory whose root is
/// a directory of the test's.
#[test]
fn the_runtime_is_found_and_read_through_its_root() {
    let tmp = tempfile::tempdir().unwrap();
    let proc_dir = tmp.path().join("proc");
    let root = tmp.path().join("root");
    fs::create_dir_all(root.join("etc/k3s")).unwrap();
    fs::create_dir_all(root.join("cni/net.d")).unwrap();
    fs::write(
        root.join("etc/k3s/containerd.toml"),
        "[plugins.'io.containerd.cri.v1.runtime'.cni]\nconf_dir = '/cni/net.d'\n",
    )
    .unwrap();
    for (pid, comm, cmdline) in [
        (
            "42",
            "containerd\n",
            "containerd\0-c\0/etc/k3s/containerd.toml\0",
        ),
        ("7", "bash\n", "bash\0"),
    ] {
        let d = proc_dir.join(pid);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("comm"), comm).unwrap();
        fs::write(d.join("cmdline"), cmdline).unwrap();
        std::os::unix::fs::symlink(&root, d.join("root")).unwrap();
    }
    let found = runtimes(&proc_dir);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].pid, 42);
    let d = dirs_of(&proc_dir, &found[0]).unwrap().unwrap();
    assert_eq!(d.conf_dir, Path::new("/cni/net.d"));
    assert_eq!(
        dev_ino(&through(&proc_dir.join("42/root"), &d.conf_dir)),
        dev_ino(&root.join("cni/net.d"))
    );
}
