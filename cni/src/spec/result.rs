//! prevResult: validated against the shape of the config's spec version, kept as JSON so that it
//! goes back to the runtime exactly as it came (a chained plugin that changes nothing must output
//! a result equivalent to its prevResult).

use std::{net::IpAddr, str::FromStr};

use ipnet::IpNet;
use serde_json::{Map, Value, json};

use super::{CniError, CniVersion, code};

#[derive(Debug, Clone, PartialEq)]
pub struct PrevResult {
    value: Map<String, Value>,
    /// Every address in `ips`, in order, for hairpin detection.
    pub ips: Vec<IpAddr>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResultError {
    #[error("prevResult{path}: {reason}")]
    Shape { path: String, reason: String },
    #[error(
        "prevResult is in CNI {found} format but the config says {config}; the runtime must convert it"
    )]
    Version { found: String, config: CniVersion },
}

impl super::error::ToCniError for ResultError {
    fn to_cni(&self) -> CniError {
        let c = match self {
            Self::Shape { .. } => code::DECODING_FAILURE,
            Self::Version { .. } => code::INCOMPATIBLE_VERSION,
        };
        CniError::new(c, self.to_string())
    }
}

fn shape(path: impl Into<String>, reason: impl Into<String>) -> ResultError {
    ResultError::Shape {
        path: path.into(),
        reason: reason.into(),
    }
}

fn obj<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, ResultError> {
    v.as_object()
        .ok_or_else(|| shape(path, "must be an object"))
}

fn arr<'a>(m: &'a Map<String, Value>, key: &str, path: &str) -> Result<&'a [Value], ResultError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(shape(format!("{path}.{key}"), "must be an array")),
    }
}

fn opt_str<'a>(
    m: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<&'a str>, ResultError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(shape(format!("{path}.{key}"), "must be a string")),
    }
}

fn opt_uint(m: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u64>, ResultError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| shape(format!("{path}.{key}"), "must be a non-negative integer")),
    }
}

fn parse_net(text: &str, path: String) -> Result<IpNet, ResultError> {
    // As Go's net.ParseCIDR, which wrote the runtime's result, refuses them.
    let addr = text.split_once('/').map_or(text, |(a, _)| a);
    if let Some(octet) = sidestep::policy::leading_zero_octet(addr) {
        return Err(shape(
            path,
            format!("{text:?}: octet {octet:?} has a leading zero"),
        ));
    }
    IpNet::from_str(text)
        .map_err(|_| shape(path, format!("{text:?} is not an address in CIDR notation")))
}

fn parse_ip(text: &str, path: String) -> Result<IpAddr, ResultError> {
    IpAddr::from_str(text).map_err(|_| shape(path, format!("{text:?} is not an IP address")))
}

/// 0.3.0, 0.3.1 and 0.4.0 share one result format, as do 1.0.0 and 1.1.0.
fn same_format(a: CniVersion, b: CniVersion) -> bool {
    a.ips_carry_version() == b.ips_carry_version()
}

