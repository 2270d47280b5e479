//! The API server reachable with the agent's credentials, and the RBAC its settings need: one
//! SelfSubjectAccessReview per verb. Creating one needs no grant of the agent's own: Kubernetes'
//! `system:basic-user` ClusterRole lets every authenticated user review its own access.

use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::{Api, api::PostParams};

use super::{DOC_ACCESS, Found, Item};
use crate::agent::{
    apiclient::ApiAccess,
    repair,
    settings::{RepairMode, Settings},
};

/// One grant: (verb, API group, resource or `resource/subresource`).
pub type Grant = (&'static str, &'static str, &'static str);
/// A grant and the component of deploy/ that gives it (`None`: deploy/clusterrole.yaml).
pub type Required = (Grant, Option<&'static str>);
/// A grant's review: allowed, or why the review failed.
pub type Review = (Required, Result<bool, String>);

/// The whole review, connection included, gets this long.
const TIMEOUT: Duration = Duration::from_secs(10);

/// What the agent asks the API with these settings, and the component of deploy/ that grants
/// it (`None`: the base ClusterRole, deploy/clusterrole.yaml).
pub fn required_grants(s: &Settings) -> Vec<Required> {
    // The pod watch and repair's list, the UID of a pod the plugin names, and Events.
    let mut out: Vec<Required> = vec![
        (("get", "", "pods"), None),
        (("list", "", "pods"), None),
        (("watch", "", "pods"), None),
        (("create", "", "events"), None),
    ];
    if s.repair {
        match s.repair_mode {
            RepairMode::Repair => {}
            RepairMode::Delete => out.push((("delete", "", "pods"), Some("repair-delete"))),
            RepairMode::Label => out.push((("patch", "", "pods"), Some("repair-label"))),
        }
    }
    if s.readiness_taint.is_some() {
        for verb in ["get", "patch"] {
            out.push(((verb, "", "nodes"), Some("readiness-taint")));
        }
    }
    if s.ambient {
        for verb in ["get", "list", "watch"] {
            out.push(((verb, "", "namespaces"), Some("ambient")));
        }
        out.push((("patch", "", "pods/status"), Some("ambient")));
    }
    out
}

fn show((verb, group, resource): Grant) -> String {
    if group.is_empty() {
        format!("{verb} {resource}")
    } else {
        format!("{verb} {resource}.{group}")
    }
}

/// The verdict from each grant's review: `Ok(allowed)`, or why the review failed.
pub fn judge(access: &str, reviews: &[Review]) -> Found {
    if let Some((_, Err(e))) = reviews.iter().find(|(_, r)| r.is_err()) {
        return Err((
            format!("the API server does not answer the agent ({access}): {e}"),
            "the agent lists the node's pods, records Events and repairs through it: check \
             api-kubeconfig or the service account, and the network to the API server"
                .into(),
        ));
    }
    let denied: Vec<String> = reviews
        .iter()
        .filter(|(_, r)| r == &Ok(false))
        .map(|((g, component), _)| match component {
            Some(c) => format!("{} (deploy/components/{c})", show(*g)),
            None => format!("{} (deploy/clusterrole.yaml)", show(*g)),
        })
        .collect();
    if denied.is_empty() {
        Ok(format!(
            "API reachable ({access}); allowed: {}",
            reviews
                .iter()
                .map(|((g, _), _)| show(*g))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    } else {
        Err((
            format!("the agent ({access}) may not: {}", denied.join(", ")),
            "apply the ClusterRole and the component of each mode the settings turn on (or the \
             chart's RBAC for them); the agent fails these requests until then"
                .into(),
        ))
    }
}

async fn review(client: kube::Client, (verb, group, resource): Grant) -> Result<bool, String> {
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, sub)) => (r, Some(sub.to_owned())),
        None => (resource, None),
    };
    let ssar = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let done = Api::<SelfSubjectAccessReview>::all(client)
        .create(&PostParams::default(), &ssar)
        .await
        .map_err(|e| e.to_string())?;
    Ok(done.status.is_some_and(|s| s.allowed))
}

fn reviews(api: &ApiAccess, grants: &[Required]) -> Vec<Review> {
    let all = |e: String| grants.iter().map(|g| (*g, Err(e.clone()))).collect();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return all(format!("cannot start an async runtime: {e}")),
    };
    rt.block_on(async {
        let client = match crate::agent::apiclient::client(api, Some(TIMEOUT)).await {
            Ok(c) => c,
            Err(e) => return all(e),
        };
        let asks = grants.iter().map(|g| review(client.clone(), g.0));
        match tokio::time::timeout(TIMEOUT, futures::future::join_all(asks)).await {
            Ok(results) => grants.iter().copied().zip(results).collect(),
            Err(_) => all(format!("no answer within {TIMEOUT:?}")),
        }
    })
}

