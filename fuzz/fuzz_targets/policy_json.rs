//! The JSON policy (`sidestep enroll --policy FILE`, the CNI config's `policy` object) decoded
//! with serde. Input: the policy JSON.
//!
//! Checked: a decoded policy satisfies the policy invariants (canonical lists, JSON round trip,
//! sane map entries, no panic building them); decoding through a `serde_json::Value` agrees with
//! decoding the bytes; the CNI config accepts the same object exactly when it validates, and then
//! yields the same policy.

#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sidestep::policy::Policy;
use sidestep_cni::{
    config::{ConfigError, PluginConfig},
    spec::Command,
};
use sidestep_fuzz::{check_enrolled_policy, check_policy};

fuzz_target!(|data: &[u8]| {
    let Ok(p) = serde_json::from_slice::<Policy>(data) else {
        return;
    };
    check_policy(&p);
    let v: Value = serde_json::from_slice(data).expect("a decoded policy is JSON");
    let via_value: Policy = serde_json::from_value(v.clone())
        .unwrap_or_else(|e| panic!("decodes from bytes but not from a Value: {e}"));
    assert_eq!(via_value, p);

    let mut cfg = serde_json::json!({"cniVersion": "1.0.0", "name": "n", "type": "sidestep"});
    cfg["policy"] = v;
    let stdin = serde_json::to_vec(&cfg).expect("serialises");
    let parsed = PluginConfig::parse(&stdin, Command::Add);
    match (p.validate(), parsed) {
        (Ok(()), Ok(c)) => {
            check_enrolled_policy(&p);
            assert_eq!(c.policy.as_ref(), Some(&p));
        }
        (Err(_), Err(ConfigError::Field { field, .. })) => assert_eq!(field, "policy"),
        (v, c) => panic!("validate {v:?} but the config {:?}", c.map(|c| c.policy)),
    }
});
