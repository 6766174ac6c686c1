//! [`GateNode`]: a Node as the node gate reads it.
//!
//! The node gate caches every node of the cluster. A `k8s_openapi` `Node` is a large struct (its
//! status alone has a dozen optional parts: images, addresses, node info, volumes, conditions),
//! and a real node's JSON carries tens of KiB of them. `GateNode` is the same object read
//! through a narrower type: the API path and kind are a Node's, and decoding keeps only the
//! metadata, the taints, the capacity and the conditions; everything else in the JSON is skipped
//! while it is parsed, never allocated. [`GateNode::slim`] then drops the parts of those the gate
//! never reads (other components' annotations, managed fields, the kubelet's conditions, the
//! node's own resources).
//!
//! Everything meshgate decides about a node (`meshgate_core::nodegate`) reads a `GateNode`:
//! the controller, `meshgate status` and `meshgate uninstall` list and watch nodes as this type.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// A Node with only what the node gate reads (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateNode {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<GateNodeSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<GateNodeStatus>,
}

/// The node's spec: its taints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateNodeSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taints: Option<Vec<Taint>>,
}

/// The node's status: its capacity (where a gate's extended resource is advertised) and its
/// conditions (where each gate publishes its own).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateNodeStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<BTreeMap<String, Quantity>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<NodeCondition>>,
    #[serde(default, rename = "nodeInfo", skip_serializing_if = "Option::is_none")]
    pub node_info: Option<GateNodeInfo>,
}

/// What the node says about its kubelet: its version (which DRA features it runs).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateNodeInfo {
    #[serde(
        default,
        rename = "kubeletVersion",
        skip_serializing_if = "String::is_empty"
    )]
    pub kubelet_version: String,
}

impl k8s_openapi::Resource for GateNode {
    const API_VERSION: &'static str = <Node as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Node as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Node as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Node as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Node as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Node as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for GateNode {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl GateNode {
    /// Drops what no gate reads, before the node is cached: `managedFields`, annotations
    /// outside meshgate's domain, conditions other than the gates' own, and capacity other than
    /// extended resources (a gate's resource is one: [`crate::NodeGateSpec::problems`]).
    pub fn slim(&mut self) {
        self.metadata.managed_fields = None;
        if let Some(annotations) = self.metadata.annotations.as_mut() {
            annotations.retain(|k, _| crate::in_domain(k));
        }
        if let Some(status) = self.status.as_mut() {
            if let Some(conditions) = status.conditions.as_mut() {
                conditions.retain(|c| crate::in_domain(&c.type_));
                conditions.shrink_to_fit();
            }
            if status.conditions.as_ref().is_some_and(Vec::is_empty) {
                status.conditions = None;
            }
            if let Some(capacity) = status.capacity.as_mut() {
                // Extended resources (a gate's), and `pods`: how many exclusive devices a DRA
                // gate offers where devices cannot be shared.
                capacity.retain(|k, _| k == "pods" || crate::node_gate::is_extended_resource(k));
            }
        }
    }

    /// The version its kubelet reports (`status.nodeInfo.kubeletVersion`), where it says.
    pub fn kubelet_version(&self) -> Option<&str> {
        self.status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|i| i.kubelet_version.as_str())
            .filter(|v| !v.is_empty())
    }

    /// The node's taints (none when it has no spec).
    pub fn taints(&self) -> &[Taint] {
        self.spec
            .as_ref()
            .and_then(|s| s.taints.as_deref())
            .unwrap_or_default()
    }

    /// The pods the node can run (`status.capacity.pods`), where it says.
    pub fn pods(&self) -> Option<u32> {
        self.status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("pods"))
            .and_then(|q| q.0.parse().ok())
    }

    /// Whether the node's capacity lists `resource`.
    pub fn advertises(&self, resource: &str) -> bool {
        self.status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .is_some_and(|c| c.contains_key(resource))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn real_node() -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": "n1", "uid": "u1", "resourceVersion": "7",
                "labels": {"pool": "a", "kubernetes.io/hostname": "n1"},
                "annotations": {
                    "meshgate.dev/owned-taints": "example.com/x",
                    "node.meshgate.dev/other": "kept",
                    "node.alpha.kubernetes.io/ttl": "0",
                    "notmeshgate.dev/x": "dropped",
                },
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
            "spec": {
                "podCIDR": "10.0.0.0/24", "providerID": "x://n1",
                "taints": [{"key": "node.meshgate.dev/agent-not-ready", "effect": "NoSchedule"}],
            },
            "status": {
                "capacity": {"cpu": "2", "memory": "1Gi", "meshgate.dev/mesh-ready": "1000",
                             "example.com/gpu": "1"},
                "allocatable": {"cpu": "2"},
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "meshgate.dev/meshReady", "status": "False", "reason": "AgentsNotReady"},
                ],
                "images": [{"names": ["a"], "sizeBytes": 1}],
                "nodeInfo": {"kubeletVersion": "v1.36.3"},
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            },
        })
    }

    #[test]
    fn reads_a_node_through_the_narrow_type_and_slims_it() {
        let mut node: GateNode = serde_json::from_value(real_node()).expect("a node decodes");
        assert_eq!(node.metadata.name.as_deref(), Some("n1"));
        assert_eq!(node.taints().len(), 1);
        node.slim();
        assert_eq!(node.metadata.managed_fields, None);
        let annotations: Vec<&str> = node
            .metadata
            .annotations
            .iter()
            .flatten()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(
            annotations,
            ["meshgate.dev/owned-taints", "node.meshgate.dev/other"]
        );
        let status = node.status.as_ref().expect("status kept");
        let types: Vec<&str> = status
            .conditions
            .iter()
            .flatten()
            .map(|c| c.type_.as_str())
            .collect();
        assert_eq!(types, ["meshgate.dev/meshReady"]);
        assert!(node.advertises("meshgate.dev/mesh-ready"));
        assert!(node.advertises("example.com/gpu"));
        assert!(!node.advertises("cpu"));
        // The labels every selector reads are all kept.
        assert_eq!(node.metadata.labels.as_ref().map(BTreeMap::len), Some(2));
    }

    #[test]
    fn is_served_from_the_nodes_path() {
        use k8s_openapi::Resource;
        assert_eq!(GateNode::URL_PATH_SEGMENT, "nodes");
        assert_eq!(GateNode::KIND, "Node");
        assert_eq!(GateNode::API_VERSION, "v1");
    }

    #[test]
    fn a_node_without_spec_or_status_decodes() {
        let node: GateNode =
            serde_json::from_value(json!({"metadata": {"name": "bare"}})).expect("decodes");
        assert!(node.taints().is_empty());
        assert!(!node.advertises("meshgate.dev/mesh-ready"));
    }
}
