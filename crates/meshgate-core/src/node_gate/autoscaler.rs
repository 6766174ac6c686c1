//! What a node autoscaler does beside a node gate (docs/design.md, "Autoscalers"), read from
//! each autoscaler's source and, for Karpenter, run for real (`tests/karpenter.rs`):
//!
//! * **Startup taints.** An autoscaler adds nodes for pending pods. A new node that registers
//!   with a taint the pods do not tolerate looks, to an autoscaler, like a node the pods can
//!   never use, and it launches another, and another, until the taint is gone; unless it knows
//!   the taint as a *startup taint*, one that goes away by itself. Karpenter knows every key
//!   under `readiness.k8s.io/` (and the keys of a NodePool's `startupTaints`): it neither
//!   launches for pods such a taint holds nor marks the NodeClaim `Initialized` before it is
//!   gone. The Cluster Autoscaler knows every key under
//!   `startup-taint.cluster-autoscaler.kubernetes.io/` (and the deprecated
//!   `ignore-taint.cluster-autoscaler.kubernetes.io/`), the keys of its `--startup-taint` and
//!   `--ignore-taint` flags and, from 1.36, the prefixes of `--startup-taint-prefix`
//!   (`utils/taints/taints.go`); `readiness.k8s.io/` only through those flags. It waits for
//!   such a node at most `--max-node-provision-time` (15 minutes) after it scaled up.
//! * **The gate resource.** A pod that requests `meshgate.dev/mesh-ready` fits a new node only
//!   if the autoscaler's idea of that node (Karpenter: the instance type, extended by a
//!   `NodeOverlay`; the Cluster Autoscaler: the node group's template) offers it. Neither offers
//!   an extended resource by default, so such pods make no node launch at all: the cluster
//!   stops scaling for mesh workloads. A DRA request is not provisioned for either (Karpenter's
//!   `IGNORE_DRA_REQUESTS` is true by default).
//!
//! The rules here are pure; the CLI finds the autoscalers (`meshgate::autoscaler`), and
//! `install` and `check` report what these rules say.

/// A node autoscaler meshgate knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Autoscaler {
    Karpenter,
    ClusterAutoscaler,
}

/// The name of the taint key `meshgate install` gives the gate under an autoscaler's prefix.
pub const GATE_TAINT_NAME: &str = "mesh-agents";

impl Autoscaler {
    pub fn name(self) -> &'static str {
        match self {
            Autoscaler::Karpenter => "Karpenter",
            Autoscaler::ClusterAutoscaler => "the Cluster Autoscaler",
        }
    }

    /// The key prefix it treats as a startup taint with no configuration (the first of
    /// [`Autoscaler::startup_prefixes`]).
    fn startup_prefix(self) -> &'static str {
        self.startup_prefixes()[0]
    }

    /// Every key prefix it treats as a startup taint with no configuration.
    pub fn startup_prefixes(self) -> &'static [&'static str] {
        match self {
            Autoscaler::Karpenter => &["readiness.k8s.io/"],
            Autoscaler::ClusterAutoscaler => &[
                "startup-taint.cluster-autoscaler.kubernetes.io/",
                "ignore-taint.cluster-autoscaler.kubernetes.io/",
            ],
        }
    }

    /// Whether it treats a taint with this key as a startup taint: by its prefixes, or because
    /// it is configured to (`found`: a NodePool's `startupTaints`, the Cluster Autoscaler's
    /// `--startup-taint`/`--ignore-taint` keys and `--startup-taint-prefix` prefixes).
    fn knows_startup_taint(self, key: &str, found: &Found) -> bool {
        self.startup_prefixes().iter().any(|p| key.starts_with(p))
            || found.startup_keys.iter().any(|k| k == key)
            || found
                .startup_prefixes
                .iter()
                .any(|p| key.starts_with(p.as_str()))
    }

    /// The gate key that it knows with no configuration.
    pub fn gate_key(self) -> String {
        format!("{}{GATE_TAINT_NAME}", self.startup_prefix())
    }

    /// Where its node templates would offer an extended resource, for a fix.
    fn resource_fix(self, resource: &str) -> String {
        match self {
            Autoscaler::Karpenter => format!(
                "a NodeOverlay (karpenter.sh/v1alpha1, feature gate NodeOverlay) whose capacity offers {resource} on the NodePools' instance types"
            ),
            Autoscaler::ClusterAutoscaler => format!(
                "{resource} in every node group's template, also while its nodes exist (AWS: the ASG tag k8s.io/cluster-autoscaler/node-template/resources/{resource}; Azure: the VMSS tag k8s.io_cluster-autoscaler_node-template_resources_{}; a template copied from a node that withdrew the resource lacks it)",
                resource.replace('/', "_")
            ),
        }
    }
}

