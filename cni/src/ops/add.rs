//! ADD: decide, record the intent, enrol, record; undo the enrolment when the record cannot be
//! written.
//!
//! Every step is safe to be killed after: the pending record written before the first map
//! write names the netns cookie, so DEL (even with the netns gone), GC and the agent's
//! reconcile undo a half-done ADD, and a repeated ADD finishes it (enrolment is idempotent).
//! The `add:*` failpoints ([`sidestep::sys::failpoint`]) sit between the steps. The record's
//! netns-cookie index entry goes in before the pending record (see [`crate::state`]).

use std::{collections::BTreeSet, path::Path};

use serde_json::Value;

use super::{
    Ctx, Resolved, ToEnrol, Uncaptured, args_label, pod_label, require_loaded, resolve, uncaptured,
};
use sidestep::{
    enroll::{Enrolled, Plan, Removal, hook::TcBecause},
    error::EnrollError,
    policy::{InboundHook, Policy},
    sys::failpoint,
};

use crate::{
    config::Mesh,
    dataplane::{Ask, Facts, netns_error},
    mesh::Identity,
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
    let target = parse(ctx)?;
    let resolved = resolve(ctx);
    if ctx.cfg.decide_only {
        return Ok(decision_report(&resolved));
    }
    let to_enrol = match decide(ctx, resolved) {
        Decided::Enrol(e) => e,
        Decided::Done(done) => return done.map(|()| output),
    };
    let attempt = Attempt::new(ctx, &to_enrol);
    let fail = |error: CniError| attempt.uncaptured(error).map(|()| output.clone());
    let (plan, facts) = plan(ctx, &target, *to_enrol, &attempt.who);
    if let Err(e) = require_loaded(ctx) {
        return fail(e);
    }
    let previous = attempt.previous_record();
    let mut record = attempt.record(&plan);
    // Enrolment would refuse it too, but only after the index entry: a refused input leaves
    // nothing, not even a marker.
    if let Err(e) = plan.policy.validate() {
        return Err(EnrollError::from(e).to_cni());
    }
    let state = &ctx.state;
    let (cid, ifname) = ctx.env.attachment();
    if let Err(e) = state.index_attachment(plan.netns_cookie, cid, ifname, facts.enrolled) {
        return fail(e.to_cni());
    }
    failpoint("add:after-index");
    let undo = |stage| attempt.rollback(stage, &plan, previous.as_ref(), facts.enrolled);
    if let Err(e) = state.write_pending(&record) {
        undo(Stage::Indexed);
        return fail(e.to_cni());
    }
    failpoint("add:after-pending");
    let enrolled = match ctx.dp.apply(&plan) {
        Ok(e) => e,
        Err(e) => {
            undo(Stage::Pending);
            return fail(e.to_cni());
        }
    };
    failpoint("add:after-enroll");
    record.netns_cookie = enrolled.netns_cookie;
    record.interfaces = enrolled.interfaces.clone();
    record.inbound_ifindexes = Some(enrolled.inbound_ifindexes.clone());
    record.netns_keys = Some(enrolled.netns_keys.clone());
    let recorded = state.write_record(&record).map_err(|e| e.to_cni());
    if let Err(e) = recorded.and_then(|()| confirm_current(ctx, &plan, &attempt.who)) {
        undo(Stage::Enrolled(enrolled.netns_cookie));
        return fail(e);
    }
    failpoint("add:after-record");
    attempt.finish(previous, &enrolled);
    Ok(output)
}

/// The netns the runtime named, checked before anything reads the pod.
struct Target<'a> {
    netns: &'a Path,
    cookie: u64,
}

/// Parse: the netns and its cookie. A bad netns is an error whatever the decision: the host's
/// is never a pod's. Before anything reads the pod or enters the netns's user namespace
/// (enrolment does, for a user-namespaced pod's proxy IDs), the cookie must be the one the
/// agent's repair found, if it asked.
fn parse<'a>(ctx: &'a Ctx<'_>) -> Result<Target<'a>, CniError> {
    let netns = ctx.env.netns.as_deref().unwrap_or_else(|| "".as_ref());
    let cookie = ctx.dp.netns_cookie(netns).map_err(|e| netns_error(&e))?;
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
    Ok(Target { netns, cookie })
}

