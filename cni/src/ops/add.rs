//! ADD: decide, record the intent, enrol, record; undo the enrolment when the record cannot be
//! written.
//!
//! Every step is safe to be killed after: the pending record written before the first map
//! write names the netns cookie, so DEL (even with the netns gone), GC and the agent's
//! reconcile undo a half-done ADD, and a repeated ADD finishes it (enrolment is idempotent).
//! The `add:*` failpoints ([`sidestep::sys::failpoint`]) sit between the steps. The record's
//! netns-cookie index entry goes in before the pending record (see [`crate::state`]).

use std::collections::BTreeSet;

use serde_json::Value;

use super::{
    Ctx, Resolved, Uncaptured, args_label, pod_label, require_loaded, resolve, uncaptured,
};
use sidestep::{
    enroll::hook::TcBecause,
    error::EnrollError,
    policy::{InboundHook, Policy},
    sys::failpoint,
};

use crate::{
    config::Mesh,
    dataplane::netns_error,
    spec::{CniError, code, error::ToCniError, result::empty_result},
    state::{RECORD_FORMAT, Record, StateDir, now_unix},
};

fn mesh_name(m: Mesh) -> &'static str {
    match m {
        Mesh::Istio => "istio",
        Mesh::Linkerd => "linkerd",
        Mesh::Kuma => "kuma",
    }
}

/// Returns the result to print: prevResult unchanged, or an empty result without one.
/// `decide_only`: what ADD would do, and nothing done: `{"sidestepDecision": "enrol"}`, or
/// `"skip"` with the reason, or `"uncaptured"` with the error that would fail (or, under
/// FAIL_OPEN, pass) the ADD.
fn decision_report(resolved: &Result<Resolved, Result<Uncaptured, CniError>>) -> Value {
    match resolved {
        Ok(Resolved::Enrol(_)) => serde_json::json!({"sidestepDecision": "enrol"}),
        Ok(Resolved::Skip(reason, _)) => {
            serde_json::json!({"sidestepDecision": "skip", "reason": reason.to_string()})
        }
        Err(Ok(u)) => {
            serde_json::json!({"sidestepDecision": "uncaptured", "reason": u.error.msg})
        }
        Err(Err(e)) => serde_json::json!({"sidestepDecision": "error", "reason": e.msg}),
    }
}

