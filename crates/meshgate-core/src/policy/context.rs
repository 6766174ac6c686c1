//! What a policy reads from the cluster at admission: the ConfigMaps its `configMap` context
//! entries name, and the paths its `apiCall` entries GET.
//!
//! The engine stays pure: it asks a [`ClusterData`] for a ConfigMap or a path, and the caller
//! answers from what it holds. The webhook answers ConfigMaps from a watch cache of exactly the
//! ConfigMaps the policies name (`meshgate-webhook`'s `sources`) and paths with a GET as its
//! ServiceAccount (`meshgate_kube::api_reader`); `render` answers both from the objects
//! given with its input ([`GivenObjects`]), and callers without a cluster with [`NoCluster`].
//!
//! Kyverno's loader (`pkg/engine/context/loaders/configmap.go`) makes a `configMap` entry's value
//! `{"data": <the ConfigMap's data>, "metadata": <its metadata>}` ([`config_map_value`]). The
//! namespace is required in a cluster-wide policy (`validate`, as Kyverno's policy validation);
//! a namespaced policy reads its own, and no other ([`super::confine`] sets it). A ConfigMap
//! that does not exist or cannot be read fails the entry, and so the expressions that name it
//! (Kyverno loads entries lazily).
//!
//! An `apiCall` entry is Kyverno's GET (`pkg/engine/apicall/apiCall.go`): the path with its
//! variables substituted; the response's JSON, or `jmesPath` over it (a missing key is an error,
//! which `default` does not catch); `default` as given when the GET fails (not found, forbidden,
//! timed out); without `default`, the failure fails the entry. meshgate accepts only paths of
//! the API (`/api/...`, `/apis/...`: [`api_path`]), and a namespaced policy only paths under its
//! own namespace (Kyverno's rule for namespaced policies).

use std::collections::{BTreeMap, BTreeSet};

use meshgate_api::mutation_policy::{ContextEntry, Mutation, MutationPolicySpec};
use serde_json::{Map, Value};

/// The namespace a `configMap` entry without one reads, in a cluster-wide policy (Kyverno's).
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where the engine reads the ConfigMaps of `configMap` context entries and the paths of
/// `apiCall` entries.
pub trait ClusterData: std::fmt::Debug + Sync {
    /// The ConfigMap `namespace/name` as JSON (`Ok(None)`: it does not exist), or why it cannot
    /// be known (not readable, not yet synced, not given).
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String>;

    /// The JSON the API server answers to a GET of `path` (an [`api_path`], with its query), or
    /// why there is none (not found, forbidden, timed out, not given).
    fn get(&self, path: &str) -> Result<Value, String>;
}

/// No cluster: every read fails, saying so.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCluster;

impl ClusterData for NoCluster {
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String> {
        Err(format!(
            "ConfigMap {namespace}/{name}: no cluster to read it from"
        ))
    }

    fn get(&self, path: &str) -> Result<Value, String> {
        Err(format!("GET {path}: no cluster to read it from"))
    }
}

/// Objects given whole: `render`'s input, or the ConfigMaps a caller read.
///
/// [`GivenObjects::default`] is `render`'s: a ConfigMap or an object not given is an error that
/// says to give it (`render` cannot know whether it exists), and a list is the given objects of
/// its resource. [`GivenObjects::read`] is a caller's that read the ConfigMaps a policy names:
/// one not given does not exist, one it could not read is recorded with
/// [`GivenObjects::unreadable`].
#[derive(Clone, Debug, Default)]
pub struct GivenObjects {
    objects: Vec<Value>,
    unreadable: BTreeMap<(String, String), String>,
    /// Whether every ConfigMap that exists is given.
    complete: bool,
}

impl GivenObjects {
    /// Objects read from the cluster: one not added does not exist.
    pub fn read() -> Self {
        Self {
            complete: true,
            ..Self::default()
        }
    }

    /// Adds an object; returns whether it has an `apiVersion`, a `kind` and a name.
    pub fn add(&mut self, object: &Value) -> bool {
        let s = |p: &str| object.pointer(p).and_then(Value::as_str).is_some();
        if !(s("/apiVersion") && s("/kind") && s("/metadata/name")) {
            return false;
        }
        self.objects.push(object.clone());
        true
    }

    /// Records that ConfigMap `namespace/name` could not be read, and why.
    pub fn unreadable(&mut self, namespace: &str, name: &str, why: String) {
        self.unreadable
            .insert((namespace.to_owned(), name.to_owned()), why);
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// The given objects of `apiVersion`'s resource `resource` (plural), in `namespace` when
    /// given (an object without one is in `default`).
    fn of<'a>(
        &'a self,
        api_version: &'a str,
        resource: &'a str,
        namespace: Option<&'a str>,
    ) -> impl Iterator<Item = &'a Value> + 'a {
        self.objects.iter().filter(move |o| {
            let s = |p: &str| o.pointer(p).and_then(Value::as_str);
            s("/apiVersion") == Some(api_version)
                && s("/kind").is_some_and(|k| plural(k) == resource)
                && namespace
                    .is_none_or(|ns| s("/metadata/namespace").unwrap_or(DEFAULT_NAMESPACE) == ns)
        })
    }
}

