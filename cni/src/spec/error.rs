//! The spec's error result. Every failure of the plugin ends as one of these on stdout.

use serde::Serialize;

use super::CniVersion;

/// Error codes. 0-99 are the spec's; 100+ are sidestep's own.
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    /// The spec's "invalid netns" (libcni's ErrInvalidNetNS): missing, not a netns, or the host's.
    pub const INVALID_NETNS: u32 = 8;
    pub const TRY_AGAIN_LATER: u32 = 11;
    pub const NOT_AVAILABLE: u32 = 50;

    /// The data path refused the enrolment (map full, tc attach failed, ...).
    pub const ENROLL_FAILED: u32 = 100;
    /// A pod annotation (or injected container field) has a value that does not parse.
    pub const BAD_ANNOTATION: u32 = 101;
    /// The pod could not be read from the Kubernetes API.
    pub const POD_UNREADABLE: u32 = 102;
    /// The per-attachment state record could not be written or read.
    pub const STATE: u32 = 103;
    /// CHECK found the attachment missing or different from what ADD set up.
    pub const CHECK_FAILED: u32 = 104;
    /// DEL or GC could not remove what ADD set up.
    pub const CLEANUP_FAILED: u32 = 105;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The JSON the runtime reads, in `version` (the config's, or the latest when the config
    /// never got far enough to say).
    pub fn to_json(&self, version: Option<CniVersion>) -> serde_json::Value {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Wire<'a> {
            cni_version: &'a str,
            code: u32,
            msg: &'a str,
            details: &'a str,
        }
        serde_json::to_value(Wire {
            cni_version: version.unwrap_or(CniVersion::LATEST).as_str(),
            code: self.code,
            msg: &self.msg,
            details: &self.details,
        })
        .expect("a struct of strings serialises")
    }
}

/// Domain errors say which spec code they map to.
pub trait ToCniError {
    fn to_cni(&self) -> CniError;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_shape() {
        let e = CniError::new(code::INVALID_CONFIG, "bad").details("more");
        let j = e.to_json(Some(CniVersion::V0_4_0));
        assert_eq!(
            j,
            serde_json::json!({"cniVersion": "0.4.0", "code": 7, "msg": "bad", "details": "more"})
        );
        let j = CniError::new(code::TRY_AGAIN_LATER, "x").to_json(None);
        assert_eq!(j["cniVersion"], "1.1.0");
        assert_eq!(j["details"], "");
    }
}
