//! The files of the state directory: a record per attachment, a marker per pod let through
//! uncaptured, and the agent's lenient view of a record.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::policy::Policy;

pub const RECORD_FORMAT: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub format: u32,
    pub network: String,
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
    pub netns: PathBuf,
    pub netns_cookie: u64,
    /// Interfaces that carry the inbound tc program.
    pub interfaces: Vec<String>,
    /// Their ifindexes inside the pod, as enrolment keyed them in `SIDESTEP_IFACES`. Absent in
    /// pending records and in records of older plugins (DEL then finds the keys by a scan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inbound_ifindexes: Option<Vec<u32>>,
    /// The keys enrolment derived from the netns (its addresses, excluded interfaces, routes),
    /// and the addresses of this attachment's interface. Absent in pending records and in
    /// records of older plugins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_keys: Option<crate::enroll::NetnsKeys>,
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    pub mesh: String,
    pub policy: Policy,
    pub pin_root: PathBuf,
    pub created_unix: u64,
    /// Written before enrolment starts; cleared when ADD finished. Absent in older records.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending: bool,
    /// The PID of the plugin that wrote a pending record: once it is gone, the ADD is dead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer_pid: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailOpenMarker {
    pub network: String,
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    pub reason: String,
    pub created_unix: u64,
}

impl Record {
    /// What the enrolment wrote, as its DEL removes it without a scan.
    pub fn recorded(&self) -> crate::enroll::Recorded<'_> {
        crate::enroll::Recorded {
            policy: &self.policy,
            inbound_ifindexes: self.inbound_ifindexes.as_deref(),
            netns_keys: self.netns_keys.as_ref(),
        }
    }
}

/// The fields of a [`Record`] the agent lists pods by, read leniently: a record whose policy has
/// keys this build does not know (a newer plugin's), or that lacks fields older plugins did not
/// write, still names its pod, netns and cookie, so the agent can collect it. [`Record`] itself
/// refuses both, and the operations that act on a policy use it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordSummary {
    /// [`RECORD_FORMAT`] for every record written so far; not checked here.
    #[serde(default)]
    pub format: Option<u64>,
    pub network: String,
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
    pub netns: PathBuf,
    pub netns_cookie: u64,
    #[serde(default)]
    pub pod_name: Option<String>,
    #[serde(default)]
    pub pod_namespace: Option<String>,
    #[serde(default)]
    pub pin_root: Option<PathBuf>,
    #[serde(default)]
    pub policy: SummaryPolicy,
    /// Its ADD is under way (or died before finishing).
    #[serde(default)]
    pub pending: bool,
    #[serde(default)]
    pub created_unix: u64,
}

/// The part of the recorded policy the agent lists pods by.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryPolicy {
    #[serde(default)]
    pub exclude_interfaces: Vec<String>,
    #[serde(default)]
    pub ambient: bool,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::policy::InboundHook;

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/state")
                .join(name),
        )
        .unwrap()
    }

    /// Records written by earlier releases (the plugin of 8cf2b51, the first record format, and
    /// of the release before the state directory had one owner) read with today's types, as the
    /// plugin and the agent both read them.
    #[test]
    fn records_of_earlier_releases_still_read() {
        let first: Record =
            serde_json::from_slice(&fixture("record-format1-8cf2b51.json")).unwrap();
        assert_eq!(first.format, RECORD_FORMAT);
        assert_eq!(first.netns_cookie, 8_589_934_601);
        assert_eq!(first.inbound_ifindexes, None);
        assert_eq!(first.netns_keys, None);
        assert!(!first.pending);
        // A record from before the hook was recorded was enrolled with tc.
        assert_eq!(first.policy.inbound_hook, InboundHook::Tc);
        assert_eq!(
            first.policy.pod_ips,
            ["10.244.1.17".parse::<std::net::IpAddr>().unwrap()]
        );

        let full: Record = serde_json::from_slice(&fixture("record-full.json")).unwrap();
        let keys = full.netns_keys.as_ref().unwrap();
        assert_eq!(keys.proxy_host_ids, Some((101_337, 101_337)));
        assert_eq!(keys.source_routes.len(), 1);
        assert_eq!(keys.routes[0].metric, 100);
        assert_eq!(full.policy.exclude_interfaces, ["net1"]);
        // Written back, it is the same file: nothing of it is lost or renamed.
        let again = serde_json::to_vec_pretty(&full).unwrap();
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&again).unwrap(),
            serde_json::from_slice::<serde_json::Value>(&fixture("record-full.json")).unwrap()
        );

        let pending: Record = serde_json::from_slice(&fixture("record-pending.json")).unwrap();
        assert!(pending.pending);
        assert_eq!(pending.writer_pid, Some(4242));

        let marker: FailOpenMarker = serde_json::from_slice(&fixture("marker.json")).unwrap();
        assert_eq!(marker.pod_name.as_deref(), Some("batch-1"));
    }

    /// The agent's view agrees with the full record on every field they share, for every
    /// fixture, so the two cannot drift apart.
    #[test]
    fn the_summary_agrees_with_the_record() {
        for name in [
            "record-format1-8cf2b51.json",
            "record-full.json",
            "record-pending.json",
        ] {
            let text = fixture(name);
            let full: Record = serde_json::from_slice(&text).unwrap();
            let summary: RecordSummary = serde_json::from_slice(&text).unwrap();
            assert_eq!(summary.format, Some(u64::from(full.format)), "{name}");
            assert_eq!(
                (
                    &summary.network,
                    &summary.container_id,
                    &summary.ifname,
                    &summary.netns,
                    summary.netns_cookie,
                ),
                (
                    &full.network,
                    &full.container_id,
                    &full.ifname,
                    &full.netns,
                    full.netns_cookie,
                ),
                "{name}"
            );
            assert_eq!(summary.pod_name, full.pod_name, "{name}");
            assert_eq!(summary.pod_namespace, full.pod_namespace, "{name}");
            assert_eq!(summary.pin_root.as_ref(), Some(&full.pin_root), "{name}");
            assert_eq!(
                summary.policy.exclude_interfaces,
                full.policy.exclude_interfaces
            );
            assert_eq!(summary.policy.ambient, full.policy.ambient, "{name}");
            assert_eq!(summary.pending, full.pending, "{name}");
            assert_eq!(summary.created_unix, full.created_unix, "{name}");
        }
    }

    /// A newer plugin's record: the summary still names the pod; the full record refuses it
    /// rather than act on a policy it does not understand.
    #[test]
    fn a_newer_policy_is_listed_but_not_acted_on() {
        let mut v: serde_json::Value =
            serde_json::from_slice(&fixture("record-full.json")).unwrap();
        v["policy"]["futureField"] = true.into();
        v["futureTopLevel"] = 1.into();
        let text = serde_json::to_vec(&v).unwrap();
        assert!(serde_json::from_slice::<RecordSummary>(&text).is_ok());
        assert!(serde_json::from_slice::<Record>(&text).is_err());
    }
}
