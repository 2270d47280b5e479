//! The list parsers behind every annotation, flag and policy field: ports, port lists, CIDRs and
//! CIDR lists (`sidestep::policy`), and Linkerd's port ranges. Input: the list text.
//!
//! Checked: ports are in 1..=65535; CIDR prefixes fit their family and carry no host bits; what
//! parses formats back to text that parses to the same value; `*` means all exactly when the
//! text is `*`; parse_port_list is parse_port_set without `*`; the JSON forms (a string, or an
//! array of the comma-separated items) decode to the same value as the text; errors quote a
//! part of the input.

#![no_main]

use std::net::IpAddr;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sidestep::{
    error::PolicyError,
    policy::{self, CidrSet, PortSet},
};
use sidestep_cni::mesh::linkerd;
use sidestep_fuzz::{check_cidr, check_cidr_set, check_port_set};

fn items(text: &str) -> Vec<&str> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

fn quoted(e: &PolicyError) -> &str {
    match e {
        PolicyError::Port { value, .. }
        | PolicyError::Cidr { value, .. }
        | PolicyError::Value { value, .. } => value,
        // A list past the pod's budget is named, not quoted.
        PolicyError::TooLong { .. } | PolicyError::OverBudget(_) => "",
    }
}

/// serde's path (`ListInput`): a string, or an array whose items are joined with commas.
fn json_forms<T: serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
    text: &str,
    direct: Option<&T>,
) {
    let as_string: Option<T> = serde_json::from_value(Value::String(text.to_owned())).ok();
    assert_eq!(as_string.as_ref(), direct, "JSON string form of {text:?}");
    let parts: Vec<Value> = text.split(',').map(|s| Value::String(s.into())).collect();
    let as_array: Option<T> = serde_json::from_value(Value::Array(parts)).ok();
    assert_eq!(as_array.as_ref(), direct, "JSON array form of {text:?}");
}

fn ports(text: &str) {
    if let Ok(p) = policy::parse_port("f", text) {
        assert_ne!(p, 0);
        assert_eq!(policy::parse_port("f", &p.to_string()).ok(), Some(p));
    }
    let set = policy::parse_port_set("f", text);
    match &set {
        Ok(PortSet::All) => assert_eq!(text.trim(), "*"),
        Ok(s @ PortSet::Only(ports)) => {
            check_port_set("set", s);
            assert!(ports.len() <= items(text).len());
            for item in items(text) {
                let p = policy::parse_port("f", item).expect("every item of a parsed list parses");
                assert!(ports.contains(&p));
            }
        }
        Err(e) => assert!(text.contains(quoted(e)), "error quotes {e}"),
    }
    let list = policy::parse_port_list("f", text);
    match (&set, &list) {
        (Ok(PortSet::All), Err(PolicyError::Value { .. })) => {}
        (Ok(PortSet::Only(a)), Ok(b)) => assert_eq!(a, b),
        (Err(_), Err(_)) => {}
        (s, l) => panic!("parse_port_set {s:?} but parse_port_list {l:?}"),
    }
    json_forms::<PortSet>(text, set.as_ref().ok());

    match linkerd::port_ranges("k", text) {
        Ok(r) => {
            assert!(r.len() <= sidestep::enroll::MAX_POD_PORT_RULES);
            assert!(!r.contains(&0));
            // Without ranges, Linkerd's lists are the plain port lists.
            if !text.contains('-') {
                assert_eq!(list.as_ref().ok(), Some(&r), "linkerd list {text:?}");
            }
            let formatted = String::from(PortSet::Only(r.clone()));
            assert_eq!(linkerd::port_ranges("k", &formatted).ok(), Some(r));
        }
        Err(e) => assert!(text.contains(&e.value), "{e}"),
    }
}

fn cidrs(text: &str) {
    if let Ok(net) = policy::parse_cidr("f", text) {
        check_cidr(&net);
        if !text.contains('/') {
            let ip: IpAddr = text.parse().expect("a bare address");
            assert_eq!(net.addr(), ip);
            assert_eq!(
                net.prefix_len(),
                net.max_prefix_len(),
                "bare address is a host route"
            );
        }
    }
    let set = policy::parse_cidr_set("f", text);
    match &set {
        Ok(CidrSet::All) => assert_eq!(text.trim(), "*"),
        Ok(s @ CidrSet::Only(nets)) => {
            check_cidr_set("set", s);
            let want: Vec<_> = items(text)
                .into_iter()
                .map(|i| policy::parse_cidr("f", i).expect("every item of a parsed list parses"))
                .collect();
            assert_eq!(nets, &want);
        }
        Err(e) => assert!(text.contains(quoted(e)), "error quotes {e}"),
    }
    json_forms::<CidrSet>(text, set.as_ref().ok());
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    ports(&text);
    cidrs(&text);
});
