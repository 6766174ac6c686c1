//! `MutatingAdmissionPolicy` documents applied offline (`meshgate render`), as the API server
//! applies them (`k8s.io/apiserver` 1.36, `admission/plugin/policy/mutating`), with CEL from the
//! maintained `cel` crate.
//!
//! # What is evaluated
//! * `matchConstraints`: `resourceRules` (group, version, resource and operation; the resource
//!   is the kind's plural, from a table of Kubernetes' kinds, else the lowercase kind plus `s`;
//!   `*` matches all), `excludeResourceRules`, `namespaceSelector` (a namespaced object's
//!   namespace labels; a Namespace's own; ignored for other cluster-scoped objects, as the API
//!   server does) and `objectSelector`.
//! * `variables` (in order, as `variables.<name>`), then every `matchConditions` expression
//!   (all must be true), with `object`, `oldObject` (null: a CREATE), `request` (`operation`,
//!   `namespace`, `name`, `kind`, `resource`) and `namespaceObject` (`metadata.name` and
//!   `labels` of the namespace, null for a cluster-scoped object).
//! * `mutations`, in order: `ApplyConfiguration` (an `Object{...}` expression: merged into the
//!   object as server-side apply merges a patch: maps by key, lists of objects by `name` where
//!   every element has one, other lists replaced) and `JSONPatch` (a list of
//!   `JSONPatch{op, path, from, value}`: RFC 6902, strictly). A mutation that fails is skipped
//!   and the ones before it are kept, as the API server does; with `failurePolicy: Fail` it is
//!   an error instead.
//!
//! Kyverno's CEL `MutatingPolicy` (`policies.kyverno.io/v1`) has the same spec fields and is
//! applied the same way ([`is_admission_policy`]).
//!
//! # What is not
//! Bindings are not read (every policy applies, as if bound without `matchResources`); no
//! `paramKind`; no `authorizer`; no Kubernetes CEL extension libraries beyond the standard ones
//! (strings, lists, regex `matches`); the merge does not know the schema's atomic fields.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cel::common::types::{CelMap, CelMapKey, CelString, Type};
use cel::common::value::{CowVal, Val};
use cel::{Context, Env, StructType};
use meshgate_api::LabelSelector;
use meshgate_api::mutation_policy::{JsonPatchOperation, JsonPatchOptions};
use serde_json::{Value, json};

/// The request an object is admitted in.
#[derive(Clone, Debug)]
pub struct AdmissionRequest<'a> {
    pub operation: &'a str,
    /// The object's namespace (`""`: cluster-scoped; a Namespace is its own).
    pub namespace: &'a str,
    /// That namespace's labels.
    pub namespace_labels: &'a BTreeMap<String, String>,
}

/// A policy that could not be applied to an object.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("MutatingAdmissionPolicy {policy}: {message}")]
pub struct AdmissionError {
    pub policy: String,
    pub message: String,
}

/// The result of applying policies to one object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Admitted {
    pub object: Value,
    /// Policies that changed it.
    pub applied: Vec<String>,
    /// Mutations skipped under `failurePolicy: Ignore` (the API server's behaviour), as errors.
    pub ignored: Vec<AdmissionError>,
}

/// A struct type CEL expressions construct by any name (`Object`, `Object.spec.template`,
/// `JSONPatch`), with any fields: a map.
struct AnyStruct(Type);

impl StructType for AnyStruct {
    fn get_type(&self) -> &Type {
        &self.0
    }

    fn new_value<'b, 'v>(
        &self,
        fields: BTreeMap<String, CowVal<'b, 'v>>,
    ) -> Result<Box<dyn Val + 'v>, cel::ExecutionError> {
        let map: HashMap<CelMapKey<'v>, Box<dyn Val + 'v>> = fields
            .into_iter()
            .map(|(k, v)| (CelMapKey::String(CelString::from(k)), v.into_owned()))
            .collect();
        Ok(Box::new(CelMap::from(map)))
    }
}