pub(super) fn item(s: &Settings) -> Item {
    let Some(api) = repair::api_access(s) else {
        return Item::new(
            "api",
            DOC_ACCESS,
            Ok(
                "not in a cluster (no KUBERNETES_SERVICE_HOST, no api-kubeconfig): no API to \
                check"
                    .into(),
            ),
        );
    };
    let grants = required_grants(s);
    Item::new(
        "api",
        DOC_ACCESS,
        judge(&api.to_string(), &reviews(&api, &grants)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::AgentArgs;

    /// Settings that resolve on any machine, repair off, no mode turned on.
    fn settings() -> Settings {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap().keep();
        for d in ["bin", "net.d"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let bin = dir.join("sidestep-cni");
        std::fs::write(&bin, b"x").unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let args = AgentArgs {
            cni_bin_dir: Some(dir.join("bin").display().to_string()),
            cni_conf_dir: Some(dir.join("net.d").display().to_string()),
            cni_binary: Some(bin.display().to_string()),
            ..AgentArgs::default()
        };
        let mut s = Settings::resolve(&args, None).unwrap();
        s.repair = false;
        s
    }

    fn grants(s: &Settings) -> Vec<Grant> {
        required_grants(s).into_iter().map(|(g, _)| g).collect()
    }

    #[test]
    fn each_mode_adds_its_components_grants() {
        let base: Vec<Grant> = vec![
            ("get", "", "pods"),
            ("list", "", "pods"),
            ("watch", "", "pods"),
            ("create", "", "events"),
        ];
        let mut s = settings();
        assert_eq!(grants(&s), base);
        let with = |extra: &[Grant]| [base.clone(), extra.to_vec()].concat();
        s.repair_mode = RepairMode::Delete;
        // Without repair, its mode asks nothing.
        assert_eq!(grants(&s), base);
        s.repair = true;
        assert_eq!(grants(&s), with(&[("delete", "", "pods")]));
        s.repair_mode = RepairMode::Label;
        assert_eq!(grants(&s), with(&[("patch", "", "pods")]));
        s.repair_mode = RepairMode::Repair;
        assert_eq!(grants(&s), base);
        s.readiness_taint = Some("sidestep.io/not-ready".into());
        assert_eq!(
            grants(&s),
            with(&[("get", "", "nodes"), ("patch", "", "nodes")])
        );
        s.readiness_taint = None;
        s.ambient = true;
        assert_eq!(
            grants(&s),
            with(&[
                ("get", "", "namespaces"),
                ("list", "", "namespaces"),
                ("watch", "", "namespaces"),
                ("patch", "", "pods/status"),
            ])
        );
    }

    /// The deploy/ files grant what the table says, component by component.
    #[test]
    fn the_table_matches_deploy() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
        let mut s = settings();
        s.repair = true;
        s.readiness_taint = Some("sidestep.io/not-ready".into());
        s.ambient = true;
        let mut all = required_grants(&s);
        s.repair_mode = RepairMode::Label;
        all.extend(required_grants(&s));
        s.repair_mode = RepairMode::Delete;
        all.extend(required_grants(&s));
        for ((verb, _, resource), component) in all {
            let file = match component {
                None => root.join("clusterrole.yaml"),
                Some(c) => root.join("components").join(c).join("kustomization.yaml"),
            };
            let text = std::fs::read_to_string(&file).unwrap();
            let granted = text
                .lines()
                .any(|l| l.contains("resources:") && l.contains(&format!("\"{resource}\"")))
                && text
                    .lines()
                    .any(|l| l.contains("verbs:") && l.contains(&format!("\"{verb}\"")));
            assert!(granted, "{} grants no {verb} on {resource}", file.display());
        }
    }

    #[test]
    fn a_denied_verb_or_no_answer_fails() {
        let g = |verb| ((verb, "", "pods"), None);
        assert!(judge("sa", &[(g("list"), Ok(true))]).is_ok());
        let (line, _) = judge(
            "sa",
            &[
                (g("list"), Ok(true)),
                ((("delete", "", "pods"), Some("repair-delete")), Ok(false)),
            ],
        )
        .unwrap_err();
        assert!(
            line.contains("delete pods (deploy/components/repair-delete)"),
            "{line}"
        );
        let (line, _) = judge("sa", &[(g("list"), Err("connection refused".into()))]).unwrap_err();
        assert!(
            line.contains("does not answer") && line.contains("refused"),
            "{line}"
        );
    }
}
