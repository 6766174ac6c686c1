//! meshgate's API types.
//!
//! * [`NodeGate`] (cluster-scoped CRD): which nodes are held back until which mesh agents are
//!   Ready, and how (startup taint, extended resource).
//! * [`MutationPolicy`] (cluster-scoped CRD): mutations applied to pods and pod templates, at
//!   admission and to existing workloads.
//! * [`GateConfig`]: the init-gate configuration the webhook reads from a file; it is also the
//!   single source of the generated `MutatingWebhookConfiguration`.
//! * [`GateNode`]: a Node read through the narrow type the node gate decides from.
//!
//! This crate holds types, defaults and validation only: no client, no I/O.

pub mod config;
pub mod gate_node;
pub mod mesh;
pub mod mutation_policy;
pub mod node_gate;
pub mod selector;
pub mod yaml;

pub use config::{GateCheck, GateConfig, Profile};
pub use gate_node::GateNode;
pub use mesh::{Capture, Mesh, MeshProfile};
pub use mutation_policy::{
    MutationPolicy, MutationPolicySpec, MutationPolicyStatus, NamespacedMutationPolicy,
    NamespacedMutationPolicySpec,
};
pub use node_gate::{NodeGate, NodeGateSpec, NodeGateStatus};
pub use selector::{LabelSelector, LabelSelectorRequirement, SelectorOperator};

/// The API group of meshgate's CRDs, and the prefix of its labels, annotations, taints and
/// resources.
pub const DOMAIN: &str = "meshgate.dev";

/// Whether a key (annotation, taint key, condition type) is in meshgate's domain or a
/// subdomain of it (`meshgate.dev/x`, `node.meshgate.dev/x`).
pub fn in_domain(key: &str) -> bool {
    key.split_once('/').is_some_and(|(domain, _)| {
        domain == DOMAIN
            || domain
                .strip_suffix(DOMAIN)
                .is_some_and(|sub| sub.ends_with('.'))
    })
}

/// Well-known names: labels, annotations, the default taint and the extended resource.
pub mod names {
    /// Pod label or annotation `"false"` opts a pod out of every meshgate mutation.
    pub const OPT_OUT: &str = "meshgate.dev/inject";
    /// Name of the injected init container.
    pub const GATE_CONTAINER: &str = "meshgate-wait";
    /// The startup taint key of a `NodeGate` that names none (the CRD's default), and of the
    /// gate `meshgate install` rendered before it keyed its gate [`STARTUP_TAINT_KEY`]: nodes
    /// tainted by such an install may still carry it.
    pub const DEFAULT_TAINT_KEY: &str = "node.meshgate.dev/agent-not-ready";
    /// The key of the gate `meshgate install` and the chart render (`--taint-key`): under the
    /// prefix `readiness.k8s.io/`, which Karpenter treats as a startup taint (it neither
    /// launches another node for pods the taint holds nor marks the node initialized before the
    /// taint is gone) and SIG Node's node-readiness controller uses (docs/design.md,
    /// "Autoscalers").
    pub const STARTUP_TAINT_KEY: &str = "readiness.k8s.io/mesh-agents";
    /// Default extended resource advertised on ready nodes.
    pub const DEFAULT_RESOURCE: &str = "meshgate.dev/mesh-ready";
    /// Node annotation: RFC 3339 time the agents of a gate were first seen Ready on the node
    /// (the first gate to see it; the repair loop's started-early rule reads it). Each gate's
    /// own bootstrap mark is [`GATE_READY_SINCE_PREFIX`]`<gate>`; a node marked before those
    /// existed carries this one alone, and it then stands for every gate.
    pub const NODE_READY_SINCE: &str = "meshgate.dev/agents-ready-since";
    /// Node annotation prefix of each gate's bootstrap mark: RFC 3339 time that gate's agents
    /// were first seen Ready on the node (`meshgate_core::nodegate::ready_since_key`).
    pub const GATE_READY_SINCE_PREFIX: &str = "agents-ready-since.meshgate.dev/";
    /// Label on every object meshgate renders.
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    /// Pod annotation written by the init gate on every pod a profile selects: what the gate
    /// decided for the pod and why (`gated: ...` or `none: <reason>`).
    pub const GATE_VERDICT: &str = "meshgate.dev/gate";
    /// The DRA driver of meshgate's node gates: the driver of their `ResourceSlice`s and
    /// `DeviceClass`es, and the name the node plugin (`meshgate node`) registers with the
    /// kubelet.
    pub const DRA_DRIVER: &str = "gate.meshgate.dev";
    /// Field manager used for every write.
    pub const FIELD_MANAGER: &str = "meshgate";
}
