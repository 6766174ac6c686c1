//! The GETs of `apiCall` context entries (`meshgate_core::policy::context`), as the component's
//! ServiceAccount: the webhook's at admission, the controller's in a backfill pass.
//!
//! The policy engine is synchronous and pure; it asks [`ApiReads`] for a path, and the GET runs
//! on the component's runtime while the engine's thread waits (`block_in_place`, so the other
//! reviews go on). Each GET has a timeout ([`API_CALL_TIMEOUT`]); a path is read once per
//! [`ApiReads`] (one review, or one object of a backfill pass). What the GET may read is what
//! RBAC grants the ServiceAccount (`meshgate install --context-api-read`); a refusal says so.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use meshgate_core::policy::context::ClusterData;
use serde_json::Value;

/// How long one GET may take. The webhook's own deadline is the registration's
/// `timeoutSeconds`; a policy whose call times out fails (or takes its `default`), and the
/// object is admitted without it.
pub const API_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The `apiCall` reads of one review (or one object), beside where ConfigMaps are read.
pub struct ApiReads<'a> {
    client: &'a kube::Client,
    config_maps: &'a dyn ClusterData,
    timeout: Duration,
    cache: Mutex<HashMap<String, Result<Value, String>>>,
}

impl<'a> ApiReads<'a> {
    pub fn new(client: &'a kube::Client, config_maps: &'a dyn ClusterData) -> Self {
        Self {
            client,
            config_maps,
            timeout: API_CALL_TIMEOUT,
            cache: Mutex::default(),
        }
    }

    async fn fetch(&self, path: &str) -> Result<Value, String> {
        let request = http::Request::get(path)
            .body(Vec::new())
            .map_err(|e| format!("GET {path}: {e}"))?;
        let text = match tokio::time::timeout(self.timeout, self.client.request_text(request)).await
        {
            Err(_) => return Err(format!("GET {path}: timed out after {:?}", self.timeout)),
            Ok(Err(kube::Error::Api(status))) if status.is_not_found() => {
                return Err(format!("GET {path}: not found"));
            }
            Ok(Err(kube::Error::Api(status))) if status.is_forbidden() => {
                return Err(format!(
                    "GET {path}: forbidden: {} (grant it with meshgate install --context-api-read)",
                    status.message
                ));
            }
            Ok(Err(e)) => return Err(format!("GET {path}: {e}")),
            Ok(Ok(text)) => text,
        };
        serde_json::from_str(&text).map_err(|e| format!("GET {path}: not JSON: {e}"))
    }
}

impl std::fmt::Debug for ApiReads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiReads")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ClusterData for ApiReads<'_> {
    fn config_map(&self, namespace: &str, name: &str) -> Result<Option<Value>, String> {
        self.config_maps.config_map(namespace, name)
    }

    fn get(&self, path: &str) -> Result<Value, String> {
        if let Some(done) = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(path)
        {
            return done.clone();
        }
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| format!("GET {path}: not read (no runtime)"))?;
        if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return Err(format!(
                "GET {path}: not read (the runtime is single-threaded)"
            ));
        }
        let result = tokio::task::block_in_place(|| handle.block_on(self.fetch(path)));
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(path.to_owned(), result.clone());
        result
    }
}
