//! Strategic merge with Kyverno's anchors.
//!
//! Two phases, like Kyverno: the patch is first *resolved* against the unchanged target (the
//! anchors of maps are evaluated on the object as it was before this mutation; the elements of a
//! list apply in order, each seeing the earlier ones applied), which yields a plain patch or
//! "skip"; the plain patch is then merged. See the module documentation of [`crate::policy`] for
//! the semantics.

use serde_json::{Map, Value};

use super::pattern::value_matches;

/// A key of a strategic-merge patch, with its anchor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key<'a> {
    /// `key`: set / merge.
    Plain(&'a str),
    /// `(key)`: condition on the resource.
    Condition(&'a str),
    /// `<(key)`: condition that skips the whole mutation when it fails.
    Global(&'a str),
    /// `+(key)`: set only when the resource has no such key.
    AddIfAbsent(&'a str),
}

impl<'a> Key<'a> {
    /// The field name without the anchor.
    pub fn name(&self) -> &'a str {
        match self {
            Key::Plain(k) | Key::Condition(k) | Key::Global(k) | Key::AddIfAbsent(k) => k,
        }
    }

    /// Conditional or global anchor.
    pub fn is_condition(&self) -> bool {
        matches!(self, Key::Condition(_) | Key::Global(_))
    }
}

/// Parses a patch key. Keys never legitimately contain parentheses in Pod objects (field names,
/// label and annotation keys cannot), so any other use of them is a malformed anchor.
pub fn parse_key(key: &str) -> Result<Key<'_>, String> {
    let anchored = |prefix: &str| -> Option<Result<&str, String>> {
        let rest = key.strip_prefix(prefix)?;
        Some(match rest.strip_suffix(')') {
            Some("") => Err("empty anchor".to_owned()),
            Some(inner) if inner.contains(['(', ')']) => {
                Err("malformed anchor (nested or unbalanced parentheses)".to_owned())
            }
            Some(inner) => Ok(inner),
            None => Err("malformed anchor (unbalanced parentheses)".to_owned()),
        })
    };
    if let Some(r) = anchored("+(") {
        return r.map(Key::AddIfAbsent);
    }
    if let Some(r) = anchored("<(") {
        return r.map(Key::Global);
    }
    if let Some(r) = anchored("(") {
        return r.map(Key::Condition);
    }
    if key.contains(['(', ')']) {
        for (prefix, what) in [
            ("=(", "equality anchor `=()`"),
            ("^(", "existence anchor `^()`"),
            ("X(", "negation anchor `X()`"),
        ] {
            if key.starts_with(prefix) && key.ends_with(')') {
                return Err(format!(
                    "{what} is a Kyverno validate anchor; strategicMerge supports `(key)`, `+(key)` and `<(key)`"
                ));
            }
        }
        return Err("malformed anchor (unbalanced parentheses)".to_owned());
    }
    Ok(Key::Plain(key))
}

/// The merge key of a list field (the Kubernetes `patchMergeKey`), when the field is one of the
/// associative lists of the Pod schema, or a Service's `spec.ports` (`path`, relative to the
/// patch, is `.spec.ports`; a Pod has no `spec.ports`, its containers' ports are deeper), which
/// Kubernetes merges by `port`.
pub fn known_merge_key(field: &str, path: &str) -> Option<&'static str> {
    if field == "ports" && path == ".spec.ports" {
        return Some("port");
    }
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "resourceClaims"
        | "schedulingGates" => "name",
        "ports" => "containerPort",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "hostAliases" => "ip",
        "readinessGates" => "conditionType",
        "topologySpreadConstraints" => "topologyKey",
        _ => return None,
    })
}

/// Why resolving stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// A conditional anchor did not hold.
    Condition,
    /// A global anchor did not hold: skip the whole mutation.
    Global,
    /// The patch is malformed; `path` is relative to the patch root (`.spec.containers[0]`).
    Invalid { path: String, message: String },
}

