//! The DRA gate's writes: a `DeviceClass` per DRA gate and a `ResourceSlice` per gate and ready
//! node (objects and rules in `meshgate_core::dra`).
//!
//! * Whether the API server serves `resource.k8s.io/v1` is asked at start, until it answers (a
//!   failure to ask is retried, [`served`]), and again on an interval while the controller runs
//!   (`crate::nodegate`): a cluster that starts serving it later (a control-plane upgrade, a
//!   `--runtime-config` change) gets slices without a restart, one that stops gets the node
//!   status. Without it (or
//!   where it drops `DeviceClass.spec.extendedResourceName`, DRA extended resources off) a DRA
//!   gate **falls back** to offering its resource in the node status, and says so in its
//!   `ResourceProvider` condition and an Event.
//! * The slices meshgate wrote are watched (label `app.kubernetes.io/managed-by=meshgate`): the
//!   node gate decides from that cache, never before it has listed, and a slice deleted by
//!   somebody else (the kubelet deletes every slice of its node when it starts) makes the node
//!   reconciled again, so a ready node gets it back.
//! * Ownership: only slices and classes with meshgate's label, its driver and the gate's name
//!   are written or deleted; a slice is owned by its Node (garbage-collected with it), a class
//!   by its NodeGate.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::Store;
use kube::{Resource, ResourceExt};
use meshgate_api::node_gate::ResourceProvider;
use meshgate_api::{GateNode, NodeGate, names};
use meshgate_core::dra::{
    Devices, class_maps_resource, device_class, device_count, resource_slice, shared_kept,
    slice_name,
};
use meshgate_core::nodegate::Offer;

/// The label selector of meshgate's slices.
pub fn managed_selector() -> String {
    format!("{}=meshgate", names::MANAGED_BY)
}

/// What the controller knows of DRA.
pub struct Dra {
    /// `resource.k8s.io/v1` is served: slices are watched (`Some`). Replaced when a later
    /// discovery finds otherwise ([`Dra::set_slices`]).
    slices: RwLock<Option<Store<ResourceSlice>>>,
    /// DRA gates that fall back to the node status, with the reason (by gate name).
    fallback: Mutex<HashMap<String, String>>,
    /// Gates whose class is current, by (uid, generation).
    classes: Mutex<HashSet<(String, i64)>>,
    /// The API server dropped `allowMultipleAllocations`: slices offer exclusive devices.
    exclusive: AtomicBool,
}

/// Why a DRA gate cannot use DRA on an API server that does not serve `resource.k8s.io/v1`.
const NOT_SERVED: &str =
    "the API server does not serve resource.k8s.io/v1 (dynamic resource allocation)";

impl Dra {
    pub fn new(slices: Option<Store<ResourceSlice>>) -> Self {
        Self {
            slices: RwLock::new(slices),
            fallback: Mutex::new(HashMap::new()),
            classes: Mutex::new(HashSet::new()),
            exclusive: AtomicBool::new(false),
        }
    }