enum Decided {
    Enrol(Box<ToEnrol>),
    /// Nothing to enrol: skipped, let through uncaptured (FAIL_OPEN), or failed.
    Done(Result<(), CniError>),
}

/// Decide: capture the pod, skip it, or report why it cannot be captured.
fn decide(ctx: &Ctx<'_>, resolved: Result<Resolved, Result<Uncaptured, CniError>>) -> Decided {
    match resolved {
        Ok(Resolved::Skip(reason, source)) => {
            tracing::info!(
                "{} not captured: {reason}{}",
                args_label(ctx),
                source.map_or(String::new(), |s| format!(" (decided from {})", s.as_str()))
            );
            crate::logging::agent::skipped(reason.code(), &reason.to_string());
            Decided::Done(Ok(()))
        }
        Ok(Resolved::Enrol(e)) => {
            if let Some(s) = e.source {
                tracing::info!("{}: captured, decided from {}", args_label(ctx), s.as_str());
            }
            Decided::Enrol(e)
        }
        Err(Ok(u)) => Decided::Done(uncaptured(ctx, u)),
        Err(Err(e)) => Decided::Done(Err(e)),
    }
}

/// Plan: the policy as it will be enrolled (pod IPs, inbound hook), from one read of the netns
/// and the maps.
fn plan(ctx: &Ctx<'_>, target: &Target<'_>, to_enrol: ToEnrol, who: &str) -> (Plan, Facts) {
    let mut policy = to_enrol.enrolment.policy;
    policy.hairpin = to_enrol.enrolment.hairpin;
    let known_ips = match &ctx.cfg.prev_result {
        Some(p) if !p.ips.is_empty() => p.ips.clone(),
        _ => to_enrol.api_ips,
    };
    let hook = ctx.cfg.inbound_hook;
    let ask = Ask {
        listening_on: (hook == InboundHook::SkLookup && policy.inbound_port != 0)
            .then_some(policy.inbound_port),
        addresses: policy.pod_ips.is_empty() && known_ips.is_empty(),
    };
    let mut facts = ctx.dp.facts(target.netns, target.cookie, ask);
    if policy.pod_ips.is_empty() {
        policy.pod_ips = pod_ips(known_ips, std::mem::take(&mut facts.addresses), who);
    }
    policy.inbound_hook = inbound_hook(hook, &policy, &mut facts, who);
    let (_, ifname) = ctx.env.attachment();
    let plan = Plan {
        netns: target.netns.to_path_buf(),
        netns_cookie: target.cookie,
        ifname: ifname.to_owned(),
        policy,
    };
    (plan, facts)
}

/// How far a failed ADD got: what its rollback undoes.
#[derive(Clone, Copy)]
enum Stage {
    /// The index entry is in; writing the pending record failed.
    Indexed,
    /// The pending record is written; enrolment failed.
    Pending,
    /// This netns cookie is enrolled; its record, or the check that it went into the maps now
    /// pinned, failed.
    Enrolled(u64),
}

/// One ADD's attachment and pod, for its record, its rollback and its logs.
struct Attempt<'c, 'a> {
    ctx: &'c Ctx<'a>,
    identity: Option<Identity>,
    who: String,
}

impl<'c, 'a> Attempt<'c, 'a> {
    fn new(ctx: &'c Ctx<'a>, to_enrol: &ToEnrol) -> Self {
        let (cid, _) = ctx.env.attachment();
        Self {
            ctx,
            who: pod_label(to_enrol.identity.as_ref(), cid),
            identity: to_enrol.identity.clone(),
        }
    }

    /// Refusals of the input are not outages: FAIL_OPEN does not cover them.
    fn uncaptured(&self, error: CniError) -> Result<(), CniError> {
        if matches!(error.code, code::INVALID_NETNS | code::INVALID_CONFIG) {
            return Err(error);
        }
        uncaptured(
            self.ctx,
            Uncaptured {
                error,
                identity: self.identity.clone(),
            },
        )
    }