impl ClusterData for GivenObjects {
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String> {
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(cm) = self
            .of("v1", "configmaps", Some(namespace))
            .find(|o| o.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
        {
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

    fn get(&self, path: &str) -> Result<Value, String> {
        let p = api_path(path)?;
        if p.query.is_some() {
            return Err(format!(
                "GET {path}: a query is not applied to the given objects (give the path without it)"
            ));
        }
        let api_version = p.api_version();
        // A Namespace is named by the path's namespace segment.
        let (namespace, name) = match (&p.namespace, &p.name) {
            (Some(ns), None) if p.resource == "namespaces" => (None, Some(ns.as_str())),
            (ns, name) => (ns.as_deref(), name.as_deref()),
        };
        let scoped = |o: &&Value| namespace.is_some() || o.pointer("/metadata/namespace").is_none();
        match name {
            Some(name) => self
                .of(&api_version, &p.resource, namespace)
                .filter(scoped)
                .find(|o| o.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
                .cloned()
                .ok_or_else(|| {
                    if self.complete {
                        format!("GET {path}: not found")
                    } else {
                        format!(
                            "GET {path}: {}/{name} is not in the input (give it with the objects to render)",
                            p.resource
                        )
                    }
                }),
            None => {
                let mut items: Vec<Value> =
                    self.of(&api_version, &p.resource, namespace).cloned().collect();
                let key = |o: &Value| {
                    let s = |q: &str| o.pointer(q).and_then(Value::as_str).unwrap_or_default().to_owned();
                    (s("/metadata/namespace"), s("/metadata/name"))
                };
                items.sort_by_key(key);
                let kind = items
                    .first()
                    .and_then(|o| o.get("kind").and_then(Value::as_str))
                    .map_or("List".to_owned(), |k| format!("{k}List"));
                Ok(serde_json::json!({"apiVersion": api_version, "kind": kind,
                                      "metadata": {}, "items": items}))
            }
        }
    }
}

/// The resource of a kind, as Kubernetes guesses it when no discovery says otherwise
/// (`meta.UnsafeGuessKindToResource`): lower case, `s` → `ses`, `y` → `ies`, else `s`.
pub fn plural(kind: &str) -> String {
    let lower = kind.to_ascii_lowercase();
    if lower == "endpoints" {
        return lower;
    }
    if let Some(stem) = lower.strip_suffix('y') {
        return format!("{stem}ies");
    }
    if lower.ends_with('s') {
        return format!("{lower}es");
    }
    format!("{lower}s")
}

/// A path an `apiCall` entry may GET, taken apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiPath {
    /// `""` for the core group (`/api/v1`).
    pub group: String,
    pub version: String,
    pub namespace: Option<String>,
    /// The plural resource (`deployments`).
    pub resource: String,
    pub name: Option<String>,
    /// What follows `?`, as given.
    pub query: Option<String>,
}

impl ApiPath {
    /// `v1`, or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// Parses an `apiCall` path: `/api/v1/...` or `/apis/GROUP/VERSION/...`, then
/// `[namespaces/NS/]RESOURCE[/NAME]` (or `namespaces/NS` for a Namespace), and an optional
/// `?query`. Anything else (another host, `..`, a subresource) is refused.
pub fn api_path(path: &str) -> Result<ApiPath, String> {
    let (path_part, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q.to_owned())),
        None => (path, None),
    };
    let bad = |why: &str| Err(format!("{path:?}: {why}"));
    let Some(rest) = path_part.strip_prefix('/') else {
        return bad("must start with /api/ or /apis/");
    };
    let segments: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    if segments
        .iter()
        .any(|s| s.is_empty() || *s == "." || *s == ".." || s.contains(['\\', '#', '%']))
    {
        return bad("empty, relative or escaped path segments are not allowed");
    }
    let (group, version, rest) = match segments.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return bad("must start with /api/VERSION/ or /apis/GROUP/VERSION/"),
    };
    let (namespace, resource, name) = match rest {
        ["namespaces", ns] => (Some(*ns), "namespaces", None),
        ["namespaces", ns, resource] => (Some(*ns), *resource, None),
        ["namespaces", ns, resource, name] => (Some(*ns), *resource, Some(*name)),
        [resource] => (None, *resource, None),
        [resource, name] => (None, *resource, Some(*name)),
        [] => return bad("names no resource"),
        _ => return bad("subresources and longer paths are not read"),
    };
    Ok(ApiPath {
        group: group.to_owned(),
        version: version.to_owned(),
        namespace: namespace.map(str::to_owned),
        resource: resource.to_owned(),
        name: name.map(str::to_owned),
        query,
    })
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

/// Every context entry of a spec, at any depth, mutably (for [`super::confine`]).
pub(crate) fn entries_mut(spec: &mut MutationPolicySpec) -> Vec<&mut ContextEntry> {
    fn walk<'a>(m: &'a mut Mutation, out: &mut Vec<&'a mut ContextEntry>) {
        let Mutation {
            context,
            foreach,
            mutations,
            ..
        } = m;
        out.extend(context.iter_mut());
        if let Some(f) = foreach.as_mut() {
            out.extend(f.context.iter_mut());
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
