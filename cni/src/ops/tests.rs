//! The operations end to end through [`crate::plugin::run`], on a fake data path.

use std::{
    cell::{Cell, RefCell},
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
    rc::Rc,
};

use serde_json::{Value, json};
use sidestep::{
    enroll::{
        Enrolled, Plan, Removal,
        verify::{self, Expected, Mismatch, Observed, PodEntry},
    },
    error::{EnrollError, MapsError, NetnsError},
    policy::Policy,
};

use crate::{
    config::PluginConfig,
    dataplane::{Ask, Dataplane, Facts},
    plugin::{Deps, Outcome, run},
    podsource::{PodReader, Unavailable},
    spec::code,
};

#[derive(Default)]
struct World {
    loaded: Cell<bool>,
    /// netns path -> cookie; "/proc/1/ns/net" is the host.
    netns: RefCell<BTreeMap<PathBuf, u64>>,
    pods: RefCell<BTreeMap<u64, Policy>>,
    links: RefCell<BTreeMap<u64, Vec<String>>>,
    fail_enroll: Cell<bool>,
    /// Ports something listens on in every netns.
    listening: RefCell<Vec<u16>>,
    /// What every netns reports as its addresses.
    addresses: RefCell<Vec<std::net::IpAddr>>,
    /// Each unenrolment: the cookie, and whether it deleted a record's keys (or scanned).
    unenrolments: RefCell<Vec<(u64, bool)>>,
    /// Reloads that recreate the maps right after an enrolment wrote them (and so lose it).
    reloads_after_enroll: Cell<u32>,
    enrolments: Cell<u32>,
}

struct Fake(Rc<World>, PathBuf);

impl Fake {
    fn enrol(&self, netns: &Path, policy: &Policy, ifname: &str) -> Result<Enrolled, EnrollError> {
        if !self.is_loaded() {
            return Err(MapsError::NotLoaded(self.1.clone()).into());
        }
        let cookie = self.netns_cookie(netns)?;
        if self.0.fail_enroll.get() {
            return Err(MapsError::Full {
                map: "SIDESTEP_POD",
                capacity: 1,
            }
            .into());
        }
        self.0.enrolments.set(self.0.enrolments.get() + 1);
        self.0.pods.borrow_mut().insert(cookie, policy.clone());
        self.0
            .links
            .borrow_mut()
            .insert(cookie, vec![ifname.to_owned()]);
        Ok(Enrolled {
            netns_cookie: cookie,
            entries: policy.to_map_entries(cookie),
            interfaces: vec![ifname.to_owned()],
            inbound_ifindexes: vec![2],
            netns_keys: Default::default(),
        })
    }

    /// What a real enrolment pins for the policy's re-routed interfaces.
    fn reroute_pins(&self, cookie: u64) -> Vec<String> {
        self.0
            .pods
            .borrow()
            .get(&cookie)
            .map_or_else(Vec::new, |p| {
                p.reroute_virtual_interfaces
                    .iter()
                    .flat_map(|i| {
                        [
                            format!("{i}:reroute-ingress"),
                            format!("{i}:reroute-egress"),
                        ]
                    })
                    .collect()
            })
    }
}

