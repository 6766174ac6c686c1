//! Kubernetes Events, written without a cache.
//!
//! kube's `Recorder` keeps every event it wrote for six minutes, so that a repeat is written as
//! a series (a patch of the first event), and on every publish scans that whole cache under a
//! write lock. meshgate writes an event per node, pod or policy whose state changes: in a burst
//! (agents becoming ready on thousands of nodes) the cache held an event per node (~6 KiB each,
//! a third of the controller's heap at 2,000 nodes, `tools/bench/controller-heap.sh`) and every
//! publish scanned all of them while holding the lock every reconcile needed. Repeats of one of
//! meshgate's events are rare (an agent that flaps, within a gate's re-taint budget), so each
//! event is simply created: the API server expires events after its event TTL (one hour by
//! default), and `kubectl events` lists repeats one by one.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};

pub use kube::runtime::events::EventType;

/// Bytes of a note kept (the API refuses notes over 1 KiB; an ellipsis marks the cut).
const MAX_NOTE: usize = 1000;

/// The controller's name in the events it writes (`reportingController`).
pub const CONTROLLER: &str = "meshgate-controller";

/// Writes events as meshgate's controller (`reportingInstance`: the pod's name when known).
#[derive(Clone)]
pub struct Events {
    client: kube::Client,
    instance: String,
}

impl Events {
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            instance: std::env::var("POD_NAME").unwrap_or_else(|_| CONTROLLER.to_owned()),
        }
    }

    /// Creates an `events.k8s.io/v1` Event about `regarding` (in its namespace; `default` for
    /// a cluster-scoped object, as kubectl looks for them). The note is cut to what the API
    /// accepts (1 KiB).
    pub async fn publish(
        &self,
        type_: EventType,
        action: &str,
        reason: &str,
        note: &str,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = k8s_openapi::jiff::Timestamp::now();
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let event = Event {
            metadata: ObjectMeta {
                name: Some(event_name(regarding.name.as_deref(), now.as_nanosecond())),
                namespace: Some(namespace.to_owned()),
                ..Default::default()
            },
            action: Some(action.into()),
            reason: Some(reason.into()),
            note: Some(crate::conditions::truncate(note, MAX_NOTE)),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(
                match type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .into(),
            ),
            ..Default::default()
        };
        Api::<Event>::namespaced(self.client.clone(), namespace)
            .create(&PostParams::default(), &event)
            .await
            .map(|_| ())
    }
}

/// `<object>.<nanoseconds in hex>`, as client-go and kube name events.
fn event_name(object: Option<&str>, nanos: i128) -> String {
    format!("{}.{:x}", object.unwrap_or(CONTROLLER), nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_objects_and_unique_per_time() {
        assert_eq!(event_name(Some("node-1"), 255), "node-1.ff");
        assert_eq!(event_name(None, 16), "meshgate-controller.10");
        assert_ne!(event_name(Some("n"), 1), event_name(Some("n"), 2));
    }
}
