//! Import of Kyverno's CEL `MutatingPolicy` (`policies.kyverno.io`) as a MutationPolicy, where a
//! MutationPolicy can say it.
//!
//! A MutatingPolicy is a MutatingAdmissionPolicy with Kyverno's extras: its mutations are CEL
//! expressions over the request. A MutationPolicy has no CEL, so a mutation converts when its
//! expression reads nothing of the request: it is evaluated once, here, with no variable at all
//! (an expression that names `object`, `oldObject`, `request`, `variables`, `namespaceObject` or
//! `params` fails to evaluate, and the failure is the note). Then:
//!
//! * an `ApplyConfiguration` (`Object{...}`) becomes a `strategicMerge` of its value, and a
//!   `JSONPatch` list becomes the same `jsonPatch` operations;
//! * `matchConstraints.resourceRules` become `match.kinds` (Pod, the workloads, Service,
//!   ConfigMap, Namespace, Secret, ServiceAccount) and `match.operations`, with
//!   `namespaceSelector` and `objectSelector` as they are; the policy has `target: Object`
//!   (a MutatingPolicy mutates the object it matched, a Deployment itself).
//!
//! Everything else is a note naming the field: `matchConditions`, `variables`,
//! `excludeResourceRules`, `paramKind`, `autogen`, `evaluation`, `targetMatchConstraints`,
//! `webhookConfiguration`, `failurePolicy: Fail` (meshgate admits an object without a policy
//! that fails), a resource outside that table, an expression that reads the request.
//! `meshgate render` applies MutatingPolicies themselves, CEL included (`policy::admission`).

use std::collections::BTreeSet;

use meshgate_api::LabelSelector;
use meshgate_api::mutation_policy::{
    JsonPatchOperation, MatchResources, Mutation, MutationPolicySpec, MutationTarget, Operation,
};
use serde_json::Value;

use super::outcome::{KyvernoError, KyvernoImport};

/// `(group, resource, kind as a MutationPolicy names it)`.
const KINDS: &[(&str, &str, &str)] = &[
    ("", "pods", "Pod"),
    ("apps", "deployments", "Deployment"),
    ("apps", "statefulsets", "StatefulSet"),
    ("apps", "daemonsets", "DaemonSet"),
    ("apps", "replicasets", "ReplicaSet"),
    ("batch", "jobs", "Job"),
    ("batch", "cronjobs", "CronJob"),
    ("", "services", "Service"),
    ("", "configmaps", "ConfigMap"),
    ("", "namespaces", "Namespace"),
    ("", "secrets", "Secret"),
    ("", "serviceaccounts", "ServiceAccount"),
];

/// Whether `doc` is a Kyverno `MutatingPolicy`.
pub(super) fn is_mutating_policy(doc: &Value) -> bool {
    doc["apiVersion"]
        .as_str()
        .is_some_and(|a| a.starts_with("policies.kyverno.io/"))
        && doc["kind"] == "MutatingPolicy"
}

/// Converts a `MutatingPolicy` (see the module documentation).
pub(super) fn import(doc: &Value) -> Result<KyvernoImport, KyvernoError> {
    let name = doc["metadata"]["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        return Err(KyvernoError::Malformed {
            path: "metadata.name".into(),
            message: "required".into(),
        });
    }
    let spec = &doc["spec"];
    let mut notes = Vec::new();
    for field in [
        "matchConditions",
        "variables",
        "paramKind",
        "autogen",
        "evaluation",
        "targetMatchConstraints",
        "webhookConfiguration",
    ] {
        let v = &spec[field];
        let set = match v {
            Value::Null => false,
            Value::Array(a) => !a.is_empty(),
            Value::Object(m) => !m.is_empty(),
            _ => true,
        };
        if set {
            notes.push(format!(
                "spec.{field}: not converted: a MutationPolicy has no CEL, and nothing that says this"
            ));
        }
    }
    if spec["failurePolicy"] == "Fail" {
        notes.push(
            "spec.failurePolicy: Fail: not converted: meshgate admits an object without a policy that fails on it".to_owned(),
        );
    }
    let match_ = match_resources(&spec["matchConstraints"], &mut notes);
    let mut mutations = Vec::new();
    for (i, m) in spec["mutations"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        match mutation(m, &format!("spec.mutations[{i}]")) {
            Ok(m) => mutations.push(m),
            Err(note) => notes.push(note),
        }
    }
    if !notes.is_empty() || mutations.is_empty() || match_.kinds.is_empty() {
        if mutations.is_empty() && notes.is_empty() {
            notes.push("spec.mutations: none".to_owned());
        }
        if match_.kinds.is_empty() && !notes.iter().any(|n| n.contains("resourceRules")) {
            notes.push("spec.matchConstraints.resourceRules: no resource".to_owned());
        }
        return Err(KyvernoError::NothingConvertible {
            policy: name.to_owned(),
            notes,
        });
    }
    let spec = MutationPolicySpec {
        match_,
        exclude: None,
        pod_templates: false,
        target: MutationTarget::Object,
        mutations,
        warning: None,
        existing: Default::default(),
    };
    if let Err(errors) = crate::policy::validate(&spec) {
        return Err(KyvernoError::NothingConvertible {
            policy: name.to_owned(),
            notes: errors,
        });
    }
    Ok(KyvernoImport {
        policies: vec![(name.to_owned(), spec)],
        notes: Vec::new(),
        ignored: Vec::new(),
    })
}

