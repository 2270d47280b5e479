//! Judging one scenario: sidestep's outcome against the oracle's, directly, under rule G (its
//! documented SO_ORIGINAL_DST answer), or against the exact outcome an `Intended` mark promises.

use std::net::SocketAddr;

use sidestep_tests::parity::{Names, Outcome};

use crate::run::Scenario;
use crate::table::{Fam, Intended, Src};

/// Whether the accepting listener is in the subject pod (where sidestep answers getsockopt).
fn in_subject(o: &Outcome) -> bool {
    ["15001", "15006", "15053"].contains(&o.accepted.as_str()) || o.accepted.starts_with("S:")
}

/// Rule G, sidestep's documented SO_ORIGINAL_DST answer in an enrolled pod: ENOENT for every
/// query it has no redirect record for. The kernel under Istio's rules answers otherwise: the
/// REDIRECT rules turn conntrack on in the pod, so a connection nothing redirected gets its own
/// local address back. (SOL_IPV6 on an AF_INET socket fails with EOPNOTSUPP in both: the kernel
/// refuses it before netfilter is asked, and sidestep leaves that error alone.)
fn rule_g(oracle: &Outcome) -> Outcome {
    let mut o = oracle.clone();
    if !in_subject(&o) {
        return o;
    }
    let local = o.local.clone();
    for v in [&mut o.orig_v4, &mut o.orig_v6] {
        if *v == local {
            *v = "ENOENT".into();
        }
    }
    o
}

/// sidestep's exact outcome for an `Intended` row.
fn intended_outcome(why: Intended, sc: &Scenario, oracle: &Outcome, names: &Names) -> Outcome {
    let dst = names.addr(sc.dst);
    let port = sc.dst.port();
    let redirected = |accepted: &str, local: &str| Outcome {
        accepted: accepted.into(),
        local: local.into(),
        orig_v4: "ENOENT".into(),
        orig_v6: dst.clone(),
        app_peer: dst.clone(),
        source: oracle.source.clone(),
    };
    match why {
        Intended::SkAssign => {
            let mut o = rule_g(oracle);
            o.local = if sc.fam == Fam::V6 {
                o.orig_v6.clone()
            } else {
                o.orig_v4.clone()
            };
            o
        }
        Intended::V6Outbound => redirected("15001", "[::1]:15001"),
        Intended::V6Hairpin => redirected("15006", "[::1]:15006"),
        Intended::V6Inbound => redirected("15006", &dst),
        Intended::LinkLocalRedirect => {
            let mut unscoped = sc.dst;
            if let SocketAddr::V6(a) = &mut unscoped {
                a.set_scope_id(0);
            }
            let (port, local) = if sc.from == Src::Proxy {
                ("15006", "[::1]:15006")
            } else {
                ("15001", "[::1]:15001")
            };
            // The pod's link-local source would need the scope connect6 cannot see: the
            // socket keeps the loopback source.
            Outcome {
                orig_v6: names.addr(unscoped),
                app_peer: names.addr(unscoped),
                source: "::1".into(),
                ..redirected(port, local)
            }
        }
        Intended::BoundDeviceV6 => Outcome::failed(libc::ENETUNREACH.into()),
        Intended::LoopbackSourceRefused => Outcome::failed(libc::EPERM.into()),
        // Not redirected: netfilter's ENOENT, except SOL_IPV6 on an IPv4 socket, which the kernel
        // refuses itself.
        Intended::ExcludeWins => Outcome {
            accepted: format!("S:{port}"),
            local: dst.clone(),
            orig_v4: "ENOENT".into(),
            orig_v6: if sc.fam == Fam::V6 {
                "ENOENT"
            } else {
                "EOPNOTSUPP"
            }
            .into(),
            app_peer: dst.clone(),
            source: oracle.source.clone(),
        },
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    Match,
    MatchG,
    Intended(Intended),
    Mismatch,
}

pub(super) fn judge(
    sc: &Scenario,
    oracle: &Outcome,
    ss: &Outcome,
    names: &Names,
) -> (Verdict, Option<Outcome>) {
    match sc.intended {
        Some(why) => {
            let want = intended_outcome(why, sc, oracle, names);
            // A mark must describe a real difference, and sidestep must do exactly what it says.
            if *ss == want && want != rule_g(oracle) {
                (Verdict::Intended(why), None)
            } else {
                (Verdict::Mismatch, Some(want))
            }
        }
        None if ss == oracle => (Verdict::Match, None),
        None if *ss == rule_g(oracle) => (Verdict::MatchG, None),
        None => (Verdict::Mismatch, Some(rule_g(oracle))),
    }
}
