use std::os::unix::fs::PermissionsExt as _;

use super::*;

/// Settings that validate on any machine: directories from a temp dir, a plugin binary file.
fn base(dir: &Path) -> AgentArgs {
    for d in ["bin", "net.d"] {
        fs::create_dir_all(dir.join(d)).unwrap();
    }
    let bin = dir.join("sidestep-cni");
    fs::write(&bin, b"x").unwrap();
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    AgentArgs {
        cni_bin_dir: Some(dir.join("bin").display().to_string()),
        cni_conf_dir: Some(dir.join("net.d").display().to_string()),
        cni_binary: Some(bin.display().to_string()),
        ..AgentArgs::default()
    }
}

fn err(args: &AgentArgs) -> String {
    Settings::resolve(args, None).unwrap_err().to_string()
}

#[test]
fn defaults_resolve() {
    let dir = tempfile::tempdir().unwrap();
    let s = Settings::resolve(&base(dir.path()), None).unwrap();
    assert_eq!(s.cni_mode, CniMode::Chained);
    assert_eq!(s.cni_conf_name, None);
    assert_eq!(s.kubeconfig_mode, 0o600);
    assert_eq!(s.kubeconfig_name, "ZZZ-sidestep-kubeconfig");
    assert_eq!(s.host_cni_conf_dir, s.cni_conf_dir);
    assert_eq!(s.plugin_type(), "sidestep");
    assert_eq!(s.installed_binary(), dir.path().join("bin/sidestep"));
    assert_eq!(s.reconcile_interval, Duration::from_secs(30));
    assert!(!s.repair);
    assert!(s.scan_proc);
    assert_eq!(s.log_level, "info");
    assert_eq!(s.listen, Listen::AllAddresses(9964));
    assert_eq!(s.metrics_max_age, Duration::from_secs(5));
    assert!(s.metrics_per_pod);
    assert_eq!(s.late_address_budget, 4096);
}

#[test]
fn metrics_per_pod_from_the_configmap_and_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let cm = dir.path().join("cm");
    fs::create_dir(&cm).unwrap();
    fs::write(cm.join("metrics-per-pod"), "false\n").unwrap();
    let mut args = base(dir.path());
    args.config = Some(cm.clone());
    assert!(!Settings::resolve(&args, None).unwrap().metrics_per_pod);
    // `--metrics-per-pod` alone (clap's default_missing_value) wins over the ConfigMap.
    args.metrics_per_pod = Some("true".into());
    assert!(Settings::resolve(&args, None).unwrap().metrics_per_pod);
    args.metrics_per_pod = Some("some".into());
    let e = err(&args);
    assert!(
        e.contains("setting metrics-per-pod (--metrics-per-pod or SIDESTEP_METRICS_PER_POD)"),
        "{e}"
    );
}

