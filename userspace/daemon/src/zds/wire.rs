//! ZDS framing: one protobuf message per `SOCK_SEQPACKET` packet, no length prefix, at most
//! [`MAX_MESSAGE`] bytes, and the netns fd of an Add as the packet's one `SCM_RIGHTS` fd.
//! Both sides refuse a truncated packet (`MSG_TRUNC`) or control message (`MSG_CTRUNC`), as
//! Istio's agent and ztunnel do.

use std::{
    io::{self, IoSlice, IoSliceMut},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::socket::{
        ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg, setsockopt, sockopt,
    },
    sys::time::TimeVal,
};

/// The largest message either side reads.
pub const MAX_MESSAGE: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("a message longer than {MAX_MESSAGE} bytes, or with more than one fd, was truncated")]
    Truncated,
    #[error("cannot decode {what}: {source}")]
    Decode {
        what: &'static str,
        source: prost::DecodeError,
    },
}

fn errno(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Read and write deadlines of the socket (Istio's 5 s for each message and its answer).
pub fn set_deadlines(fd: BorrowedFd<'_>, each: Duration) -> io::Result<()> {
    let tv = TimeVal::new(each.as_secs() as _, each.subsec_micros() as _);
    setsockopt(&fd, sockopt::ReceiveTimeout, &tv).map_err(errno)?;
    setsockopt(&fd, sockopt::SendTimeout, &tv).map_err(errno)
}

/// Sends `msg` as one packet, with `pass` as its `SCM_RIGHTS` fd.
pub fn send(
    fd: BorrowedFd<'_>,
    msg: &impl prost::Message,
    pass: Option<BorrowedFd<'_>>,
) -> Result<(), WireError> {
    let bytes = msg.encode_to_vec();
    let iov = [IoSlice::new(&bytes)];
    let fds: Vec<RawFd> = pass.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    sendmsg::<()>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
        .map_err(|e| WireError::Io(errno(e)))?;
    Ok(())
}

/// Receives one packet as `M`, with the fds it carried (owned, close-on-exec).
pub fn recv<M: prost::Message + Default>(
    fd: BorrowedFd<'_>,
    what: &'static str,
) -> Result<(M, Vec<OwnedFd>), WireError> {
    let mut buf = [0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (len, fds, truncated) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            fd.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| WireError::Io(errno(e)))?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs().map_err(|e| WireError::Io(errno(e)))? {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                // SAFETY: the kernel installed these fds in this process for this message; each
                // is owned here exactly once.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        let truncated = msg
            .flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
        (msg.bytes, fds, truncated)
    };
    if truncated {
        return Err(WireError::Truncated);
    }
    if len == 0 {
        // Every ZDS message encodes to at least two bytes; an empty read is the end of stream.
        return Err(WireError::Closed);
    }
    let msg = M::decode(&buf[..len]).map_err(|source| WireError::Decode { what, source })?;
    Ok((msg, fds))
}

/// What an idle connection looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    Alive,
    /// The peer hung up (EOF, or an error on the socket).
    Closed,
    /// A packet is waiting: ztunnel speaks only to answer, so that is a protocol error.
    Unasked,
}

/// Checks an idle connection without taking a message (10 ms).
pub fn idle_check(fd: BorrowedFd<'_>) -> Idle {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(10u8)) {
        Ok(0) => Idle::Alive,
        Ok(_) => {
            let events = fds[0].revents().unwrap_or(PollFlags::empty());
            if events.intersects(PollFlags::POLLHUP | PollFlags::POLLERR) {
                return Idle::Closed;
            }
            // Readable: a packet, or the end of stream (a zero-length read).
            let mut byte = [0u8; 1];
            match nix::sys::socket::recv(
                fd.as_raw_fd(),
                &mut byte,
                nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(0) | Err(_) => Idle::Closed,
                Ok(_) => Idle::Unasked,
            }
        }
        Err(nix::Error::EINTR) => Idle::Alive,
        Err(_) => Idle::Closed,
    }
}
