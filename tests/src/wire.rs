//! What crossed a link, seen from the node: an AF_PACKET socket bound to one interface of the
//! test's own netns (the node side of a pod's veth), recording every frame until dropped.
//! Boundary tests use it as the last word on whether something left a pod, whatever the pod's
//! processes report.

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};

const ETH_HEADER: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const IPV6_HEADER: usize = 40;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_DEST: u8 = 60;
const IPOPT_END: u8 = 0;
const IPOPT_NOOP: u8 = 1;
const IPOPT_LSRR: u8 = 0x83;
const IPOPT_SSRR: u8 = 0x89;

/// Records every frame on one interface of the calling thread's netns from `start` to drop.
pub struct WireWatch {
    stop: Arc<AtomicBool>,
    frames: Arc<Mutex<Vec<Vec<u8>>>>,
    reader: Option<JoinHandle<()>>,
}

impl WireWatch {
    /// Starts recording on interface `ifindex` of the current netns (needs CAP_NET_RAW).
    pub fn start(ifindex: u32) -> Result<Self> {
        let protocol = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain system call; the descriptor is owned right away.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(protocol),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("AF_PACKET socket");
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_ll is valid; the fields that matter are set below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = protocol;
        sll.sll_ifindex = i32::try_from(ifindex).context("interface index")?;
        // SAFETY: `sll` is a valid sockaddr_ll of the given length.
        let rc = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&raw const sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("binding AF_PACKET to interface {ifindex}"));
        }
        // A receive timeout, so the reader notices `stop` on a quiet link.
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 50_000,
        };
        // SAFETY: `tv` is valid for reads of its size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error()).context("SO_RCVTIMEO");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(Mutex::new(Vec::new()));
        let reader = {
            let (stop, frames) = (stop.clone(), frames.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: `buf` is valid for writes of its length.
                    let n = unsafe {
                        libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                    };
                    if let Ok(n) = usize::try_from(n) {
                        frames
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(buf[..n].to_vec());
                    }
                }
            })
        };
        Ok(Self {
            stop,
            frames,
            reader: Some(reader),
        })
    }

    /// Every frame recorded so far, after letting in-flight ones arrive.
    pub fn frames(&self) -> Vec<Vec<u8>> {
        std::thread::sleep(Duration::from_millis(200));
        self.frames
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// How many frames have been recorded so far.
    pub fn count(&self) -> usize {
        self.frames.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for WireWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

fn ethertype(frame: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]))
}

/// Whether an Ethernet frame is an IPv6 packet with a routing header, or an IPv4 packet with a
/// loose or strict source route: a packet that names a first hop other than its destination.
pub fn is_source_routed(frame: &[u8]) -> bool {
    match ethertype(frame) {
        Some(ETHERTYPE_IPV6) => ipv6_has_routing_header(frame),
        Some(ETHERTYPE_IPV4) => ipv4_has_source_route(frame),
        _ => false,
    }
}

fn ipv6_has_routing_header(frame: &[u8]) -> bool {
    let Some(mut next) = frame.get(ETH_HEADER + 6).copied() else {
        return false;
    };
    let mut at = ETH_HEADER + IPV6_HEADER;
    // Hop-by-hop and destination options may come first; a handful is all a real packet has.
    for _ in 0..8 {
        match next {
            NEXTHDR_ROUTING => return true,
            NEXTHDR_HOP | NEXTHDR_DEST => {
                let (Some(&following), Some(&len)) = (frame.get(at), frame.get(at + 1)) else {
                    return false;
                };
                next = following;
                at += (usize::from(len) + 1) * 8;
            }
            _ => return false,
        }
    }
    false
}

fn ipv4_has_source_route(frame: &[u8]) -> bool {
    let Some(&version_ihl) = frame.get(ETH_HEADER) else {
        return false;
    };
    let header_len = usize::from(version_ihl & 0x0f) * 4;
    let Some(options) = frame.get(ETH_HEADER + 20..ETH_HEADER + header_len) else {
        return false;
    };
    let mut at = 0;
    while let Some(&kind) = options.get(at) {
        match kind {
            IPOPT_END => return false,
            IPOPT_NOOP => at += 1,
            IPOPT_LSRR | IPOPT_SSRR => return true,
            _ => match options.get(at + 1) {
                Some(&len) if len >= 2 => at += usize::from(len),
                _ => return false,
            },
        }
    }
    false
}

