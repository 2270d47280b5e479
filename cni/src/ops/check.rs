//! CHECK: the attachment is still what ADD made it: programs loaded, the pod's map entry with
//! the recorded policy, and the tc program on each recorded interface.

use sidestep::{
    pins::{REROUTE_EGRESS_SUFFIX, REROUTE_INGRESS_SUFFIX},
    policy::InboundHook,
};

use super::{Ctx, Resolved, pod_label, require_loaded, resolve};
use crate::{
    dataplane::{PodEntry, netns_error},
    spec::{CniError, code, error::ToCniError},
};

fn failed(msg: String) -> CniError {
    CniError::new(code::CHECK_FAILED, msg)
        .details("delete and recreate the pod, or restart the sidestep agent to repair it")
}

pub fn check(ctx: &Ctx<'_>) -> Result<(), CniError> {
    let (cid, ifname) = ctx.env.attachment();
    let netns = ctx.env.netns.as_deref().unwrap_or_else(|| "".as_ref());
    let cookie = ctx.dp.netns_cookie(netns).map_err(|e| netns_error(&e))?;
    let record = ctx.state.read_record(cid, ifname).map_err(|e| e.to_cni())?;
    let Some(record) = record else {
        if ctx.state.read_marker(cid, ifname).ok().flatten().is_some() {
            tracing::warn!("CHECK {cid}/{ifname}: started uncaptured under FAIL_OPEN");
            return Ok(());
        }
        // No record: fine if ADD skipped this pod, which the same inputs decide again.
        return match resolve(ctx) {
            Ok(Resolved::Skip(..)) => Ok(()),
            Ok(Resolved::Enrol(e)) => Err(failed(format!(
                "{} should be captured but ADD left no record in {}",
                pod_label(e.identity.as_ref(), cid),
                ctx.state.root().display()
            ))),
            Err(Ok(u)) => Err(u.error),
            Err(Err(e)) => Err(e),
        };
    };
    if record.pending {
        return Err(failed(format!(
            "the ADD of {cid}/{ifname} did not finish: its record in {} is still pending",
            ctx.state.root().display()
        )));
    }
    require_loaded(ctx)?;
    if record.netns_cookie != cookie {
        return Err(failed(format!(
            "{} is netns cookie {cookie}, but ADD enrolled cookie {}",
            netns.display(),
            record.netns_cookie
        )));
    }
    let host_ids = record.netns_keys.as_ref().and_then(|k| k.proxy_host_ids);
    match ctx.dp.pod_entry(cookie, &record.policy, host_ids) {
        Ok(PodEntry::Matches) => {}
        Ok(PodEntry::Missing) => {
            return Err(failed(format!(
                "netns cookie {cookie} is not in the pod map under {}",
                ctx.dp.pin_root().display()
            )));
        }
        Ok(PodEntry::Differs) => {
            return Err(failed(format!(
                "the pod map entry of netns cookie {cookie} differs from the recorded policy"
            )));
        }
        Err(e) => return Err(failed(format!("cannot read the pod map: {e}"))),
    }
    // Re-routed interfaces get their two links whenever the pod captures any outbound range.
    if !record.policy.include_outbound_ip_ranges.is_empty() {
        let pins = ctx.dp.reroute_pins(cookie);
        let missing: Vec<String> = record
            .policy
            .reroute_virtual_interfaces
            .iter()
            .flat_map(|i| {
                [REROUTE_INGRESS_SUFFIX, REROUTE_EGRESS_SUFFIX].map(|s| format!("{i}{s}"))
            })
            .filter(|p| !pins.contains(p))
            .collect();
        if !missing.is_empty() {
            return Err(failed(format!(
                "the re-route links [{}] of netns cookie {cookie} are missing",
                missing.join(", ")
            )));
        }
    }
    if record.interfaces.is_empty() {
        return Ok(());
    }
    if !ctx.dp.has_sk_lookup(cookie) {
        return Err(failed(format!(
            "the inbound sk_lookup program is not attached to netns cookie {cookie}"
        )));
    }
    // Records of this version name the identity program and the attachment's addresses.
    if let Some(keys) = &record.netns_keys {
        if !ctx.dp.has_identity(cookie) {
            return Err(failed(format!(
                "the identity sk_lookup program of netns cookie {cookie} is not attached: \
                 inbound to addresses enrolment did not register would not be captured"
            )));
        }
        let missing = ctx.dp.missing_addresses(cookie, &keys.interface_addresses);
        if !missing.is_empty() {
            let list: Vec<String> = missing.iter().map(ToString::to_string).collect();
            return Err(failed(format!(
                "the addresses [{}] of {cid}/{ifname} are not registered to netns cookie {cookie}",
                list.join(", ")
            )));
        }
    }
    if record.policy.inbound_hook == InboundHook::SkLookup {
        return Ok(());
    }
    let attached = ctx.dp.attached_interfaces(cookie);
    let missing: Vec<_> = record
        .interfaces
        .iter()
        .filter(|i| !attached.contains(i))
        .cloned()
        .collect();
    if !missing.is_empty() {
        return Err(failed(format!(
            "the inbound tc program is not attached to [{}] of netns cookie {cookie}",
            missing.join(", ")
        )));
    }
    Ok(())
}
