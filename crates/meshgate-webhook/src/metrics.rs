//! Prometheus metrics of the webhook.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabels {
    pub path: &'static str,
    /// `mutated`, `unchanged`, a skip reason, or `invalid`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabels {
    pub path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MutationLabels {
    /// `init-gate`, `resource-gate`, `node-taint`, or `policy`.
    pub mutation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    /// The MutationPolicy's name (bounded by the number of policies in the cluster).
    pub policy: String,
}

/// The webhook's metrics, registered under the `meshgate_webhook` prefix.
#[derive(Clone)]
pub struct Metrics {
    pub reviews: Family<ReviewLabels, Counter>,
    pub latency: Family<PathLabels, Histogram>,
    pub mutations: Family<MutationLabels, Counter>,
    pub policy_failures: Family<PolicyLabels, Counter>,
    pub cert_reloads: Counter,
    pub cert_reload_errors: Counter,
    pub in_flight: Gauge,
    pub overloaded: Counter,
    /// Reviews of a namespace not in the cache yet (read from the API server).
    pub namespace_reads: Counter,
    /// Reviews decided without their namespace's labels (it could not be read at all).
    pub namespace_unread: Counter,
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
        let reviews = Family::<ReviewLabels, Counter>::default();
        let latency = Family::<PathLabels, Histogram>::new_with_constructor(|| {
            // 100 µs to ~3 s.
            Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                0.0001, 2.5, 12,
            ))
        });
        let mutations = Family::<MutationLabels, Counter>::default();
        let policy_failures = Family::<PolicyLabels, Counter>::default();
        let cert_reloads = Counter::default();
        let cert_reload_errors = Counter::default();
        let in_flight = Gauge::default();
        let overloaded = Counter::default();
        let namespace_unread = Counter::default();
        let namespace_reads = Counter::default();
        let mut registry = Registry::with_prefix("meshgate_webhook");
        registry.register(
            "reviews",
            "Admission reviews answered, by path and outcome",
            reviews.clone(),
        );
        registry.register(
            "review_duration_seconds",
            "Time to answer one admission review, by path",
            latency.clone(),
        );
        registry.register(
            "mutations",
            "Mutations applied, by kind of mutation",
            mutations.clone(),
        );
        registry.register(
            "policy_failures",
            "MutationPolicies that matched an object but could not be applied to it (the object was admitted without them; the other policies applied), by policy",
            policy_failures.clone(),
        );
        registry.register(
            "cert_reloads",
            "Serving certificate reloads",
            cert_reloads.clone(),
        );
        registry.register(
            "cert_reload_errors",
            "Serving certificate reloads that failed (the old certificate stays)",
            cert_reload_errors.clone(),
        );
        registry.register(
            "in_flight_reviews",
            "Reviews being answered",
            in_flight.clone(),
        );
        registry.register(
            "overloaded",
            "Requests refused with 429 because the in-flight limit was reached (the API server then applies the webhook's failure policy)",
            overloaded.clone(),
        );
        registry.register(
            "namespace_reads",
            "Reviews of a namespace the cache did not hold yet (created a moment ago, or while the watch was cut), read from the API server",
            namespace_reads.clone(),
        );
        registry.register(
            "namespace_unread",
            "Reviews decided without their namespace's labels: not in the cache and not readable from the API server (admitted, with a warning)",
            namespace_unread.clone(),
        );
        Self {
            overloaded,
            namespace_unread,
            namespace_reads,
            reviews,
            latency,
            mutations,
            policy_failures,
            cert_reloads,
            cert_reload_errors,
            in_flight,
            registry: Arc::new(registry),
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