pub fn add(ctx: &Ctx<'_>) -> Result<Value, CniError> {
    let output = match &ctx.cfg.prev_result {
        Some(p) => p.output(ctx.cfg.cni_version),
        None => empty_result(ctx.cfg.cni_version),
    };
    let (cid, ifname) = ctx.env.attachment();
    let netns = ctx.env.netns.as_deref().unwrap_or_else(|| "".as_ref());
    // A bad netns is an error whatever the decision: the host's is never a pod's.
    let cookie = ctx.dp.netns_cookie(netns).map_err(|e| netns_error(&e))?;
    // Before anything reads the pod or enters the netns's user namespace (enrolment does, for
    // a user-namespaced pod's proxy IDs).
    if let Some(expected) = ctx.cfg.expect_netns_cookie
        && expected != cookie
    {
        return Err(CniError::new(
            code::INVALID_NETNS,
            format!(
                "{} is not the netns the agent's repair found (cookie {cookie}, expected \
                 {expected}): its process exited and another took its PID",
                netns.display()
            ),
        ));
    }

    let resolved = resolve(ctx);
    if ctx.cfg.decide_only {
        return Ok(decision_report(&resolved));
    }
    let (enrolment, identity, api_ips) = match resolved {
        Ok(Resolved::Skip(reason, source)) => {
            tracing::info!(
                "{} not captured: {reason}{}",
                args_label(ctx),
                source.map_or(String::new(), |s| format!(" (decided from {})", s.as_str()))
            );
            return Ok(output);
        }
        Ok(Resolved::Enrol(e)) => {
            if let Some(s) = e.source {
                tracing::info!("{}: captured, decided from {}", args_label(ctx), s.as_str());
            }
            (e.enrolment, e.identity, e.api_ips)
        }
        Err(Ok(u)) => return uncaptured(ctx, u).map(|()| output),
        Err(Err(e)) => return Err(e),
    };
    let who = pod_label(identity.as_ref(), cid);
    let mut policy = enrolment.policy;
    policy.hairpin = enrolment.hairpin;
    if policy.pod_ips.is_empty() {
        policy.pod_ips = pod_ips(ctx, netns, api_ips, &who);
    }
    policy.inbound_hook = inbound_hook(ctx, netns, cookie, &policy, &who);

    // Refusals of the input are not outages: FAIL_OPEN does not cover them.
    let fail = |error: CniError| {
        if matches!(error.code, code::INVALID_NETNS | code::INVALID_CONFIG) {
            return Err(error);
        }
        uncaptured(
            ctx,
            Uncaptured {
                error,
                identity: identity.clone(),
            },
        )
        .map(|()| output.clone())
    };
    if let Err(e) = require_loaded(ctx) {
        return fail(e);
    }
    let previous = match ctx.state.read_record(cid, ifname) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("{who}: {e}; ADD replaces it");
            None
        }
    };
    let mut record = Record {
        format: RECORD_FORMAT,
        network: ctx.cfg.name.clone(),
        container_id: cid.into(),
        ifname: ifname.into(),
        netns: netns.to_path_buf(),
        netns_cookie: cookie,
        interfaces: Vec::new(),
        // podman passes K8S_POD_NAME alone; it still tells the operator which pod this is.
        pod_name: identity
            .as_ref()
            .map(|i| i.name.clone())
            .or_else(|| ctx.env.args.get("K8S_POD_NAME").map(str::to_owned)),
        pod_namespace: identity.as_ref().map(|i| i.namespace.clone()),
        mesh: mesh_name(ctx.cfg.mesh).into(),
        policy,
        pin_root: ctx.dp.pin_root().to_path_buf(),
        created_unix: now_unix(),
        inbound_ifindexes: None,
        netns_keys: None,
        pending: false,
        writer_pid: None,
    };
    // Enrolment would refuse it too, but only after the index entry: a refused input leaves
    // nothing, not even a marker.
    if let Err(e) = record.policy.validate() {
        return Err(EnrollError::from(e).to_cni());
    }
    let previous_cookie = previous.as_ref().map(|p| p.netns_cookie);
    let enrolled_before = ctx.dp.is_enrolled(cookie);
    if let Err(e) = ctx
        .state
        .index_attachment(cookie, cid, ifname, enrolled_before)
    {
        return fail(e.to_cni());
    }
    // A failed re-enrolment may leave part of its policy beside the earlier one, which then no
    // record describes: the cookie's last DEL must scan the maps.
    let unexact = || {
        if enrolled_before && let Err(e) = ctx.state.mark_unexact(cookie) {
            tracing::warn!("{who}: {e}");
        }
    };
    failpoint("add:after-index");
    if let Err(e) = ctx.state.write_pending(&record) {
        unindex_failed(ctx, cookie, previous_cookie, &who);
        return fail(e.to_cni());
    }
    failpoint("add:after-pending");
    let enrolled = match ctx.dp.enroll(netns, &record.policy, ifname) {
        Ok(e) => e,
        Err(e) => {
            unexact();
            restore(&ctx.state, previous.as_ref(), cid, ifname, &who);
            unindex_failed(ctx, cookie, previous_cookie, &who);
            return fail(e.to_cni());
        }
    };
    failpoint("add:after-enroll");
    record.netns_cookie = enrolled.netns_cookie;
    record.interfaces = enrolled.interfaces.clone();
    record.inbound_ifindexes = Some(enrolled.inbound_ifindexes.clone());
    record.netns_keys = Some(enrolled.netns_keys.clone());
    let recorded = ctx
        .state
        .write_record(&record)
        .map_err(|e| e.to_cni())
        .and_then(|()| confirm_current(ctx, netns, &record.policy, ifname, &who));
    if let Err(e) = recorded {
        unexact();
        // Keep an enrolment an earlier ADD of this attachment recorded; undo only ours.
        let ours = previous
            .as_ref()
            .is_none_or(|p| p.netns_cookie != enrolled.netns_cookie);
        if ours
            && ctx
                .state
                .sharing(enrolled.netns_cookie, cid, ifname, &BTreeSet::new())
                .others
                == 0
            && let Err(u) = ctx.dp.unenroll(enrolled.netns_cookie)
        {
            tracing::error!("{who}: rolling back the enrolment failed: {u}");
        }
        restore(&ctx.state, previous.as_ref(), cid, ifname, &who);
        unindex_failed(ctx, cookie, previous_cookie, &who);
        return fail(e);
    }
    failpoint("add:after-record");
    if let Some(p) = previous.filter(|p| p.netns_cookie != enrolled.netns_cookie) {
        // The same attachment in a new netns: the old one is no longer ours.
        let last = ctx
            .state
            .sharing(p.netns_cookie, cid, ifname, &BTreeSet::new())
            .others
            == 0;
        if last && let Err(e) = ctx.dp.unenroll(p.netns_cookie) {
            tracing::warn!("{who}: removing the enrolment of its previous netns failed: {e}");
        }
        if let Err(e) = ctx.state.unindex(p.netns_cookie, cid, ifname, last) {
            tracing::warn!("{who}: {e}; GC removes the entry later");
        }
    }
    let _ = ctx.state.remove_marker(cid, ifname);
    tracing::info!(
        "{who} captured (netns cookie {}, inbound on [{}])",
        enrolled.netns_cookie,
        enrolled.interfaces.join(",")
    );
    Ok(output)
}

