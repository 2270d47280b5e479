//! User-namespaced pods (`hostUsers: false`). The proxy runs as UID 1337 *inside* the pod's user
//! namespace, so the kernel, and `bpf_get_current_uid_gid` with it, sees another UID (1337 plus
//! the pod's offset). istio-iptables' `--uid-owner 1337` is translated by the kernel through the
//! user namespace that owns the pod's netns (`xt_owner` maps the rule's IDs with
//! `make_kuid(net->user_ns, ..)`), so sidestep does the same once, at enrolment: the IDs written
//! to the pod's policy are the host's view of the pod's IDs.
//!
//! The owning user namespace comes from the netns itself (`NS_GET_USERNS`). Its ID maps are
//! read through a short-lived child process that joins it: `/proc/<child>/uid_map`, read from
//! the host's user namespace, gives the host IDs directly, however deeply the namespace nests
//! (user_namespaces(7)). A thread cannot join a user namespace (setns(2) refuses a multithreaded
//! process), so it has to be a process of its own.

use std::{
    fs::{self, File},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
};

use crate::netns::Netns;

/// `_IO(0xb7, 0x1)`: the user namespace that owns a namespace, as a new fd.
const NS_GET_USERNS: libc::c_ulong = 0xb701;

#[derive(Debug, thiserror::Error)]
pub enum UsernsError {
    #[error("cannot find the user namespace that owns network namespace {netns}: {source}")]
    Owner { netns: String, source: io::Error },
    #[error("cannot read the ID maps of the user namespace that owns {netns}: {source}")]
    Maps { netns: String, source: io::Error },
    #[error(
        "the proxy's {kind} {id} is not mapped in the user namespace that owns network \
         namespace {netns} (its {kind}_map: {map}); no process there can run as it, so its \
         traffic could not be told from the app's. Run the proxy as a mapped {kind}"
    )]
    Unmapped {
        kind: &'static str,
        id: u32,
        netns: String,
        map: String,
    },
}

/// One user namespace's `uid_map` or `gid_map`: (inside, outside, count) ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdMap(Vec<(u32, u32, u32)>);

