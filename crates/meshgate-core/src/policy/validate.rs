//! Structural validation of a `MutationPolicySpec`, with field paths in every message.

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{
    JsonPatchOp, JsonPatchOperation, MatchResources, MetadataMutation, Mutation,
    MutationPolicySpec, MutationTarget,
};
use serde_json::Value;

use super::matching::parse_kind;
use super::pattern::unsupported_operator;
use super::strategic::{
    Key, duplicate_key, has_condition, has_global, join_key, known_merge_key, parse_key,
};

/// Checks a spec: exactly one mutation kind per mutation, known kinds, valid selectors,
/// non-empty namespace patterns, valid label/annotation keys and label values, well-formed
/// strategic-merge anchors and JSON patch operations. Every message starts with the path of the
/// offending field, e.g. `spec.mutations[2].jsonPatch[0].path: must start with '/'`.
pub fn validate(spec: &MutationPolicySpec) -> Result<(), Vec<String>> {
    let mut errors = Vec::new();
    match_resources(&spec.match_, "spec.match", &mut errors);
    if let Some(exclude) = &spec.exclude {
        if exclude == &MatchResources::default() {
            errors.push("spec.exclude: sets no field, so it would exclude everything".to_owned());
        }
        match_resources(exclude, "spec.exclude", &mut errors);
    }
    if spec.target == MutationTarget::Object && spec.pod_templates {
        errors.push(
            "spec.podTemplates: applies a Pod policy to pod templates, and spec.target: Object mutates every object itself; set one of them"
                .to_owned(),
        );
    }
    if spec.mutations.is_empty() {
        errors.push("spec.mutations: at least one mutation is required".to_owned());
    }
    for (i, m) in spec.mutations.iter().enumerate() {
        mutation(m, &format!("spec.mutations[{i}]"), 0, &mut errors);
        variables(m, &format!("spec.mutations[{i}]"), &[], 0, &mut errors);
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn match_resources(m: &MatchResources, path: &str, errors: &mut Vec<String>) {
    for (i, kind) in m.kinds.iter().enumerate() {
        if let Err(e) = parse_kind(kind) {
            errors.push(format!("{path}.kinds[{i}]: {e}"));
        }
    }
    for (i, ns) in m.namespaces.iter().enumerate() {
        if ns.is_empty() {
            errors.push(format!("{path}.namespaces[{i}]: must not be empty"));
        } else if ns.len() > 63
            || !ns
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-*?".contains(c))
        {
            errors.push(format!(
                "{path}.namespaces[{i}]: {ns:?} is not a namespace name or pattern (lowercase letters, digits, '-', wildcards '*' and '?')"
            ));
        }
    }
    if let Some(s) = &m.namespace_selector
        && let Err(e) = s.validate()
    {
        errors.push(format!("{path}.namespaceSelector: {e}"));
    }
    if let Some(s) = &m.object_selector
        && let Err(e) = s.validate()
    {
        errors.push(format!("{path}.objectSelector: {e}"));
    }
    for (i, n) in m.names.iter().enumerate() {
        if n.is_empty() {
            errors.push(format!("{path}.names[{i}]: must not be empty"));
        }
    }
    if m.annotations.keys().any(String::is_empty) {
        errors.push(format!("{path}.annotations: a key must not be empty"));
    }
}

/// How deep `mutations` may nest (Kyverno's nested `foreach` rarely goes past two levels).
pub const MAX_NESTING: usize = 4;

fn mutation(m: &Mutation, path: &str, level: usize, errors: &mut Vec<String>) {
    let set: Vec<&str> = [
        ("annotations", m.annotations.is_some()),
        ("labels", m.labels.is_some()),
        ("strategicMerge", m.strategic_merge.is_some()),
        ("jsonPatch", m.json_patch.is_some()),
        ("mutations", !m.mutations.is_empty()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect();
    if set.len() != 1 {
        let found = if set.is_empty() {
            "none".to_owned()
        } else {
            set.join(", ")
        };
        errors.push(format!(
            "{path}: set exactly one of annotations, labels, strategicMerge, jsonPatch, mutations (found: {found})"
        ));
    }
    if !m.mutations.is_empty() && level >= MAX_NESTING {
        errors.push(format!(
            "{path}.mutations: nested more than {MAX_NESTING} levels deep"
        ));
    } else {
        for (i, sub) in m.mutations.iter().enumerate() {
            mutation(sub, &format!("{path}.mutations[{i}]"), level + 1, errors);
        }
    }
    if let Some(a) = &m.annotations {
        metadata(a, &format!("{path}.annotations"), false, errors);
    }
    if let Some(l) = &m.labels {
        metadata(l, &format!("{path}.labels"), true, errors);
    }
    if let Some(p) = &m.strategic_merge {
        let path = format!("{path}.strategicMerge");
        if p.is_object() {
            strategic(p, &path, None, false, errors);
        } else {
            errors.push(format!("{path}: must be an object"));
        }
    }
    if let Some(ops) = &m.json_patch {
        json_patch(ops, &format!("{path}.jsonPatch"), errors);
    }
    if m.json_patch_options.is_some() && m.json_patch.is_none() {
        errors.push(format!("{path}.jsonPatchOptions: only used with jsonPatch"));
    }
}

/// A `configMap` entry names one ConfigMap, literally: the webhook may read only the ConfigMaps
/// granted to it by name, so a name computed per request could not be read.
fn config_map_entry(
    cm: &meshgate_api::mutation_policy::ContextConfigMap,
    at: &str,
    errors: &mut Vec<String>,
) {
    for (field, value) in [("name", &cm.name), ("namespace", &cm.namespace)] {
        if value.contains("{{") {
            errors.push(format!(
                "{at}.configMap.{field}: {value:?}: must be literal (the webhook reads only the ConfigMaps granted to it by name)"
            ));
        } else if value.is_empty() {
            // Kyverno's policy validation requires the namespace too; a
            // NamespacedMutationPolicy's entries get its own (`confine`).
            errors.push(format!("{at}.configMap.{field}: required"));
        } else if !value.is_empty() && !is_dns1123_subdomain(value) {
            errors.push(format!(
                "{at}.configMap.{field}: {value:?} is not a valid name"
            ));
        }
    }
}

/// A Kubernetes object name (DNS-1123 subdomain): at most 253 lowercase alphanumerics, `-` and
/// `.`, starting and ending with an alphanumeric.
fn is_dns1123_subdomain(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    s.len() <= 253
        && s.starts_with(alnum)
        && s.ends_with(alnum)
        && s.chars().all(|c| alnum(c) || c == '-' || c == '.')
}

/// Every variable compiles and names a root meshgate provides or a context entry in scope
/// (`outer`: the enclosing mutations'); `element` only in a foreach, `element<N>` only inside
/// N + 1 of them (`depth`: the enclosing foreach loops).
fn variables(m: &Mutation, path: &str, outer: &[String], depth: usize, errors: &mut Vec<String>) {
    use super::variables::{Scope, check, variables_in};
    let check_value = |value: &Value, at: String, scope: Scope<'_>, errors: &mut Vec<String>| {
        for found in variables_in(value) {
            if let Err(msg) = check(&found, scope) {
                errors.push(format!("{at}: {msg}"));
            }
        }
    };
    // Context entries: each sees the earlier ones (and, in a foreach, the rule's).
    let entries = |list: &[meshgate_api::mutation_policy::ContextEntry],
                   at: &str,
                   outer: &[String],
                   depth: usize,
                   errors: &mut Vec<String>|
     -> Vec<String> {
        let mut names: Vec<String> = outer.to_vec();
        for (i, e) in list.iter().enumerate() {
            let here = format!("{at}[{i}]");
            if e.name.is_empty() {
                errors.push(format!("{here}.name: required"));
            } else if super::variables::ROOTS.contains(&e.name.as_str())
                || super::variables::element_level(&e.name).is_some()
            {
                errors.push(format!(
                    "{here}.name: {:?} is a built-in variable and cannot be redefined",
                    e.name
                ));
            }
            let scope = Scope {
                depth,
                context: &names,
            };
            let set = [
                e.variable.is_some(),
                e.config_map.is_some(),
                e.api_call.is_some(),
            ];
            if set.iter().filter(|s| **s).count() != 1 {
                errors.push(format!(
                    "{here}: set exactly one of variable, configMap and apiCall"
                ));
                continue;
            }
            if let Some(cm) = &e.config_map {
                config_map_entry(cm, &here, errors);
                names.push(e.name.clone());
                continue;
            }
            if let Some(call) = &e.api_call {
                let url = Value::String(call.url_path.clone());
                if call.url_path.is_empty() {
                    errors.push(format!("{here}.apiCall.urlPath: required"));
                } else if !call.url_path.contains("{{")
                    && let Err(why) = super::context::api_path(&call.url_path)
                {
                    errors.push(format!("{here}.apiCall.urlPath: {why}"));
                }
                check_value(&url, format!("{here}.apiCall.urlPath"), scope, errors);
                if let Some(p) = &call.jmes_path {
                    check_value(
                        &Value::String(p.clone()),
                        format!("{here}.apiCall.jmesPath"),
                        scope,
                        errors,
                    );
                    if !p.contains("{{")
                        && let Err(why) = super::variables::compiles(p)
                    {
                        errors.push(format!("{here}.apiCall.jmesPath: {why}"));
                    }
                }
                names.push(e.name.clone());
                continue;
            }
            let Some(v) = &e.variable else { continue };
            if v.value.is_none() && v.jmes_path.is_none() && v.default.is_none() {
                errors.push(format!("{here}.variable: set value, jmesPath or default"));
            }
            if let Some(value) = &v.value {
                check_value(value, format!("{here}.variable.value"), scope, errors);
            }
            if let Some(d) = &v.default {
                check_value(d, format!("{here}.variable.default"), scope, errors);
            }
            if let Some(p) = &v.jmes_path {
                check_value(
                    &Value::String(p.clone()),
                    format!("{here}.variable.jmesPath"),
                    scope,
                    errors,
                );
                // Without a value, jmesPath is an expression over the variables.
                if v.value.is_none() && !p.contains("{{") {
                    let found = super::variables::Found {
                        expression: p.clone(),
                        templated: false,
                    };
                    if let Err(msg) = check(&found, scope) {
                        errors.push(format!("{here}.variable.jmesPath: {msg}"));
                    }
                }
            }
            names.push(e.name.clone());
        }
        names
    };
    let rule_names = entries(&m.context, &format!("{path}.context"), outer, depth, errors);
    let inner = depth + usize::from(m.foreach.is_some());
    let foreach_names = match &m.foreach {
        Some(f) => entries(
            &f.context,
            &format!("{path}.foreach.context"),
            &rule_names,
            inner,
            errors,
        ),
        None => rule_names.clone(),
    };
    let scope = Scope {
        depth: inner,
        context: &foreach_names,
    };
    for (i, sub) in m.mutations.iter().enumerate() {
        variables(
            sub,
            &format!("{path}.mutations[{i}]"),
            &foreach_names,
            inner,
            errors,
        );
    }
    for (field, meta) in [("labels", &m.labels), ("annotations", &m.annotations)] {
        if let Some(meta) = meta {
            for (k, v) in &meta.values {
                check_value(
                    &Value::String(k.clone()),
                    format!("{path}.{field}.values"),
                    scope,
                    errors,
                );
                check_value(
                    &Value::String(v.clone()),
                    format!("{path}.{field}.values[{k:?}]"),
                    scope,
                    errors,
                );
            }
        }
    }
    if let Some(p) = &m.strategic_merge {
        check_value(p, format!("{path}.strategicMerge"), scope, errors);
    }
    for (i, op) in m.json_patch.iter().flatten().enumerate() {
        let at = format!("{path}.jsonPatch[{i}]");
        check_value(
            &Value::String(op.path.clone()),
            format!("{at}.path"),
            scope,
            errors,
        );
        if let Some(from) = &op.from {
            check_value(
                &Value::String(from.clone()),
                format!("{at}.from"),
                scope,
                errors,
            );
        }
        if let Some(v) = &op.value {
            check_value(v, format!("{at}.value"), scope, errors);
        }
    }
    let conditions = |c: &meshgate_api::mutation_policy::Conditions,
                      at: &str,
                      scope: Scope<'_>,
                      errors: &mut Vec<String>| {
        for (group, list) in [("any", &c.any), ("all", &c.all)] {
            for (i, cond) in list.iter().enumerate() {
                check_value(&cond.key, format!("{at}.{group}[{i}].key"), scope, errors);
                if let Some(v) = &cond.value {
                    check_value(v, format!("{at}.{group}[{i}].value"), scope, errors);
                }
            }
        }
    };
    let rule_scope = Scope {
        depth,
        context: &rule_names,
    };
    if let Some(c) = &m.preconditions {
        conditions(c, &format!("{path}.preconditions"), rule_scope, errors);
    }
    if let Some(f) = &m.foreach {
        if let Some(c) = &f.preconditions {
            conditions(c, &format!("{path}.foreach.preconditions"), scope, errors);
        }
        let found = super::variables::Found {
            expression: f.list.clone(),
            templated: false,
        };
        if let Err(msg) = check(&found, rule_scope) {
            errors.push(format!("{path}.foreach.list: {msg}"));
        }
    }
}

fn metadata(m: &MetadataMutation, path: &str, labels: bool, errors: &mut Vec<String>) {
    if m.values.is_empty() {
        errors.push(format!("{path}.values: must set at least one key"));
    }
    check_values(&m.values, path, labels, errors);
}

fn check_values(
    values: &BTreeMap<String, String>,
    path: &str,
    labels: bool,
    errors: &mut Vec<String>,
) {
    for (k, v) in values {
        if k.contains("{{") || v.contains("{{") {
            // Checked once substituted, by the API server.
            continue;
        }
        if let Err(e) = qualified_name(k) {
            errors.push(format!("{path}.values[{k:?}]: invalid key: {e}"));
        }
        if labels && let Err(e) = label_value(v) {
            errors.push(format!(
                "{path}.values[{k:?}]: invalid label value {v:?}: {e}"
            ));
        }
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.'
}

/// A label value: at most 63 characters, alphanumerics with `-`, `_`, `.` inside; empty allowed.
fn label_value(v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Ok(());
    }
    if v.len() > 63 {
        return Err("longer than 63 characters".to_owned());
    }
    let ends_ok = v.starts_with(|c: char| c.is_ascii_alphanumeric())
        && v.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !ends_ok || !v.chars().all(is_name_char) {
        return Err(
            "must be alphanumeric characters, '-', '_' or '.', starting and ending alphanumeric"
                .to_owned(),
        );
    }
    Ok(())
}

/// A label or annotation key: `[prefix/]name`, prefix a DNS subdomain.
fn qualified_name(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        let ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part.len() <= 63
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            });
        if !ok {
            return Err(format!("prefix {p:?} must be a DNS subdomain"));
        }
    }
    if name.is_empty() {
        return Err("name part must not be empty".to_owned());
    }
    label_value(name).map_err(|e| format!("name part {name:?}: {e}"))
}

