//! RFC 6902 JSON patches as the admission response carries them.

use serde::Serialize;
use serde_json::Value;

/// An ordered list of RFC 6902 operations.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct JsonPatch(pub Vec<Value>);

impl JsonPatch {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn add(&mut self, path: impl Into<String>, value: Value) {
        self.push([
            ("op", Value::from("add")),
            ("path", Value::String(path.into())),
            ("value", value),
        ]);
    }

    pub fn remove(&mut self, path: impl Into<String>) {
        self.push([
            ("op", Value::from("remove")),
            ("path", Value::String(path.into())),
        ]);
    }

    /// One operation, its fields moved in: `json!` would copy the value (through `to_value`),
    /// and a value is often a whole container.
    fn push<const N: usize>(&mut self, fields: [(&str, Value); N]) {
        self.0.push(Value::Object(
            fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
        ));
    }

    /// Appends the operations of another patch.
    pub fn extend(&mut self, other: JsonPatch) {
        self.0.extend(other.0);
    }

    /// The patch from `from` to `to` (for engines that mutate a copy).
    pub fn diff(from: &Value, to: &Value) -> Self {
        match serde_json::to_value(json_patch::diff(from, to)) {
            Ok(Value::Array(ops)) => JsonPatch(ops),
            _ => JsonPatch::default(),
        }
    }

    /// Applies the patch to a copy of `doc` (tests, `render`, dry runs).
    pub fn apply(&self, doc: &Value) -> Result<Value, PatchError> {
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(self.0.clone()))
            .map_err(|e| PatchError(e.to_string()))?;
        let mut out = doc.clone();
        json_patch::patch(&mut out, &patch).map_err(|e| PatchError(e.to_string()))?;
        Ok(out)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.0).unwrap_or_else(|_| b"[]".to_vec())
    }
}

/// A patch that does not apply.
#[derive(Debug, thiserror::Error)]
#[error("JSON patch does not apply: {0}")]
pub struct PatchError(pub String);

/// Escapes one JSON pointer segment (RFC 6901): `~` → `~0`, `/` → `~1`.
pub fn escape(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn escapes_pointer_segments() {
        assert_eq!(
            escape("meshgate.dev/mesh-ready"),
            "meshgate.dev~1mesh-ready"
        );
        assert_eq!(escape("a~b"), "a~0b");
    }

    #[test]
    fn diff_and_apply_round_trip() {
        let a = json!({"metadata": {"labels": {"a": "1"}}});
        let b = json!({"metadata": {"labels": {"a": "1", "b/c": "2"}}});
        let p = JsonPatch::diff(&a, &b);
        assert_eq!(p.apply(&a).unwrap(), b);
    }
}
