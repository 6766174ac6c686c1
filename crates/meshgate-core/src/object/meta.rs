//! An object's labels and annotations, as every rule that selects objects reads them.

use std::collections::BTreeMap;

use serde_json::Value;

/// Labels and annotations of an object or namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

impl Meta {
    /// Reads `metadata.labels` and `metadata.annotations` of a JSON object; anything that is not
    /// a string map counts as empty.
    pub fn of(object: &Value) -> Self {
        let map = |field: &str| -> BTreeMap<String, String> {
            object
                .pointer(&format!("/metadata/{field}"))
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                        .collect()
                })
                .unwrap_or_default()
        };
        Self {
            labels: map("labels"),
            annotations: map("annotations"),
        }
    }
}