/// Walks a strategic-merge patch. `in_condition`: inside a conditional/global anchor's value,
/// which is a pattern, not a patch.
fn strategic(
    value: &Value,
    path: &str,
    field: Option<&str>,
    in_condition: bool,
    errors: &mut Vec<String>,
) {
    match value {
        Value::Object(map) => {
            let mut seen: BTreeMap<&str, Key<'_>> = BTreeMap::new();
            for (k, v) in map {
                let p = join_key(path, k);
                if k.starts_with('$') {
                    errors.push(format!(
                        "{p}: strategic-merge directives ({k}) are not supported"
                    ));
                    continue;
                }
                let key = match parse_key(k) {
                    Ok(key) => key,
                    Err(e) => {
                        errors.push(format!("{p}: {e}"));
                        continue;
                    }
                };
                if in_condition && !matches!(key, Key::Plain(_)) {
                    errors.push(format!(
                        "{p}: anchors inside a condition's value are not supported"
                    ));
                    continue;
                }
                // `k` and `+(k)` both write `k`.
                let writes = matches!(key, Key::Plain(_) | Key::AddIfAbsent(_));
                if writes && seen.insert(key.name(), key).is_some() {
                    errors.push(format!(
                        "{p}: {:?} is also set by another key of this map",
                        key.name()
                    ));
                }
                let child_in_condition = in_condition || key.is_condition();
                if key.is_condition()
                    && let Value::String(s) = v
                    && let Some(op) = unsupported_operator(s)
                {
                    errors.push(format!(
                        "{p}: operator in {op:?} is not supported (wildcards, '|', '&' and '!' are)"
                    ));
                }
                strategic(v, &p, Some(key.name()), child_in_condition, errors);
            }
        }
        Value::Array(items) => {
            if in_condition {
                for (i, item) in items.iter().enumerate() {
                    strategic(item, &format!("{path}[{i}]"), None, true, errors);
                }
                return;
            }
            let objects = items.iter().filter(|i| i.is_object()).count();
            if objects > 0 && objects < items.len() {
                errors.push(format!(
                    "{path}: mixes objects and other values; a list of objects is merged by key, any other list is replaced"
                ));
            }
            let relative = path.split_once("strategicMerge").map_or("", |(_, r)| r);
            let merge_key = field.and_then(|f| known_merge_key(f, relative));
            let plain_have_name = items
                .iter()
                .filter(|e| e.is_object() && !has_condition(e) && !has_global(e))
                .all(|e| e.get("name").is_some());
            let associative_key = merge_key.or(plain_have_name.then_some("name"));
            if objects == items.len() && associative_key.is_none() {
                let templates: Vec<String> = items
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| has_condition(e) || has_global(e))
                    .map(|(i, _)| format!("[{i}]"))
                    .collect();
                if !templates.is_empty() {
                    errors.push(format!(
                        "{path}: elements without `name` replace this list, so the anchored elements {} would never apply",
                        templates.join(", ")
                    ));
                }
            }
            if objects == items.len()
                && let Some(k) = associative_key
                && let Some((i, j, value)) = duplicate_key(items, k)
            {
                errors.push(format!(
                    "{path}[{j}]: duplicate merge key {k}={value} (also in element [{i}])"
                ));
            }
            for (i, item) in items.iter().enumerate() {
                let p = format!("{path}[{i}]");
                if let Value::Object(map) = item {
                    if has_global(item) {
                        // Keys that write something: not anchors, and not maps holding only
                        // anchors (a global anchor may sit deeper in the element).
                        let writes: Vec<&str> = map
                            .iter()
                            .filter(|(k, v)| {
                                !parse_key(k).is_ok_and(|key| key.is_condition()) && writes(v)
                            })
                            .map(|(k, _)| k.as_str())
                            .collect();
                        if !writes.is_empty() {
                            errors.push(format!(
                                "{p}: a list element with a global anchor is only a condition; its other fields ({}) would never be applied — move them to another element",
                                writes.join(", ")
                            ));
                        }
                    } else if !has_condition(item)
                        && let Some(k) = merge_key
                        && !map.contains_key(k)
                    {
                        errors.push(format!(
                            "{p}: needs the merge key `{k}` of `{}`, or a conditional anchor such as `({k}): \"*\"` to patch existing elements",
                            field.unwrap_or_default()
                        ));
                    }
                }
                strategic(item, &p, None, false, errors);
            }
        }
        _ => {}
    }
}