/// The names of the struct literals in an expression (`Object.spec{`, `JSONPatch{`).
fn struct_names(expression: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes: Vec<char> = expression.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_' || bytes[i] == '.')
            {
                i += 1;
            }
            if i < bytes.len() && bytes[i] == '{' {
                let name: String = bytes[start..i].iter().collect();
                if name.starts_with("Object") || name == "JSONPatch" {
                    out.push(name);
                }
            }
        } else if c == '"' || c == '\'' {
            // Skip a string literal.
            i += 1;
            while i < bytes.len() && bytes[i] != c {
                if bytes[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else {
            i += 1;
        }
    }
    out.sort();
    out.dedup();
    out
}

fn environment(expressions: &[&str]) -> Result<Arc<Env>, String> {
    let mut env = Env::stdlib();
    let mut names: Vec<String> = expressions.iter().flat_map(|e| struct_names(e)).collect();
    names.sort();
    names.dedup();
    for name in names {
        env.add_type(AnyStruct(Type::new_struct(name.clone())))
            .map_err(|e| format!("type {name}: {e:?}"))?;
    }
    Ok(Arc::new(env))
}

fn evaluate(env: &Arc<Env>, expression: &str, vars: &Value) -> Result<Value, String> {
    let program = env
        .compile(expression)
        .map_err(|e| format!("{expression:?}: compile: {e}"))?;
    let mut ctx = Context::with_env(env.clone());
    if let Value::Object(m) = vars {
        for (k, v) in m {
            ctx.add_variable(k.clone(), v.clone())
                .map_err(|e| format!("variable {k}: {e:?}"))?;
        }
    }
    let value = program
        .execute(&ctx)
        .map_err(|e| format!("{expression:?}: {e}"))?;
    value
        .json()
        .map_err(|e| format!("{expression:?}: result: {e}"))
}

/// The value of a CEL expression that reads no variable (`Err` with the evaluation error
/// otherwise: an undeclared `object`, say), for `import` of Kyverno's MutatingPolicy.
pub(crate) fn constant(expression: &str) -> Result<Value, String> {
    let env = environment(&[expression])?;
    evaluate(&env, expression, &Value::Object(serde_json::Map::new()))
}

/// The plural resource of a kind.
fn resource_of(kind: &str) -> String {
    const TABLE: &[(&str, &str)] = &[
        ("Endpoints", "endpoints"),
        ("NetworkPolicy", "networkpolicies"),
        ("Ingress", "ingresses"),
        ("IngressClass", "ingressclasses"),
        ("PriorityClass", "priorityclasses"),
        ("StorageClass", "storageclasses"),
        ("RuntimeClass", "runtimeclasses"),
    ];
    TABLE
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(_, r)| (*r).to_owned())
        .unwrap_or_else(|| format!("{}s", kind.to_lowercase()))
}

fn listed(list: &Value, item: &str) -> bool {
    list.as_array()
        .is_some_and(|l| l.iter().any(|v| v == "*" || v == item))
}

fn rule_matches(rule: &Value, group: &str, version: &str, resource: &str, op: &str) -> bool {
    listed(&rule["apiGroups"], group)
        && listed(&rule["apiVersions"], version)
        && listed(&rule["resources"], resource)
        && (rule.get("operations").is_none() || listed(&rule["operations"], op))
}

fn labels_of(object: &Value) -> BTreeMap<String, String> {
    super::object_labels(object)
}

/// Whether a policy's `matchConstraints` select the object.
fn constraints_match(
    spec: &Value,
    object: &Value,
    req: &AdmissionRequest<'_>,
) -> Result<bool, String> {
    let c = &spec["matchConstraints"];
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let kind = object["kind"].as_str().unwrap_or_default();
    let resource = resource_of(kind);
    let rules = c["resourceRules"].as_array().cloned().unwrap_or_default();
    if !rules
        .iter()
        .any(|r| rule_matches(r, group, version, &resource, req.operation))
    {
        return Ok(false);
    }
    if c["excludeResourceRules"].as_array().is_some_and(|ex| {
        ex.iter()
            .any(|r| rule_matches(r, group, version, &resource, req.operation))
    }) {
        return Ok(false);
    }
    let selector = |v: &Value| -> Result<Option<LabelSelector>, String> {
        if v.is_null() {
            return Ok(None);
        }
        serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| format!("selector: {e}"))
    };
    if let Some(s) = selector(&c["namespaceSelector"])? {
        let own = kind == "Namespace" && group.is_empty();
        let labels = if own {
            labels_of(object)
        } else {
            req.namespace_labels.clone()
        };
        // The API server ignores the namespace selector for other cluster-scoped objects.
        if (own || !req.namespace.is_empty()) && !s.matches(&labels) {
            return Ok(false);
        }
    }
    if let Some(s) = selector(&c["objectSelector"])?
        && !s.matches(&labels_of(object))
    {
        return Ok(false);
    }
    Ok(true)
}

