//! An attachment's enrolment as values: the [`Plan`] ADD decides before it writes anything, and
//! the [`Removal`] DEL and GC choose from what the record says.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use super::Recorded;
use crate::policy::Policy;

/// One attachment's enrolment, decided before anything is written: the netns and its cookie,
/// the interface the attachment captures, and the policy. The maps, links and addresses the
/// enrolment writes follow from these and from the netns ([`super::Enrolled`] says which).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub netns: PathBuf,
    pub netns_cookie: u64,
    pub ifname: String,
    pub policy: Policy,
}

impl Plan {
    pub fn netns(&self) -> &Path {
        &self.netns
    }
}

/// How much of a cookie's enrolment to remove, and how to find it.
#[derive(Debug, Clone, Copy)]
pub enum Removal<'a> {
    /// Every key of the cookie, found by scanning the maps: no record says exactly what the maps
    /// hold (none, a damaged or pending one, a shared netns).
    Scan,
    /// The keys a complete record of the only attachment says its enrolment wrote.
    Recorded(Recorded<'a>),
    /// One attachment of a netns that other attachments keep enrolled: its interface's addresses
    /// and links.
    Attachment {
        ifname: &'a str,
        addresses: &'a [IpAddr],
        inbound_ifindexes: &'a [u32],
    },
}
