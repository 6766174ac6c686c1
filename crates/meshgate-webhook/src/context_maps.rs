//! The ConfigMaps that policies' `configMap` context entries name, each kept from its own watch,
//! so that a review reads them from memory.
//!
//! The webhook reads exactly these ConfigMaps, and no other: each is watched alone (a field
//! selector on its name, which RBAC authorizes against a `resourceNames` grant), so the webhook's
//! ServiceAccount needs `get`, `list` and `watch` on those names only (`meshgate install
//! --context-config-map NAMESPACE/NAME` renders the Role and RoleBinding). When the policies
//! change, the set of watches follows: a ConfigMap no policy names any more is dropped.
//!
//! A ConfigMap is served once its first list completed: present or absent (it does not exist).
//! Before that, or while the API server refuses the watch, a review that needs it fails the
//! policy that names it (the object is admitted without that policy, with a warning saying why,
//! as for every policy error), and the refusal is logged as a warning that says what to grant.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_core::policy::context::ClusterData;
use meshgate_kube::watch;
use serde_json::Value;
use tokio::task::AbortHandle;

type Key = (String, String);

/// What is known of one ConfigMap.
#[derive(Clone, Debug)]
enum State {
    /// Its first list has not completed.
    Pending,
    /// The API server refuses to list it: why.
    Refused(String),
    /// It does not exist.
    Absent,
    Present(Arc<Value>),
}

/// The ConfigMaps policies name, by namespace and name.
#[derive(Debug)]
pub(crate) struct ContextMaps {
    states: RwLock<HashMap<Key, State>>,
    watches: std::sync::Mutex<HashMap<Key, AbortHandle>>,
    /// Bumped on every state change (for [`ContextMaps::wait_until_synced`]).
    changed: tokio::sync::watch::Sender<u64>,
}