impl PrevResult {
    pub fn parse(v: &Value, version: CniVersion) -> Result<Self, ResultError> {
        let top = obj(v, "")?;
        if let Some(found) = opt_str(top, "cniVersion", "")? {
            match found.parse::<CniVersion>() {
                Ok(f) if same_format(f, version) => {}
                _ => {
                    return Err(ResultError::Version {
                        found: found.to_owned(),
                        config: version,
                    });
                }
            }
        }
        let interfaces = arr(top, "interfaces", "")?;
        for (i, iface) in interfaces.iter().enumerate() {
            let p = format!(".interfaces[{i}]");
            let m = obj(iface, &p)?;
            match opt_str(m, "name", &p)? {
                Some(n) if !n.is_empty() => {}
                _ => return Err(shape(format!("{p}.name"), "is required")),
            }
            for key in ["mac", "sandbox", "socketPath", "pciID"] {
                opt_str(m, key, &p)?;
            }
            opt_uint(m, "mtu", &p)?;
        }
        let mut ips = Vec::new();
        for (i, ip) in arr(top, "ips", "")?.iter().enumerate() {
            let p = format!(".ips[{i}]");
            let m = obj(ip, &p)?;
            let addr = opt_str(m, "address", &p)?
                .ok_or_else(|| shape(format!("{p}.address"), "is required"))?;
            let net = parse_net(addr, format!("{p}.address"))?;
            if let Some(gw) = opt_str(m, "gateway", &p)? {
                parse_ip(gw, format!("{p}.gateway"))?;
            }
            if let Some(idx) = opt_uint(m, "interface", &p)?
                && idx as usize >= interfaces.len()
            {
                return Err(shape(
                    format!("{p}.interface"),
                    format!("index {idx} is past the {} interfaces", interfaces.len()),
                ));
            }
            let fam = opt_str(m, "version", &p)?;
            match (version.ips_carry_version(), fam) {
                (true, None) => {
                    return Err(shape(
                        format!("{p}.version"),
                        format!("is required in CNI {version} results"),
                    ));
                }
                (true, Some(f)) => {
                    let want = if net.addr().is_ipv4() { "4" } else { "6" };
                    if f != want {
                        return Err(shape(
                            format!("{p}.version"),
                            format!("{f:?} does not match address {addr}"),
                        ));
                    }
                }
                (false, Some(_)) => {
                    return Err(shape(
                        format!("{p}.version"),
                        format!(
                            "is not part of CNI {version} results (a 0.x result sent as {version}?)"
                        ),
                    ));
                }
                (false, None) => {}
            }
            ips.push(net.addr());
        }
        for (i, route) in arr(top, "routes", "")?.iter().enumerate() {
            let p = format!(".routes[{i}]");
            let m = obj(route, &p)?;
            let dst =
                opt_str(m, "dst", &p)?.ok_or_else(|| shape(format!("{p}.dst"), "is required"))?;
            parse_net(dst, format!("{p}.dst"))?;
            if let Some(gw) = opt_str(m, "gw", &p)? {
                parse_ip(gw, format!("{p}.gw"))?;
            }
            for key in ["mtu", "advmss", "priority", "table", "scope"] {
                opt_uint(m, key, &p)?;
            }
        }
        if let Some(dns) = top.get("dns").filter(|d| !d.is_null()) {
            let m = obj(dns, ".dns")?;
            opt_str(m, "domain", ".dns")?;
            for key in ["nameservers", "search", "options"] {
                for (i, s) in arr(m, key, ".dns")?.iter().enumerate() {
                    if !s.is_string() {
                        return Err(shape(format!(".dns.{key}[{i}]"), "must be a string"));
                    }
                }
            }
        }
        Ok(Self {
            value: top.clone(),
            ips,
        })
    }

    /// The result to print: unchanged but for `cniVersion`, which must be the config's.
    pub fn output(&self, version: CniVersion) -> Value {
        let mut m = self.value.clone();
        m.insert("cniVersion".into(), json!(version.as_str()));
        Value::Object(m)
    }
}

/// What ADD prints when it is the first plugin (no prevResult): an empty but valid result.
pub fn empty_result(version: CniVersion) -> Value {
    json!({ "cniVersion": version.as_str(), "interfaces": [], "ips": [], "dns": {} })
}

#[cfg(test)]
mod tests {
    use super::*;
    use CniVersion::*;

    fn bridge_result(with_version: bool) -> Value {
        let mut ip4 = json!({"address": "10.22.0.5/16", "gateway": "10.22.0.1", "interface": 2});
        let mut ip6 = json!({"address": "fd00::5/64", "interface": 2});
        if with_version {
            ip4["version"] = json!("4");
            ip6["version"] = json!("6");
        }
        json!({
            "interfaces": [
                {"name": "cni0", "mac": "aa:bb:cc:dd:ee:ff"},
                {"name": "veth1234", "mac": "aa:bb:cc:dd:ee:00"},
                {"name": "eth0", "mac": "aa:bb:cc:dd:ee:01", "sandbox": "/run/netns/x"}
            ],
            "ips": [ip4, ip6],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0", "gw": "fd00::1"}],
            "dns": {"nameservers": ["10.22.0.1"], "search": ["svc.cluster.local"]}
        })
    }

