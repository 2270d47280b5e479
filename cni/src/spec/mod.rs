//! The CNI protocol itself: spec versions, commands, the environment, results and errors.
//! Nothing here knows about sidestep; it is the part every chained plugin needs.

pub mod env;
pub mod error;
pub mod result;

use std::{fmt, str::FromStr};

pub use error::{CniError, code};

/// The spec versions this plugin speaks. 0.1.0 and 0.2.0 predate chaining (no prevResult), so a
/// chained plugin has nothing to offer them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CniVersion {
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

pub const SUPPORTED_VERSIONS: [CniVersion; 5] = [
    CniVersion::V0_3_0,
    CniVersion::V0_3_1,
    CniVersion::V0_4_0,
    CniVersion::V1_0_0,
    CniVersion::V1_1_0,
];

impl CniVersion {
    pub const LATEST: Self = Self::V1_1_0;

    pub fn as_str(self) -> &'static str {
        match self {
            Self::V0_3_0 => "0.3.0",
            Self::V0_3_1 => "0.3.1",
            Self::V0_4_0 => "0.4.0",
            Self::V1_0_0 => "1.0.0",
            Self::V1_1_0 => "1.1.0",
        }
    }

    /// Results before 1.0.0 tag every IP with `"version": "4"|"6"`; 1.x results drop it.
    pub fn ips_carry_version(self) -> bool {
        self < Self::V1_0_0
    }

    /// Whether `cmd` exists in this version of the spec.
    pub fn allows(self, cmd: Command) -> bool {
        match cmd {
            Command::Check => self >= Self::V0_4_0,
            Command::Status | Command::Gc => self >= Self::V1_1_0,
            Command::Add | Command::Del | Command::Version => true,
        }
    }

    pub fn supported_list() -> String {
        SUPPORTED_VERSIONS
            .iter()
            .map(|v| v.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CniVersion {
    type Err = CniError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SUPPORTED_VERSIONS
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| {
                CniError::new(
                    code::INCOMPATIBLE_VERSION,
                    format!("incompatible CNI version {s:?}"),
                )
                .details(format!("sidestep-cni supports {}", Self::supported_list()))
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Status => "STATUS",
            Self::Gc => "GC",
            Self::Version => "VERSION",
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Command {
    type Err = CniError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            Self::Add,
            Self::Del,
            Self::Check,
            Self::Status,
            Self::Gc,
            Self::Version,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
        .ok_or_else(|| {
            CniError::new(code::INVALID_ENV, format!("unknown CNI_COMMAND: {s:?}"))
                .details("CNI_COMMAND is one of ADD, DEL, CHECK, STATUS, GC, VERSION")
        })
    }
}

/// The VERSION answer: `cniVersion` echoes the request when we speak it.
pub fn version_response(requested: Option<&str>) -> serde_json::Value {
    let echoed = requested
        .and_then(|r| r.parse::<CniVersion>().ok())
        .unwrap_or(CniVersion::LATEST);
    serde_json::json!({
        "cniVersion": echoed.as_str(),
        "supportedVersions": SUPPORTED_VERSIONS.iter().map(|v| v.as_str()).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_round_trip_and_order() {
        for v in SUPPORTED_VERSIONS {
            assert_eq!(v.as_str().parse::<CniVersion>().unwrap(), v);
        }
        assert!(CniVersion::V0_3_1 < CniVersion::V0_4_0);
        for bad in ["0.1.0", "0.2.0", "1.2.0", "", "1.0", "v1.0.0"] {
            let e = bad.parse::<CniVersion>().unwrap_err();
            assert_eq!(e.code, code::INCOMPATIBLE_VERSION, "{bad}");
        }
    }

    #[test]
    fn commands_per_version() {
        use CniVersion::*;
        assert!(!V0_3_1.allows(Command::Check));
        assert!(V0_4_0.allows(Command::Check));
        assert!(!V1_0_0.allows(Command::Status));
        assert!(!V1_0_0.allows(Command::Gc));
        assert!(V1_1_0.allows(Command::Gc));
        assert!(V0_3_0.allows(Command::Add));
        assert!(V0_3_0.allows(Command::Del));
    }

    #[test]
    fn unknown_command_is_invalid_env() {
        assert_eq!("ADD".parse::<Command>().unwrap(), Command::Add);
        let e = "add".parse::<Command>().unwrap_err();
        assert_eq!(e.code, code::INVALID_ENV);
        assert!(e.msg.contains("add"));
    }

    #[test]
    fn version_echoes_known_versions_only() {
        assert_eq!(version_response(Some("0.4.0"))["cniVersion"], "0.4.0");
        assert_eq!(version_response(Some("9.9.9"))["cniVersion"], "1.1.0");
        assert_eq!(version_response(None)["supportedVersions"][0], "0.3.0");
    }
}