impl Dataplane for Fake {
    fn pin_root(&self) -> &Path {
        &self.1
    }
    fn is_loaded(&self) -> bool {
        self.0.loaded.get()
    }
    fn netns_cookie(&self, netns: &Path) -> Result<u64, NetnsError> {
        if netns == Path::new("/proc/1/ns/net") {
            return Err(NetnsError::HostNetns(netns.into()));
        }
        self.0
            .netns
            .borrow()
            .get(netns)
            .copied()
            .ok_or_else(|| NetnsError::Open {
                path: netns.into(),
                source: io::ErrorKind::NotFound.into(),
            })
    }
    fn facts(&self, netns: &Path, cookie: u64, ask: Ask) -> Facts {
        let enrolled_hook = self.0.pods.borrow().get(&cookie).map(|p| p.inbound_hook);
        Facts {
            enrolled: self.0.pods.borrow().contains_key(&cookie),
            enrolled_hook,
            listening: ask
                .listening_on
                .filter(|_| enrolled_hook.is_none())
                .map(|port| {
                    self.netns_cookie(netns)?;
                    Ok(self.0.listening.borrow().contains(&port))
                }),
            addresses: if ask.addresses {
                self.0.addresses.borrow().clone()
            } else {
                Vec::new()
            },
        }
    }
    fn apply(&self, plan: &Plan) -> Result<Enrolled, EnrollError> {
        self.enrol(&plan.netns, &plan.policy, &plan.ifname)
    }
    fn current(&self) -> bool {
        let reloads = self.0.reloads_after_enroll.get();
        if reloads == 0 {
            return true;
        }
        self.0.reloads_after_enroll.set(reloads - 1);
        self.0.pods.borrow_mut().clear();
        false
    }
    fn remove(&self, cookie: u64, removal: Removal<'_>) -> Result<bool, EnrollError> {
        match removal {
            Removal::Attachment { ifname, .. } => {
                if let Some(links) = self.0.links.borrow_mut().get_mut(&cookie) {
                    links.retain(|l| l != ifname);
                }
                return Ok(true);
            }
            Removal::Recorded(recorded) => {
                assert_eq!(recorded.inbound_ifindexes, Some(&[2][..]));
                self.0.unenrolments.borrow_mut().push((cookie, true));
            }
            Removal::Scan => self.0.unenrolments.borrow_mut().push((cookie, false)),
        }
        self.0.links.borrow_mut().remove(&cookie);
        Ok(self.0.pods.borrow_mut().remove(&cookie).is_some())
    }
    /// The library's rule ([`verify::compare`]) over what this world holds.
    fn verify(&self, cookie: u64, expected: &Expected<'_>) -> Result<(), Mismatch> {
        let links = self.0.links.borrow().get(&cookie).cloned();
        let observed = Observed {
            pod_entry: match self.0.pods.borrow().get(&cookie) {
                None => PodEntry::Missing,
                Some(p) if p == expected.policy => PodEntry::Matches,
                Some(_) => PodEntry::Differs,
            },
            reroute_pins: self.reroute_pins(cookie),
            sk_lookup: links.is_some(),
            identity: links.is_some(),
            missing_addresses: Vec::new(),
            tc_interfaces: links.unwrap_or_default(),
        };
        verify::compare(&self.1, cookie, expected, &observed)
    }
    fn traces(&self, cookie: u64) -> bool {
        self.0.links.borrow().contains_key(&cookie) || self.0.pods.borrow().contains_key(&cookie)
    }
}

struct FakeDeps(Rc<World>);

impl Deps for FakeDeps {
    fn dataplane(&self, cfg: &PluginConfig) -> Box<dyn Dataplane> {
        Box::new(Fake(self.0.clone(), cfg.pin_root.clone()))
    }
    fn pod_reader(&self, _: &PluginConfig) -> Box<dyn PodReader> {
        Box::new(Unavailable("no API in tests".into()))
    }
}

struct Harness {
    world: Rc<World>,
    tmp: tempfile::TempDir,
}

const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;

impl Harness {
    fn new() -> Self {
        let world = Rc::new(World::default());
        world.loaded.set(true);
        world.netns.borrow_mut().insert("/run/netns/a".into(), 101);
        world.netns.borrow_mut().insert("/run/netns/b".into(), 202);
        Self {
            world,
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    fn state_dir(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    fn conf(&self, extra: Value) -> Value {
        let mut v = json!({
            "cniVersion": "1.0.0", "name": "net", "type": "sidestep",
            "pin_root": "/sys/fs/bpf/fake", "state_dir": self.state_dir(),
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS}},
            "prevResult": {"cniVersion": "1.0.0",
                "interfaces": [{"name": "eth0", "sandbox": "/run/netns/a"}],
                "ips": [{"address": "10.0.0.5/24", "interface": 0}]}
        });
        for (k, val) in extra.as_object().unwrap() {
            if val.is_null() {
                v.as_object_mut().unwrap().remove(k);
            } else {
                v[k] = val.clone();
            }
        }
        v
    }

    fn run(&self, cmd: &str, cid: &str, netns: &str, conf: &Value) -> Outcome {
        self.run_if(cmd, cid, "eth0", netns, conf)
    }

    /// [`Harness::run`] for another attachment (CNI_IFNAME) of the container.
    fn run_if(&self, cmd: &str, cid: &str, ifname: &str, netns: &str, conf: &Value) -> Outcome {
        let env: BTreeMap<&str, String> = BTreeMap::from([
            ("CNI_COMMAND", cmd.to_owned()),
            ("CNI_CONTAINERID", cid.to_owned()),
            ("CNI_NETNS", netns.to_owned()),
            ("CNI_IFNAME", ifname.to_owned()),
            ("CNI_PATH", "/opt/cni/bin".to_owned()),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=shop".to_owned(),
            ),
        ]);
        run(
            &|k| env.get(k).cloned().filter(|v| !v.is_empty()),
            &serde_json::to_vec(conf).unwrap(),
            &FakeDeps(self.world.clone()),
        )
    }

