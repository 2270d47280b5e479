//! DEL's ways of finding what to undo (record, netns, damaged or pending record, never
//! captured), and ADD across a reload that recreates the maps.

use std::path::Path;

use serde_json::{Value, json};

use super::{Harness, err_code};
use crate::spec::code;

#[test]
fn del_is_idempotent_and_survives_missing_pieces() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    // The netns is gone: the record's cookie still finds the enrolment.
    h.world.netns.borrow_mut().remove(Path::new("/run/netns/a"));
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("DEL", "c1", "", &conf).success);
    // No record, netns alive: its cookie is used.
    assert!(h.run("ADD", "c2", "/run/netns/b", &conf).success);
    std::fs::remove_file(h.state_dir().join("c2@eth0.json")).unwrap();
    assert!(h.run("DEL", "c2", "/run/netns/b", &conf).success);
    assert!(h.world.pods.borrow().is_empty());
    // Programs gone: still fine.
    h.world.loaded.set(false);
    assert!(h.run("DEL", "c3", "/run/netns/b", &conf).success);
    // A host netns on DEL is never unenrolled, and is not an error.
    assert!(h.run("DEL", "c4", "/proc/1/ns/net", &conf).success);
}

/// A reload that recreates the maps during ADD (after its enrolment, before its record) loses
/// that enrolment: ADD enrols again into the new maps. One that keeps racing fails the ADD with
/// "try again later" and leaves no record, never a pod running uncaptured.
#[test]
fn add_enrols_again_when_the_maps_were_recreated_meanwhile() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    h.world.reloads_after_enroll.set(1);
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.world.enrolments.get(), 2);
    assert!(h.world.pods.borrow().contains_key(&101));
    assert!(h.run("CHECK", "c1", "/run/netns/a", &conf).success);

    let h = Harness::new();
    h.world.reloads_after_enroll.set(u32::MAX);
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert_eq!(err_code(&o), code::TRY_AGAIN_LATER as u64);
    assert_eq!(h.world.enrolments.get(), 3);
    assert!(h.world.pods.borrow().is_empty());
    assert!(
        !h.files().iter().any(|f| f.ends_with(".json")),
        "{:?}",
        h.files()
    );
}

/// A pod ADD skipped has no record and no enrolment: its DEL touches no map. Another
/// attachment's enrolment of the same netns stays; a lost record of an enrolled pod still
/// unenrols it.
#[test]
fn del_of_a_pod_never_captured_unenrols_nothing() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    let skipped = h.conf(json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {}}}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &skipped).success);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    assert!(h.run("DEL", "c1", "/run/netns/a", &skipped).success);
    assert!(h.world.unenrolments.borrow().is_empty());

    // The same netns enrolled through another attachment: the skipped one's DEL keeps it.
    assert!(h.run("ADD", "c2", "/run/netns/a", &conf).success);
    assert!(h.run("DEL", "c1", "/run/netns/a", &skipped).success);
    assert!(h.world.pods.borrow().contains_key(&101));
    assert!(h.world.unenrolments.borrow().is_empty());

    // Enrolled, record lost: DEL still finds the enrolment by the netns and scans it away.
    std::fs::remove_file(h.state_dir().join("c2@eth0.json")).unwrap();
    assert!(h.run("DEL", "c2", "/run/netns/a", &conf).success);
    assert!(h.world.pods.borrow().is_empty());
    assert_eq!(*h.world.unenrolments.borrow(), vec![(101, false)]);
}

/// A pending record as an ADD killed after its first map write leaves it.
pub(super) fn pending_record(h: &Harness, cid: &str) {
    assert!(
        h.run("ADD", cid, "/run/netns/a", &h.conf(json!({})))
            .success
    );
    let path = h.state_dir().join(format!("{cid}@eth0.json"));
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["pending"] = json!(true);
    v["writerPid"] = json!(1);
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn a_pending_record_fails_check_and_lets_del_find_the_gone_netns() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    pending_record(&h, "c1");
    assert_eq!(
        err_code(&h.run("CHECK", "c1", "/run/netns/a", &conf)),
        code::CHECK_FAILED as u64
    );
    h.world.netns.borrow_mut().remove(Path::new("/run/netns/a"));
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
}

#[test]
fn a_retried_add_completes_a_pending_record() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    pending_record(&h, "c1");
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("CHECK", "c1", "/run/netns/a", &conf).success);
    let text = std::fs::read_to_string(h.state_dir().join("c1@eth0.json")).unwrap();
    assert!(
        !text.contains("pending") && !text.contains("writerPid"),
        "{text}"
    );
}

#[test]
fn a_failed_enrolment_leaves_no_pending_record_and_keeps_an_earlier_one() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    h.world.fail_enroll.set(true);
    assert!(!h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.files().is_empty(), "{:?}", h.files());
    h.world.fail_enroll.set(false);
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    let before = std::fs::read(h.state_dir().join("c1@eth0.json")).unwrap();
    h.world.fail_enroll.set(true);
    assert!(!h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert_eq!(
        std::fs::read(h.state_dir().join("c1@eth0.json")).unwrap(),
        before
    );
}
