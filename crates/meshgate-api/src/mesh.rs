//! The mesh profile records: for each mesh meshgate knows, the names and numbers its rules read.
//!
//! One record per [`Profile`]: which pods the mesh selects, how it captures traffic (its proxy
//! container, the proxy's uid, the init containers that install redirection themselves, its
//! own validator), the agents that must be Ready on a node, and the node gate's mode. `install`,
//! the webhook, `render` and `status` all read these records; the rules that use them (what the
//! mesh does to a given pod) are in `meshgate_core::mesh`. Adding a mesh is adding a record and
//! its rule there.
//!
//! Every value here was read from the meshes' own source (docs/design.md, "What the meshes do").

use crate::config::{GateCheck, Profile};
use crate::node_gate::GateMode;

/// A mesh family: the rules that read a pod differ per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mesh {
    Istio,
    Linkerd,
}

/// How the mesh captures a pod's traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capture {
    /// The node proxy opens its listeners inside the pod's network namespace (Istio ambient):
    /// the gate waits for `listener_port` to be listening.
    NodeProxy { listener_port: u16 },
    /// A sidecar proxy, with redirection installed by the mesh's CNI plugin at pod sandbox
    /// creation or by the pod's own init container: the gate proves that outbound TCP reaches
    /// `outbound_port`.
    Sidecar { outbound_port: u16 },
}

/// An agent DaemonSet of the mesh that must be Ready on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentRecord {
    /// The name the NodeGate gives it (`cni`, `node-proxy`).
    pub name: &'static str,
    pub namespace: &'static str,
    /// The label that selects its pods.
    pub label: (&'static str, &'static str),
    pub daemon_set: &'static str,
    /// The mesh's control plane, when the agent cannot become Ready without it (Istio's node
    /// proxy takes its certificates and configuration from istiod). A gate that waits for such
    /// an agent deadlocks wherever the control plane can only run on nodes the gate tainted,
    /// unless the control plane tolerates the gate's taint (`meshgate check` says so).
    pub needs: Option<ControlPlane>,
}

/// A Deployment of the mesh's control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlPlane {
    pub namespace: &'static str,
    pub deployment: &'static str,
    /// Where the mesh's chart takes the Deployment's tolerations (for the hint).
    pub tolerations_value: &'static str,
}

/// istiod, as Istio's `istio-discovery` chart installs it.
pub const ISTIOD: ControlPlane = ControlPlane {
    namespace: "istio-system",
    deployment: "istiod",
    tolerations_value: "pilot.tolerations",
};

/// Everything meshgate needs to know of one mesh mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshProfile {
    pub profile: Profile,
    pub mesh: Mesh,
    pub capture: Capture,
    /// The proxy container (a container, or a native sidecar in `initContainers`).
    pub proxy_container: &'static str,
    /// The uid whose traffic the redirection leaves alone (the proxy's), unless the pod says
    /// otherwise.
    pub proxy_uid: i64,
    /// The gid whose traffic the redirection leaves alone, if any.
    pub proxy_gid: Option<i64>,
    /// Init containers of the mesh that install redirection themselves (no CNI plugin).
    pub redirect_init_containers: &'static [&'static str],
    /// The mesh's own check that redirection is in place (CNI mode).
    pub validator_container: Option<&'static str>,
    pub agents: &'static [AgentRecord],
    /// How the profile's default NodeGate behaves.
    pub node_gate_mode: GateMode,
    /// The `type` of the mesh's plugin in the node's CNI configuration, chained into the
    /// runtime's active configuration by the mesh's CNI agent (Istio: `cni/pkg/install`
    /// `cniconfig.go`; Linkerd: proxy-init `internal/cni/conf.go`). Both agents remove it again
    /// when they stop (Istio ambient only when its DaemonSet goes away). The DRA node plugin
    /// requires it before a pod's sandbox is created.
    pub cni_plugin: &'static str,
    /// Taints the mesh's own node readiness puts on nodes, which meshgate's pods tolerate so
    /// that meshgate and the mesh never wait on each other (Istio: the untaint controller's
    /// `cni.istio.io/not-ready`, `pilot/pkg/controllers/untaint`, which istiod tolerates and
    /// lifts once the CNI agent is Ready; istiod in turn waits for meshgate's taint).
    pub mesh_taints: &'static [&'static str],
}