impl IdMap {
    /// The text of a `/proc/PID/{uid,gid}_map` file; malformed lines are an error.
    pub fn parse(text: &str) -> io::Result<Self> {
        let bad = |line: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{line:?}"));
        let mut ranges = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let nums: Vec<u32> = line
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .map_err(|_| bad(line))?;
            match nums[..] {
                [inside, outside, count] => ranges.push((inside, outside, count)),
                _ => return Err(bad(line)),
            }
        }
        Ok(Self(ranges))
    }

    /// The host ID of `id`, or `None` when no range maps it.
    pub fn to_host(&self, id: u32) -> Option<u32> {
        self.0.iter().find_map(|&(inside, outside, count)| {
            let offset = id.checked_sub(inside)?;
            (offset < count).then(|| outside + offset)
        })
    }

    fn describe(&self) -> String {
        if self.0.is_empty() {
            return "empty".into();
        }
        self.0
            .iter()
            .map(|(i, o, c)| format!("{i} {o} {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The ID maps of the user namespace that owns a netns; `None` when that is the host's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerMaps {
    pub uid: IdMap,
    pub gid: IdMap,
}

/// The host's (uid, gid) for the proxy's in-pod `uid` and `gid`, or `None` when the netns
/// belongs to the host's user namespace, where they are the same (one ioctl and two stats).
pub fn proxy_ids_on_host(
    netns: &Netns,
    uid: u32,
    gid: u32,
) -> Result<Option<(u32, u32)>, UsernsError> {
    let name = || netns.path().display().to_string();
    let Some(maps) = owner_maps(netns)? else {
        return Ok(None);
    };
    let host = |map: &IdMap, kind: &'static str, id: u32| {
        map.to_host(id).ok_or_else(|| UsernsError::Unmapped {
            kind,
            id,
            netns: name(),
            map: map.describe(),
        })
    };
    Ok(Some((
        host(&maps.uid, "uid", uid)?,
        host(&maps.gid, "gid", gid)?,
    )))
}

/// The user namespace that owns `netns` (`NS_GET_USERNS`, which enters nothing), and whether it
/// is the one this process runs in.
///
/// "The one this process runs in" is `/proc/self/ns/user`, compared by `(st_dev, st_ino)` as
/// namespaces(7) says two namespaces are compared. For the agent and the plugin that is the
/// node's user namespace: both run in it (the agent's DaemonSet is `hostUsers: true`, the plugin
/// is the runtime's child), and the runtime makes every ordinary pod's netns from it. Not
/// `/proc/1/ns/user`: where the node itself runs in a user namespace (a node in a container),
/// PID 1 of the host's /proc is outside it, while its pods' netns belong to the node's, which is
/// ours. An owner outside our scope (`EPERM` from the ioctl, an ancestor) is an error.
fn owner(netns: &Netns) -> Result<(OwnedFd, bool), UsernsError> {
    let owner_err = |source: io::Error| UsernsError::Owner {
        netns: netns.path().display().to_string(),
        source,
    };
    // SAFETY: NS_GET_USERNS takes no argument and returns a new fd or -1.
    let fd = unsafe { libc::ioctl(netns.fd().as_raw_fd(), NS_GET_USERNS) };
    if fd < 0 {
        return Err(owner_err(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let userns = unsafe { OwnedFd::from_raw_fd(fd) };
    let theirs = File::from(userns.try_clone().map_err(owner_err)?)
        .metadata()
        .map_err(owner_err)?;
    let ours = fs::metadata("/proc/self/ns/user").map_err(owner_err)?;
    let same = (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino());
    Ok((userns, same))
}

/// Whether `netns` belongs to the node's user namespace (see [`owner`]): one ioctl and two
/// stats, nothing entered. A netns that a process made in a nested user namespace of its own
/// (`unshare -Urn` as root in a pod) does not.
pub fn owned_by_ours(netns: &Netns) -> Result<bool, UsernsError> {
    owner(netns).map(|(_, ours)| ours)
}

/// The maps of the user namespace owning `netns`, or `None` when it is the one this process
/// runs in (the host's, for the plugin and the agent). Otherwise a child process joins that user
/// namespace: call this only for the netns of a pod the runtime made (an enrolment), never to
/// find out whether an unknown netns is a pod's (the agent's scan uses [`owned_by_ours`]).
pub fn owner_maps(netns: &Netns) -> Result<Option<OwnerMaps>, UsernsError> {
    let (userns, ours) = owner(netns)?;
    if ours {
        return Ok(None);
    }
    read_maps(&userns)
        .map(Some)
        .map_err(|source| UsernsError::Maps {
            netns: netns.path().display().to_string(),
            source,
        })
}

/// Forks a child that joins `userns` and waits; reads its maps from here; lets it go.
fn read_maps(userns: &OwnedFd) -> io::Result<OwnerMaps> {
    // Close-on-exec, so that a process another thread spawns meanwhile does not keep them open.
    let (joined_r, joined_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (release_r, release_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: the child only makes raw system calls (close, setns, write, read, _exit) before
    // it exits, all async-signal-safe, so forking a multithreaded process (the agent) is sound.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            // SAFETY: raw syscalls on fds this process holds; `_exit` never returns. The
            // parent's ends are closed first so that the parent sees EOF if this child dies.
            unsafe {
                libc::close(joined_r.as_raw_fd());
                libc::close(release_w.as_raw_fd());
                let ok = libc::setns(userns.as_raw_fd(), libc::CLONE_NEWUSER) == 0;
                let status = [u8::from(ok)];
                libc::write(joined_w.as_raw_fd(), status.as_ptr().cast(), 1);
                let mut byte = [0u8; 1];
                libc::read(release_r.as_raw_fd(), byte.as_mut_ptr().cast(), 1);
                libc::_exit(0)
            }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(joined_w);
            drop(release_r);
            let mut status = [0u8; 1];
            let joined = nix::unistd::read(joined_r.as_raw_fd(), &mut status);
            let maps = match joined {
                Ok(1) if status[0] == 1 => (|| {
                    Ok(OwnerMaps {
                        uid: IdMap::parse(&fs::read_to_string(format!("/proc/{child}/uid_map"))?)?,
                        gid: IdMap::parse(&fs::read_to_string(format!("/proc/{child}/gid_map"))?)?,
                    })
                })(),
                Ok(_) => Err(io::Error::other(
                    "a child process could not join the user namespace (setns)",
                )),
                Err(e) => Err(e.into()),
            };
            // An explicit byte, not EOF: a child forked meanwhile elsewhere may hold this end.
            let _ = nix::unistd::write(&release_w, &[1]);
            drop(release_w);
            let _ = nix::sys::wait::waitpid(child, None);
            maps
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_translate_inside_ids_and_refuse_unmapped_ones() {
        let map = IdMap::parse("         0     100000      65536\n").unwrap();
        assert_eq!(map.to_host(0), Some(100_000));
        assert_eq!(map.to_host(1337), Some(101_337));
        assert_eq!(map.to_host(65_535), Some(165_535));
        assert_eq!(map.to_host(65_536), None);
        let split = IdMap::parse("0 1000 1\n1337 200000 10\n").unwrap();
        assert_eq!(split.to_host(0), Some(1000));
        assert_eq!(split.to_host(1), None);
        assert_eq!(split.to_host(1346), Some(200_009));
        assert_eq!(IdMap::parse("").unwrap().to_host(0), None);
        assert!(IdMap::parse("0 1").is_err());
        assert!(IdMap::parse("0 x 1").is_err());
    }

    #[test]
    fn the_identity_map_of_the_host() {
        let map = IdMap::parse("0 0 4294967295").unwrap();
        assert_eq!(map.to_host(1337), Some(1337));
    }
}