/// Server-side-apply-like merge of `patch` into `target`.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                match t.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(t), Value::Array(p))
            if !p.is_empty()
                && p.iter()
                    .all(|e| e.get("name").is_some_and(Value::is_string))
                && t.iter()
                    .all(|e| e.get("name").is_some_and(Value::is_string)) =>
        {
            for element in p {
                match t.iter_mut().find(|e| e["name"] == element["name"]) {
                    Some(existing) => merge(existing, element),
                    None => t.push(element.clone()),
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Applies `policies` (`(name, MutatingAdmissionPolicy document)`) to `object` in this request,
/// in order. Errors only under `failurePolicy: Fail`.
pub fn apply(
    policies: &[(String, Value)],
    object: &Value,
    req: &AdmissionRequest<'_>,
) -> Result<Admitted, AdmissionError> {
    let mut out = Admitted {
        object: object.clone(),
        ..Admitted::default()
    };
    for (name, doc) in policies {
        let spec = &doc["spec"];
        let fail = spec["failurePolicy"] == "Fail";
        let error = |message: String| AdmissionError {
            policy: name.clone(),
            message,
        };
        let failed = |out: &mut Admitted, message: String| -> Result<(), AdmissionError> {
            if fail {
                Err(error(message))
            } else {
                out.ignored.push(error(message));
                Ok(())
            }
        };
        match constraints_match(spec, &out.object, req) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                failed(&mut out, e)?;
                continue;
            }
        }
        let mut expressions: Vec<&str> = Vec::new();
        for list in ["variables", "matchConditions"] {
            for v in spec[list].as_array().into_iter().flatten() {
                expressions.extend(v["expression"].as_str());
            }
        }
        for m in spec["mutations"].as_array().into_iter().flatten() {
            expressions.extend(m["applyConfiguration"]["expression"].as_str());
            expressions.extend(m["jsonPatch"]["expression"].as_str());
        }
        let env = match environment(&expressions) {
            Ok(env) => env,
            Err(e) => {
                failed(&mut out, e)?;
                continue;
            }
        };
        let kind = out.object["kind"].as_str().unwrap_or_default().to_owned();
        let api_version = out.object["apiVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let (group, version) = api_version
            .rsplit_once('/')
            .unwrap_or(("", api_version.as_str()));
        let namespace_object = if req.namespace.is_empty() {
            Value::Null
        } else {
            json!({"metadata": {"name": req.namespace, "labels": req.namespace_labels}})
        };
        let request = json!({
            "operation": req.operation,
            "namespace": req.namespace,
            "name": out.object.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource_of(&kind)},
        });
        let mut vars = json!({
            "object": out.object,
            "oldObject": null,
            "request": request,
            "namespaceObject": namespace_object,
            "variables": {},
        });
        // Variables are evaluated when an expression uses them (the API server's are lazy).
        let declared: Vec<(String, String)> = spec["variables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| {
                Some((
                    v["name"].as_str()?.to_owned(),
                    v["expression"].as_str()?.to_owned(),
                ))
            })
            .collect();
        let eval = |expr: &str, vars: &mut Value| -> Result<Value, String> {
            let mut needed: Vec<&str> = vec![expr];
            for (name, vexpr) in declared.iter().rev() {
                if needed
                    .iter()
                    .any(|e| e.contains(&format!("variables.{name}")))
                {
                    needed.push(vexpr);
                }
            }
            for (name, vexpr) in &declared {
                if vars["variables"].get(name).is_none()
                    && needed
                        .iter()
                        .any(|e| e.contains(&format!("variables.{name}")))
                {
                    let value = evaluate(&env, vexpr, vars)
                        .map_err(|e| format!("variables.{name}: {e}"))?;
                    vars["variables"][name.as_str()] = value;
                }
            }
            evaluate(&env, expr, vars)
        };
        let mut broken = None;
        let mut matched = true;
        for c in spec["matchConditions"].as_array().into_iter().flatten() {
            let expr = c["expression"].as_str().unwrap_or("true");
            match eval(expr, &mut vars) {
                Ok(Value::Bool(true)) => {}
                Ok(Value::Bool(false)) => {
                    matched = false;
                    break;
                }
                Ok(other) => {
                    broken = Some(format!(
                        "matchConditions {}: not a bool: {other}",
                        c["name"]
                    ));
                    break;
                }
                Err(e) => {
                    broken = Some(format!("matchConditions {}: {e}", c["name"]));
                    break;
                }
            }
        }
        if let Some(e) = broken {
            failed(&mut out, e)?;
            continue;
        }
        if !matched {
            continue;
        }
        let before = out.object.clone();
        for (i, m) in spec["mutations"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            vars["object"] = out.object.clone();
            // Variables see the object as this mutation finds it.
            vars["variables"] = json!({});
            let result = match m["patchType"].as_str() {
                Some("ApplyConfiguration") => {
                    let expr = m["applyConfiguration"]["expression"].as_str().unwrap_or("");
                    eval(expr, &mut vars).and_then(|patch| {
                        if !patch.is_object() {
                            return Err(format!("not an Object: {patch}"));
                        }
                        let mut next = out.object.clone();
                        merge(&mut next, &patch);
                        Ok(next)
                    })
                }
                Some("JSONPatch") => {
                    let expr = m["jsonPatch"]["expression"].as_str().unwrap_or("");
                    eval(expr, &mut vars).and_then(|ops| {
                        let ops: Vec<JsonPatchOperation> = serde_json::from_value(ops)
                            .map_err(|e| format!("not a list of JSONPatch: {e}"))?;
                        let mut next = out.object.clone();
                        super::json6902::apply(&mut next, &ops, &JsonPatchOptions::default())
                            .map_err(|(op, e)| format!("operation {op}: {e}"))?;
                        Ok(next)
                    })
                }
                other => Err(format!("patchType {other:?} is not supported")),
            };
            match result {
                Ok(next) => out.object = next,
                Err(e) => failed(&mut out, format!("mutations[{i}]: {e}"))?,
            }
        }
        if out.object != before {
            out.applied.push(name.clone());
        }
    }
    Ok(out)
}