/// The pod's addresses: prevResult's, else the pod status's, else what the netns has (a
/// runtime can ADD before it reports IPs). With none the pod is enrolled anyway: no hairpin, and
/// inbound through tc (see [`inbound_hook`]).
fn pod_ips(
    ctx: &Ctx<'_>,
    netns: &std::path::Path,
    api_ips: Vec<std::net::IpAddr>,
    who: &str,
) -> Vec<std::net::IpAddr> {
    let mut ips = match &ctx.cfg.prev_result {
        Some(p) if !p.ips.is_empty() => p.ips.clone(),
        _ => api_ips,
    };
    if ips.is_empty() {
        ips = ctx.dp.addresses(netns);
        if ips.is_empty() {
            tracing::info!(
                "{who}: no pod IPs in prevResult, the pod status or the netns; enrolling without \
                 hairpin"
            );
        }
    }
    ips
}

/// The configured inbound hook, but `tc` where `sk_lookup` cannot work: when something already
/// listens on the inbound port (an ADD into a running netns, such as `podman network connect`:
/// sk_lookup knows a proxy's listener only from a listen(2) after enrolment). An error reading
/// the netns's sockets counts as a listener.
///
/// A netns another attachment enrolled already keeps that attachment's hook: its proxy may
/// listen by now, and with `sk_lookup` the listener is known, with `tc` it may not be.
fn inbound_hook(
    ctx: &Ctx<'_>,
    netns: &std::path::Path,
    cookie: u64,
    policy: &Policy,
    who: &str,
) -> InboundHook {
    let hook = ctx.cfg.inbound_hook;
    if hook != InboundHook::SkLookup || policy.inbound_port == 0 {
        return hook;
    }
    let decided = sidestep::enroll::hook::decide(ctx.dp.enrolled_hook(cookie), || {
        ctx.dp.listening(netns, policy.inbound_port)
    });
    decided.unwrap_or_else(|because| {
        match because {
            TcBecause::EnrolledWithTc => {}
            TcBecause::AlreadyListening => {
                tracing::info!("{who}: {because}; inbound through tc");
            }
            TcBecause::Unknown(_) => tracing::warn!("{who}: {because}; inbound through tc"),
        }
        InboundHook::Tc
    })
}

/// Enrolments an ADD makes before it gives up on a data path that keeps being reloaded.
const ENROL_ATTEMPTS_ACROSS_RELOADS: usize = 3;

/// Once the record is complete, a reload that recreates the maps re-enrols the pod from it (the
/// agent's reconcile). One that came between this ADD's open of the maps and its record took the
/// enrolment with the old maps, and read the records before this one was complete: enrol again
/// into the maps now pinned. A reload that keeps racing fails the ADD (try again later), never
/// lets the pod start uncaptured.
fn confirm_current(
    ctx: &Ctx<'_>,
    netns: &std::path::Path,
    policy: &Policy,
    ifname: &str,
    who: &str,
) -> Result<(), CniError> {
    for _ in 1..ENROL_ATTEMPTS_ACROSS_RELOADS {
        if ctx.dp.enrolment_current() {
            return Ok(());
        }
        tracing::warn!("{who}: the maps were recreated during ADD; enrolling into the new ones");
        ctx.dp
            .enroll(netns, policy, ifname)
            .map_err(|e| e.to_cni())?;
    }
    if ctx.dp.enrolment_current() {
        return Ok(());
    }
    Err(CniError::new(
        code::TRY_AGAIN_LATER,
        format!(
            "the maps under {} were recreated during each of {ENROL_ATTEMPTS_ACROSS_RELOADS}              enrolments (a reload in progress)",
            ctx.dp.pin_root().display()
        ),
    ))
}

/// After a failed ADD: its index entry goes unless the attachment's earlier record (put back)
/// names the same cookie. Markers stay: they describe the netns, not this attachment.
fn unindex_failed(ctx: &Ctx<'_>, cookie: u64, previous_cookie: Option<u64>, who: &str) {
    if previous_cookie != Some(cookie) {
        let (cid, ifname) = ctx.env.attachment();
        if let Err(e) = ctx.state.unindex(cookie, cid, ifname, false) {
            tracing::warn!("{who}: {e}; GC removes the entry later");
        }
    }
}

/// Puts back the record an earlier ADD of this attachment wrote, or removes the pending one,
/// after a failed ADD undid its enrolment.
fn restore(state: &StateDir, previous: Option<&Record>, cid: &str, ifname: &str, who: &str) {
    let result = match previous {
        Some(p) => state.write_record(p),
        None => state.remove_record(cid, ifname).map(drop),
    };
    if let Err(e) = result {
        tracing::error!("{who}: restoring the state record after a failed ADD: {e}");
    }
}
