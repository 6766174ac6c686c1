//! The DRA gate's objects: what the controller publishes for a gate whose resource is offered
//! through dynamic resource allocation (`resource.provider: DRA`), and what the node plugin
//! checks before the kubelet creates a pod's sandbox.
//!
//! # Rules (Kubernetes 1.36, read from its source; docs/design.md "The DRA gate")
//! * **One `DeviceClass` per gate**, named [`device_class_name`], with `extendedResourceName`
//!   set to the gate's resource: a pod that requests the resource (the request the resource
//!   gate already gives mesh pods) is satisfied by a device of that class on a node that does
//!   not advertise the resource natively; the scheduler creates the pod's claim itself. A node
//!   that does advertise the name in `status.allocatable` is served natively instead, so a DRA
//!   gate's nodes never carry it there.
//! * **One `ResourceSlice` per gate and ready node** ([`resource_slice`]), published while the
//!   node gate's decision says the resource is offered, deleted when it says withdrawn:
//!   deleting a slice stops new placements only, never touches running pods. Its pool is the
//!   gate's on that node, so two gates never share a pool.
//! * **Devices:** one device the API server lets any number of claims share
//!   (`allowMultipleAllocations`, `DRAConsumableCapacity`, beta and on in 1.36). Where the API
//!   server dropped that field (the feature is off), the slice is written again with one
//!   exclusive device per pod the node can run ([`device_count`], at most 128 per slice).
//! * The kubelet deletes every `ResourceSlice` of its node when it starts, and a driver's slices
//!   30 s after its plugin unregisters: the controller writes the slice again when it is gone
//!   and the node is still ready.

pub mod node;

use serde_json::{Value, json};

use meshgate_api::names;
use meshgate_api::node_gate::DRA_MAX_DEVICES;

/// The attribute (in the driver's domain) that names the gate a device belongs to.
pub const GATE_ATTRIBUTE: &str = "gate";
/// Label on meshgate's slices and device classes: the gate that owns them.
pub const GATE_LABEL: &str = "meshgate.dev/node-gate";

/// The oldest kubelet (major, minor) that prepares the claim the scheduler makes for a pod's
/// extended resource: the kubelet's `DRAExtendedResource` gate is alpha and off in 1.34 and 1.35
/// (such a kubelet admits the pod without preparing its claim, so the node plugin's check never
/// runs), beta and on in 1.36, GA in 1.37; a 1.33 kubelet speaks only `v1beta1` DRA and refuses
/// the node plugin.
pub const EXTENDED_RESOURCE_KUBELET: (u32, u32) = (1, 36);

/// Why a DRA gate offers its resource in the node status on a node whose kubelet reports
/// `version` (`status.nodeInfo.kubeletVersion`, e.g. `v1.35.4-eks-1`) instead of a
/// `ResourceSlice`: a kubelet older than [`EXTENDED_RESOURCE_KUBELET`], or a version that does
/// not say (the node status works on every kubelet). `None`: the kubelet prepares the claim.
pub fn kubelet_falls_back(version: Option<&str>) -> Option<String> {
    let (major, minor) = EXTENDED_RESOURCE_KUBELET;
    let parsed = version.and_then(|v| {
        let mut parts = v.strip_prefix('v').unwrap_or(v).split('.');
        let ma: u32 = parts.next()?.parse().ok()?;
        let digits: String = parts
            .next()?
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        Some((ma, digits.parse::<u32>().ok()?))
    });
    match (version, parsed) {
        (_, Some(v)) if v >= (major, minor) => None,
        (Some(v), Some(_)) => Some(format!(
            "its kubelet ({v}) is older than {major}.{minor} and does not prepare DRA claims for extended resources"
        )),
        (Some(v), None) => Some(format!(
            "its kubelet's version ({v}) does not say whether it prepares DRA claims for extended resources"
        )),
        (None, _) => Some("the node does not report its kubelet's version".into()),
    }
}