fn match_resources(constraints: &Value, notes: &mut Vec<String>) -> MatchResources {
    let mut kinds = BTreeSet::new();
    let mut operations = BTreeSet::new();
    if constraints["excludeResourceRules"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
    {
        notes.push("spec.matchConstraints.excludeResourceRules: not converted".to_owned());
    }
    for (i, rule) in constraints["resourceRules"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let at = format!("spec.matchConstraints.resourceRules[{i}]");
        let groups: Vec<&str> = rule["apiGroups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for resource in rule["resources"].as_array().into_iter().flatten() {
            let resource = resource.as_str().unwrap_or_default();
            match KINDS
                .iter()
                .find(|(g, r, _)| *r == resource && groups.iter().any(|x| x == g || *x == "*"))
            {
                Some((_, _, kind)) => {
                    kinds.insert((*kind).to_owned());
                }
                None => notes.push(format!(
                    "{at}.resources: {resource:?} (groups {groups:?}): not converted: meshgate's import names {}",
                    KINDS.iter().map(|k| k.1).collect::<Vec<_>>().join(", ")
                )),
            }
        }
        for op in rule["operations"].as_array().into_iter().flatten() {
            match op.as_str().unwrap_or_default() {
                "CREATE" => {
                    operations.insert(0);
                }
                "UPDATE" => {
                    operations.insert(1);
                }
                "*" => {
                    operations.extend([0, 1]);
                }
                other => notes.push(format!(
                    "{at}.operations: {other:?}: not converted: MutationPolicies apply on CREATE and UPDATE"
                )),
            }
        }
    }
    let mut selector = |field: &str| -> Option<LabelSelector> {
        let v = &constraints[field];
        if v.is_null() || v.as_object().is_some_and(|m| m.is_empty()) {
            return None;
        }
        match serde_json::from_value(v.clone()) {
            Ok(s) => Some(s),
            Err(e) => {
                notes.push(format!("spec.matchConstraints.{field}: {e}"));
                None
            }
        }
    };
    let namespace_selector = selector("namespaceSelector");
    let object_selector = selector("objectSelector");
    MatchResources {
        kinds: kinds.into_iter().collect(),
        namespace_selector,
        object_selector,
        operations: operations
            .into_iter()
            .map(|o| {
                if o == 0 {
                    Operation::Create
                } else {
                    Operation::Update
                }
            })
            .collect(),
        ..MatchResources::default()
    }
}

/// One mutation, when its expression reads nothing of the request.
fn mutation(m: &Value, at: &str) -> Result<Mutation, String> {
    let (field, patch_type) = match m["patchType"].as_str().unwrap_or_default() {
        "ApplyConfiguration" => ("applyConfiguration", true),
        "JSONPatch" => ("jsonPatch", false),
        other => {
            return Err(format!(
                "{at}.patchType: {other:?}: expected ApplyConfiguration or JSONPatch"
            ));
        }
    };
    let Some(expression) = m[field]["expression"].as_str() else {
        return Err(format!("{at}.{field}.expression: required"));
    };
    let value = crate::policy::admission::constant(expression).map_err(|e| {
        format!(
            "{at}.{field}.expression: not converted: only an expression that reads nothing of the request converts (a MutationPolicy has no CEL; `meshgate render` applies it as written): {e}"
        )
    })?;
    if patch_type {
        if !value.is_object() {
            return Err(format!(
                "{at}.{field}.expression: gives {value}, not an object"
            ));
        }
        return Ok(Mutation {
            strategic_merge: Some(value),
            ..Mutation::default()
        });
    }
    let ops: Vec<JsonPatchOperation> = serde_json::from_value(value.clone()).map_err(|e| {
        format!("{at}.{field}.expression: gives {value}: not JSON patch operations: {e}")
    })?;
    Ok(Mutation {
        json_patch: Some(ops),
        ..Mutation::default()
    })
}
