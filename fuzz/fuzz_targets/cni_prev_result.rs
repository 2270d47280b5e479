//! prevResult validation on its own, for every spec version: the JSON the previous plugin in the
//! chain printed. Input: the prevResult JSON.
//!
//! Checked: what validates goes back out unchanged but for `cniVersion`, re-validates, and keeps
//! one address per `ips` entry; versions that share a result format agree; a result is never
//! valid in both the 0.x and the 1.x format unless it lists no addresses; errors map to the
//! spec's codes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sidestep_cni::spec::{
    CniVersion, SUPPORTED_VERSIONS, code,
    error::ToCniError,
    result::{PrevResult, ResultError},
};
use sidestep_fuzz::without_version;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let results: Vec<(CniVersion, Result<PrevResult, ResultError>)> = SUPPORTED_VERSIONS
        .into_iter()
        .map(|version| (version, PrevResult::parse(&v, version)))
        .collect();
    for (version, r) in &results {
        match r {
            Ok(pr) => {
                let out = pr.output(*version);
                assert_eq!(out["cniVersion"], version.as_str());
                assert_eq!(without_version(&out), without_version(&v));
                let again = PrevResult::parse(&out, *version)
                    .unwrap_or_else(|e| panic!("{version}: output does not re-validate: {e}"));
                assert_eq!(again.ips, pr.ips);
                assert_eq!(again.output(*version), out);
                let n = v["ips"].as_array().map_or(0, Vec::len);
                assert_eq!(pr.ips.len(), n);
                for (ip, entry) in pr.ips.iter().zip(v["ips"].as_array().into_iter().flatten()) {
                    let addr = entry["address"].as_str().expect("address is a string");
                    // ipnet's parser: the prevResult parser refused leading zeros already.
                    let net: ipnet::IpNet = addr.parse().expect("address is a CIDR");
                    assert_eq!(net.addr(), *ip, "{addr}");
                }
            }
            Err(e) => {
                let c = e.to_cni();
                assert!(
                    [code::DECODING_FAILURE, code::INCOMPATIBLE_VERSION].contains(&c.code),
                    "{e}"
                );
                assert!(e.to_string().starts_with("prevResult"), "{e}");
            }
        }
    }
    // 0.3.0, 0.3.1 and 0.4.0 share one format; 1.0.0 and 1.1.0 another.
    for pair in results.windows(2) {
        let ((a, ra), (b, rb)) = (&pair[0], &pair[1]);
        if a.ips_carry_version() == b.ips_carry_version() {
            assert_eq!(
                ra.as_ref().map(|p| &p.ips).ok(),
                rb.as_ref().map(|p| &p.ips).ok(),
                "{a} and {b} disagree"
            );
        }
    }
    let old = results[0].1.as_ref().ok();
    let new = results[SUPPORTED_VERSIONS.len() - 1].1.as_ref().ok();
    if let (Some(o), Some(n)) = (old, new) {
        assert!(
            o.ips.is_empty() && n.ips.is_empty(),
            "a result with addresses is valid in both the 0.x and 1.x formats"
        );
    }
});
