//! Reading `AdmissionReview` requests and writing responses.
//!
//! Requests are read as JSON values, not into typed structs: a review with a field the types do
//! not expect must still get an answer that names the problem, never a deserializer panic or a
//! dropped connection.

use meshgate_core::patch::JsonPatch;
use serde_json::{Value, json};

pub const API_VERSION: &str = "admission.k8s.io/v1";

/// The parts of `request` the handlers read.
#[derive(Debug)]
pub struct Request<'a> {
    pub uid: &'a str,
    /// `request.kind.kind`, e.g. `Pod`.
    pub kind: &'a str,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT`.
    pub operation: &'a str,
    /// Empty for cluster-scoped objects.
    pub namespace: &'a str,
    pub name: &'a str,
    pub dry_run: bool,
    /// `request.object` (null for DELETE).
    pub object: &'a Value,
}

/// Why a body is not a review we can answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReviewError {
    /// Not even a uid to answer to: the caller gets HTTP 400.
    #[error("{0}")]
    Unanswerable(String),
    /// A review with a uid but something wrong: answered with `allowed: false`, code 400.
    #[error("{message}")]
    Invalid { uid: String, message: String },
}

static NULL: Value = Value::Null;

/// Parses and checks a review. The errors say exactly what is wrong.
pub fn parse(review: &Value) -> Result<Request<'_>, ReviewError> {
    if !review.is_object() {
        return Err(ReviewError::Unanswerable(
            "body is not an AdmissionReview: expected a JSON object".into(),
        ));
    }
    let Some(request) = review.get("request").filter(|r| r.is_object()) else {
        return Err(ReviewError::Unanswerable(
            "AdmissionReview has no request object".into(),
        ));
    };
    let Some(uid) = request
        .get("uid")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
    else {
        return Err(ReviewError::Unanswerable(
            "request.uid is missing or not a string".into(),
        ));
    };
    let invalid = |message: String| ReviewError::Invalid {
        uid: uid.to_owned(),
        message,
    };
    let api_version = review
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if api_version != API_VERSION {
        return Err(invalid(format!(
            "apiVersion {api_version:?} is not supported: this webhook speaks {API_VERSION}"
        )));
    }
    let kind_field = review
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if kind_field != "AdmissionReview" {
        return Err(invalid(format!(
            "kind {kind_field:?} is not AdmissionReview"
        )));
    }
    let str_field = |path: &str| request.pointer(path).and_then(Value::as_str);
    let Some(kind) = str_field("/kind/kind") else {
        return Err(invalid("request.kind.kind is missing".into()));
    };
    let Some(operation) = str_field("/operation") else {
        return Err(invalid("request.operation is missing".into()));
    };
    if !["CREATE", "UPDATE", "DELETE", "CONNECT"].contains(&operation) {
        return Err(invalid(format!(
            "request.operation {operation:?} is not an admission operation"
        )));
    }
    let object = request.get("object").unwrap_or(&NULL);
    if matches!(operation, "CREATE" | "UPDATE") && !object.is_object() {
        return Err(invalid(format!(
            "request.object must be an object for {operation}"
        )));
    }
    Ok(Request {
        uid,
        kind,
        operation,
        namespace: str_field("/namespace").unwrap_or_default(),
        name: str_field("/name")
            .or_else(|| object.pointer("/metadata/name").and_then(Value::as_str))
            .or_else(|| {
                object
                    .pointer("/metadata/generateName")
                    .and_then(Value::as_str)
            })
            .unwrap_or_default(),
        dry_run: request
            .get("dryRun")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        object,
    })
}

/// An allowing response, with the patch when it is not empty.
pub fn allow(uid: &str, patch: &JsonPatch, warnings: &[String]) -> Value {
    let mut response = json!({"uid": uid, "allowed": true});
    if !patch.is_empty() {
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(k8s_openapi::ByteString(patch.to_bytes()));
    }
    if !warnings.is_empty() {
        response["warnings"] = json!(warnings);
    }
    review(response)
}

/// A refusing response with an HTTP-like code and a message.
pub fn deny(uid: &str, code: u16, message: &str) -> Value {
    review(json!({
        "uid": uid,
        "allowed": false,
        "status": {"code": code, "message": message, "status": "Failure"},
    }))
}

fn review(response: Value) -> Value {
    json!({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": "CREATE", "namespace": "ns", "dryRun": true,
                        "object": {"metadata": {"generateName": "web-"}, "spec": {}}}
        })
    }

    #[test]
    fn reads_a_review() {
        let v = good();
        let r = parse(&v).unwrap();
        assert_eq!(
            (r.uid, r.kind, r.operation, r.namespace, r.name, r.dry_run),
            ("u1", "Pod", "CREATE", "ns", "web-", true)
        );
    }

    #[test]
    fn names_what_is_wrong() {
        let cases: Vec<(Value, &str)> = vec![
            (json!([]), "expected a JSON object"),
            (
                json!({"apiVersion": "admission.k8s.io/v1"}),
                "no request object",
            ),
            (json!({"request": {"uid": 3}}), "request.uid"),
        ];
        for (v, want) in cases {
            match parse(&v) {
                Err(ReviewError::Unanswerable(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        let mut v = good();
        v["apiVersion"] = json!("admission.k8s.io/v1beta1");
        assert!(
            matches!(parse(&v), Err(ReviewError::Invalid { message, .. }) if message.contains("v1beta1"))
        );
        let mut v = good();
        v["request"]["object"] = json!("x");
        assert!(
            matches!(parse(&v), Err(ReviewError::Invalid { message, .. }) if message.contains("request.object"))
        );
        let mut v = good();
        v["request"]["operation"] = json!("PATCH");
        assert!(parse(&v).is_err());
    }

    #[test]
    fn responses_are_well_formed() {
        let mut p = JsonPatch::default();
        p.add("/metadata/labels", json!({}));
        let r = allow("u", &p, &["w".into()]);
        assert_eq!(r["response"]["patchType"], "JSONPatch");
        assert!(r["response"]["patch"].is_string(), "base64");
        assert_eq!(r["response"]["warnings"], json!(["w"]));
        let r = allow("u", &JsonPatch::default(), &[]);
        assert!(r["response"].get("patch").is_none());
        let r = deny("u", 400, "bad");
        assert_eq!(r["response"]["status"]["code"], 400);
        assert_eq!(r["response"]["allowed"], false);
    }
}