    /// The record an earlier ADD of this attachment wrote, if it reads.
    fn previous_record(&self) -> Option<Record> {
        let (cid, ifname) = self.ctx.env.attachment();
        self.ctx.state.read_record(cid, ifname).unwrap_or_else(|e| {
            tracing::warn!("{}: {e}; ADD replaces it", self.who);
            None
        })
    }

    /// The record of `plan`, before enrolment fills in what it wrote.
    fn record(&self, plan: &Plan) -> Record {
        let ctx = self.ctx;
        let (cid, ifname) = ctx.env.attachment();
        Record {
            format: RECORD_FORMAT,
            network: ctx.cfg.name.clone(),
            container_id: cid.into(),
            ifname: ifname.into(),
            netns: plan.netns.clone(),
            netns_cookie: plan.netns_cookie,
            interfaces: Vec::new(),
            // podman passes K8S_POD_NAME alone; it still tells the operator which pod this is.
            pod_name: self
                .identity
                .as_ref()
                .map(|i| i.name.clone())
                .or_else(|| ctx.env.args.get("K8S_POD_NAME").map(str::to_owned)),
            pod_namespace: self.identity.as_ref().map(|i| i.namespace.clone()),
            mesh: mesh_name(ctx.cfg.mesh).into(),
            policy: plan.policy.clone(),
            pin_root: ctx.dp.pin_root().to_path_buf(),
            created_unix: now_unix(),
            inbound_ifindexes: None,
            netns_keys: None,
            pending: false,
            writer_pid: None,
        }
    }

    /// Undoes what an ADD that failed at `stage` did: its index entry, the pending record (or
    /// the earlier record put back), and the enrolment if it was this ADD's alone.
    fn rollback(
        &self,
        stage: Stage,
        plan: &Plan,
        previous: Option<&Record>,
        enrolled_before: bool,
    ) {
        let ctx = self.ctx;
        let (cid, ifname) = ctx.env.attachment();
        let who = &self.who;
        if !matches!(stage, Stage::Indexed) {
            // A failed re-enrolment may leave part of its policy beside the earlier one, which
            // then no record describes: the cookie's last DEL must scan the maps.
            if enrolled_before && let Err(e) = ctx.state.mark_unexact(plan.netns_cookie) {
                tracing::warn!("{who}: {e}");
            }
        }
        if let Stage::Enrolled(cookie) = stage {
            // Keep an enrolment an earlier ADD of this attachment recorded; undo only ours.
            let ours = previous.is_none_or(|p| p.netns_cookie != cookie);
            if ours
                && ctx
                    .state
                    .sharing(cookie, cid, ifname, &BTreeSet::new())
                    .others
                    == 0
                && let Err(u) = ctx.dp.remove(cookie, Removal::Scan)
            {
                tracing::error!("{who}: rolling back the enrolment failed: {u}");
            }
        }
        if !matches!(stage, Stage::Indexed) {
            restore(&ctx.state, previous, cid, ifname, who);
        }
        // Its index entry goes unless the attachment's earlier record (put back) names the
        // same cookie. Markers stay: they describe the netns, not this attachment.
        if previous.map(|p| p.netns_cookie) != Some(plan.netns_cookie)
            && let Err(e) = ctx.state.unindex(plan.netns_cookie, cid, ifname, false)
        {
            tracing::warn!("{who}: {e}; GC removes the entry later");
        }
    }

