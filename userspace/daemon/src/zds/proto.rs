//! The ZDS messages (package `istio.workload.zds`), as istio/istio `pkg/zdsapi/zds.proto` and
//! istio/ztunnel `proto/zds.proto` define them; written out with prost's derive (the field
//! numbers are the wire contract), so the build needs no protoc.

/// `enum Version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

/// ztunnel's first message on a connection.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

/// Sent with the pod's netns fd as its one `SCM_RIGHTS` fd.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// In a snapshot, for a pod whose netns the agent does not hold: keep its proxy if it runs.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    /// Field 2 in the proto (field 1 is unused there).
    #[prost(string, tag = "2")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "workload_request::Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<workload_request::Payload>,
}

pub mod workload_request {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        #[prost(message, tag = "1")]
        Add(super::AddWorkload),
        #[prost(message, tag = "2")]
        Del(super::DelWorkload),
        #[prost(message, tag = "3")]
        SnapshotSent(super::SnapshotSent),
        #[prost(message, tag = "5")]
        Keep(super::KeepWorkload),
    }
}

/// An empty `error` is an ACK; anything else a NACK.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "workload_response::Payload", tags = "1")]
    pub payload: Option<workload_response::Payload>,
}

pub mod workload_response {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        #[prost(message, tag = "1")]
        Ack(super::Ack),
    }
}
