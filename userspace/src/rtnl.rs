//! A NETLINK_ROUTE socket of the calling thread's netns, for the few idempotent requests
//! enrolment makes inside a pod (TPROXY's rule and route, the IPv6 passthrough address).

use std::io;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// How many times a dump the kernel marks interrupted is asked for.
const DUMP_ATTEMPTS: usize = 5;

/// A NETLINK_ROUTE socket of the calling thread's netns.
pub(crate) struct Rtnl {
    socket: Socket,
    seq: u32,
}

impl Rtnl {
    pub(crate) fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self { socket, seq: 0 })
    }

    /// Sends `message` with `flags` under the next sequence number.
    fn send(&mut self, message: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(message));
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0).map(drop)
    }

    /// Sends one request and waits for its acknowledgement. An add of what exists, or a delete
    /// of what is gone, counts as done.
    pub(crate) fn request(&mut self, message: RouteNetlinkMessage, add: bool) -> io::Result<()> {
        let mut flags = NLM_F_REQUEST | NLM_F_ACK;
        if add {
            flags |= NLM_F_CREATE | NLM_F_EXCL;
        }
        self.send(message, flags)?;
        self.until_answered(8192, |_, payload| {
            let NetlinkPayload::Error(err) = payload else {
                return None;
            };
            Some(match err.code {
                None => Ok(()),
                Some(code) => {
                    let errno = -code.get();
                    let benign = if add {
                        errno == libc::EEXIST
                    } else {
                        errno == libc::ENOENT || errno == libc::ESRCH
                    };
                    // An IPv6-less kernel refuses the family; there is nothing to route.
                    if benign || errno == libc::EAFNOSUPPORT {
                        Ok(())
                    } else {
                        Err(io::Error::from_raw_os_error(errno))
                    }
                }
            })
        })
    }

    /// Sends a dump request and collects every message of the reply. A dump the kernel marks
    /// interrupted (`NLM_F_DUMP_INTR`: the table changed under it, so entries may be missing) is
    /// asked for again; after [`DUMP_ATTEMPTS`] such answers it is an error, not a partial list.
    pub(crate) fn dump(
        &mut self,
        message: RouteNetlinkMessage,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        for _ in 0..DUMP_ATTEMPTS {
            self.send(message.clone(), NLM_F_REQUEST | NLM_F_DUMP)?;
            let mut out = Vec::new();
            let mut interrupted = false;
            self.until_answered(32768, |flags, payload| {
                interrupted |= flags & NLM_F_DUMP_INTR != 0;
                match payload {
                    NetlinkPayload::Done(_) => Some(Ok(())),
                    NetlinkPayload::Error(err) => Some(match err.code {
                        None => Ok(()),
                        Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                    }),
                    NetlinkPayload::InnerMessage(m) => {
                        out.push(m);
                        None
                    }
                    _ => None,
                }
            })?;
            if !interrupted {
                return Ok(out);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::Interrupted,
            format!(
                "the netlink dump was interrupted {DUMP_ATTEMPTS} times (the table kept changing)"
            ),
        ))
    }

    /// Reads replies to the last request, handing each payload of its sequence number to
    /// `answer` until that returns the outcome.
    fn until_answered(
        &mut self,
        buffer: usize,
        mut answer: impl FnMut(u16, NetlinkPayload<RouteNetlinkMessage>) -> Option<io::Result<()>>,
    ) -> io::Result<()> {
        let mut reply = vec![0; buffer];
        loop {
            let n = self.socket.recv(&mut &mut reply[..], 0)?;
            let mut offset = 0;
            while offset < n {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply[offset..n])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = msg.header.length as usize;
                if msg.header.sequence_number == self.seq
                    && let Some(outcome) = answer(msg.header.flags, msg.payload)
                {
                    return outcome;
                }
                if len == 0 {
                    break;
                }
                offset += len;
            }
        }
    }
}