const ISTIO_CNI: AgentRecord = AgentRecord {
    name: "cni",
    namespace: "istio-system",
    label: ("k8s-app", "istio-cni-node"),
    daemon_set: "istio-cni-node",
    needs: None,
};

/// Istio ambient: the CNI agent enrols the pod and the node proxy opens 15001, 15006 and 15008
/// inside it.
pub const ISTIO_AMBIENT: MeshProfile = MeshProfile {
    profile: Profile::IstioAmbient,
    mesh: Mesh::Istio,
    capture: Capture::NodeProxy {
        listener_port: 15008,
    },
    proxy_container: "istio-proxy",
    proxy_uid: 1337,
    proxy_gid: Some(1337),
    redirect_init_containers: &["istio-init"],
    validator_container: Some("istio-validation"),
    agents: &[
        ISTIO_CNI,
        AgentRecord {
            name: "node-proxy",
            namespace: "istio-system",
            label: ("app", "ztunnel"),
            daemon_set: "ztunnel",
            needs: Some(ISTIOD),
        },
    ],
    node_gate_mode: GateMode::Continuous,
    cni_plugin: "istio-cni",
    mesh_taints: &["cni.istio.io/not-ready"],
};

/// Istio sidecar mode: `istio-proxy` listens for redirected outbound TCP on 15001.
pub const ISTIO_SIDECAR: MeshProfile = MeshProfile {
    profile: Profile::IstioSidecar,
    mesh: Mesh::Istio,
    capture: Capture::Sidecar {
        outbound_port: 15001,
    },
    proxy_container: "istio-proxy",
    proxy_uid: 1337,
    proxy_gid: Some(1337),
    redirect_init_containers: &["istio-init"],
    validator_container: Some("istio-validation"),
    agents: &[ISTIO_CNI],
    node_gate_mode: GateMode::Bootstrap,
    cni_plugin: "istio-cni",
    mesh_taints: &["cni.istio.io/not-ready"],
};

/// Linkerd: `linkerd-proxy` listens for redirected outbound TCP on 4140.
pub const LINKERD: MeshProfile = MeshProfile {
    profile: Profile::Linkerd,
    mesh: Mesh::Linkerd,
    capture: Capture::Sidecar {
        outbound_port: 4140,
    },
    proxy_container: "linkerd-proxy",
    proxy_uid: 2102,
    proxy_gid: None,
    redirect_init_containers: &["linkerd-init"],
    validator_container: Some("linkerd-network-validator"),
    agents: &[AgentRecord {
        name: "cni",
        namespace: "linkerd-cni",
        label: ("k8s-app", "linkerd-cni"),
        daemon_set: "linkerd-cni",
        needs: None,
    }],
    node_gate_mode: GateMode::Bootstrap,
    cni_plugin: "linkerd-cni",
    mesh_taints: &[],
};

impl MeshProfile {
    /// The gate check that fits the capture mode.
    pub fn check(&self) -> GateCheck {
        match self.capture {
            Capture::NodeProxy { listener_port } => GateCheck::TcpListening {
                port: listener_port,
            },
            Capture::Sidecar { outbound_port } => GateCheck::RedirectCheck {
                port: outbound_port,
            },
        }
    }
}

/// The record of the agent a NodeGate names by its DaemonSet, in any profile.
pub fn agent_record(namespace: &str, daemon_set: &str) -> Option<&'static AgentRecord> {
    Profile::ALL
        .into_iter()
        .flat_map(|p| p.record().agents)
        .find(|a| a.namespace == namespace && a.daemon_set == daemon_set)
}

impl Profile {
    /// The profile's record.
    pub fn record(self) -> &'static MeshProfile {
        match self {
            Profile::IstioAmbient => &ISTIO_AMBIENT,
            Profile::IstioSidecar => &ISTIO_SIDECAR,
            Profile::Linkerd => &LINKERD,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_has_its_record() {
        for p in Profile::ALL {
            assert_eq!(p.record().profile, p);
            assert!(!p.record().agents.is_empty());
        }
    }
}