/// An autoscaler found in the cluster, with what it is configured to know.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    pub autoscaler: Option<Autoscaler>,
    /// Startup taint keys it is configured with (NodePools' `startupTaints`, `--startup-taint`,
    /// `--ignore-taint`).
    pub startup_keys: Vec<String>,
    /// Startup taint prefixes it is configured with (`--startup-taint-prefix`).
    pub startup_prefixes: Vec<String>,
    /// Extended resources its node templates offer (NodeOverlays' capacity).
    pub template_resources: Vec<String>,
}

/// What the gate makes mesh pods request from the scheduler, besides tolerating nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodRequest<'a> {
    /// Nothing: the taint holds them.
    Nothing,
    /// An extended resource in the node status.
    Resource(&'a str),
    /// A DRA extended resource (a claim the scheduler makes).
    Dra(&'a str),
}

/// A configuration an autoscaler cannot live with: what goes wrong, and the fix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub autoscaler: Autoscaler,
    pub message: String,
    pub fix: String,
}

/// What goes wrong with a gate keyed `key` whose mesh pods request `request`, beside `found`.
pub fn problems(found: &Found, key: &str, request: PodRequest<'_>) -> Vec<Problem> {
    let Some(autoscaler) = found.autoscaler else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if !autoscaler.knows_startup_taint(key, found) {
        out.push(Problem {
            autoscaler,
            message: format!(
                "{} does not know the gate's taint {key} as a startup taint: it launches another node for the pods the taint holds, again and again until the taint is lifted",
                autoscaler.name()
            ),
            fix: format!(
                "key the gate {} (meshgate install --taint-key {})",
                autoscaler.gate_key(),
                autoscaler.gate_key()
            ),
        });
    }
    match request {
        PodRequest::Nothing => {}
        PodRequest::Resource(resource)
            if found.template_resources.iter().any(|r| r == resource) => {}
        PodRequest::Resource(resource) => out.push(Problem {
            autoscaler,
            message: format!(
                "mesh pods request {resource}, which no node {} can launch offers: it launches no node for them, and mesh workloads never scale up",
                autoscaler.name()
            ),
            fix: format!(
                "use --strategy taint (the default), or give the autoscaler {}",
                autoscaler.resource_fix(resource)
            ),
        }),
        PodRequest::Dra(resource) => out.push(Problem {
            autoscaler,
            message: format!(
                "mesh pods request {resource} through DRA, which {} does not provision for: it launches no node for them, and mesh workloads never scale up",
                autoscaler.name()
            ),
            fix: "use --strategy taint (the default)".into(),
        }),
    }
    out
}