    /// The slice cache, where the API server serves DRA.
    fn slices(&self) -> Option<Store<ResourceSlice>> {
        self.slices
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether the API server serves DRA.
    pub fn served(&self) -> bool {
        self.slices().is_some()
    }

    /// Waits until the slice cache (if any) has listed.
    pub async fn wait_until_ready(&self) {
        if let Some(s) = self.slices() {
            let _ = s.wait_until_ready().await;
        }
    }

    /// What a later discovery found: the slice cache (listed already) where DRA is served now,
    /// `None` where it is not. Every gate's class is written and checked again (the API server
    /// that serves it now may keep or drop `extendedResourceName`).
    pub fn set_slices(&self, slices: Option<Store<ResourceSlice>>) {
        *self
            .slices
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = slices;
        self.forget_classes();
    }

    /// Writes and checks every gate's class again at the next status pass (the API server
    /// changed: what it keeps of a `DeviceClass` may have too).
    pub fn forget_classes(&self) {
        lock(&self.classes).clear();
    }

    /// How the gate's resource is offered on the node now.
    pub fn offer(&self, gate: &NodeGate, node: &GateNode) -> Offer {
        match self.provider_on(gate, node) {
            Ok(ResourceProvider::Dra) => Offer::Dra {
                slice: self.has_slice(gate, &node.name_any()),
            },
            _ => Offer::NodeStatus,
        }
    }

    /// The provider in effect for the gate on `node`: the gate's ([`Dra::provider`]), except
    /// that a DRA gate falls back to the node status on a node whose kubelet does not prepare
    /// DRA claims for extended resources ([`meshgate_core::dra::kubelet_falls_back`]).
    pub fn provider_on(
        &self,
        gate: &NodeGate,
        node: &GateNode,
    ) -> Result<ResourceProvider, String> {
        match self.provider(gate) {
            Ok(ResourceProvider::Dra) => {
                match meshgate_core::dra::kubelet_falls_back(node.kubelet_version()) {
                    Some(why) => Err(why),
                    None => Ok(ResourceProvider::Dra),
                }
            }
            other => other,
        }
    }

    /// Whether the cache holds the gate's slice for the node.
    pub fn has_slice(&self, gate: &NodeGate, node: &str) -> bool {
        self.slices().is_some_and(|s| {
            s.get(&kube::runtime::reflector::ObjectRef::new(&slice_name(
                &gate.name_any(),
                node,
            )))
            .is_some()
        })
    }

    /// The provider in effect for the gate: `Ok(DRA)`, `Ok(NodeStatus)` where the gate asks
    /// for it, or `Err(why)` for a DRA gate that falls back to the node status.
    pub fn provider(&self, gate: &NodeGate) -> Result<ResourceProvider, String> {
        let Some(res) = &gate.spec.resource else {
            return Ok(ResourceProvider::NodeStatus);
        };
        if res.provider != ResourceProvider::Dra {
            return Ok(ResourceProvider::NodeStatus);
        }
        if !self.served() {
            return Err(NOT_SERVED.into());
        }
        match lock(&self.fallback).get(&gate.name_any()) {
            Some(why) => Err(why.clone()),
            None => Ok(ResourceProvider::Dra),
        }
    }

    /// Publishes (`offer`) or deletes the gate's slice for the node.
    pub async fn write_slice(
        &self,
        client: &kube::Client,
        gate: &NodeGate,
        node: &GateNode,
        offer: bool,
    ) -> Result<(), kube::Error> {
        let api = Api::<ResourceSlice>::all(client.clone());
        let gate_name = gate.name_any();
        let node_name = node.name_any();
        let name = slice_name(&gate_name, &node_name);
        if !offer {
            return match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e),
            };
        }
        let devices = if self.exclusive.load(Ordering::Acquire) {
            Devices::Exclusive(device_count(node.pods()))
        } else {
            Devices::Shared
        };
        let slice = with_owner(resource_slice(&gate_name, &node_name, devices), node);
        let slice: ResourceSlice =
            serde_json::from_value(slice).map_err(kube::Error::SerdeError)?;
        let stored = match api.create(&PostParams::default(), &slice).await {
            Ok(s) => s,
            Err(kube::Error::Api(e)) if e.code == 409 => return Ok(()),
            Err(e) => return Err(e),
        };
        let stored_value = serde_json::to_value(&stored).unwrap_or_default();
        if devices == Devices::Shared && !shared_kept(&stored_value) {
            // Consumable capacity is off: one exclusive device per pod the node can run.
            self.exclusive.store(true, Ordering::Release);
            tracing::info!(
                node = %node_name,
                "the API server does not keep shared devices (DRAConsumableCapacity off): slices offer one device per pod the node can run"
            );
            let mut replacement = with_owner(
                resource_slice(
                    &gate_name,
                    &node_name,
                    Devices::Exclusive(device_count(node.pods())),
                ),
                node,
            );
            replacement["metadata"]["resourceVersion"] =
                serde_json::json!(stored.resource_version());
            let replacement: ResourceSlice =
                serde_json::from_value(replacement).map_err(kube::Error::SerdeError)?;
            api.replace(&name, &PostParams::default(), &replacement)
                .await?;
        }
        Ok(())
    }

    /// Keeps the gate's `DeviceClass` current (once per generation) and notes a fallback when
    /// the API server does not keep its `extendedResourceName`.
    pub async fn ensure_class(&self, client: &kube::Client, gate: &NodeGate) -> Option<String> {
        self.apply_class(client, gate, false).await
    }

    /// Asks, without writing (a dry-run apply: any replica may), whether the API server keeps
    /// the gate's class as meshgate writes it, and notes the fallback. Done for every DRA gate
    /// before the first decision after the caches sync: otherwise a restarted controller on a
    /// cluster that drops `extendedResourceName` would decide as a DRA gate until its first
    /// status pass (withdrawing the node-status resource from ready nodes, then advertising it
    /// again).
    pub async fn check_class(&self, client: &kube::Client, gate: &NodeGate) {
        let _ = self.apply_class(client, gate, true).await;
    }

    async fn apply_class(
        &self,
        client: &kube::Client,
        gate: &NodeGate,
        dry_run: bool,
    ) -> Option<String> {
        let res = gate.spec.resource.as_ref()?;
        if res.provider != ResourceProvider::Dra || !self.served() {
            return None;
        }
        let key = (
            gate.uid().unwrap_or_default(),
            gate.metadata.generation.unwrap_or_default(),
        );
        if lock(&self.classes).contains(&key) {
            return None;
        }
        let gate_name = gate.name_any();
        let mut class = device_class(&gate_name, &res.name);
        if let Some(owner) = gate.controller_owner_ref(&()) {
            class["metadata"]["ownerReferences"] = serde_json::json!([owner]);
        }
        let api = Api::<DeviceClass>::all(client.clone());
        let name = meshgate_core::dra::device_class_name(&gate_name);
        let mut pp = PatchParams::apply(names::FIELD_MANAGER).force();
        if dry_run {
            pp = pp.dry_run();
        }
        match api.patch(&name, &pp, &Patch::Apply(&class)).await {
            Ok(stored) => {
                if !dry_run {
                    lock(&self.classes).insert(key);
                }
                let value = serde_json::to_value(&stored).unwrap_or_default();
                let mut fallback = lock(&self.fallback);
                if class_maps_resource(&value, &res.name) {
                    fallback.remove(&gate_name);
                    None
                } else {
                    let why = format!(
                        "the API server dropped DeviceClass {name}'s extendedResourceName (DRA extended resources are off)"
                    );
                    fallback.insert(gate_name, why.clone());
                    Some(why)
                }
            }
            Err(kube::Error::Api(e)) if e.code == 403 => {
                // A real failure: the gate cannot use DRA until it is allowed to.
                tracing::warn!(gate = %gate_name, error = %e, "the DeviceClass of the DRA gate may not be written: grant create and patch on resource.k8s.io deviceclasses (meshgate install --strategy dra does)");
                None
            }
            Err(e) => {
                tracing::debug!(gate = %gate_name, dry_run, error = %e, "device class not written yet; retrying");
                None
            }
        }
    }

    /// Deletes every slice and the class of a DRA gate (the gate is being deleted); a gate that
    /// offers its resource in the node status has neither, and nothing is asked of the API.
    pub async fn remove_gate(
        &self,
        client: &kube::Client,
        gate: &NodeGate,
    ) -> Result<(), kube::Error> {
        let dra = gate
            .spec
            .resource
            .as_ref()
            .is_some_and(|r| r.provider == ResourceProvider::Dra);
        if !self.served() || !dra {
            return Ok(());
        }
        let gate_name = gate.name_any();
        let api = Api::<ResourceSlice>::all(client.clone());
        let lp = ListParams::default().labels(&managed_selector());
        let suffix = format!("/{gate_name}");
        for s in api.list(&lp).await?.items {
            if s.spec.driver != names::DRA_DRIVER || !s.spec.pool.name.ends_with(&suffix) {
                continue;
            }
            match api.delete(&s.name_any(), &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let classes = Api::<DeviceClass>::all(client.clone());
        match classes
            .delete(
                &meshgate_core::dra::device_class_name(&gate_name),
                &DeleteParams::default(),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Whether the API server serves `resource.k8s.io/v1` with ResourceSlices and DeviceClasses,
/// asked until it answers: a refusal ("not found": the group version is not served) is an
/// answer; a failure to ask (no connection, a 5xx, a 429) is retried with backoff
/// (`meshgate_core::node_gate::retry`, one warning per streak), so that a blip at start no
/// longer pins every DRA gate to the node status for the life of the process. Nothing is decided
/// for any node before this returns (the node gate waits for it before it syncs).
pub async fn served(client: &kube::Client) -> bool {
    use meshgate_core::node_gate::retry::{Failure, Streak};
    let mut streak = Streak::default();
    loop {
        match client.list_api_group_resources("resource.k8s.io/v1").await {
            Ok(list) => {
                if streak.failures > 0 {
                    tracing::info!(
                        failures = streak.failures,
                        "asked again: the API server answered whether it serves resource.k8s.io/v1"
                    );
                }
                return ["resourceslices", "deviceclasses"]
                    .iter()
                    .all(|r| list.resources.iter().any(|x| x.name == *r));
            }
            // A refusal (404: the group version is not served; any other 4xx but 429) is an
            // answer; retrying would not change it.
            Err(kube::Error::Api(e)) if (400..500).contains(&e.code) && e.code != 429 => {
                tracing::info!(code = e.code, reason = %e.reason, "resource.k8s.io/v1 is not served: DRA gates use the node status");
                return false;
            }
            Err(e) => {
                let (wait, warn) = streak.fail(Failure::Other);
                if warn {
                    tracing::warn!(error = %e, retry_in = ?wait, "could not ask whether resource.k8s.io/v1 is served; asking again");
                } else {
                    tracing::debug!(error = %e, failures = streak.failures, retry_in = ?wait, "could not ask whether resource.k8s.io/v1 is served");
                }
                tokio::time::sleep(wait).await;
            }
        }
    }
}

fn with_owner(mut slice: serde_json::Value, node: &GateNode) -> serde_json::Value {
    if let Some(uid) = node.uid() {
        slice["metadata"]["ownerReferences"] = serde_json::json!([{
            "apiVersion": "v1", "kind": "Node", "name": node.name_any(), "uid": uid,
        }]);
    }
    slice
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Shared handle.
pub type SharedDra = Arc<Dra>;

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use std::future::IntoFuture;
    use std::sync::atomic::AtomicUsize;

    /// A fake API server whose discovery of `resource.k8s.io/v1` fails with a 500 `failures`
    /// times, then answers: `Some(resources)` or a 404. Returns a client for it and the calls.
    async fn api_server(
        failures: usize,
        resources: Option<&'static [&'static str]>,
    ) -> (kube::Client, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let status = |code: u16, reason: &str| {
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": reason, "reason": reason, "code": code})
            .to_string()
        };
        let app = axum::Router::new().route(
            "/apis/resource.k8s.io/v1",
            axum::routing::get(move || {
                let n = seen.fetch_add(1, Ordering::SeqCst);
                async move {
                    match resources {
                        _ if n < failures => (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            status(500, "InternalError"),
                        ),
                        None => (StatusCode::NOT_FOUND, status(404, "NotFound")),
                        Some(names) => {
                            let list: Vec<serde_json::Value> = names
                                .iter()
                                .map(|n| {
                                    serde_json::json!({"name": n, "namespaced": false,
                                    "kind": "X", "singularName": "", "verbs": ["list"]})
                                })
                                .collect();
                            (
                                StatusCode::OK,
                                serde_json::json!({"kind": "APIResourceList",
                                    "groupVersion": "resource.k8s.io/v1", "resources": list})
                                .to_string(),
                            )
                        }
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(axum::serve(listener, app).into_future());
        let url = format!("http://{addr}").parse().expect("url");
        let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
        (client, calls)
    }

    #[tokio::test]
    async fn a_failure_to_ask_is_retried_until_the_api_server_answers() {
        // Two 500s (not retried inside kube's client), then the answer: served. Asked once,
        // as before, the first failure decided "not served" for the life of the process.
        let (client, calls) = api_server(2, Some(&["resourceslices", "deviceclasses"])).await;
        assert!(served(&client).await);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn not_served_is_an_answer() {
        let (client, calls) = api_server(0, None).await;
        assert!(!served(&client).await);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Served without device classes: not enough.
        let (client, _) = api_server(0, Some(&["resourceslices"])).await;
        assert!(!served(&client).await);
    }
}