/// Whether a patch value writes anything: a scalar or list does; a map does when some key is
/// not a conditional or global anchor and its value writes.
fn writes(value: &Value) -> bool {
    match value {
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| !parse_key(k).is_ok_and(|key| key.is_condition()) && writes(v)),
        _ => true,
    }
}

fn json_patch(ops: &[JsonPatchOperation], path: &str, errors: &mut Vec<String>) {
    if ops.is_empty() {
        errors.push(format!("{path}: at least one operation is required"));
    }
    for (i, op) in ops.iter().enumerate() {
        let p = format!("{path}[{i}]");
        if let Err(e) = pointer(&op.path) {
            errors.push(format!("{p}.path: {e}"));
        }
        let needs_from = matches!(op.op, JsonPatchOp::Move | JsonPatchOp::Copy);
        match (&op.from, needs_from) {
            (Some(from), true) => {
                if let Err(e) = pointer(from) {
                    errors.push(format!("{p}.from: {e}"));
                }
            }
            (None, true) => errors.push(format!("{p}.from: required for {:?}", op.op)),
            (Some(_), false) => {
                errors.push(format!("{p}.from: only used by move and copy"));
            }
            (None, false) => {}
        }
        let needs_value = matches!(
            op.op,
            JsonPatchOp::Add | JsonPatchOp::Replace | JsonPatchOp::Test
        );
        if needs_value && op.value.is_none() {
            errors.push(format!("{p}.value: required for {:?}", op.op));
        }
        if !needs_value && op.value.is_some() {
            errors.push(format!("{p}.value: not used by {:?}", op.op));
        }
    }
}

/// A JSON pointer addressing something inside the object (RFC 6901, not the root).
fn pointer(p: &str) -> Result<(), String> {
    if !p.starts_with('/') {
        return Err("must start with '/'".to_owned());
    }
    let mut chars = p.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return Err("'~' must be followed by '0' or '1' (RFC 6901 escaping)".to_owned());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualified_names() {
        assert!(qualified_name("app").is_ok());
        assert!(qualified_name("traffic.sidecar.istio.io/excludeOutboundIPRanges").is_ok());
        assert!(qualified_name("a/b/c").is_err());
        assert!(qualified_name("/x").is_err());
        assert!(qualified_name("Example.com/x").is_err());
        assert!(qualified_name("x/").is_err());
        assert!(qualified_name("-x").is_err());
        assert!(label_value("").is_ok());
        assert!(label_value("0.0.0.0/0").is_err());
    }

    #[test]
    fn pointers() {
        assert!(pointer("/metadata/annotations/a~1b").is_ok());
        assert_eq!(pointer("metadata").unwrap_err(), "must start with '/'");
        assert!(pointer("/a~2").is_err());
        assert!(pointer("/a~").is_err());
    }
}