    /// After the record: the attachment's previous netns is no longer its own, and a FAIL_OPEN
    /// marker of an earlier ADD goes.
    fn finish(&self, previous: Option<Record>, enrolled: &Enrolled) {
        let ctx = self.ctx;
        let (cid, ifname) = ctx.env.attachment();
        let who = &self.who;
        if let Some(p) = previous.filter(|p| p.netns_cookie != enrolled.netns_cookie) {
            let last = ctx
                .state
                .sharing(p.netns_cookie, cid, ifname, &BTreeSet::new())
                .others
                == 0;
            if last && let Err(e) = ctx.dp.remove(p.netns_cookie, Removal::Scan) {
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
    }
}

/// The pod's addresses: prevResult's, else the pod status's (`known`), else what the netns has
/// (a runtime can ADD before it reports IPs). With none the pod is enrolled anyway: no hairpin,
/// and inbound through tc (see [`inbound_hook`]).
fn pod_ips(
    known: Vec<std::net::IpAddr>,
    in_netns: Vec<std::net::IpAddr>,
    who: &str,
) -> Vec<std::net::IpAddr> {
    if !known.is_empty() {
        return known;
    }
    if in_netns.is_empty() {
        tracing::info!(
            "{who}: no pod IPs in prevResult, the pod status or the netns; enrolling without \
             hairpin"
        );
    }
    in_netns
}

/// The configured inbound hook, but `tc` where `sk_lookup` cannot work: when something already
/// listens on the inbound port (an ADD into a running netns, such as `podman network connect`:
/// sk_lookup knows a proxy's listener only from a listen(2) after enrolment). An error reading
/// the netns's sockets counts as a listener.
///
/// A netns another attachment enrolled already keeps that attachment's hook: its proxy may
/// listen by now, and with `sk_lookup` the listener is known, with `tc` it may not be.
fn inbound_hook(hook: InboundHook, policy: &Policy, facts: &mut Facts, who: &str) -> InboundHook {
    if hook != InboundHook::SkLookup || policy.inbound_port == 0 {
        return hook;
    }
    let listening = facts.listening.take();
    let decided =
        sidestep::enroll::hook::decide(facts.enrolled_hook, || listening.unwrap_or(Ok(true)));
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
fn confirm_current(ctx: &Ctx<'_>, plan: &Plan, who: &str) -> Result<(), CniError> {
    for _ in 1..ENROL_ATTEMPTS_ACROSS_RELOADS {
        if ctx.dp.current() {
            return Ok(());
        }
        tracing::warn!("{who}: the maps were recreated during ADD; enrolling into the new ones");
        ctx.dp.apply(plan).map_err(|e| e.to_cni())?;
    }
    if ctx.dp.current() {
        return Ok(());
    }
    Err(CniError::new(
        code::TRY_AGAIN_LATER,
        format!(
            "the maps under {} were recreated during each of {ENROL_ATTEMPTS_ACROSS_RELOADS} \
             enrolments (a reload in progress)",
            ctx.dp.pin_root().display()
        ),
    ))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> std::net::IpAddr {
        s.parse().unwrap()
    }

    /// The plan's pod IPs: prevResult's or the pod status's first, the netns's only without.
    #[test]
    fn the_plan_takes_known_pod_ips_before_the_netns() {
        let known = vec![ip("10.0.0.7")];
        let netns = vec![ip("10.0.0.9")];
        assert_eq!(pod_ips(known.clone(), netns.clone(), "t"), known);
        assert_eq!(pod_ips(Vec::new(), netns.clone(), "t"), netns);
        assert!(pod_ips(Vec::new(), Vec::new(), "t").is_empty());
    }

    /// The plan's inbound hook from the facts alone: sk_lookup, but tc where a listener is
    /// there already (or cannot be ruled out), and the hook another attachment enrolled with.
    #[test]
    fn the_plan_picks_the_inbound_hook_from_the_facts() {
        let policy = Policy::default();
        let hook = |enrolled_hook, listening| {
            let mut facts = Facts {
                enrolled_hook,
                listening,
                ..Facts::default()
            };
            inbound_hook(InboundHook::SkLookup, &policy, &mut facts, "t")
        };
        assert_eq!(hook(None, Some(Ok(false))), InboundHook::SkLookup);
        assert_eq!(hook(None, Some(Ok(true))), InboundHook::Tc);
        let unreadable = sidestep::error::NetnsError::NotNetns("/x".into());
        assert_eq!(hook(None, Some(Err(unreadable))), InboundHook::Tc);
        assert_eq!(hook(Some(InboundHook::Tc), None), InboundHook::Tc);
        assert_eq!(
            hook(Some(InboundHook::SkLookup), None),
            InboundHook::SkLookup
        );
        // Configured tc stays tc, whatever the facts.
        let mut facts = Facts::default();
        assert_eq!(
            inbound_hook(InboundHook::Tc, &policy, &mut facts, "t"),
            InboundHook::Tc
        );
    }
}