    #[test]
    fn every_version_accepts_its_own_shape() {
        for v in [V0_3_0, V0_3_1, V0_4_0] {
            let r = PrevResult::parse(&bridge_result(true), v).unwrap();
            assert_eq!(r.ips.len(), 2);
            assert_eq!(r.output(v)["cniVersion"], v.as_str());
            assert!(PrevResult::parse(&bridge_result(false), v).is_err(), "{v}");
        }
        for v in [V1_0_0, V1_1_0] {
            let r = PrevResult::parse(&bridge_result(false), v).unwrap();
            assert_eq!(r.ips[0].to_string(), "10.22.0.5");
            assert_eq!(r.ips[1].to_string(), "fd00::5");
            let e = PrevResult::parse(&bridge_result(true), v).unwrap_err();
            assert!(e.to_string().contains("ips[0].version"), "{e}");
        }
    }

    #[test]
    fn output_is_the_input_with_the_config_version() {
        let mut input = bridge_result(false);
        input["cniVersion"] = json!("1.0.0");
        input["extra"] = json!({"kept": true});
        let r = PrevResult::parse(&input, V1_1_0).unwrap();
        let mut want = input.clone();
        want["cniVersion"] = json!("1.1.0");
        assert_eq!(r.output(V1_1_0), want);
    }

    #[test]
    fn foreign_versions_are_refused() {
        let mut input = bridge_result(false);
        input["cniVersion"] = json!("0.4.0");
        let e = PrevResult::parse(&input, V1_0_0).unwrap_err();
        assert!(matches!(e, ResultError::Version { .. }));
        input["cniVersion"] = json!("7.0.0");
        assert!(PrevResult::parse(&input, V1_0_0).is_err());
    }

    #[test]
    fn malformed_results() {
        let cases = [
            (json!([]), ""),
            (json!({"ips": {}}), ".ips"),
            (json!({"ips": [{"address": "10.0.0.1"}]}), ".ips[0].address"),
            (
                json!({"ips": [{"address": "10.0.0.300/24"}]}),
                ".ips[0].address",
            ),
            (json!({"ips": [{}]}), ".ips[0].address"),
            (
                json!({"ips": [{"address": "10.0.0.1/24", "gateway": "x"}]}),
                ".ips[0].gateway",
            ),
            (
                json!({"ips": [{"address": "10.0.0.1/24", "interface": 0}]}),
                ".ips[0].interface",
            ),
            (
                json!({"ips": [{"address": "10.0.0.1/24", "interface": -1}]}),
                ".ips[0].interface",
            ),
            (json!({"interfaces": [{"mac": "x"}]}), ".interfaces[0].name"),
            (json!({"interfaces": ["eth0"]}), ".interfaces[0]"),
            (json!({"routes": [{"gw": "10.0.0.1"}]}), ".routes[0].dst"),
            (json!({"routes": [{"dst": "nope"}]}), ".routes[0].dst"),
            (json!({"dns": []}), ".dns"),
            (json!({"dns": {"nameservers": [1]}}), ".dns.nameservers[0]"),
            (json!({"cniVersion": 1}), ".cniVersion"),
        ];
        for (input, path) in cases {
            let e = PrevResult::parse(&input, V1_0_0).unwrap_err();
            assert!(
                e.to_string().starts_with(&format!("prevResult{path}")),
                "{input}: {e}"
            );
        }
        let e = PrevResult::parse(
            &json!({"ips": [{"version": "6", "address": "10.0.0.1/24"}]}),
            V0_4_0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not match"));
    }

    #[test]
    fn empty_result_per_version() {
        for v in crate::spec::SUPPORTED_VERSIONS {
            let r = empty_result(v);
            assert_eq!(r["cniVersion"], v.as_str());
            PrevResult::parse(&r, v).unwrap();
        }
    }
}
