//! Prometheus metrics of the controller.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GateStateLabels {
    pub gate: String,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// `taint`, `untaint`, `advertise`, `withdraw`, `mark-ready`.
    pub operation: &'static str,
}

/// The controller's metrics, under the `meshgate_controller` prefix.
#[derive(Clone)]
pub struct Metrics {
    pub nodes: Family<GateStateLabels, Gauge>,
    pub ready_to_untaint: Histogram,
    pub operations: Family<OperationLabels, Counter>,
    pub errors: Family<OperationLabels, Counter>,
    pub reconciles: Counter,
    pub leader: Gauge,
    /// 1 once nodes, node gates, agent pods and DaemonSets have all been listed.
    pub synced: Gauge,
    /// 1 once every node was reconciled after the caches synced (or leadership was gained).
    pub initial_reconcile_done: Gauge,
    /// Re-taints the budget held back.
    pub retaints_deferred: Counter,
    /// The repair loop's metrics, `meshgate_controller_repair_*`, in the same registry.
    pub repair: crate::repair::RepairMetrics,
    registry: Arc<Registry>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let nodes = Family::<GateStateLabels, Gauge>::default();
        // 10 ms to ~160 s.
        let ready_to_untaint = Histogram::new(exponential_buckets(0.01, 2.0, 15));
        let operations = Family::<OperationLabels, Counter>::default();
        let errors = Family::<OperationLabels, Counter>::default();
        let reconciles = Counter::default();
        let leader = Gauge::default();
        let synced = Gauge::default();
        let initial_reconcile_done = Gauge::default();
        let retaints_deferred = Counter::default();
        let mut r = Registry::with_prefix("meshgate_controller");
        r.register("nodes", "Nodes by node gate and state", nodes.clone());
        r.register(
            "ready_to_untaint_seconds",
            "Time from a node's agents being Ready to its startup taint being removed",
            ready_to_untaint.clone(),
        );
        r.register(
            "operations",
            "Writes to nodes, by operation",
            operations.clone(),
        );
        r.register(
            "errors",
            "Failed writes and reconciles, by operation",
            errors.clone(),
        );
        r.register("reconciles", "Node reconciles run", reconciles.clone());
        r.register(
            "leader",
            "1 while this replica holds the leader lease",
            leader.clone(),
        );
        r.register(
            "synced",
            "1 once nodes, node gates, agent pods and DaemonSets have all been listed (no decision before)",
            synced.clone(),
        );
        r.register(
            "initial_reconcile_done",
            "1 once every node was reconciled after the caches synced or leadership was gained",
            initial_reconcile_done.clone(),
        );
        r.register(
            "retaints_deferred",
            "Re-taints not written because the gate's maxRetainted budget was used up",
            retaints_deferred.clone(),
        );
        let repair = crate::repair::RepairMetrics::register(r.sub_registry_with_prefix("repair"));
        Self {
            repair,
            synced,
            initial_reconcile_done,
            retaints_deferred,
            nodes,
            ready_to_untaint,
            operations,
            errors,
            reconciles,
            leader,
            registry: Arc::new(r),
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_registry_one_exposition() {
        let m = super::Metrics::new();
        m.repair.pods.set(3);
        let text = m.encode();
        assert!(text.contains("meshgate_controller_repair_pods 3"), "{text}");
        assert!(text.contains("meshgate_controller_synced"), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
    }
}
