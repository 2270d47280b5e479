use std::os::unix::fs::PermissionsExt;

use super::*;

fn entry() -> Value {
    json!({"type": "sidestep", "pin_root": "/sys/fs/bpf/sidestep"})
}

fn flannel_list() -> Value {
    json!({
        "cniVersion": "0.3.1", "name": "cbr0",
        "plugins": [
            {"type": "flannel", "delegate": {"hairpinMode": true, "isDefaultGateway": true}},
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
}

fn write(dir: &Path, name: &str, v: &Value, mode: u32) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, to_bytes(v)).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    p
}

fn read(p: &Path) -> Value {
    serde_json::from_slice(&fs::read(p).unwrap()).unwrap()
}

#[test]
fn inserts_after_the_chain_once() {
    let with = insert_entry(&flannel_list(), &entry()).unwrap();
    let types: Vec<&str> = with["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["flannel", "portmap", "sidestep"]);
    assert_eq!(with["cniVersion"], "0.3.1");
    // Inserting again changes nothing.
    assert_eq!(insert_entry(&with, &entry()), None);
    // A changed entry replaces the old one, still once.
    let mut e2 = entry();
    e2["pin_root"] = json!("/other");
    let replaced = insert_entry(&with, &e2).unwrap();
    assert_eq!(count_entries(&replaced, "sidestep"), 1);
    assert_eq!(replaced["plugins"][2], e2);
    // Duplicates left by someone else collapse into one.
    let mut dup = with.clone();
    dup["plugins"].as_array_mut().unwrap().push(entry());
    assert_eq!(
        count_entries(&insert_entry(&dup, &entry()).unwrap(), "sidestep"),
        1
    );
}

#[test]
fn removes_only_ours() {
    let with = insert_entry(&flannel_list(), &entry()).unwrap();
    assert_eq!(remove_entry(&with, "sidestep").unwrap(), flannel_list());
    assert_eq!(remove_entry(&flannel_list(), "sidestep"), None);
}

#[test]
fn wraps_a_lone_conf_keeping_mode() {
    let dir = tempfile::tempdir().unwrap();
    let conf = json!({"cniVersion": "0.4.0", "name": "mynet", "type": "bridge", "bridge": "cni0"});
    let from = write(dir.path(), "10-bridge.conf", &conf, 0o600);
    let done = ensure_chained(dir.path(), None, &entry()).unwrap();
    let to = dir.path().join("10-bridge.conflist");
    assert_eq!(
        done,
        Ensured::Wrapped {
            from: from.clone(),
            to: to.clone()
        }
    );
    assert!(!from.exists());
    assert_eq!(file_mode(&to), Some(0o600));
    let v = read(&to);
    assert_eq!(v["cniVersion"], "0.4.0");
    assert_eq!(v["name"], "mynet");
    assert_eq!(v["plugins"][0], json!({"type": "bridge", "bridge": "cni0"}));
    assert_eq!(v["plugins"][1], entry());
    assert_eq!(
        ensure_chained(dir.path(), None, &entry()).unwrap(),
        Ensured::Unchanged(to.clone())
    );
    // Named by its old name, the wrapped file is still found.
    assert_eq!(
        ensure_chained(dir.path(), Some("10-bridge.conf"), &entry()).unwrap(),
        Ensured::Unchanged(to)
    );
    // No temporary files remain.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn picks_the_highest_priority_file_and_never_inserts_twice() {
    let dir = tempfile::tempdir().unwrap();
    let low = write(dir.path(), "20-other.conflist", &flannel_list(), 0o644);
    let high = write(dir.path(), "10-flannel.conflist", &flannel_list(), 0o640);
    fs::write(dir.path().join("05-notes.txt"), "x").unwrap();
    fs::write(dir.path().join(".hidden.conflist"), "{").unwrap();
    assert_eq!(
        ensure_chained(dir.path(), None, &entry()).unwrap(),
        Ensured::Written(high.clone())
    );
    assert_eq!(file_mode(&high), Some(0o640));
    for _ in 0..3 {
        assert!(!ensure_chained(dir.path(), None, &entry()).unwrap().wrote());
    }
    assert_eq!(count_entries(&read(&high), "sidestep"), 1);
    assert_eq!(read(&low), flannel_list());
    assert!(entry_in_place(dir.path(), None, false, &entry()));
    // A named file wins over priority.
    assert!(
        ensure_chained(dir.path(), Some("20-other.conflist"), &entry())
            .unwrap()
            .wrote()
    );
    // Another CNI rewrites its file without us: one insertion puts it back.
    write(dir.path(), "10-flannel.conflist", &flannel_list(), 0o640);
    assert!(!entry_in_place(dir.path(), None, false, &entry()));
    assert!(ensure_chained(dir.path(), None, &entry()).unwrap().wrote());
    assert_eq!(count_entries(&read(&high), "sidestep"), 1);
    // Uninstall takes it out of both.
    let changed = remove_everywhere(dir.path(), "sidestep", None).unwrap();
    assert_eq!(changed, [high.clone(), low.clone()]);
    assert_eq!(read(&high), flannel_list());
    assert_eq!(read(&low), flannel_list());
}

#[test]
fn waits_for_the_primary_and_skips_half_written_files() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        ensure_chained(dir.path(), None, &entry()).unwrap(),
        Ensured::Waiting
    );
    assert_eq!(
        ensure_chained(dir.path(), Some("10-x.conflist"), &entry()).unwrap(),
        Ensured::Waiting
    );
    fs::write(dir.path().join("10-x.conflist"), "{\"cniVersion\":").unwrap();
    let e = ensure_chained(dir.path(), None, &entry()).unwrap_err();
    assert!(matches!(e, ConfError::Invalid { .. }), "{e}");
}

#[test]
fn standalone_file_is_ours_and_not_chained_into() {
    let dir = tempfile::tempdir().unwrap();
    let s = ensure_standalone(dir.path(), "99-sidestep.conflist", &entry()).unwrap();
    assert!(s.wrote());
    assert!(
        !ensure_standalone(dir.path(), "99-sidestep.conflist", &entry())
            .unwrap()
            .wrote()
    );
    assert!(entry_in_place(
        dir.path(),
        Some("99-sidestep.conflist"),
        true,
        &entry()
    ));
    // Chained mode does not take a standalone file of ours for the primary's.
    assert_eq!(
        ensure_chained(dir.path(), None, &entry()).unwrap(),
        Ensured::Waiting
    );
    let changed = remove_everywhere(dir.path(), "sidestep", Some("99-sidestep.conflist")).unwrap();
    assert_eq!(changed.len(), 1);
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
}
