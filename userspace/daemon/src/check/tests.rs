use std::{fs, path::Path};

use super::*;

fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for (name, text) in files {
        fs::write(d.path().join(name), text).unwrap();
    }
    d
}

const BRIDGE: &str = r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"}]}"#;
const CHAINED: &str =
    r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"sidestep"}]}"#;

#[test]
fn each_conflist_fault_fails_its_line() {
    let check = |files: &[(&str, &str)], installed| {
        let d = dir_with(files);
        conflist(d.path(), None, "sidestep", installed)
    };
    assert!(check(&[("10-k8s.conflist", CHAINED)], true).is_ok());
    assert!(check(&[("10-k8s.conflist", BRIDGE)], false).is_ok());
    let (line, _) = check(&[("10-k8s.conflist", "{")], true).unwrap_err();
    assert!(line.contains("10-k8s.conflist"), "{line}");
    let istio =
        r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"istio-cni"}]}"#;
    let (line, hint) = check(&[("10-k8s.conflist", istio)], false).unwrap_err();
    assert!(
        line.contains("istio-cni") && hint.contains("Migrating"),
        "{line}"
    );
    let (line, _) = check(&[("10-k8s.conflist", BRIDGE)], true).unwrap_err();
    assert!(line.contains("no sidestep entry"), "{line}");
    let first =
        r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"sidestep"},{"type":"bridge"}]}"#;
    let (line, _) = check(&[("10-k8s.conflist", first)], true).unwrap_err();
    assert!(line.contains("is not last"), "{line}");
    let (line, _) = check(&[], false).unwrap_err();
    assert!(line.contains("no CNI configuration"), "{line}");
}

#[test]
fn a_pin_root_off_bpffs_fails() {
    let d = tempfile::tempdir().unwrap();
    let item = bpffs(&d.path().join("sidestep"));
    assert_eq!(item.verdict, Verdict::Fail, "{item:?}");
    assert!(item.line.contains("is not on a bpffs"), "{item:?}");
}

#[test]
fn a_nearly_full_pod_map_fails() {
    assert!(fill(89, 100).is_ok());
    assert!(fill(90, 100).is_err());
    assert!(fill(0, 0).is_err());
}

#[test]
fn another_build_fails_and_no_marker_warns() {
    assert!(
        items::build_matches(Some("0_1_0-aaa"), "0_1_0-aaa")
            .unwrap()
            .is_ok()
    );
    let (line, hint) = items::build_matches(Some("0_1_0-bbb"), "0_1_0-aaa")
        .unwrap()
        .unwrap_err();
    assert!(
        line.contains("0_1_0-bbb") && line.contains("0_1_0-aaa"),
        "{line}"
    );
    assert!(hint.contains("rollout"), "{hint}");
    assert!(items::build_matches(None, "0_1_0-aaa").is_none());
}

#[test]
fn a_failure_fails_the_run_and_a_warning_does_not() {
    let item = |verdict| Item {
        id: "x",
        verdict,
        line: String::new(),
        hint: None,
        doc: DOC_KERNEL,
    };
    assert!(passed(&[item(Verdict::Pass), item(Verdict::Warn)]));
    assert!(!passed(&[item(Verdict::Pass), item(Verdict::Fail)]));
    let text = render(&[item(Verdict::Fail)]);
    assert!(
        text.starts_with("✖ x") && text.ends_with("1 of 1 checks failed\n"),
        "{text}"
    );
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_doc_link_names_a_heading() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for link in DOCS {
        let (file, want) = link.split_once('#').unwrap();
        let text = fs::read_to_string(root.join(file)).unwrap();
        let mut in_code = false;
        let found = text.lines().any(|l| {
            if l.starts_with("```") {
                in_code = !in_code;
            }
            !in_code && l.starts_with('#') && anchor(l.trim_start_matches('#')) == want
        });
        assert!(found, "{link}: no such heading");
    }
}