/// Whether a document is a MutatingAdmissionPolicy, or a Kyverno `MutatingPolicy`
/// (`policies.kyverno.io`), whose spec has the same fields (`matchConstraints`,
/// `matchConditions`, `variables`, `mutations`) and is applied the same way (Kyverno's own CEL
/// libraries, `autogen` and `evaluation` are not evaluated).
pub fn is_admission_policy(doc: &Value) -> bool {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    (doc["kind"] == "MutatingAdmissionPolicy"
        && api_version.starts_with("admissionregistration.k8s.io/"))
        || (doc["kind"] == "MutatingPolicy" && api_version.starts_with("policies.kyverno.io/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(mutations: Value, failure: &str) -> (String, Value) {
        (
            "p".to_owned(),
            json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
                "metadata": {"name": "p"},
                "spec": {
                    "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                        "operations": ["CREATE"], "resources": ["pods"]}]},
                    "matchConditions": [{"name": "labelled", "expression": "has(object.metadata.labels) && 'app' in object.metadata.labels"}],
                    "variables": [{"name": "app", "expression": "object.metadata.labels['app']"}],
                    "failurePolicy": failure,
                    "reinvocationPolicy": "Never",
                    "mutations": mutations,
                },
            }),
        )
    }

    fn pod(labels: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "labels": labels},
               "spec": {"containers": [{"name": "app", "image": "a"}]}})
    }

    fn req() -> AdmissionRequest<'static> {
        static EMPTY: BTreeMap<String, String> = BTreeMap::new();
        AdmissionRequest {
            operation: "CREATE",
            namespace: "shop",
            namespace_labels: &EMPTY,
        }
    }

    #[test]
    fn apply_configuration_and_json_patch_mutations_apply_in_order() {
        let p = policy(
            json!([
                {"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "Object{spec: Object.spec{containers: [Object.spec.containers{name: 'app', imagePullPolicy: 'Always'}]}}"}},
                {"patchType": "JSONPatch", "jsonPatch": {"expression":
                    "[JSONPatch{op: 'add', path: '/metadata/labels/copy', value: variables.app + '-' + request.namespace}]"}},
            ]),
            "Fail",
        );
        let out = apply(
            std::slice::from_ref(&p),
            &pod(json!({"app": "web"})),
            &req(),
        )
        .expect("applies");
        assert_eq!(out.applied, ["p"]);
        assert_eq!(
            out.object["spec"]["containers"][0]["imagePullPolicy"],
            "Always"
        );
        assert_eq!(out.object["spec"]["containers"][0]["image"], "a");
        assert_eq!(out.object["metadata"]["labels"]["copy"], "web-shop");
        // The match condition does not hold: nothing.
        let out = apply(&[p], &pod(json!({"team": "x"})), &req()).expect("applies");
        assert!(out.applied.is_empty());
    }

    #[test]
    fn a_failing_mutation_keeps_the_earlier_ones_under_ignore_and_fails_under_fail() {
        let mutations = json!([
            {"patchType": "JSONPatch", "jsonPatch": {"expression": "[JSONPatch{op: 'add', path: '/metadata/labels/first', value: 'yes'}]"}},
            {"patchType": "JSONPatch", "jsonPatch": {"expression": "[JSONPatch{op: 'remove', path: '/metadata/annotations/missing'}]"}},
        ]);
        let out = apply(
            &[policy(mutations.clone(), "Ignore")],
            &pod(json!({"app": "web"})),
            &req(),
        )
        .expect("ignored");
        assert_eq!(out.object["metadata"]["labels"]["first"], "yes");
        assert_eq!(out.ignored.len(), 1, "{:?}", out.ignored);
        assert!(
            out.ignored[0].message.starts_with("mutations[1]"),
            "{:?}",
            out.ignored
        );
        let err = apply(
            &[policy(mutations, "Fail")],
            &pod(json!({"app": "web"})),
            &req(),
        )
        .expect_err("fails");
        assert_eq!(err.policy, "p");
    }

    #[test]
    fn struct_names_are_found_outside_strings() {
        assert_eq!(
            struct_names("Object{spec: Object.spec{x: 'Object.fake{'}} + [JSONPatch{op: \"a\"}]"),
            ["JSONPatch", "Object", "Object.spec"]
        );
    }
}
