//! What the webhook reads from the cluster: namespace labels and annotations, LimitRanges,
//! MutationPolicies and NodeGates, each from a watch-fed cache so that a review costs no API call.
//!
//! What a review reads is kept the way it reads it, shared: a namespace's [`Meta`] and its
//! LimitRanges' `Container` items, each behind an `Arc` in a map by namespace name, so a review
//! costs one lookup and no copy. (Until the ninth session a review copied the namespace's label
//! and annotation maps out of the watch cache and scanned every LimitRange of the cluster for
//! its namespace: cost growing with the cluster, which the throughput bench, on fixed data, did
//! not see. Fixed data and the cluster now share [`NamespaceIndex`], so the bench measures the
//! lookup the server does.)
//!
//! A namespace missing from the cache (created a moment ago) is read once from the API server.
//! [`Sources::fixed`] serves the same from fixed data, for tests and offline use.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{LimitRange, Namespace};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_api::{MutationPolicy, MutationPolicySpec, NamespacedMutationPolicy, NodeGate};
use meshgate_core::resources::ContainerLimits;
use meshgate_core::select::Meta;
use meshgate_kube::watch;

use crate::context_maps::ContextMaps;

/// The webhook's view of the cluster.
#[derive(Clone)]
pub struct Sources(Arc<Inner>);

/// The policy list every review reads: shared, replaced whole when a policy changes.
pub type Policies = Arc<[(String, MutationPolicySpec)]>;

struct Inner {
    index: NamespaceIndex,
    /// Sorted by name; replaced whole on every policy event.
    policies: RwLock<Policies>,
    /// The ConfigMaps the policies' context entries name.
    config_maps: Arc<ContextMaps>,
    origin: Origin,
}

enum Origin {
    Fixed {
        gates: Vec<NodeGateSpec>,
    },
    Cluster {
        client: kube::Client,
        gates: Store<NodeGate>,
        synced: AtomicBool,
    },
}

/// What a review reads of its namespace, by namespace name, shared.
struct NamespaceIndex {
    /// Labels and annotations.
    metas: Watched<Arc<Meta>>,
    /// The `Container` items of the namespace's LimitRanges (in the order of the LimitRanges'
    /// names); a namespace without any is absent. Rebuilt whole on a LimitRange event (they
    /// are few and rarely change).
    limits: RwLock<HashMap<String, Arc<[ContainerLimits]>>>,
    /// Given for a namespace that has no LimitRange.
    no_limits: Arc<[ContainerLimits]>,
}

impl NamespaceIndex {
    fn new(metas: Watched<Arc<Meta>>, limits: HashMap<String, Arc<[ContainerLimits]>>) -> Self {
        Self {
            metas,
            limits: RwLock::new(limits),
            no_limits: Arc::from([]),
        }
    }

    fn limits(&self, namespace: &str) -> Arc<[ContainerLimits]> {
        self.limits
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(namespace)
            .cloned()
            .unwrap_or_else(|| self.no_limits.clone())
    }

    /// Replaces the LimitRange part with the watch cache's content.
    fn publish_limits(&self, cache: &Store<LimitRange>) {
        let mut ranges = cache.state();
        ranges.sort_by(|a, b| {
            (&a.metadata.namespace, &a.metadata.name)
                .cmp(&(&b.metadata.namespace, &b.metadata.name))
        });
        let mut by_namespace: HashMap<String, Vec<ContainerLimits>> = HashMap::new();
        for range in &ranges {
            let items = ContainerLimits::of(range);
            if let (Some(ns), false) = (&range.metadata.namespace, items.is_empty()) {
                by_namespace.entry(ns.clone()).or_default().extend(items);
            }
        }
        let limits = by_namespace
            .into_iter()
            .map(|(ns, items)| (ns, Arc::from(items)))
            .collect();
        *self.limits.write().unwrap_or_else(PoisonError::into_inner) = limits;
    }
}