/// The gate key `install` chooses when `--taint-key` is not given: the prefix the one
/// autoscaler found knows; with none or both found, Karpenter's (`readiness.k8s.io/`, also the
/// node-readiness controller's), with the reason.
pub fn choose_key(found: &[Found]) -> (String, String) {
    let kinds: Vec<Autoscaler> = found.iter().filter_map(|f| f.autoscaler).collect();
    let karpenter = kinds.contains(&Autoscaler::Karpenter);
    let ca = kinds.contains(&Autoscaler::ClusterAutoscaler);
    match (karpenter, ca) {
        (false, true) => (
            Autoscaler::ClusterAutoscaler.gate_key(),
            "the Cluster Autoscaler was found: its startup-taint prefix".into(),
        ),
        (true, false) => (
            Autoscaler::Karpenter.gate_key(),
            "Karpenter was found: a readiness.k8s.io/ key is a startup taint to it".into(),
        ),
        (true, true) => (
            Autoscaler::Karpenter.gate_key(),
            "Karpenter and the Cluster Autoscaler were both found: Karpenter's prefix; list the key in the Cluster Autoscaler's --startup-taint".into(),
        ),
        (false, false) => (
            Autoscaler::Karpenter.gate_key(),
            "no autoscaler found: readiness.k8s.io/ (Karpenter's and the node-readiness controller's startup taints); under the Cluster Autoscaler use --taint-key startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn karpenter() -> Found {
        Found {
            autoscaler: Some(Autoscaler::Karpenter),
            ..Found::default()
        }
    }

    #[test]
    fn each_autoscaler_knows_its_prefixes_and_what_it_is_configured_with() {
        let none = Found::default();
        let k = Autoscaler::Karpenter;
        assert!(k.knows_startup_taint("readiness.k8s.io/mesh-agents", &none));
        assert!(!k.knows_startup_taint("node.meshgate.dev/agent-not-ready", &none));
        let pool = Found {
            startup_keys: vec!["node.meshgate.dev/agent-not-ready".into()],
            ..Found::default()
        };
        assert!(k.knows_startup_taint("node.meshgate.dev/agent-not-ready", &pool));
        assert!(!k.knows_startup_taint(
            "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents",
            &none
        ));
        let ca = Autoscaler::ClusterAutoscaler;
        assert!(ca.knows_startup_taint(&ca.gate_key(), &none));
        assert!(ca.knows_startup_taint(
            "ignore-taint.cluster-autoscaler.kubernetes.io/mesh-agents",
            &none
        ));
        assert!(!ca.knows_startup_taint("readiness.k8s.io/mesh-agents", &none));
        let prefix = Found {
            startup_prefixes: vec!["readiness.k8s.io/".into()],
            ..Found::default()
        };
        assert!(ca.knows_startup_taint("readiness.k8s.io/mesh-agents", &prefix));
    }

    #[test]
    fn the_default_passes_and_each_trap_names_its_fix() {
        let key = "readiness.k8s.io/mesh-agents";
        assert_eq!(problems(&karpenter(), key, PodRequest::Nothing), []);
        assert_eq!(
            problems(&Found::default(), "x.io/y", PodRequest::Dra("a/b")),
            []
        );
        let old = problems(
            &karpenter(),
            "node.meshgate.dev/agent-not-ready",
            PodRequest::Nothing,
        );
        assert_eq!(old.len(), 1);
        assert!(
            old[0]
                .fix
                .contains("--taint-key readiness.k8s.io/mesh-agents")
        );
        let resource = problems(
            &karpenter(),
            key,
            PodRequest::Resource("meshgate.dev/mesh-ready"),
        );
        assert_eq!(resource.len(), 1);
        assert!(resource[0].message.contains("never scale up"));
        assert!(resource[0].fix.contains("--strategy taint"));
        // A NodeOverlay that offers the resource makes it provisionable.
        let overlay = Found {
            template_resources: vec!["meshgate.dev/mesh-ready".into()],
            ..karpenter()
        };
        assert_eq!(
            problems(
                &overlay,
                key,
                PodRequest::Resource("meshgate.dev/mesh-ready")
            ),
            []
        );
        assert_eq!(
            problems(&overlay, key, PodRequest::Dra("meshgate.dev/mesh-ready")).len(),
            1
        );
    }

    #[test]
    fn the_key_follows_the_autoscaler_found() {
        let ca = Found {
            autoscaler: Some(Autoscaler::ClusterAutoscaler),
            ..Found::default()
        };
        assert_eq!(
            choose_key(std::slice::from_ref(&ca)).0,
            "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents"
        );
        assert_eq!(choose_key(&[karpenter()]).0, "readiness.k8s.io/mesh-agents");
        assert_eq!(choose_key(&[]).0, "readiness.k8s.io/mesh-agents");
        assert_eq!(
            choose_key(&[karpenter(), ca]).0,
            "readiness.k8s.io/mesh-agents"
        );
    }
}
