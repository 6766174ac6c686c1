//! What the webhook reads from the cluster: namespace labels and annotations, MutationPolicies
//! and NodeGates, each from a watch-fed cache so that a review costs no API call.
//!
//! A namespace missing from the cache (created a moment ago) is read once from the API server.
//! [`Sources::fixed`] serves the same from fixed data, for tests and offline use.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{LimitRange, Namespace};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_api::{MutationPolicy, MutationPolicySpec, NamespacedMutationPolicy, NodeGate};
use meshgate_core::resources::ContainerLimits;
use meshgate_core::select::Meta;

/// The webhook's view of the cluster.
#[derive(Clone)]
pub struct Sources(Arc<Inner>);

/// The policy list every review reads: shared, replaced whole when a policy changes.
pub type Policies = Arc<[(String, MutationPolicySpec)]>;

enum Inner {
    Fixed {
        namespaces: BTreeMap<String, Meta>,
        policies: Policies,
        gates: Vec<NodeGateSpec>,
        limits: BTreeMap<String, Vec<ContainerLimits>>,
    },
    Cluster {
        client: kube::Client,
        namespaces: Store<PartialObjectMeta<Namespace>>,
        /// Sorted by name; rebuilt from the watch cache on every policy event.
        policies: RwLock<Policies>,
        gates: Store<NodeGate>,
        limit_ranges: Store<LimitRange>,
        synced: AtomicBool,
    },
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources").finish_non_exhaustive()
    }
}

/// A namespace could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading namespace {name:?}: {source}")]
pub struct SourceError {
    name: String,
    #[source]
    source: kube::Error,
}

fn meta_of(
    labels: Option<&BTreeMap<String, String>>,
    annotations: Option<&BTreeMap<String, String>>,
) -> Meta {
    Meta {
        labels: labels.cloned().unwrap_or_default(),
        annotations: annotations.cloned().unwrap_or_default(),
    }
}

impl Sources {
    /// Fixed data: namespaces by name, policies, node gates.
    pub fn fixed(
        namespaces: BTreeMap<String, Meta>,
        mut policies: Vec<(String, MutationPolicySpec)>,
        gates: Vec<NodeGateSpec>,
    ) -> Self {
        policies.sort_by(|a, b| a.0.cmp(&b.0));
        Sources(Arc::new(Inner::Fixed {
            namespaces,
            policies: policies.into(),
            gates,
            limits: BTreeMap::new(),
        }))
    }

    /// Fixed data with LimitRanges (`Container` items by namespace).
    pub fn fixed_with_limits(
        namespaces: BTreeMap<String, Meta>,
        limits: BTreeMap<String, Vec<ContainerLimits>>,
    ) -> Self {
        Sources(Arc::new(Inner::Fixed {
            namespaces,
            policies: Arc::from([]),
            gates: Vec::new(),
            limits,
        }))
    }