/// Whether a frame is a TCP SYN (without ACK) to `port`, over IPv4 or IPv6 (extension headers
/// followed).
pub fn is_tcp_syn_to(frame: &[u8], port: u16) -> bool {
    let tcp = match ethertype(frame) {
        Some(ETHERTYPE_IPV4) => {
            let Some(&version_ihl) = frame.get(ETH_HEADER) else {
                return false;
            };
            if frame.get(ETH_HEADER + 9) != Some(&NEXTHDR_TCP) {
                return false;
            }
            ETH_HEADER + usize::from(version_ihl & 0x0f) * 4
        }
        Some(ETHERTYPE_IPV6) => {
            let Some(mut next) = frame.get(ETH_HEADER + 6).copied() else {
                return false;
            };
            let mut at = ETH_HEADER + IPV6_HEADER;
            for _ in 0..8 {
                if next == NEXTHDR_TCP {
                    break;
                }
                let (Some(&following), Some(&len)) = (frame.get(at), frame.get(at + 1)) else {
                    return false;
                };
                next = following;
                at += (usize::from(len) + 1) * 8;
            }
            if next != NEXTHDR_TCP {
                return false;
            }
            at
        }
        _ => return false,
    };
    let (Some(d0), Some(d1), Some(flags)) =
        (frame.get(tcp + 2), frame.get(tcp + 3), frame.get(tcp + 13))
    else {
        return false;
    };
    u16::from_be_bytes([*d0, *d1]) == port && flags & 0x12 == 0x02
}

/// Whether a frame is an IPv4 UDP datagram to `port` (options skipped; the first fragment or
/// an unfragmented one). IPv6 is not needed: its per-datagram routing header needs a kernel
/// with `CONFIG_IPV6_MIP6`.
pub fn is_udp4_to(frame: &[u8], port: u16) -> bool {
    if ethertype(frame) != Some(ETHERTYPE_IPV4) {
        return false;
    }
    let (Some(&version_ihl), Some(&protocol)) = (frame.get(ETH_HEADER), frame.get(ETH_HEADER + 9))
    else {
        return false;
    };
    if protocol != IPPROTO_UDP {
        return false;
    }
    let udp = ETH_HEADER + usize::from(version_ihl & 0x0f) * 4;
    let (Some(d0), Some(d1)) = (frame.get(udp + 2), frame.get(udp + 3)) else {
        return false;
    };
    u16::from_be_bytes([*d0, *d1]) == port
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv6_frame(next: u8, ext: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; ETH_HEADER + IPV6_HEADER];
        f[12..14].copy_from_slice(&ETHERTYPE_IPV6.to_be_bytes());
        f[ETH_HEADER] = 0x60;
        f[ETH_HEADER + 6] = next;
        f.extend_from_slice(ext);
        f
    }

    #[test]
    fn routing_headers_are_found_behind_options() {
        assert!(is_source_routed(&ipv6_frame(
            NEXTHDR_ROUTING,
            &[6, 0, 4, 0, 0, 0, 0, 0]
        )));
        let hop_then_routing = [NEXTHDR_ROUTING, 0, 1, 4, 0, 0, 0, 0, 6, 0, 4, 0, 0, 0, 0, 0];
        assert!(is_source_routed(&ipv6_frame(
            NEXTHDR_HOP,
            &hop_then_routing
        )));
        assert!(!is_source_routed(&ipv6_frame(NEXTHDR_TCP, &[0; 20])));
    }

    #[test]
    fn ipv4_source_routes_are_found_among_options() {
        let mut f = vec![0u8; ETH_HEADER + 20];
        f[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        f[ETH_HEADER] = 0x47;
        f.extend_from_slice(&[IPOPT_NOOP, IPOPT_LSRR, 7, 4, 10, 0, 0, 1]);
        assert!(is_source_routed(&f));
        f[ETH_HEADER + 21] = 7; // record route instead
        assert!(!is_source_routed(&f));
    }

    #[test]
    fn a_syn_is_told_from_a_syn_ack() {
        let mut tcp = [0u8; 20];
        tcp[2..4].copy_from_slice(&8080u16.to_be_bytes());
        tcp[13] = 0x02;
        assert!(is_tcp_syn_to(&ipv6_frame(NEXTHDR_TCP, &tcp), 8080));
        assert!(!is_tcp_syn_to(&ipv6_frame(NEXTHDR_TCP, &tcp), 80));
        tcp[13] = 0x12;
        assert!(!is_tcp_syn_to(&ipv6_frame(NEXTHDR_TCP, &tcp), 8080));
    }
}