    fn files(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (dir, prefix) in [
            (self.state_dir(), ""),
            (self.state_dir().join("failopen"), "failopen/"),
        ] {
            if let Ok(rd) = std::fs::read_dir(dir) {
                out.extend(
                    rd.flatten()
                        .filter(|e| e.path().is_file())
                        // The invocation timing log (crate::timing) is not state.
                        .filter(|e| e.file_name() != sidestep::statedir::timings::FILE_NAME)
                        .map(|e| format!("{prefix}{}", e.file_name().to_string_lossy())),
                );
            }
        }
        out.sort();
        out
    }
}

fn err_code(o: &Outcome) -> u64 {
    assert!(!o.success, "expected an error, got {:?}", o.stdout);
    o.stdout.as_ref().unwrap()["code"].as_u64().unwrap()
}

#[test]
fn add_enrols_records_and_passes_prev_result_through() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(o.success, "{:?}", o.stdout);
    assert_eq!(o.stdout.unwrap(), conf["prevResult"]);
    let pods = h.world.pods.borrow();
    assert_eq!(
        pods[&101].pod_ips,
        ["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]
    );
    drop(pods);
    assert_eq!(h.files(), ["c1@eth0.json"]);
    // Repeated ADD: same state.
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.world.pods.borrow().len(), 1);
    assert_eq!(h.files(), ["c1@eth0.json"]);
    let rec: Value =
        serde_json::from_slice(&std::fs::read(h.state_dir().join("c1@eth0.json")).unwrap())
            .unwrap();
    assert_eq!(rec["netnsCookie"], 101);
    assert_eq!(rec["podName"], "web");
    assert_eq!(rec["interfaces"], json!(["eth0"]));
}

#[test]
fn add_without_prev_result_prints_an_empty_result() {
    let h = Harness::new();
    for v in ["0.3.0", "0.4.0", "1.1.0"] {
        let conf = h.conf(json!({"cniVersion": v, "prevResult": null}));
        let o = h.run("ADD", "c1", "/run/netns/a", &conf);
        assert_eq!(
            o.stdout.unwrap(),
            json!({"cniVersion": v, "interfaces": [], "ips": [], "dns": {}})
        );
    }
}

#[test]
fn skipped_pods_change_nothing() {
    let h = Harness::new();
    let conf = h.conf(json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {}}}));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(o.success);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    // CHECK of a skipped pod passes: the same inputs skip it again.
    assert!(h.run("CHECK", "c1", "/run/netns/a", &conf).success);
}

#[test]
fn not_loaded_fails_closed_or_open() {
    let h = Harness::new();
    h.world.loaded.set(false);
    let o = h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})));
    assert_eq!(err_code(&o), code::TRY_AGAIN_LATER as u64);
    let out = o.stdout.unwrap();
    let msg = out["msg"].as_str().unwrap().to_owned();
    assert!(msg.contains("/sys/fs/bpf/fake"), "{msg}");
    assert!(out["details"].as_str().unwrap().contains("sidestep load"));
    assert!(h.files().is_empty());
    // On a cluster (the agent wrote its namespace into the entry) the hint is its pod.
    let o = h.run(
        "ADD",
        "c1",
        "/run/netns/a",
        &h.conf(json!({"pod_namespace": "sidestep-system"})),
    );
    let details = o.stdout.unwrap()["details"].as_str().unwrap().to_owned();
    assert!(
        details.contains("kubectl -n sidestep-system") && !details.contains("sidestep load"),
        "{details}"
    );

    let conf = h.conf(json!({"fail_strategy": "FAIL_OPEN"}));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(o.success);
    assert_eq!(o.stdout.unwrap(), conf["prevResult"]);
    assert_eq!(h.files(), ["failopen/c1@eth0.json"]);
    assert!(h.run("CHECK", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert!(h.files().is_empty());
}

#[test]
fn enrol_failure_fails_open_but_bad_input_does_not() {
    let h = Harness::new();
    h.world.fail_enroll.set(true);
    let o = h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})));
    assert_eq!(err_code(&o), code::ENROLL_FAILED as u64);
    let open = h.conf(json!({"fail_strategy": "FAIL_OPEN"}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &open).success);
    let bad = h.conf(json!({"fail_strategy": "FAIL_OPEN", "runtimeConfig": {
        "io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": STATUS,
            "traffic.sidecar.istio.io/includeInboundPorts": "70000"}}}));
    let o = h.run("ADD", "c2", "/run/netns/b", &bad);
    assert_eq!(err_code(&o), code::BAD_ANNOTATION as u64);
    assert!(
        o.stdout.unwrap()["msg"]
            .as_str()
            .unwrap()
            .contains("includeInboundPorts=\"70000\"")
    );
}