/// The `DeviceClass` of a gate.
pub fn device_class_name(gate: &str) -> String {
    format!("{gate}.{}", names::DRA_DRIVER)
}

/// The `DeviceClass` that maps the gate's extended resource to its devices.
pub fn device_class(gate: &str, resource: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {
            "name": device_class_name(gate),
            "labels": {names::MANAGED_BY: "meshgate"},
        },
        "spec": {
            "extendedResourceName": resource,
            "selectors": [{"cel": {"expression": device_selector(gate)}}],
        },
    })
}

/// The CEL selector of a gate's devices.
fn device_selector(gate: &str) -> String {
    format!(
        "device.driver == '{driver}' && device.attributes['{driver}'].{GATE_ATTRIBUTE} == '{gate}'",
        driver = names::DRA_DRIVER
    )
}

/// The name of the gate's slice for a node: `<gate>-<node>`, or, where that is longer than a
/// name may be (253), the gate's name and a hash of the node's.
pub fn slice_name(gate: &str, node: &str) -> String {
    let name = format!("{gate}-{node}");
    if name.len() <= 253 {
        return name;
    }
    // FNV-1a: stable across builds and platforms.
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = 253 - 17;
    let gate: String = gate.chars().take(keep).collect();
    format!("{gate}-{hash:016x}")
}

/// The pool of the gate's devices on a node (unique per driver: the gate and the node).
fn pool_name(gate: &str, node: &str) -> String {
    format!("{node}/{gate}")
}

/// How many exclusive devices a node gets where devices cannot be shared: one per pod the node
/// can run (`status.allocatable.pods`, 110 when unknown), at most one slice's worth.
pub fn device_count(allocatable_pods: Option<u32>) -> u32 {
    allocatable_pods.unwrap_or(110).clamp(1, DRA_MAX_DEVICES)
}

/// How a slice offers its devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Devices {
    /// One device every pod's claim may share.
    Shared,
    /// This many exclusive devices.
    Exclusive(u32),
}

/// The gate's `ResourceSlice` for a node.
pub fn resource_slice(gate: &str, node: &str, devices: Devices) -> Value {
    let device = |name: String, shared: bool| {
        let mut d = json!({
            "name": name,
            "attributes": {format!("{}/{GATE_ATTRIBUTE}", names::DRA_DRIVER): {"string": gate}},
        });
        if shared {
            d["allowMultipleAllocations"] = json!(true);
        }
        d
    };
    let list: Vec<Value> = match devices {
        Devices::Shared => vec![device("mesh-ready".into(), true)],
        Devices::Exclusive(n) => (0..n)
            .map(|i| device(format!("mesh-ready-{i}"), false))
            .collect(),
    };
    let mut labels = json!({names::MANAGED_BY: "meshgate"});
    if gate.len() <= 63 {
        // A label value is at most 63 characters; the pool names the gate in any case.
        labels[GATE_LABEL] = json!(gate);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(gate, node),
            "labels": labels,
        },
        "spec": {
            "driver": names::DRA_DRIVER,
            "nodeName": node,
            "pool": {"name": pool_name(gate, node), "generation": 1, "resourceSliceCount": 1},
            "devices": list,
        },
    })
}

/// Whether the API server kept the shared device as written: `false` when it dropped
/// `allowMultipleAllocations` (consumable capacity off), and the slice must offer exclusive
/// devices instead.
pub fn shared_kept(stored: &Value) -> bool {
    stored["spec"]["devices"].as_array().is_some_and(|d| {
        d.iter()
            .all(|d| d["allowMultipleAllocations"] == json!(true))
    })
}

