//! CHECK: the attachment is still what ADD made it: programs loaded, and the data path as its
//! record says ([`sidestep::enroll::verify`]: the pod's map entry with the recorded policy, and
//! each link and address).

use sidestep::enroll::verify::Expected;

use super::{Ctx, Resolved, pod_label, require_loaded, resolve};
use crate::{
    dataplane::netns_error,
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
    let attachment = format!("{cid}/{ifname}");
    let expected = Expected {
        attachment: &attachment,
        policy: &record.policy,
        interfaces: &record.interfaces,
        netns_keys: record.netns_keys.as_ref(),
    };
    ctx.dp
        .verify(cookie, &expected)
        .map_err(|m| failed(m.to_string()))
}