#[test]
fn record_failure_rolls_the_enrolment_back() {
    let h = Harness::new();
    std::fs::write(h.state_dir(), "not a directory").unwrap();
    let o = h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})));
    assert_eq!(err_code(&o), code::STATE as u64);
    assert!(h.world.pods.borrow().is_empty());
    assert!(h.world.links.borrow().is_empty());
}

#[test]
fn bad_netns_is_refused() {
    let h = Harness::new();
    for netns in ["/proc/1/ns/net", "/run/netns/nope"] {
        let o = h.run("ADD", "c1", netns, &h.conf(json!({})));
        assert_eq!(err_code(&o), code::INVALID_NETNS as u64, "{netns}");
        assert_eq!(
            err_code(&h.run("CHECK", "c1", netns, &h.conf(json!({})))),
            8
        );
    }
    let o = h.run("ADD", "c1", "", &h.conf(json!({})));
    assert_eq!(err_code(&o), code::INVALID_ENV as u64);
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
}

#[test]
fn check_verifies_map_links_and_programs() {
    // The default hook: CHECK needs the netns's sk_lookup link.
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("CHECK", "c1", "/run/netns/a", &conf).success);
    h.world.links.borrow_mut().remove(&101);
    let o = h.run("CHECK", "c1", "/run/netns/a", &conf);
    assert_eq!(err_code(&o), code::CHECK_FAILED as u64);
    assert!(
        o.stdout.unwrap()["msg"]
            .as_str()
            .unwrap()
            .contains("sk_lookup")
    );

    // The tc hook: also each recorded interface's tc link.
    let h = Harness::new();
    let conf = h.conf(json!({"inbound_hook": "tc"}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("CHECK", "c1", "/run/netns/a", &conf).success);

    h.world.links.borrow_mut().insert(101, vec![]);
    let o = h.run("CHECK", "c1", "/run/netns/a", &conf);
    assert_eq!(err_code(&o), code::CHECK_FAILED as u64);
    assert!(
        o.stdout.unwrap()["msg"]
            .as_str()
            .unwrap()
            .contains("tc program")
    );

    let p = h.world.pods.borrow_mut().remove(&101).unwrap();
    let o = h.run("CHECK", "c1", "/run/netns/a", &conf);
    assert!(
        o.stdout.unwrap()["msg"]
            .as_str()
            .unwrap()
            .contains("not in the pod map")
    );

    h.world
        .pods
        .borrow_mut()
        .insert(101, Policy { proxy_uid: 1, ..p });
    let o = h.run("CHECK", "c1", "/run/netns/a", &conf);
    assert!(
        o.stdout.unwrap()["msg"]
            .as_str()
            .unwrap()
            .contains("differs")
    );

    h.world.loaded.set(false);
    assert_eq!(
        err_code(&h.run("CHECK", "c1", "/run/netns/a", &conf)),
        code::TRY_AGAIN_LATER as u64
    );

    // An enrolable pod with no record at all.
    h.world.loaded.set(true);
    let o = h.run("CHECK", "c9", "/run/netns/b", &conf);
    assert!(
        o.stdout.unwrap()["msg"]
            .as_str()
            .unwrap()
            .contains("no record")
    );
    // CHECK is not in 0.3.x.
    let old = h.conf(json!({"cniVersion": "0.3.1", "prevResult": null}));
    assert_eq!(err_code(&h.run("CHECK", "c1", "/run/netns/a", &old)), 1);
}