/// A map kept from a watch, by object name, with the semantics of kube's reflector: a (re-)list
/// is collected aside and replaces the map when it completes, so a review never sees a map
/// half listed; `synced` turns true when the first list completes.
struct Watched<V> {
    live: RwLock<HashMap<String, V>>,
    relist: Mutex<Option<HashMap<String, V>>>,
    synced: tokio::sync::watch::Sender<bool>,
}

impl<V: Clone> Watched<V> {
    /// A map that is complete from the start (fixed data).
    fn complete(map: HashMap<String, V>) -> Self {
        Self {
            live: RwLock::new(map),
            relist: Mutex::new(None),
            synced: tokio::sync::watch::Sender::new(true),
        }
    }

    /// A map to be filled by a watch.
    fn empty() -> Self {
        Self {
            live: RwLock::new(HashMap::new()),
            relist: Mutex::new(None),
            synced: tokio::sync::watch::Sender::new(false),
        }
    }

    fn get(&self, key: &str) -> Option<V> {
        self.live
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    /// Applies a watch event; `entry` gives an object's key and value.
    fn apply<K>(&self, event: watcher::Event<K>, entry: impl Fn(K) -> (String, V)) {
        let live = || self.live.write().unwrap_or_else(PoisonError::into_inner);
        let relist = || self.relist.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Init => *relist() = Some(HashMap::new()),
            watcher::Event::InitApply(object) => {
                let (key, value) = entry(object);
                relist().get_or_insert_with(HashMap::new).insert(key, value);
            }
            watcher::Event::InitDone => {
                let listed = relist().take().unwrap_or_default();
                *live() = listed;
                self.synced.send_replace(true);
            }
            watcher::Event::Apply(object) => {
                let (key, value) = entry(object);
                live().insert(key, value);
            }
            watcher::Event::Delete(object) => {
                let (key, _) = entry(object);
                live().remove(&key);
            }
        }
    }

    async fn wait_until_synced(&self) {
        let _ = self.synced.subscribe().wait_for(|synced| *synced).await;
    }
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources").finish_non_exhaustive()
    }
}

/// How long a review waits for the cache to bring a namespace it could not read.
const NAMESPACE_WAIT: Duration = Duration::from_secs(1);

/// A namespace could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading namespace {name:?}: {source}")]
pub struct SourceError {
    name: String,
    #[source]
    source: kube::Error,
}

fn meta_of(metadata: kube::core::ObjectMeta) -> Meta {
    Meta {
        labels: metadata.labels.unwrap_or_default(),
        annotations: metadata.annotations.unwrap_or_default(),
    }
}

impl Sources {
    /// Fixed data: namespaces by name, policies, node gates.
    pub fn fixed(
        namespaces: BTreeMap<String, Meta>,
        policies: Vec<(String, MutationPolicySpec)>,
        gates: Vec<NodeGateSpec>,
    ) -> Self {
        Self::fixed_all(namespaces, BTreeMap::new(), policies, gates, Vec::new())
    }

    /// Fixed data with the ConfigMaps policies' context entries read (no other exists).
    pub fn fixed_with_config_maps(
        namespaces: BTreeMap<String, Meta>,
        policies: Vec<(String, MutationPolicySpec)>,
        config_maps: Vec<serde_json::Value>,
    ) -> Self {
        Self::fixed_all(
            namespaces,
            BTreeMap::new(),
            policies,
            Vec::new(),
            config_maps,
        )
    }

    /// Fixed data with LimitRanges (`Container` items by namespace).
    pub fn fixed_with_limits(
        namespaces: BTreeMap<String, Meta>,
        limits: BTreeMap<String, Vec<ContainerLimits>>,
    ) -> Self {
        Self::fixed_all(namespaces, limits, Vec::new(), Vec::new(), Vec::new())
    }

