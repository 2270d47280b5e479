//! `sidestep-cni`: a chained CNI plugin that enrols mesh pods in sidestep's eBPF redirection, in
//! place of istio-cni (and Linkerd's and Kuma's plugins).
//!
//! The layers, each testable alone:
//! - [`spec`]: the CNI protocol (versions, environment, prevResult, errors);
//! - [`config`] and [`pod`]: parsing the network configuration and the pod;
//! - [`mesh`]: the pure enrolment decision and annotation-to-policy rules;
//! - [`podsource`] (and `kubeapi`): pod data from runtimeConfig or the Kubernetes API;
//! - [`ops`], [`state`] and [`dataplane`]: the effects of ADD, DEL, CHECK and GC;
//! - [`plugin`]: one invocation end to end.

pub mod config;
pub mod dataplane;
#[cfg(feature = "kubernetes")]
pub mod kubeapi;
pub mod logging;
pub mod mesh;
pub mod ops;
pub mod plugin;
pub mod pod;
pub mod podsource;
pub mod spec;
pub mod state;