impl ContextMaps {
    pub(crate) fn new() -> Self {
        Self {
            states: RwLock::new(HashMap::new()),
            watches: std::sync::Mutex::new(HashMap::new()),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Fixed data: these ConfigMaps exist, no other does.
    pub(crate) fn fixed(maps: Vec<Value>) -> Self {
        let out = Self::new();
        {
            let mut states = out.states.write().unwrap_or_else(PoisonError::into_inner);
            for cm in maps {
                let ns = cm.pointer("/metadata/namespace").and_then(Value::as_str);
                let name = cm.pointer("/metadata/name").and_then(Value::as_str);
                if let (Some(ns), Some(name)) = (ns, name) {
                    states.insert(
                        (ns.to_owned(), name.to_owned()),
                        State::Present(Arc::new(cm)),
                    );
                }
            }
        }
        out
    }

    fn set(&self, key: &Key, state: State) {
        self.states
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), state);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Watches exactly the ConfigMaps in `wanted`: starts the missing watches, stops the others.
    pub(crate) fn follow(self: &Arc<Self>, client: &kube::Client, wanted: BTreeSet<Key>) {
        let mut watches = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
        watches.retain(|key, handle| {
            let keep = wanted.contains(key);
            if !keep {
                handle.abort();
                self.states
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(key);
                tracing::info!(namespace = %key.0, name = %key.1, "ConfigMap no longer named by a policy; not watched");
            }
            keep
        });
        for key in wanted {
            if watches.contains_key(&key) {
                continue;
            }
            self.set(&key, State::Pending);
            let task = tokio::spawn(self.clone().watch(client.clone(), key.clone()));
            watches.insert(key, task.abort_handle());
        }
        self.changed.send_modify(|n| *n += 1);
    }

    /// Keeps one ConfigMap's state from its watch.
    async fn watch(self: Arc<Self>, client: kube::Client, key: Key) {
        let (namespace, name) = &key;
        let what = format!(
            "ConfigMap {namespace}/{name} (named by a policy's context entry; `meshgate install --context-config-map {namespace}/{name}` grants it)"
        );
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        // A re-list is collected aside: the map keeps serving the last state until it completes.
        let mut listed: Option<Option<Arc<Value>>> = None;
        watcher(Api::<ConfigMap>::namespaced(client, namespace), config)
            .default_backoff()
            .for_each(|event| {
                match event {
                    Ok(watcher::Event::Init) => listed = Some(None),
                    Ok(watcher::Event::InitApply(cm)) => listed = Some(as_value(&cm)),
                    Ok(watcher::Event::InitDone) => {
                        let state = match listed.take().flatten() {
                            Some(v) => State::Present(v),
                            None => State::Absent,
                        };
                        self.set(&key, state);
                    }
                    Ok(watcher::Event::Apply(cm)) => {
                        if let Some(v) = as_value(&cm) {
                            self.set(&key, State::Present(v));
                        }
                    }
                    Ok(watcher::Event::Delete(_)) => self.set(&key, State::Absent),
                    Err(e) => {
                        watch::log(&what, &e);
                        if let watch::WatchTrouble::Act(why) = watch::classify(&what, &e)
                            && self.is_pending(&key)
                        {
                            self.set(&key, State::Refused(why));
                        }
                    }
                }
                async {}
            })
            .await;
    }

    fn is_pending(&self, key: &Key) -> bool {
        matches!(
            self.states
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .get(key),
            Some(State::Pending | State::Refused(_))
        )
    }

    /// Waits until every watched ConfigMap has had its first list (or was refused).
    pub(crate) async fn wait_until_synced(&self) {
        let mut rx = self.changed.subscribe();
        let _ = rx
            .wait_for(|_| {
                !self
                    .states
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .values()
                    .any(|s| matches!(s, State::Pending))
            })
            .await;
    }

    /// How many ConfigMaps are watched.
    pub(crate) fn len(&self) -> usize {
        self.states
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

fn as_value(cm: &ConfigMap) -> Option<Arc<Value>> {
    let mut v = serde_json::to_value(cm).ok()?;
    v["apiVersion"] = "v1".into();
    v["kind"] = "ConfigMap".into();
    Some(Arc::new(v))
}

impl ClusterData for ContextMaps {
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String> {
        let states = self.states.read().unwrap_or_else(PoisonError::into_inner);
        match states.get(&(namespace.to_owned(), name.to_owned())) {
            Some(State::Present(v)) => Ok(Some(Value::clone(v))),
            Some(State::Absent) => Ok(None),
            Some(State::Pending) => Err(format!(
                "ConfigMap {namespace}/{name}: not read yet (the webhook's watch of it is starting)"
            )),
            Some(State::Refused(why)) => Err(format!("ConfigMap {namespace}/{name}: {why}")),
            None => Err(format!(
                "ConfigMap {namespace}/{name}: not watched (no policy the webhook holds names it)"
            )),
        }
    }

    /// Paths are read by `meshgate_kube::api_reader`, not from this cache.
    fn get(&self, path: &str) -> Result<Value, String> {
        Err(format!("GET {path}: not read (no API client)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_maps_are_served_and_others_are_not_watched() {
        let maps = ContextMaps::fixed(vec![serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "n"}, "data": {"k": "v"},
        })]);
        let cm = maps.config_map("n", "c").expect("served").expect("present");
        assert_eq!(cm["data"]["k"], "v");
        let err = maps.config_map("n", "other").expect_err("unknown");
        assert!(err.contains("not watched"), "{err}");
    }

    #[test]
    fn a_refused_or_pending_map_fails_saying_why() {
        let maps = ContextMaps::new();
        let key = ("n".to_owned(), "c".to_owned());
        maps.set(&key, State::Pending);
        assert!(
            maps.config_map("n", "c")
                .expect_err("pending")
                .contains("not read yet")
        );
        maps.set(&key, State::Refused("grant it".into()));
        assert!(
            maps.config_map("n", "c")
                .expect_err("refused")
                .contains("grant it")
        );
        maps.set(&key, State::Absent);
        assert_eq!(maps.config_map("n", "c"), Ok(None));
    }
}