#[test]
fn listen_is_every_address_or_one() {
    let p = |v| Listen::parse(v);
    assert_eq!(p(":9964"), Ok(Listen::AllAddresses(9964)));
    assert_eq!(
        p("127.0.0.1:9964"),
        Ok(Listen::Addr(([127, 0, 0, 1], 9964).into()))
    );
    assert_eq!(p("[::1]:80").map(|l| l.port()), Ok(80));
    assert_eq!(p(":9964").unwrap().to_string(), ":9964");
    assert_eq!(p("[::1]:9964").unwrap().to_string(), "[::1]:9964");
    for bad in [
        "nowhere",
        "127.0.0.1",
        ":",
        ":x",
        "::1:9964",
        "0.0.0.0:70000",
    ] {
        assert!(p(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn bad_settings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let b = base(dir.path());
    let with = |f: &dyn Fn(&mut AgentArgs)| {
        let mut a = b.clone();
        f(&mut a);
        a
    };
    let s = |v: &str| Some(v.to_string());
    let cases: Vec<(AgentArgs, &str)> = vec![
        (
            with(&|a| a.cni_bin_dir = s("/nonexistent-dir")),
            "setting cni-bin-dir",
        ),
        (
            with(&|a| a.cni_conf_dir = s("relative")),
            "setting cni-conf-dir",
        ),
        (
            with(&|a| a.cni_conf_name = s("a/b.conflist")),
            "setting cni-conf-name",
        ),
        (
            with(&|a| a.cni_conf_name = s("10-x.yaml")),
            "setting cni-conf-name",
        ),
        (with(&|a| a.cni_mode = s("sideways")), "setting cni-mode"),
        (
            with(&|a| a.plugin_json = s("{\"type\":")),
            "setting plugin-json",
        ),
        (
            with(&|a| a.plugin_json = s(r#"{"type":"sidestep","x":"__BAD__"}"#)),
            "__BAD__",
        ),
        (
            with(&|a| a.plugin_template = s("/nonexistent")),
            "setting plugin-template",
        ),
        (
            with(&|a| {
                a.plugin_template = s("/a");
                a.plugin_json = s("{}");
            }),
            "not both",
        ),
        (
            with(&|a| a.kubeconfig_mode = s("rw")),
            "setting kubeconfig-mode",
        ),
        (
            with(&|a| a.kubeconfig_name = s("../x")),
            "setting kubeconfig-name",
        ),
        (with(&|a| a.listen = s("nowhere")), "setting listen"),
        (with(&|a| a.listen = s("127.0.0.1")), "setting listen"),
        (
            with(&|a| a.metrics_max_age = s("fast")),
            "setting metrics-max-age",
        ),
        (
            with(&|a| a.reconcile_interval = s("5 parsecs")),
            "setting reconcile-interval",
        ),
        (with(&|a| a.repair = s("maybe")), "setting repair"),
        (
            with(&|a| a.cgroup = Some(dir.path().display().to_string())),
            "setting cgroup",
        ),
        (with(&|a| a.pod_capacity = s("0")), "setting pod-capacity"),
        (
            with(&|a| a.late_address_budget = s("-1")),
            "setting late-address-budget",
        ),
        (
            with(&|a| a.cni_binary = s("/nonexistent")),
            "setting cni-binary",
        ),
        (with(&|a| a.log_format = s("xml")), "setting log-format"),
    ];
    for (args, want) in cases {
        let e = err(&args);
        assert!(e.contains(want), "want {want:?} in {e:?}");
    }
    // The flag's variable is named too.
    let e = err(&with(&|a| a.cni_mode = s("x")));
    assert!(e.contains("SIDESTEP_CNI_MODE"), "{e}");
    assert!(
        Settings::resolve(&b, Some("sidestep=[")).is_err(),
        "bad log filter accepted"
    );
}

#[test]
fn configmap_directory_and_json_file() {
    let dir = tempfile::tempdir().unwrap();
    let cm = dir.path().join("cm");
    fs::create_dir(&cm).unwrap();
    fs::write(cm.join("cni-mode"), "standalone\n").unwrap();
    fs::write(cm.join("kubeconfig-mode"), "0640").unwrap();
    fs::write(cm.join("log-level"), "debug").unwrap();
    // What a mounted ConfigMap has beside its keys.
    fs::create_dir(cm.join("..2024_01_01")).unwrap();
    fs::write(cm.join("..data"), "").unwrap();
    let mut args = base(dir.path());
    args.config = Some(cm.clone());
    let s = Settings::resolve(&args, None).unwrap();
    assert_eq!(s.cni_mode, CniMode::Standalone);
    assert_eq!(s.cni_conf_name.as_deref(), Some(DEFAULT_STANDALONE_NAME));
    assert_eq!(s.kubeconfig_mode, 0o640);
    assert_eq!(s.log_level, "debug");
    // A flag wins over the ConfigMap; the global log level over its key.
    args.kubeconfig_mode = Some("0600".into());
    let s = Settings::resolve(&args, Some("warn")).unwrap();
    assert_eq!(s.kubeconfig_mode, 0o600);
    assert_eq!(s.log_level, "warn");
    // A bad ConfigMap value names the key and the file.
    fs::write(cm.join("repair"), "perhaps").unwrap();
    let e = err(&args);
    assert!(e.contains("setting repair (key repair of"), "{e}");
    fs::remove_file(cm.join("repair")).unwrap();
    fs::write(cm.join("cni-conf-dirr"), "/x").unwrap();
    assert!(err(&args).contains("unknown key \"cni-conf-dirr\""));
    fs::remove_file(cm.join("cni-conf-dirr")).unwrap();

    let file = dir.path().join("agent.json");
    fs::write(
        &file,
        r#"{"reconcile-interval": "2s", "repair": true, "netns-dirs": "/a, /b"}"#,
    )
    .unwrap();
    args.config = Some(file);
    let s = Settings::resolve(&args, None).unwrap();
    assert_eq!(s.reconcile_interval, Duration::from_secs(2));
    assert!(s.repair);
    assert_eq!(s.netns_dirs, [PathBuf::from("/a"), PathBuf::from("/b")]);
}

#[test]
fn durations() {
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
    assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
    assert!(parse_duration("1ms").is_err());
    assert!(parse_duration("s").is_err());
    assert!(parse_duration("3d").is_err());
}

#[test]
fn readiness_taint_takes_true_a_key_or_nothing() {
    assert_eq!(parse_taint_key("").unwrap(), None);
    assert_eq!(parse_taint_key("false").unwrap(), None);
    assert_eq!(
        parse_taint_key("true").unwrap().as_deref(),
        Some(DEFAULT_READINESS_TAINT)
    );
    assert_eq!(
        parse_taint_key(" example.com/cni-not-ready ")
            .unwrap()
            .as_deref(),
        Some("example.com/cni-not-ready")
    );
    for bad in ["a/b/c", "no spaces", "x/", "key=value"] {
        let e = parse_taint_key(bad).unwrap_err();
        assert!(e.contains("not a taint key"), "{bad}: {e}");
    }
}

#[test]
fn an_uninstall_requested_after_start_is_seen() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    fs::create_dir_all(&config).unwrap();
    fs::write(config.join("uninstall-requested"), "false").unwrap();
    let args = AgentArgs {
        config: Some(config.clone()),
        ..base(dir.path())
    };
    let s = Settings::resolve(&args, None).unwrap();
    assert!(!s.uninstall_requested_now());
    // The ConfigMap volume changes under the running agent, as kubelet refreshes it.
    fs::write(config.join("uninstall-requested"), "true").unwrap();
    assert!(s.uninstall_requested_now());
}

#[test]
fn an_uninstall_request_reads_as_the_prestop_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    fs::create_dir_all(&config).unwrap();
    let args = AgentArgs {
        config: Some(config.clone()),
        ..base(dir.path())
    };
    let s = Settings::resolve(&args, None).unwrap();
    for (value, requested) in [("yes", true), ("On", true), ("0", false), ("maybe", false)] {
        fs::write(config.join("uninstall-requested"), value).unwrap();
        assert_eq!(s.uninstall_requested_now(), requested, "{value}");
    }
}

#[test]
fn ambient_with_another_mesh_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let args = AgentArgs {
        ambient: Some("true".into()),
        plugin_json: Some(r#"{"type": "sidestep", "mesh": "linkerd"}"#.into()),
        ..base(dir.path())
    };
    let e = err(&args);
    assert!(e.contains("ambient mode is Istio's"), "{e}");
    assert!(e.contains("linkerd"), "{e}");
}
