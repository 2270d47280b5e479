//! ztunnel's side of ZDS, for the ztunnel stand-in (`probe ztunnel`): the messages (istio/ztunnel
//! `proto/zds.proto`; written out with prost's derive, as the agent's own copy is, since this
//! crate tests sidestep from outside and does not link it) and the packet framing.

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
};

use anyhow::{Result, bail};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(int32, tag = "1")]
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

#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Request {
    #[prost(message, tag = "1")]
    Add(AddWorkload),
    #[prost(message, tag = "2")]
    Del(DelWorkload),
    #[prost(message, tag = "3")]
    SnapshotSent(SnapshotSent),
    #[prost(message, tag = "5")]
    Keep(KeepWorkload),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "Request", tags = "1, 2, 3, 5")]
    pub payload: Option<Request>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    Ack(Ack),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "Response", tags = "1")]
    pub payload: Option<Response>,
}

/// Sends one message as one packet.
pub fn send(fd: BorrowedFd<'_>, msg: &impl prost::Message) -> Result<()> {
    let bytes = msg.encode_to_vec();
    sendmsg::<()>(
        fd.as_raw_fd(),
        &[IoSlice::new(&bytes)],
        &[],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receives one request and the fds it carried; `None` at the end of the stream.
pub fn recv_request(fd: BorrowedFd<'_>) -> Result<Option<(WorkloadRequest, Vec<OwnedFd>)>> {
    let mut buf = [0u8; 1024];
    let mut space = nix::cmsg_space!([RawFd; 2]);
    let (len, fds, truncated) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            fd.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: fds the kernel installed for this message, each owned once here.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        let truncated = msg
            .flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
        (msg.bytes, fds, truncated)
    };
    if truncated {
        bail!("a truncated ZDS message");
    }
    if len == 0 {
        return Ok(None);
    }
    Ok(Some((prost::Message::decode(&buf[..len])?, fds)))
}

pub fn ack(error: &str) -> WorkloadResponse {
    WorkloadResponse {
        payload: Some(Response::Ack(Ack {
            error: error.into(),
        })),
    }
}