/// A patch with its anchors resolved against one resource.
#[derive(Debug, Clone, PartialEq)]
enum Resolved {
    /// Replace with this value (`null`: delete the key).
    Value(Value),
    /// Merge into a map. `literal_empty`: the patch was `{}`, which creates an empty map.
    Map {
        entries: Vec<(String, Resolved)>,
        literal_empty: bool,
    },
    /// Leave as it is.
    Keep,
}

/// Applies a strategic-merge patch to `target`. Returns `Ok(false)` when an anchor condition
/// skipped the mutation (target untouched).
pub fn apply(target: &mut Value, patch: &Value) -> Result<bool, Stop> {
    let mut path = String::new();
    let resolved = match resolve(patch, Some(target), None, &mut path) {
        Ok(r) => r,
        Err(Stop::Condition | Stop::Global) => return Ok(false),
        Err(e) => return Err(e),
    };
    merge(target, &resolved);
    Ok(true)
}

fn resolve(
    pattern: &Value,
    resource: Option<&Value>,
    field: Option<&str>,
    path: &mut String,
) -> Result<Resolved, Stop> {
    match pattern {
        Value::Object(map) => resolve_map(map, resource, path),
        Value::Array(list) => resolve_list(list, resource, field, path),
        other => Ok(Resolved::Value(other.clone())),
    }
}

fn invalid(path: &str, message: impl Into<String>) -> Stop {
    Stop::Invalid {
        path: path.to_owned(),
        message: message.into(),
    }
}

fn push_key(path: &mut String, key: &str) -> usize {
    let len = path.len();
    *path = join_key(path, key);
    len
}

/// `path.key`, or `path["key"]` when the key is not a plain identifier (or a well-formed anchor
/// around one).
pub fn join_key(path: &str, key: &str) -> String {
    let plain = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    if parse_key(key).is_ok_and(|k| plain(k.name())) {
        format!("{path}.{key}")
    } else {
        format!("{path}[{key:?}]")
    }
}

fn condition_holds(resource: Option<&Map<String, Value>>, name: &str, pattern: &Value) -> bool {
    resource
        .and_then(|r| r.get(name))
        .is_some_and(|value| value_matches(pattern, value))
}

