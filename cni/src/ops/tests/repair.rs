//! ADD as the agent's repair runs it.

use serde_json::json;

use super::Harness;

/// The agent's repair names the netns it found by cookie: a path that names another netns now
/// (a `/proc/PID` path whose PID another process took) is refused before anything is decided or
/// enrolled, so the plugin never enters that netns's user namespace.
#[test]
fn add_refuses_a_netns_other_than_the_one_repair_found() {
    let h = Harness::new();
    let conf = h.conf(json!({"expect_netns_cookie": 202}));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(!o.success, "{:?}", o.stdout);
    assert!(h.world.pods.borrow().is_empty(), "enrolled another netns");
    let conf = h.conf(json!({"expect_netns_cookie": 202, "decide_only": true}));
    assert!(!h.run("ADD", "c1", "/run/netns/a", &conf).success);
    let conf = h.conf(json!({"expect_netns_cookie": 101}));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(o.success, "{:?}", o.stdout);
    assert_eq!(h.world.pods.borrow().len(), 1);
}