    fn fixed_all(
        namespaces: BTreeMap<String, Meta>,
        limits: BTreeMap<String, Vec<ContainerLimits>>,
        mut policies: Vec<(String, MutationPolicySpec)>,
        gates: Vec<NodeGateSpec>,
        config_maps: Vec<serde_json::Value>,
    ) -> Self {
        policies.sort_by(|a, b| a.0.cmp(&b.0));
        let metas = namespaces
            .into_iter()
            .map(|(name, meta)| (name, Arc::new(meta)))
            .collect();
        let limits = limits
            .into_iter()
            .filter(|(_, items)| !items.is_empty())
            .map(|(ns, items)| (ns, Arc::from(items)))
            .collect();
        Sources(Arc::new(Inner {
            index: NamespaceIndex::new(Watched::complete(metas), limits),
            policies: RwLock::new(policies.into()),
            config_maps: Arc::new(ContextMaps::fixed(config_maps)),
            origin: Origin::Fixed { gates },
        }))
    }

    /// Caches fed by watches on the cluster; the returned future drives them and never ends.
    pub fn watch(client: kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let (pol_store, pol_writer) = reflector::store();
        let (npol_store, npol_writer) = reflector::store();
        let (gate_store, gate_writer) = reflector::store();
        let (lr_store, lr_writer) = reflector::store();
        let sources = Sources(Arc::new(Inner {
            index: NamespaceIndex::new(Watched::empty(), HashMap::new()),
            policies: RwLock::new(Arc::from([])),
            config_maps: Arc::new(ContextMaps::new()),
            origin: Origin::Cluster {
                client: client.clone(),
                gates: gate_store.clone(),
                synced: AtomicBool::new(false),
            },
        }));
        let lr_stream = limit_ranges(&sources, &client, lr_writer, lr_store.clone());
        let ns_stream = namespaces(&sources, &client);
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
        let gate_stream = node_gates(&client, gate_writer);
        let (publish, pol_cache, npol_cache) =
            (sources.clone(), pol_store.clone(), npol_store.clone());
        let pol_stream = pol_stream.for_each(move |event| {
            match event {
                Ok(_) => publish.publish_policies(&pol_cache, &npol_cache),
                Err(e) => watch::log("MutationPolicies (webhook cache)", &e),
            }
            async {}
        });
        let (publish, pol_cache, npol_cache) =
            (sources.clone(), pol_store.clone(), npol_store.clone());
        let npol_stream = npol_stream.for_each(move |event| {
            match event {
                Ok(_) => publish.publish_policies(&pol_cache, &npol_cache),
                Err(e) => watch::log("NamespacedMutationPolicies (webhook cache)", &e),
            }
            async {}
        });
        let flag = sources.clone();
        let drive = async move {
            let ready = async move {
                flag.0.index.metas.wait_until_synced().await;
                let _ = pol_store.wait_until_ready().await;
                let _ = npol_store.wait_until_ready().await;
                let _ = gate_store.wait_until_ready().await;
                let _ = lr_store.wait_until_ready().await;
                // Published here too: the streams publish after the store has the event, and
                // a store can be ready a moment before its stream has published the list.
                flag.publish_policies(&pol_store, &npol_store);
                flag.0.index.publish_limits(&lr_store);
                // The ConfigMaps the policies name, listed (or refused) before the first review.
                flag.0.config_maps.wait_until_synced().await;
                if let Origin::Cluster { synced, .. } = &flag.0.origin {
                    synced.store(true, Ordering::Release);
                    tracing::info!(
                        config_maps = flag.0.config_maps.len(),
                        "caches synced: namespaces, limit ranges, mutation policies, node gates, policies' ConfigMaps"
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
        if let Origin::Cluster { client, .. } = &self.0.origin {
            let wanted = list
                .iter()
                .flat_map(|(_, spec)| meshgate_core::policy::context::config_maps_named(spec))
                .collect();
            self.0.config_maps.follow(client, wanted);
        }
        *self
            .0
            .policies
            .write()
            .unwrap_or_else(PoisonError::into_inner) = list.into();
    }

    /// Where the policies' `configMap` context entries are read: the webhook's cache of them.
    pub fn cluster_data(&self) -> &dyn meshgate_core::policy::context::ClusterData {
        &*self.0.config_maps
    }

    /// The client `apiCall` context entries GET with (none for fixed data).
    pub fn api_client(&self) -> Option<&kube::Client> {
        match &self.0.origin {
            Origin::Fixed { .. } => None,
            Origin::Cluster { client, .. } => Some(client),
        }
    }

    /// Whether the caches have their first full list.
    pub fn ready(&self) -> bool {
        match &self.0.origin {
            Origin::Fixed { .. } => true,
            Origin::Cluster { synced, .. } => synced.load(Ordering::Acquire),
        }
    }

    /// A namespace's labels and annotations (empty for an unknown namespace in fixed data),
    /// shared with the cache.
    pub async fn namespace(&self, name: &str) -> Result<Arc<Meta>, SourceError> {
        if let Some(meta) = self.0.index.metas.get(name) {
            return Ok(meta);
        }
        match &self.0.origin {
            Origin::Fixed { .. } => Ok(Arc::default()),
            Origin::Cluster { client, .. } => {
                // The webhook may `get` namespaces (install's RBAC): a namespace created a
                // moment ago, or while the watch is cut, is read once.
                match Api::<Namespace>::all(client.clone())
                    .get_metadata(name)
                    .await
                {
                    Ok(ns) => Ok(Arc::new(meta_of(ns.metadata))),
                    Err(source) => {
                        // Unreadable (the API server is slow to answer, or a grant is
                        // missing): the watch may still bring it, within a second.
                        let deadline = tokio::time::Instant::now() + NAMESPACE_WAIT;
                        while tokio::time::Instant::now() < deadline {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            if let Some(meta) = self.0.index.metas.get(name) {
                                return Ok(meta);
                            }
                        }
                        Err(SourceError {
                            name: name.to_owned(),
                            source,
                        })
                    }
                }
            }
        }
    }

    /// The namespace's labels and annotations from the cache alone (`None`: not cached yet).
    pub fn cached_namespace(&self, name: &str) -> Option<Arc<Meta>> {
        self.0.index.metas.get(name)
    }

    /// The `Container` items of a namespace's LimitRanges, shared with the cache.
    pub fn limit_ranges(&self, namespace: &str) -> Arc<[ContainerLimits]> {
        self.0.index.limits(namespace)
    }

    /// Every MutationPolicy, sorted by name (shared: no copy per review).
    pub fn policies(&self) -> Policies {
        self.0
            .policies
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Every NodeGate's spec.
    pub fn node_gates(&self) -> Vec<NodeGateSpec> {
        match &self.0.origin {
            Origin::Fixed { gates } => gates.clone(),
            Origin::Cluster { gates, .. } => gates.state().iter().map(|g| g.spec.clone()).collect(),
        }
    }
}

/// The LimitRanges' watch: an event rebuilds the namespace's limits; the events of a list are
/// published once, when it completes.
fn limit_ranges(
    sources: &Sources,
    client: &kube::Client,
    writer: reflector::store::Writer<LimitRange>,
    cache: reflector::Store<LimitRange>,
) -> impl Future<Output = ()> + Send + use<> {
    let publish = sources.clone();
    reflector::reflector(
        writer,
        watcher(
            Api::<LimitRange>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .for_each(move |event| {
        match event {
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                publish.0.index.publish_limits(&cache)
            }
            Ok(_) => {}
            Err(e) => watch::log("LimitRanges (webhook cache)", &e),
        }
        async {}
    })
}

/// The namespaces' watch (their metadata only), into the index.
fn namespaces(sources: &Sources, client: &kube::Client) -> impl Future<Output = ()> + Send + use<> {
    let index = sources.clone();
    watcher(
        Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .for_each(move |event| {
        match event {
            Ok(event) => {
                index
                    .0
                    .index
                    .metas
                    .apply(event, |ns: PartialObjectMeta<Namespace>| {
                        let name = ns.metadata.name.clone().unwrap_or_default();
                        (name, Arc::new(meta_of(ns.metadata)))
                    });
            }
            Err(e) => watch::log("namespaces (webhook cache)", &e),
        }
        async {}
    })
}

/// The NodeGates' watch, into `writer`'s store.
fn node_gates(
    client: &kube::Client,
    writer: reflector::store::Writer<NodeGate>,
) -> impl Future<Output = ()> + Send + use<> {
    reflector::reflector(
        writer,
        watcher(
            Api::<NodeGate>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .for_each(|event| {
        if let Err(e) = event {
            watch::log("NodeGates (webhook cache)", &e);
        }
        async {}
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher::Event;

    fn watched() -> Watched<&'static str> {
        Watched::empty()
    }

    fn apply(w: &Watched<&'static str>, event: Event<(&'static str, &'static str)>) {
        w.apply(event, |(k, v)| (k.to_owned(), v));
    }

    #[test]
    fn a_list_is_served_only_once_complete_and_replaces_the_map() {
        let w = watched();
        apply(&w, Event::Init);
        apply(&w, Event::InitApply(("a", "1")));
        assert_eq!(w.get("a"), None, "half a list is not served");
        assert!(!*w.synced.borrow());
        apply(&w, Event::InitDone);
        assert_eq!(w.get("a"), Some("1"));
        assert!(*w.synced.borrow());

        apply(&w, Event::Apply(("b", "2")));
        apply(&w, Event::Apply(("a", "3")));
        assert_eq!((w.get("a"), w.get("b")), (Some("3"), Some("2")));

        // A re-list (the watch expired): the old map is served until the new one is complete,
        // then an object deleted meanwhile is gone.
        apply(&w, Event::Init);
        apply(&w, Event::InitApply(("a", "4")));
        assert_eq!((w.get("a"), w.get("b")), (Some("3"), Some("2")));
        apply(&w, Event::InitDone);
        assert_eq!((w.get("a"), w.get("b")), (Some("4"), None));

        apply(&w, Event::Delete(("a", "4")));
        assert_eq!(w.get("a"), None);
    }

    #[test]
    fn limits_are_grouped_by_namespace_in_the_order_of_the_names() {
        let range = |ns: &str, name: &str, min: &str, kind: &str| -> LimitRange {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": ns},
                "spec": {"limits": [{"type": kind, "min": {"memory": min}}]},
            }))
            .expect("limit range")
        };
        let (store, mut writer) = reflector::store::<LimitRange>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for r in [
            range("shop", "z", "64Mi", "Container"),
            range("shop", "a", "32Mi", "Container"),
            range("pods-only", "a", "32Mi", "Pod"),
            range("other", "a", "16Mi", "Container"),
        ] {
            writer.apply_watcher_event(&watcher::Event::InitApply(r));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let sources = Sources::fixed(BTreeMap::new(), vec![], vec![]);
        sources.0.index.publish_limits(&store);

        let mins = |ns: &str| -> Vec<String> {
            sources
                .limit_ranges(ns)
                .iter()
                .map(|l| format!("{:?}", l.min.get("memory")))
                .collect()
        };
        let expected = |q: &[&str]| -> Vec<String> {
            q.iter()
                .map(|q| format!("{:?}", meshgate_core::quantity::Quantity::parse(q)))
                .collect()
        };
        assert_eq!(mins("shop"), expected(&["32Mi", "64Mi"]));
        assert_eq!(mins("other"), expected(&["16Mi"]));
        assert!(
            mins("pods-only").is_empty(),
            "a Pod item is not a container's"
        );
        assert!(mins("elsewhere").is_empty());
    }
}