/// Whether a stored `DeviceClass` maps the gate's resource: `false` when the API server dropped
/// `extendedResourceName` (DRA extended resources off), and the gate must fall back to the
/// node status.
pub fn class_maps_resource(stored: &Value, resource: &str) -> bool {
    stored["spec"]["extendedResourceName"].as_str() == Some(resource)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_kubelet_that_prepares_extended_resource_claims_gets_a_slice() {
        for v in [
            "v1.36.3",
            "v1.37.2",
            "v1.36.0-eks-4f1b2c3",
            "1.38.0",
            "v2.0.0",
        ] {
            assert_eq!(kubelet_falls_back(Some(v)), None, "{v}");
        }
        for v in ["v1.35.4", "v1.34.0", "v1.33.9", "v1.35.4-gke.100"] {
            let why = kubelet_falls_back(Some(v)).expect(v);
            assert!(why.contains(v) && why.contains("older than 1.36"), "{why}");
        }
        // A version that does not say, or none: the node status, which every kubelet serves.
        assert!(kubelet_falls_back(Some("fake")).unwrap().contains("fake"));
        assert!(kubelet_falls_back(Some("v1.x")).is_some());
        assert!(kubelet_falls_back(None).is_some());
    }

    #[test]
    fn a_slice_offers_one_shared_device_of_the_gate_on_its_node() {
        let s = resource_slice("mesh", "node-a", Devices::Shared);
        assert_eq!(s["metadata"]["name"], "mesh-node-a");
        assert_eq!(s["spec"]["nodeName"], "node-a");
        assert_eq!(s["spec"]["driver"], names::DRA_DRIVER);
        assert_eq!(s["spec"]["pool"]["name"], "node-a/mesh");
        let devices = s["spec"]["devices"].as_array().expect("devices");
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0]["allowMultipleAllocations"], true);
        assert_eq!(
            devices[0]["attributes"]["gate.meshgate.dev/gate"]["string"],
            "mesh"
        );
        assert!(shared_kept(&s));
        let mut dropped = s.clone();
        dropped["spec"]["devices"][0]
            .as_object_mut()
            .expect("device")
            .remove("allowMultipleAllocations");
        assert!(!shared_kept(&dropped));
    }

    #[test]
    fn exclusive_devices_cover_every_pod_the_node_can_run_up_to_one_slice() {
        assert_eq!(device_count(Some(110)), 110);
        assert_eq!(device_count(None), 110);
        assert_eq!(device_count(Some(250)), DRA_MAX_DEVICES);
        assert_eq!(device_count(Some(0)), 1);
        let s = resource_slice("mesh", "n", Devices::Exclusive(3));
        let names: Vec<&str> = s["spec"]["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .filter_map(|d| d["name"].as_str())
            .collect();
        assert_eq!(names, ["mesh-ready-0", "mesh-ready-1", "mesh-ready-2"]);
        assert!(!shared_kept(&s));
    }

    #[test]
    fn the_class_maps_the_resource_to_the_gates_devices_only() {
        let c = device_class("mesh", "meshgate.dev/mesh-ready");
        assert_eq!(c["metadata"]["name"], "mesh.gate.meshgate.dev");
        assert_eq!(c["spec"]["extendedResourceName"], "meshgate.dev/mesh-ready");
        assert_eq!(
            c["spec"]["selectors"][0]["cel"]["expression"],
            "device.driver == 'gate.meshgate.dev' && device.attributes['gate.meshgate.dev'].gate == 'mesh'"
        );
        assert!(class_maps_resource(&c, "meshgate.dev/mesh-ready"));
        let mut dropped = c.clone();
        dropped["spec"]
            .as_object_mut()
            .expect("spec")
            .remove("extendedResourceName");
        assert!(!class_maps_resource(&dropped, "meshgate.dev/mesh-ready"));
    }

    #[test]
    fn slice_names_stay_within_the_limit() {
        let node = "n".repeat(253);
        let a = slice_name("mesh", &node);
        assert!(a.len() <= 253, "{}", a.len());
        assert_ne!(a, slice_name("mesh", &"m".repeat(253)));
        assert_eq!(a, slice_name("mesh", &node));
    }
}
