//! The state directory as the plugin's operations see it: the library's types
//! ([`sidestep::statedir`], which owns the format, the index and the timings, and whose
//! documentation describes the layout and its rules), with the CNI error code a state failure
//! is reported under.

pub use sidestep::statedir::{
    FailOpenMarker, RECORD_FORMAT, Record, Sharing, StateDir, StateError, now_unix, salvage_cookie,
};

use crate::spec::{CniError, code, error::ToCniError};

impl ToCniError for StateError {
    fn to_cni(&self) -> CniError {
        CniError::new(code::STATE, self.to_string())
    }
}

/// Writes the record fixtures that the library's readers must keep reading
/// (`userspace/fixtures/state/`), with this build's writer. Run by hand when the format changes:
/// `SIDESTEP_WRITE_FIXTURES=1 cargo test -p sidestep-cni write_record_fixtures -- --ignored`.
#[cfg(test)]
mod fixtures {
    use std::net::IpAddr;

    use sidestep::{
        enroll::{NetnsKeys, Route, source::SourceRoute},
        policy::{InboundHook, InterceptionMode, Policy, parse_cidr_set, parse_port_set},
    };

    use super::*;
    use std::{fs, path::Path};

    fn full_record() -> Record {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let policy = Policy {
            proxy_uid: 1337,
            proxy_gid: 1337,
            interception_mode: InterceptionMode::Redirect,
            include_outbound_ip_ranges: parse_cidr_set("x", "10.0.0.0/8,fd00::/8").unwrap(),
            exclude_outbound_ip_ranges: parse_cidr_set("x", "10.96.0.1/32").unwrap(),
            include_outbound_ports: parse_port_set("x", "").unwrap(),
            exclude_outbound_ports: parse_port_set("x", "5432").unwrap(),
            include_inbound_ports: parse_port_set("x", "*").unwrap(),
            exclude_inbound_ports: parse_port_set("x", "15020,15021").unwrap(),
            exclude_interfaces: vec!["net1".into()],
            reroute_virtual_interfaces: vec!["tun0".into()],
            dns_capture: true,
            pod_ips: vec![ip("10.1.2.3"), ip("fd00::3")],
            inbound_hook: InboundHook::Tc,
            debug: true,
            ..Policy::default()
        };
        Record {
            format: RECORD_FORMAT,
            network: "k8s-pod-network".into(),
            container_id: "0123456789abcdef".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/cni-1234".into(),
            netns_cookie: 4_294_967_337,
            interfaces: vec!["eth0".into()],
            inbound_ifindexes: Some(vec![2]),
            netns_keys: Some(NetnsKeys {
                addresses: vec![ip("10.1.2.4")],
                interface_addresses: vec![ip("10.1.2.3"), ip("fd00::3")],
                excluded_ifindexes: vec![3],
                rerouted_ifindexes: vec![4],
                routes: vec![Route {
                    destination: ip("192.168.0.0"),
                    prefix_len: 16,
                    ifindex: 3,
                    metric: 100,
                }],
                source_routes: vec![SourceRoute {
                    destination: ip("172.16.0.0"),
                    prefix_len: 12,
                    source: ip("10.1.2.4"),
                }],
                proxy_host_ids: Some((101_337, 101_337)),
                route_localnet: false,
            }),
            pod_name: Some("web-7d4b9c".into()),
            pod_namespace: Some("shop".into()),
            mesh: "istio".into(),
            policy,
            pin_root: "/sys/fs/bpf/sidestep".into(),
            created_unix: 1_796_000_000,
            pending: false,
            writer_pid: None,
        }
    }

    #[test]
    #[ignore = "writes the fixtures; run by hand when the record format changes"]
    fn write_record_fixtures() {
        assert!(std::env::var_os("SIDESTEP_WRITE_FIXTURES").is_some());
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../userspace/fixtures/state");
        let state = StateDir::new(tempfile::tempdir().unwrap().keep());
        let full = full_record();
        state.write_record(&full).unwrap();
        fs::copy(
            state.record_path(&full.container_id, &full.ifname),
            dir.join("record-full.json"),
        )
        .unwrap();
        let pending = Record {
            container_id: "fedcba9876543210".into(),
            inbound_ifindexes: None,
            netns_keys: None,
            ..full_record()
        };
        state.write_pending(&pending).unwrap();
        let mut text =
            fs::read_to_string(state.record_path(&pending.container_id, "eth0")).unwrap();
        // A fixed PID: the test's own would change the file at every run.
        let pid = format!("\"writerPid\": {}", std::process::id());
        text = text.replace(&pid, "\"writerPid\": 4242");
        fs::write(dir.join("record-pending.json"), text).unwrap();
        let marker = FailOpenMarker {
            network: "k8s-pod-network".into(),
            container_id: "00aa11bb22cc33dd".into(),
            ifname: "eth0".into(),
            pod_name: Some("batch-1".into()),
            pod_namespace: Some("jobs".into()),
            reason: "sidestep is not loaded at /sys/fs/bpf/sidestep".into(),
            created_unix: 1_796_000_100,
        };
        state.write_marker(&marker).unwrap();
        fs::copy(
            state.marker_path(&marker.container_id, &marker.ifname),
            dir.join("marker.json"),
        )
        .unwrap();
        fs::remove_dir_all(state.root()).unwrap();
    }
}
