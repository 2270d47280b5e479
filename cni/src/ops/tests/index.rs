//! The netns-cookie index (crate::state) through ADD, DEL and GC: which unenrolment DEL picks,
//! shared netns, state written by a plugin without the index, and what kills leave.

use std::{fs, path::PathBuf, time::SystemTime};

use serde_json::{Value, json};
use sidestep::statedir::index::{INCOMPLETE, SHARED};

use super::Harness;
use crate::state::StateDir;

impl Harness {
    fn state(&self) -> StateDir {
        StateDir::new(self.state_dir())
    }

    fn cookie_dir(&self, cookie: u64) -> PathBuf {
        self.state_dir().join("cookies").join(cookie.to_string())
    }

    /// Names in the cookie's index directory; empty when it has none.
    fn index(&self, cookie: u64) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.cookie_dir(cookie))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    fn no_index_left(&self) {
        let left: Vec<_> = fs::read_dir(self.state_dir().join("cookies"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "index left behind: {left:?}");
    }

    /// Turns the state dir into what the previous plugin version wrote: records without
    /// ifindexes, and no index.
    fn make_legacy(&self) {
        fs::remove_dir_all(self.state_dir().join("cookies")).unwrap();
        for e in fs::read_dir(self.state_dir()).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "json") {
                let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
                v.as_object_mut().unwrap().remove("inboundIfindexes");
                fs::write(&p, v.to_string()).unwrap();
            }
        }
    }

    fn unenrolments(&self) -> Vec<(u64, bool)> {
        self.world.unenrolments.borrow_mut().drain(..).collect()
    }
}

#[test]
fn del_of_a_sole_attachment_deletes_its_recorded_keys() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.index(101), ["c1@eth0"]);
    let text = fs::read_to_string(h.state_dir().join("c1@eth0.json")).unwrap();
    assert!(text.contains("\"inboundIfindexes\""), "{text}");
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.unenrolments(), [(101, true)]);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    h.no_index_left();
}

#[test]
fn shared_netns_first_del_keeps_the_enrolment_and_the_last_scans() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("ADD", "c1b", "/run/netns/a", &conf).success);
    assert_eq!(h.index(101), ["c1@eth0", "c1b@eth0", SHARED]);
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.world.pods.borrow().len(), 1);
    assert!(h.unenrolments().is_empty());
    assert_eq!(h.index(101), ["c1b@eth0", SHARED]);
    // The maps hold what the last ADD wrote, which one record may not describe: a scan.
    assert!(h.run("DEL", "c1b", "/run/netns/a", &conf).success);
    assert_eq!(h.unenrolments(), [(101, false)]);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    h.no_index_left();
}

#[test]
fn a_state_dir_without_index_is_answered_by_reading_the_records() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("ADD", "c1b", "/run/netns/a", &conf).success);
    assert!(h.run("ADD", "c2", "/run/netns/b", &conf).success);
    h.make_legacy();
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.world.pods.borrow().len(), 2, "c1b still uses netns a");
    assert!(h.run("DEL", "c1b", "/run/netns/a", &conf).success);
    assert!(h.run("DEL", "c2", "/run/netns/b", &conf).success);
    assert_eq!(h.unenrolments(), [(101, false), (202, false)]);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    h.no_index_left();
}

#[test]
fn an_attachment_added_beside_an_unindexed_one_does_not_trust_the_index() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "old", "/run/netns/a", &conf).success);
    h.make_legacy();
    // The new plugin finds netns a enrolled, with no entry to explain it.
    assert!(h.run("ADD", "new", "/run/netns/a", &conf).success);
    assert_eq!(h.index(101), [INCOMPLETE, "new@eth0"]);
    assert!(h.run("DEL", "new", "/run/netns/a", &conf).success);
    assert_eq!(
        h.world.pods.borrow().len(),
        1,
        "the old attachment still uses it"
    );
    // Its own entry is gone; the marker stays for the old record.
    assert_eq!(h.index(101), [INCOMPLETE]);
    assert!(h.run("DEL", "old", "/run/netns/a", &conf).success);
    assert_eq!(h.unenrolments(), [(101, false)]);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    h.no_index_left();
}

#[test]
fn kills_between_steps_leave_nothing_a_retry_or_gc_does_not_finish() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    // ADD killed after its entry, before its record: the entry names no record, and counts for
    // nothing. The runtime's DEL (no record, cookie from the netns) removes it.
    h.state()
        .index_attachment(101, "c1", "eth0", false)
        .unwrap();
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    h.no_index_left();

    // A stale entry of another attachment does not keep a netns enrolled.
    h.state()
        .index_attachment(101, "ghost", "eth0", false)
        .unwrap();
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert!(h.world.pods.borrow().is_empty());
    assert_eq!(h.index(101), ["ghost@eth0", SHARED]);
    // GC sweeps it once it is old enough not to be an ADD under way.
    let gc = h.conf(json!({"cniVersion": "1.1.0", "prevResult": null,
        "cni.dev/valid-attachments": []}));
    assert!(h.run("GC", "", "", &gc).success);
    assert_eq!(h.index(101), ["ghost@eth0", SHARED]);
    for name in ["ghost@eth0", SHARED] {
        let f = fs::File::options()
            .write(true)
            .open(h.cookie_dir(101).join(name))
            .unwrap();
        f.set_modified(SystemTime::now() - std::time::Duration::from_secs(120))
            .unwrap();
    }
    assert!(h.run("GC", "", "", &gc).success);
    h.no_index_left();

    // DEL killed after removing the record, before its entry: the retry (netns alive) removes it.
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    fs::remove_file(h.state_dir().join("c1@eth0.json")).unwrap();
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    h.no_index_left();

    // ADD killed after its pending record and retried: still a sole, exact enrolment.
    super::del::pending_record(&h, "c1");
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.index(101), ["c1@eth0"]);
    h.unenrolments();
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.unenrolments(), [(101, true)]);
    h.no_index_left();

    // A DEL of a pending record scans: its ADD may have stopped half-way through replacing an
    // earlier enrolment.
    super::del::pending_record(&h, "c1");
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.unenrolments(), [(101, false)]);
    h.no_index_left();
}

#[test]
fn failed_adds_and_gc_remove_their_entries() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    h.world.fail_enroll.set(true);
    assert!(!h.run("ADD", "c1", "/run/netns/a", &conf).success);
    h.no_index_left();
    h.world.fail_enroll.set(false);
    assert!(h.run("ADD", "keep", "/run/netns/a", &conf).success);
    assert!(h.run("ADD", "gone", "/run/netns/b", &conf).success);
    let gc = h.conf(json!({"cniVersion": "1.1.0", "prevResult": null,
        "cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]}));
    assert!(h.run("GC", "", "", &gc).success);
    assert_eq!(h.index(101), ["keep@eth0"]);
    assert!(h.index(202).is_empty());
    // The same attachment moved to another netns: its old cookie's entry goes.
    assert!(h.run("ADD", "keep", "/run/netns/b", &conf).success);
    assert!(h.index(101).is_empty());
    assert_eq!(h.index(202), ["keep@eth0"]);
}
