//! What a policy reads from the cluster at admission: the ConfigMaps its `configMap` context
//! entries name.
//!
//! The engine stays pure: it asks a [`ClusterData`] for a ConfigMap, and the caller answers from
//! what it holds. The webhook answers from a watch cache of exactly the ConfigMaps the policies
//! name (`meshgate-webhook`'s `sources`), `render` from the ConfigMaps given with its input
//! ([`GivenConfigMaps`]), and callers without a cluster with [`NoCluster`].
//!
//! Kyverno's loader (`pkg/engine/context/loaders/configmap.go`) makes the entry's value
//! `{"data": <the ConfigMap's data>, "metadata": <its metadata>}` ([`config_map_value`]). The
//! namespace is required in a cluster-wide policy (`validate`, as Kyverno's policy validation);
//! a namespaced policy reads its own, and no other ([`super::confine`] sets it). A ConfigMap
//! that does not exist or cannot be read fails the entry, and so the expressions that name it
//! (Kyverno loads entries lazily).

use std::collections::{BTreeMap, BTreeSet};

use meshgate_api::mutation_policy::{ContextEntry, Mutation, MutationPolicySpec};
use serde_json::{Map, Value};

/// The namespace a `configMap` entry without one reads, in a cluster-wide policy (Kyverno's).
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where the engine reads the ConfigMaps of `configMap` context entries.
pub trait ClusterData: std::fmt::Debug + Sync {
    /// The ConfigMap `namespace/name` as JSON (`Ok(None)`: it does not exist), or why it cannot
    /// be known (not readable, not yet synced, not given).
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String>;
}

/// No cluster: every ConfigMap read fails, saying so.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCluster;

impl ClusterData for NoCluster {
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String> {
        Err(format!(
            "ConfigMap {namespace}/{name}: no cluster to read it from"
        ))
    }
}

/// ConfigMaps given whole, by namespace and name: `render`'s input, or what a caller read.
///
/// [`GivenConfigMaps::default`] is `render`'s: a ConfigMap not given is an error that says to
/// give it (`render` cannot know whether it exists). [`GivenConfigMaps::read`] is a caller's
/// that read the ConfigMaps a policy names: one not given does not exist, one it could not read
/// is recorded with [`GivenConfigMaps::unreadable`].
#[derive(Clone, Debug, Default)]
pub struct GivenConfigMaps {
    maps: BTreeMap<(String, String), Value>,
    unreadable: BTreeMap<(String, String), String>,
    /// Whether every ConfigMap that exists is given.
    complete: bool,
}

impl GivenConfigMaps {
    /// ConfigMaps read from the cluster: one not added does not exist.
    pub fn read() -> Self {
        Self {
            complete: true,
            ..Self::default()
        }
    }

    /// Adds a ConfigMap (its `metadata.namespace`, or `default`); returns whether `object` is a
    /// `v1` ConfigMap with a name.
    pub fn add(&mut self, object: &Value) -> bool {
        let is_cm = object.get("apiVersion").and_then(Value::as_str) == Some("v1")
            && object.get("kind").and_then(Value::as_str) == Some("ConfigMap");
        let name = object.pointer("/metadata/name").and_then(Value::as_str);
        let (true, Some(name)) = (is_cm, name) else {
            return false;
        };
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or(DEFAULT_NAMESPACE);
        self.maps
            .insert((namespace.to_owned(), name.to_owned()), object.clone());
        true
    }

    /// Records that `namespace/name` could not be read, and why.
    pub fn unreadable(&mut self, namespace: &str, name: &str, why: String) {
        self.unreadable
            .insert((namespace.to_owned(), name.to_owned()), why);
    }

    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

impl ClusterData for GivenConfigMaps {
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String> {
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(cm) = self.maps.get(&key) {
            return Ok(Some(cm.clone()));
        }
        if let Some(why) = self.unreadable.get(&key) {
            return Err(format!("ConfigMap {namespace}/{name}: {why}"));
        }
        if self.complete {
            return Ok(None);
        }
        Err(format!(
            "ConfigMap {namespace}/{name} is not in the input (give it with the objects to render)"
        ))
    }
}

/// A `configMap` entry's value: `data` (or `null`) and `metadata`, as Kyverno's loader.
pub fn config_map_value(config_map: &Value) -> Value {
    let mut out = Map::new();
    out.insert(
        "data".into(),
        config_map.get("data").cloned().unwrap_or(Value::Null),
    );
    out.insert(
        "metadata".into(),
        config_map
            .get("metadata")
            .cloned()
            .unwrap_or_else(|| Value::Object(Map::new())),
    );
    Value::Object(out)
}

/// Reads a `configMap` entry through `cluster`.
pub(crate) fn load(entry: &ContextEntry, cluster: &dyn ClusterData) -> Result<Value, String> {
    let Some(cm) = &entry.config_map else {
        return Err("not a configMap entry".to_owned());
    };
    let namespace = if cm.namespace.is_empty() {
        DEFAULT_NAMESPACE
    } else {
        &cm.namespace
    };
    match cluster.config_map(namespace, &cm.name)? {
        Some(object) => Ok(config_map_value(&object)),
        None => Err(format!("ConfigMap {namespace}/{} not found", cm.name)),
    }
}

/// The ConfigMaps (`(namespace, name)`) a policy's `configMap` entries read, at any depth.
pub fn config_maps_named(spec: &MutationPolicySpec) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for m in &spec.mutations {
        collect(m, &mut out);
    }
    out
}

fn collect(m: &Mutation, out: &mut BTreeSet<(String, String)>) {
    let entries = m
        .context
        .iter()
        .chain(m.foreach.iter().flat_map(|f| f.context.iter()));
    for e in entries {
        if let Some(cm) = &e.config_map {
            let ns = if cm.namespace.is_empty() {
                DEFAULT_NAMESPACE
            } else {
                &cm.namespace
            };
            out.insert((ns.to_owned(), cm.name.clone()));
        }
    }
    for sub in &m.mutations {
        collect(sub, out);
    }
}

/// Every `configMap` entry of a spec, mutably (for [`super::confine`]).
pub(crate) fn config_map_entries_mut(
    spec: &mut MutationPolicySpec,
) -> Vec<&mut meshgate_api::mutation_policy::ContextConfigMap> {
    fn walk<'a>(
        m: &'a mut Mutation,
        out: &mut Vec<&'a mut meshgate_api::mutation_policy::ContextConfigMap>,
    ) {
        let Mutation {
            context,
            foreach,
            mutations,
            ..
        } = m;
        for e in context.iter_mut() {
            if let Some(cm) = e.config_map.as_mut() {
                out.push(cm);
            }
        }
        if let Some(f) = foreach.as_mut() {
            for e in f.context.iter_mut() {
                if let Some(cm) = e.config_map.as_mut() {
                    out.push(cm);
                }
            }
        }
        for sub in mutations.iter_mut() {
            walk(sub, out);
        }
    }
    let mut out = Vec::new();
    for m in spec.mutations.iter_mut() {
        walk(m, &mut out);
    }
    out
}