#[test]
fn gc_removes_what_is_not_listed() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "keep", "/run/netns/a", &conf).success);
    assert!(h.run("ADD", "gone", "/run/netns/b", &conf).success);
    let other = h.conf(json!({"name": "other"}));
    h.world
        .netns
        .borrow_mut()
        .insert("/run/netns/c".into(), 303);
    assert!(h.run("ADD", "othernet", "/run/netns/c", &other).success);
    let gc = h.conf(json!({"cniVersion": "1.1.0", "prevResult": null,
        "cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]}));
    let o = h.run("GC", "", "", &gc);
    assert!(o.success, "{:?}", o.stdout);
    assert_eq!(h.files(), ["keep@eth0.json", "othernet@eth0.json"]);
    let pods: Vec<u64> = h.world.pods.borrow().keys().copied().collect();
    assert_eq!(pods, [101, 303]);
}

#[test]
fn shared_netns_stays_enrolled_until_its_last_attachment() {
    let h = Harness::new();
    let conf = h.conf(json!({}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.run("ADD", "c1b", "/run/netns/a", &conf).success);
    assert!(h.run("DEL", "c1", "/run/netns/a", &conf).success);
    assert_eq!(h.world.pods.borrow().len(), 1);
    assert!(h.run("DEL", "c1b", "/run/netns/a", &conf).success);
    assert!(h.world.pods.borrow().is_empty());
}

#[test]
fn status_and_version() {
    let h = Harness::new();
    let conf = h.conf(json!({"cniVersion": "1.1.0", "prevResult": null}));
    let o = h.run("STATUS", "", "", &conf);
    assert!(o.success && o.stdout.is_none());
    h.world.loaded.set(false);
    assert_eq!(
        err_code(&h.run("STATUS", "", "", &conf)),
        code::NOT_AVAILABLE as u64
    );
    let o = h.run("VERSION", "", "", &json!({"cniVersion": "0.4.0"}));
    assert_eq!(o.stdout.unwrap()["cniVersion"], "0.4.0");
    let o = h.run("VERSION", "", "", &json!("garbage"));
    assert_eq!(
        o.stdout.unwrap()["supportedVersions"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    assert_eq!(
        err_code(&h.run("BOGUS", "", "", &conf)),
        code::INVALID_ENV as u64
    );
}

#[test]
fn config_policy_for_workloads_without_kubernetes() {
    let h = Harness::new();
    let conf = h.conf(json!({"policy": {"proxyUid": 1500}, "runtimeConfig": null}));
    let env: BTreeMap<&str, &str> = BTreeMap::from([
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "podman1"),
        ("CNI_NETNS", "/run/netns/a"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web"),
    ]);
    let o = run(
        &|k| env.get(k).map(|v| (*v).to_owned()),
        &serde_json::to_vec(&conf).unwrap(),
        &FakeDeps(h.world.clone()),
    );
    assert!(o.success, "{:?}", o.stdout);
    assert_eq!(h.world.pods.borrow()[&101].proxy_uid, 1500);
}

#[test]
fn pod_addresses_and_hairpin_follow_the_mesh() {
    // Linkerd: no hairpin, but the pod's addresses are registered, since the inbound programs
    // find the pod by them.
    let h = Harness::new();
    let conf = h.conf(json!({
        "mesh": "linkerd",
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"linkerd.io/proxy-version": "stable-2.14.0"}},
    }));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(o.success, "{:?}", o.stdout);
    let p = h.world.pods.borrow()[&101].clone();
    assert!(!p.hairpin);
    assert_eq!(p.pod_ips, ["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]);
    let flags = p.to_map_entries(101).pod.flags;
    assert_eq!(flags & sidestep_abi::flags::HAIRPIN, 0);
    assert_ne!(flags & sidestep_abi::flags::INBOUND, 0);
    assert_eq!(p.inbound_hook, sidestep::policy::InboundHook::SkLookup);

    // Istio: hairpin on.
    let h = Harness::new();
    assert!(
        h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    let p = h.world.pods.borrow()[&101].clone();
    assert!(p.hairpin);
    assert_ne!(
        p.to_map_entries(101).pod.flags & sidestep_abi::flags::HAIRPIN,
        0
    );
}

#[test]
fn sk_lookup_falls_back_to_tc_where_it_cannot_work() {
    use sidestep::policy::InboundHook;
    let hook = |h: &Harness| h.world.pods.borrow()[&101].inbound_hook;
    // No IPs in prevResult: the netns's own addresses, and sk_lookup.
    let h = Harness::new();
    h.world
        .addresses
        .borrow_mut()
        .push("10.0.0.9".parse().unwrap());
    let conf = h.conf(json!({"prevResult": {"cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "sandbox": "/run/netns/a"}], "ips": []}}));
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert_eq!(
        h.world.pods.borrow()[&101].pod_ips,
        ["10.0.0.9".parse::<std::net::IpAddr>().unwrap()]
    );
    assert_eq!(hook(&h), InboundHook::SkLookup);

    // No address anywhere: still sk_lookup, whose identity program names the pod.
    let h = Harness::new();
    assert!(h.run("ADD", "c1", "/run/netns/a", &conf).success);
    assert!(h.world.pods.borrow()[&101].pod_ips.is_empty());
    assert_eq!(hook(&h), InboundHook::SkLookup);

    // The inbound port listens already (an ADD into a running pod): tc.
    let h = Harness::new();
    h.world.listening.borrow_mut().push(15006);
    assert!(
        h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    assert_eq!(hook(&h), InboundHook::Tc);
    let rec: Value =
        serde_json::from_slice(&std::fs::read(h.state_dir().join("c1@eth0.json")).unwrap())
            .unwrap();
    assert_eq!(rec["policy"]["inboundHook"], "tc");

    // A second attachment of a netns enrolled with tc keeps tc, even with nothing listening,
    // and one of a netns enrolled with sk_lookup keeps sk_lookup with the proxy listening.
    let h = Harness::new();
    h.world.listening.borrow_mut().push(15006);
    assert!(
        h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    h.world.listening.borrow_mut().clear();
    assert!(
        h.run_if("ADD", "c1", "net1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    assert_eq!(hook(&h), InboundHook::Tc);
    let h = Harness::new();
    assert!(
        h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    h.world.listening.borrow_mut().push(15006);
    assert!(
        h.run_if("ADD", "c1", "net1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    assert_eq!(hook(&h), InboundHook::SkLookup);

    // Another port listening changes nothing.
    let h = Harness::new();
    h.world.listening.borrow_mut().push(8080);
    assert!(
        h.run("ADD", "c1", "/run/netns/a", &h.conf(json!({})))
            .success
    );
    assert_eq!(hook(&h), InboundHook::SkLookup);
}

mod del;
mod index;
mod repair;

#[test]
fn decide_only_reports_the_decision_and_changes_nothing() {
    let h = Harness::new();
    let conf = h.conf(json!({"decide_only": true}));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    assert!(o.success, "{:?}", o.stdout);
    let v: Value = o.stdout.clone().unwrap();
    assert_eq!(v["sidestepDecision"], "enrol", "{v}");
    assert!(h.world.pods.borrow().is_empty(), "decide_only enrolled");

    let h = Harness::new();
    let conf = h.conf(json!({
        "decide_only": true,
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {}},
    }));
    let o = h.run("ADD", "c1", "/run/netns/a", &conf);
    let v: Value = o.stdout.clone().unwrap();
    assert_eq!(v["sidestepDecision"], "skip", "{v}");
    assert!(v["reason"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
    assert!(h.world.pods.borrow().is_empty());
}

/// With ambient on, a pod decided from the runtime's annotations (the API did not answer) could
/// be ambient: it is not let through as a plain pod; an injected sidecar pod still is decided.
#[test]
fn ambient_without_the_api_fails_closed_for_pods_that_could_be_ambient() {
    let h = Harness::new();
    let api = json!({"kubeconfig": "/nonexistent/kubeconfig", "pod_read_retries": 1,
                     "pod_read_interval_ms": 1});
    let plain = h.conf(json!({"ambient_enabled": true, "kubernetes": api,
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {}}}));
    let o = h.run("ADD", "c1", "/run/netns/a", &plain);
    assert_eq!(err_code(&o), code::POD_UNREADABLE as u64);
    let msg = o.stdout.unwrap()["msg"].as_str().unwrap().to_owned();
    assert!(msg.contains("ambient"), "{msg}");
    assert!(h.world.pods.borrow().is_empty() && h.files().is_empty());
    // FAIL_OPEN lets it through, marked.
    let mut open = plain.clone();
    open["fail_strategy"] = json!("FAIL_OPEN");
    assert!(h.run("ADD", "c1", "/run/netns/a", &open).success);
    assert_eq!(h.files(), ["failopen/c1@eth0.json"]);
    assert!(h.run("DEL", "c1", "/run/netns/a", &open).success);
    // A sidecar-injected pod is never ambient: decided from its annotations as before.
    let injected = h.conf(json!({"ambient_enabled": true, "kubernetes": api}));
    assert!(h.run("ADD", "c2", "/run/netns/b", &injected).success);
    assert_eq!(h.world.pods.borrow().len(), 1);
}