fn resolve_map(
    pattern: &Map<String, Value>,
    resource: Option<&Value>,
    path: &mut String,
) -> Result<Resolved, Stop> {
    let keys = pattern
        .iter()
        .map(|(k, v)| {
            parse_key(k)
                .map(|key| (key, v))
                .map_err(|m| invalid(&format!("{path}[{k:?}]"), m))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let rmap = resource.and_then(Value::as_object);
    // Global anchors first, then conditions, before anything below (Kyverno's order).
    for (key, value) in &keys {
        if let Key::Global(name) = key
            && !condition_holds(rmap, name, value)
        {
            return Err(Stop::Global);
        }
    }
    for (key, value) in &keys {
        if let Key::Condition(name) = key
            && !condition_holds(rmap, name, value)
        {
            return Err(Stop::Condition);
        }
    }
    let mut entries = Vec::new();
    for (key, value) in keys {
        let (name, current) = match key {
            Key::Plain(name) => (name, rmap.and_then(|m| m.get(name))),
            Key::AddIfAbsent(name) if rmap.is_some_and(|m| m.contains_key(name)) => continue,
            Key::AddIfAbsent(name) => (name, None),
            Key::Condition(_) | Key::Global(_) => continue,
        };
        let len = push_key(path, name);
        let resolved = resolve(value, current, Some(name), path);
        path.truncate(len);
        entries.push((name.to_owned(), resolved?));
    }
    Ok(Resolved::Map {
        entries,
        literal_empty: pattern.is_empty(),
    })
}

/// Whether a conditional or global anchor occurs in this element's maps (nested lists excluded:
/// they select their own elements).
pub fn has_condition(value: &Value) -> bool {
    value.as_object().is_some_and(|m| {
        m.iter().any(|(k, v)| {
            parse_key(k).is_ok_and(|key| key.is_condition()) || (v.is_object() && has_condition(v))
        })
    })
}

/// Whether a global anchor occurs anywhere below (maps and lists, like Kyverno).
pub fn has_global(value: &Value) -> bool {
    match value {
        Value::Object(m) => m
            .iter()
            .any(|(k, v)| matches!(parse_key(k), Ok(Key::Global(_))) || has_global(v)),
        Value::Array(l) => l.iter().any(has_global),
        _ => false,
    }
}

fn resolve_list(
    pattern: &[Value],
    resource: Option<&Value>,
    field: Option<&str>,
    path: &mut String,
) -> Result<Resolved, Stop> {
    let known_key = field.and_then(|f| known_merge_key(f, path));
    if pattern.is_empty() {
        // `[]` empties a list; for an associative list it adds nothing.
        return Ok(match known_key {
            Some(_) => Resolved::Keep,
            None => Resolved::Value(Value::Array(Vec::new())),
        });
    }
    if !pattern.iter().all(Value::is_object) {
        if pattern.iter().any(|e| has_condition(e) || has_global(e)) {
            return Err(invalid(
                path,
                "a list mixing objects and other values cannot use anchors",
            ));
        }
        // Lists of scalars (or mixed lists) replace.
        return Ok(Resolved::Value(Value::Array(pattern.to_vec())));
    }
    let key_name = known_key.unwrap_or("name");
    let is_plain = |e: &&Value| !has_condition(e) && !has_global(e);
    // A list outside the Pod schema merges by `name` only when every plain element has one;
    // otherwise the plain elements replace it (a strategic merge of a list without merge key).
    if known_key.is_none()
        && !pattern
            .iter()
            .filter(is_plain)
            .all(|e| e.get("name").is_some())
    {
        let mut items = Vec::new();
        for (i, element) in pattern.iter().enumerate().filter(|(_, e)| is_plain(e)) {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            let resolved = element
                .as_object()
                .map(|map| resolve_map(map, None, path))
                .transpose();
            path.truncate(len);
            items.extend(resolved?.as_ref().and_then(materialize));
        }
        return Ok(Resolved::Value(Value::Array(items)));
    }
    if let Some((i, j, value)) = duplicate_key(pattern, key_name) {
        return Err(invalid(
            &format!("{path}[{j}]"),
            format!("duplicate merge key {key_name}={value} (also in element [{i}])"),
        ));
    }
    // Elements apply in order: each one's anchors see the earlier ones applied.
    let existing = resource.and_then(Value::as_array);
    let mut work: Vec<Value> = existing.cloned().unwrap_or_default();
    // Indices (in `work`) of the elements the patch names by merge key, in patch order: they
    // come first in the result, the others after them in their order (Kyverno's strategic merge
    // prepends, so a container added to `containers` becomes the first one). Elements a
    // template selects stay where they are (see the module's deviations).
    let mut touched: Vec<usize> = Vec::new();
    for (i, element) in pattern.iter().enumerate() {
        let len = path.len();
        path.push_str(&format!("[{i}]"));
        let result = resolve_element(element, &work, key_name, path);
        path.truncate(len);
        match result? {
            ElementPatch::Targeted(patches) => {
                for (index, patch) in patches {
                    if let Some(item) = work.get_mut(index) {
                        merge(item, &patch);
                    }
                }
            }
            ElementPatch::Plain(key_value, patch) => {
                match work
                    .iter()
                    .position(|w| w.get(key_name) == Some(&key_value))
                {
                    Some(index) => {
                        merge(&mut work[index], &patch);
                        touched.push(index);
                    }
                    None => {
                        if let Some(item) = materialize(&patch) {
                            touched.push(work.len());
                            work.push(item);
                        }
                    }
                }
            }
            ElementPatch::Nothing => {}
        }
    }
    if existing.is_none() && work.is_empty() {
        return Ok(Resolved::Keep);
    }
    let mut order: Vec<usize> = Vec::with_capacity(work.len());
    for i in touched.into_iter().chain(0..work.len()) {
        if !order.contains(&i) {
            order.push(i);
        }
    }
    let mut slots: Vec<Option<Value>> = work.into_iter().map(Some).collect();
    let ordered = order.into_iter().filter_map(|i| slots[i].take()).collect();
    Ok(Resolved::Value(Value::Array(ordered)))
}

/// Two plain elements (no conditions) of a patch list with the same merge-key value: their
/// first and second index and the value.
pub fn duplicate_key(pattern: &[Value], key: &str) -> Option<(usize, usize, Value)> {
    let plain: Vec<(usize, &Value)> = pattern
        .iter()
        .enumerate()
        .filter(|(_, e)| !has_condition(e) && !has_global(e))
        .filter_map(|(i, e)| e.get(key).map(|v| (i, v)))
        .collect();
    plain.iter().enumerate().find_map(|(n, (j, v))| {
        plain[..n]
            .iter()
            .find(|(_, w)| w == v)
            .map(|(i, _)| (*i, *j, (*v).clone()))
    })
}

enum ElementPatch {
    Targeted(Vec<(usize, Resolved)>),
    Plain(Value, Resolved),
    Nothing,
}

fn resolve_element(
    element: &Value,
    resources: &[Value],
    key: &str,
    path: &mut String,
) -> Result<ElementPatch, Stop> {
    let Value::Object(map) = element else {
        return Err(invalid(path, "expected an object"));
    };
    if has_global(element) {
        // A pure condition: it holds when some element satisfies it; it writes nothing.
        for resource in resources {
            match resolve_map(map, Some(resource), path) {
                Ok(_) => return Ok(ElementPatch::Nothing),
                Err(Stop::Condition | Stop::Global) => {}
                Err(e) => return Err(e),
            }
        }
        return Err(Stop::Global);
    }
    if has_condition(element) {
        // A template for every element that satisfies its conditions (and has the merge-key
        // value the template names, if it names one).
        let mut targeted = Vec::new();
        for (index, resource) in resources.iter().enumerate() {
            if let Some(wanted) = map.get(key)
                && resource.get(key) != Some(wanted)
            {
                continue;
            }
            match resolve_map(map, Some(resource), path) {
                Ok(patch) => targeted.push((index, patch)),
                Err(Stop::Condition) => {}
                Err(e) => return Err(e),
            }
        }
        return Ok(ElementPatch::Targeted(targeted));
    }
    let Some(wanted) = map.get(key) else {
        return Err(invalid(
            path,
            format!(
                "list element has neither the merge key `{key}` nor a conditional anchor such as `({key}): \"*\"`"
            ),
        ));
    };
    let current = resources.iter().find(|r| r.get(key) == Some(wanted));
    let patch = resolve_map(map, current, path)?;
    Ok(ElementPatch::Plain(wanted.clone(), patch))
}

/// The value a resolved patch creates where the target has nothing; `None`: nothing to create.
fn materialize(patch: &Resolved) -> Option<Value> {
    match patch {
        Resolved::Value(Value::Null) | Resolved::Keep => None,
        Resolved::Value(v) => Some(v.clone()),
        Resolved::Map {
            entries,
            literal_empty,
        } => {
            let map: Map<String, Value> = entries
                .iter()
                .filter_map(|(k, p)| materialize(p).map(|v| (k.clone(), v)))
                .collect();
            (!map.is_empty() || *literal_empty).then_some(Value::Object(map))
        }
    }
}

fn merge(target: &mut Value, patch: &Resolved) {
    match patch {
        Resolved::Keep => {}
        Resolved::Value(v) => *target = v.clone(),
        Resolved::Map { entries, .. } => {
            let Value::Object(map) = target else {
                if let Some(v) = materialize(patch) {
                    *target = v;
                }
                return;
            };
            for (key, sub) in entries {
                if matches!(sub, Resolved::Value(Value::Null)) {
                    map.remove(key);
                } else if let Some(existing) = map.get_mut(key) {
                    merge(existing, sub);
                } else if let Some(v) = materialize(sub) {
                    map.insert(key.clone(), v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn patched(target: Value, patch: Value) -> Value {
        let mut t = target;
        apply(&mut t, &patch).unwrap();
        t
    }

    #[test]
    fn keys_parse() {
        assert_eq!(parse_key("a"), Ok(Key::Plain("a")));
        assert_eq!(parse_key("(a)"), Ok(Key::Condition("a")));
        assert_eq!(parse_key("<(a)"), Ok(Key::Global("a")));
        assert_eq!(parse_key("+(a.b/c)"), Ok(Key::AddIfAbsent("a.b/c")));
        assert!(parse_key("(a").is_err());
        assert!(parse_key("a)").is_err());
        assert!(parse_key("+()").is_err());
        assert!(parse_key("((a))").is_err());
        assert!(parse_key("=(a)").unwrap_err().contains("validate anchor"));
    }

    #[test]
    fn maps_merge_and_null_deletes() {
        let t = json!({"metadata": {"labels": {"a": "1", "b": "2"}}, "spec": {"x": 1}});
        let out = patched(t, json!({"metadata": {"labels": {"b": null, "c": "3"}}}));
        assert_eq!(
            out,
            json!({"metadata": {"labels": {"a": "1", "c": "3"}}, "spec": {"x": 1}})
        );
    }

    #[test]
    fn deleting_below_a_missing_map_creates_nothing() {
        let t = json!({"metadata": {"name": "p"}});
        assert_eq!(
            patched(t.clone(), json!({"metadata": {"annotations": {"x": null}}})),
            t
        );
        // A literal {} is created.
        assert_eq!(
            patched(json!({}), json!({"spec": {"emptyDir": {}}})),
            json!({"spec": {"emptyDir": {}}})
        );
    }

    #[test]
    fn anchors_inside_appended_elements_resolve_against_nothing() {
        let t = json!({"spec": {"containers": [{"name": "a"}]}});
        let out = patched(
            t,
            json!({"spec": {"containers": [{"name": "b", "+(image)": "x"}]}}),
        );
        // Added elements come first, as in Kyverno.
        assert_eq!(
            out,
            json!({"spec": {"containers": [{"name": "b", "image": "x"}, {"name": "a"}]}})
        );
    }

    #[test]
    fn generic_lists_without_names_replace() {
        let t = json!({"spec": {"tolerations": [{"key": "a", "operator": "Exists"}]}});
        let out = patched(
            t,
            json!({"spec": {"tolerations": [{"key": "b", "operator": "Exists"}]}}),
        );
        assert_eq!(
            out,
            json!({"spec": {"tolerations": [{"key": "b", "operator": "Exists"}]}})
        );
        // ...and merge by name when every element has one.
        let t = json!({"x": [{"name": "c"}, {"name": "a", "v": 1}]});
        let out = patched(t, json!({"x": [{"name": "a", "w": 2}, {"name": "b"}]}));
        assert_eq!(
            out,
            json!({"x": [{"name": "a", "v": 1, "w": 2}, {"name": "b"}, {"name": "c"}]})
        );
    }

    #[test]
    fn known_list_element_without_key_is_invalid() {
        let mut t = json!({"spec": {"containers": [{"name": "a"}]}});
        let err = apply(&mut t, &json!({"spec": {"containers": [{"image": "x"}]}})).unwrap_err();
        assert_eq!(
            err,
            Stop::Invalid {
                path: ".spec.containers[0]".into(),
                message: "list element has neither the merge key `name` nor a conditional anchor such as `(name): \"*\"`".into()
            }
        );
    }

    #[test]
    fn ports_merge_by_container_port() {
        let t = json!({"ports": [{"containerPort": 80, "name": "http"}]});
        let out = patched(
            t,
            json!({"ports": [{"containerPort": 80, "protocol": "TCP"}, {"containerPort": 443}]}),
        );
        assert_eq!(
            out,
            json!({"ports": [{"containerPort": 80, "name": "http", "protocol": "TCP"}, {"containerPort": 443}]})
        );
    }

    #[test]
    fn template_naming_the_merge_key_selects_that_element_only() {
        let t = json!({"containers": [{"name": "a", "image": "x:latest"}, {"name": "b", "image": "y:latest"}]});
        let out = patched(
            t,
            json!({"containers": [{"name": "b", "(image)": "*:latest", "imagePullPolicy": "Always"}]}),
        );
        // A template's selection stays in place.
        assert_eq!(
            out,
            json!({"containers": [{"name": "a", "image": "x:latest"}, {"name": "b", "image": "y:latest", "imagePullPolicy": "Always"}]})
        );
    }
}