    /// Caches fed by watches on the cluster; the returned future drives them and never ends.
    pub fn watch(client: kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let (ns_store, ns_writer) = reflector::store();
        let (pol_store, pol_writer) = reflector::store();
        let (npol_store, npol_writer) = reflector::store();
        let (gate_store, gate_writer) = reflector::store();
        let (lr_store, lr_writer) = reflector::store();
        let lr_stream = reflector::reflector(
            lr_writer,
            watcher(
                Api::<LimitRange>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .for_each(|_| async {});
        let ns_stream = reflector::reflector(
            ns_writer,
            watcher(
                Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .for_each(|_| async {});
        let pol_stream = reflector::reflector(
            pol_writer,
            watcher(
                Api::<MutationPolicy>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff();
        let npol_stream = reflector::reflector(
            npol_writer,
            watcher(
                Api::<NamespacedMutationPolicy>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff();
        let gate_stream = reflector::reflector(
            gate_writer,
            watcher(
                Api::<NodeGate>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .for_each(|_| async {});
        let sources = Sources(Arc::new(Inner::Cluster {
            client,
            namespaces: ns_store.clone(),
            policies: RwLock::new(Arc::from([])),
            gates: gate_store.clone(),
            limit_ranges: lr_store.clone(),
            synced: AtomicBool::new(false),
        }));
        let (publish, pol_cache, npol_cache) =
            (sources.clone(), pol_store.clone(), npol_store.clone());
        let pol_stream = pol_stream.for_each(move |_| {
            publish.publish_policies(&pol_cache, &npol_cache);
            async {}
        });
        let (publish, pol_cache, npol_cache) =
            (sources.clone(), pol_store.clone(), npol_store.clone());
        let npol_stream = npol_stream.for_each(move |_| {
            publish.publish_policies(&pol_cache, &npol_cache);
            async {}
        });
        let flag = sources.clone();
        let drive = async move {
            let ready = async move {
                let _ = ns_store.wait_until_ready().await;
                let _ = pol_store.wait_until_ready().await;
                let _ = npol_store.wait_until_ready().await;
                let _ = gate_store.wait_until_ready().await;
                let _ = lr_store.wait_until_ready().await;
                flag.publish_policies(&pol_store, &npol_store);
                if let Inner::Cluster { synced, .. } = &*flag.0 {
                    synced.store(true, Ordering::Release);
                    tracing::info!(
                        "caches synced: namespaces, limit ranges, mutation policies, node gates"
                    );
                }
                futures::future::pending::<()>().await;
            };
            futures::join!(
                ns_stream,
                pol_stream,
                npol_stream,
                gate_stream,
                lr_stream,
                ready
            );
        };
        (sources, drive)
    }

    /// Replaces the shared policy list with the watch caches' content, sorted by name: the
    /// cluster-wide policies by name, the namespaced ones as `namespace/name`, confined to their
    /// namespace (one that cannot be confined is left out, and logged).
    fn publish_policies(
        &self,
        cache: &Store<MutationPolicy>,
        namespaced: &Store<NamespacedMutationPolicy>,
    ) {
        if let Inner::Cluster { policies, .. } = &*self.0 {
            let mut list: Vec<(String, MutationPolicySpec)> = cache
                .state()
                .iter()
                .map(|p| (p.metadata.name.clone().unwrap_or_default(), p.spec.clone()))
                .collect();
            for p in namespaced.state() {
                let ns = p.metadata.namespace.clone().unwrap_or_default();
                let name = format!("{ns}/{}", p.metadata.name.clone().unwrap_or_default());
                match meshgate_core::policy::confine(&p.spec.policy, &ns) {
                    Ok(spec) => list.push((name, spec)),
                    Err(e) => {
                        tracing::warn!(policy = %name, errors = ?e, "NamespacedMutationPolicy not applied")
                    }
                }
            }
            list.sort_by(|a, b| a.0.cmp(&b.0));
            *policies.write().unwrap_or_else(PoisonError::into_inner) = list.into();
        }
    }

    /// Whether the caches have their first full list.
    pub fn ready(&self) -> bool {
        match &*self.0 {
            Inner::Fixed { .. } => true,
            Inner::Cluster { synced, .. } => synced.load(Ordering::Acquire),
        }
    }

    /// A namespace's labels and annotations (empty for an unknown namespace in fixed data).
    pub async fn namespace(&self, name: &str) -> Result<Meta, SourceError> {
        match &*self.0 {
            Inner::Fixed { namespaces, .. } => {
                Ok(namespaces.get(name).cloned().unwrap_or_default())
            }
            Inner::Cluster {
                client, namespaces, ..
            } => {
                if let Some(ns) = namespaces.get(&ObjectRef::new(name)) {
                    return Ok(meta_of(
                        ns.metadata.labels.as_ref(),
                        ns.metadata.annotations.as_ref(),
                    ));
                }
                let ns = Api::<Namespace>::all(client.clone())
                    .get_metadata(name)
                    .await
                    .map_err(|source| SourceError {
                        name: name.to_owned(),
                        source,
                    })?;
                Ok(meta_of(
                    ns.metadata.labels.as_ref(),
                    ns.metadata.annotations.as_ref(),
                ))
            }
        }
    }

    /// The `Container` items of a namespace's LimitRanges.
    pub fn limit_ranges(&self, namespace: &str) -> Vec<ContainerLimits> {
        match &*self.0 {
            Inner::Fixed { limits, .. } => limits.get(namespace).cloned().unwrap_or_default(),
            Inner::Cluster { limit_ranges, .. } => limit_ranges
                .state()
                .iter()
                .filter(|lr| lr.metadata.namespace.as_deref() == Some(namespace))
                .flat_map(|lr| ContainerLimits::of(lr))
                .collect(),
        }
    }

    /// Every MutationPolicy, sorted by name (shared: no copy per review).
    pub fn policies(&self) -> Policies {
        match &*self.0 {
            Inner::Fixed { policies, .. } => policies.clone(),
            Inner::Cluster { policies, .. } => policies
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }

    /// Every NodeGate's spec.
    pub fn node_gates(&self) -> Vec<NodeGateSpec> {
        match &*self.0 {
            Inner::Fixed { gates, .. } => gates.clone(),
            Inner::Cluster { gates, .. } => gates.state().iter().map(|g| g.spec.clone()).collect(),
        }
    }
}
