//! Reading `AdmissionReview` requests and writing responses.
//!
//! A review is decoded straight from the body into a few borrowed fields (see
//! [`meshgate_core::view`]): `request.object` stays raw JSON text until a handler reads it, the
//! init gate as a lean pod view, the other handlers as a `Value`. Every field is lenient: a field
//! of an unexpected type reads as absent, so that a review with a field the types do not expect
//! still gets an answer that names the problem, never a deserializer error or a dropped
//! connection. A body the direct decode refuses although it is JSON (an object with a key
//! twice) is read through a `Value` first, which keeps the last of repeated keys.
//!
//! A body that is not UTF-8 is refused as a `Value` parse would refuse it. One difference is
//! left, found by fuzzing: the decode reads past values it skips (and keeps `request.object` as
//! text) without checking two things a `Value` parse checks, the range of numbers (`1e400`) and
//! the pairing of `\u` surrogate escapes (`"\ud800"`). Such a review is still answered: the
//! pod gate plans from what it reads; a handler that needs the object as a `Value` refuses it
//! with code 400. The API server never sends either (Go's JSON encoder cannot write them).

use std::borrow::Cow;

use meshgate_core::patch::JsonPatch;
use meshgate_core::view::{Bool, Obj, Str};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

pub const API_VERSION: &str = "admission.k8s.io/v1";

/// The parts of `request` the handlers read; `O` is how `request.object` is read: as JSON text
/// ([`RawValue`], the default) or decoded in the same pass as the review (e.g. the init gate's
/// [`PodView`](meshgate_core::view::PodView), see [`Object`]).
#[derive(Debug)]
pub struct Request<'a, O = &'a RawValue> {
    pub uid: Cow<'a, str>,
    /// `request.kind.kind`, e.g. `Pod`.
    pub kind: Cow<'a, str>,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT`.
    pub operation: &'static str,
    /// Empty for cluster-scoped objects.
    pub namespace: Cow<'a, str>,
    /// `request.name`; empty for objects named by the API server (`generateName`).
    pub name: Cow<'a, str>,
    pub dry_run: bool,
    /// `request.object` (JSON `null` when absent, as for DELETE).
    pub object: O,
}

/// A way to read `request.object` while the review is decoded.
pub trait Object<'a>: Deserialize<'a> {
    /// `request.object` absent.
    fn absent() -> Self;
    /// Whether `request.object` is a JSON object.
    fn is_object(&self) -> bool;
}

impl<'a> Object<'a> for &'a RawValue {
    fn absent() -> Self {
        RawValue::NULL
    }
    fn is_object(&self) -> bool {
        self.get().starts_with('{')
    }
}

/// Read as a lean view (lenient: `None` for anything but a JSON object).
impl<'a, T: Deserialize<'a> + Default> Object<'a> for Obj<T> {
    fn absent() -> Self {
        Obj(None)
    }
    fn is_object(&self) -> bool {
        self.0.is_some()
    }
}

impl Request<'_> {
    /// `request.object` as a `Value`.
    pub fn object_value(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_str(self.object.get())
    }
}

/// `metadata.name` of an object, else `metadata.generateName`, else empty.
pub fn object_name(object: &Value) -> &str {
    object
        .pointer("/metadata/name")
        .or_else(|| object.pointer("/metadata/generateName"))
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// Why a body is not a review we can answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReviewError {
    /// Not JSON: the caller gets HTTP 400.
    #[error("body is not JSON: {0}")]
    NotJson(String),
    /// Not even a uid to answer to: the caller gets HTTP 400.
    #[error("{0}")]
    Unanswerable(String),
    /// A review with a uid but something wrong: answered with `allowed: false`, code 400.
    #[error("{message}")]
    Invalid { uid: String, message: String },
}

/// The review as sent, every field lenient.
#[derive(Deserialize)]
#[serde(default, bound = "O: Object<'de>")]
struct Envelope<'a, O> {
    #[serde(borrow, rename = "apiVersion")]
    api_version: Str<'a>,
    #[serde(borrow)]
    kind: Str<'a>,
    request: Obj<RequestIn<'a, O>>,
}

impl<O> Default for Envelope<'_, O> {
    fn default() -> Self {
        Self {
            api_version: Str::default(),
            kind: Str::default(),
            request: Obj(None),
        }
    }
}

#[derive(Deserialize)]
#[serde(default, bound = "O: Object<'de>")]
struct RequestIn<'a, O> {
    #[serde(borrow)]
    uid: Str<'a>,
    #[serde(borrow)]
    kind: Obj<KindIn<'a>>,
    #[serde(borrow)]
    operation: Str<'a>,
    #[serde(borrow)]
    namespace: Str<'a>,
    #[serde(borrow)]
    name: Str<'a>,
    #[serde(rename = "dryRun")]
    dry_run: Bool,
    object: Option<O>,
}

impl<O> Default for RequestIn<'_, O> {
    fn default() -> Self {
        Self {
            uid: Str::default(),
            kind: Obj(None),
            operation: Str::default(),
            namespace: Str::default(),
            name: Str::default(),
            dry_run: Bool::default(),
            object: None,
        }
    }
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct KindIn<'a> {
    #[serde(borrow)]
    kind: Str<'a>,
}

const OPERATIONS: [&str; 4] = ["CREATE", "UPDATE", "DELETE", "CONNECT"];

/// Decodes and checks a review body, `request.object` as JSON text. The errors say exactly what
/// is wrong. `scratch` holds the normalised text when the body has to be read through a `Value`
/// (see the module docs).
pub fn decode<'a>(
    body: &'a [u8],
    scratch: &'a mut Option<String>,
) -> Result<Request<'a>, ReviewError> {
    decode_as(body, scratch)
}

/// [`decode`], with `request.object` read as `O` in the same pass (one pass over the object's
/// bytes instead of two: skipped as text, then decoded).
pub fn decode_as<'a, O: Object<'a>>(
    body: &'a [u8],
    scratch: &'a mut Option<String>,
) -> Result<Request<'a, O>, ReviewError> {
    // UTF-8 first: the decode skips unread strings without checking them, and a review that is
    // not JSON must be refused whatever field holds the bad bytes (found by fuzzing).
    let text = std::str::from_utf8(body).map_err(|e| ReviewError::NotJson(e.to_string()))?;
    let envelope = match serde_json::from_str::<Obj<Envelope<'a, O>>>(text) {
        Ok(e) => e,
        Err(_) => {
            let value: Value =
                serde_json::from_str(text).map_err(|e| ReviewError::NotJson(e.to_string()))?;
            let text: &'a str = scratch.insert(value.to_string());
            serde_json::from_str::<Obj<Envelope<'a, O>>>(text)
                .map_err(|e| ReviewError::NotJson(e.to_string()))?
        }
    };
    check(envelope)
}

/// Parses and checks a review given as a `Value` (tests and tools; the server uses [`decode`]).
pub fn parse<'a>(
    review: &Value,
    scratch: &'a mut Option<String>,
) -> Result<Request<'a>, ReviewError> {
    let text: &'a str = scratch.insert(review.to_string());
    let envelope = serde_json::from_str::<Obj<Envelope<'a, &'a RawValue>>>(text)
        .map_err(|e| ReviewError::NotJson(e.to_string()))?;
    check(envelope)
}

fn check<'a, O: Object<'a>>(envelope: Obj<Envelope<'a, O>>) -> Result<Request<'a, O>, ReviewError> {
    let Some(review) = envelope.0 else {
        return Err(ReviewError::Unanswerable(
            "body is not an AdmissionReview: expected a JSON object".into(),
        ));
    };
    let Some(request) = review.request.0 else {
        return Err(ReviewError::Unanswerable(
            "AdmissionReview has no request object".into(),
        ));
    };
    let Some(uid) = request.uid.0.filter(|u| !u.is_empty()) else {
        return Err(ReviewError::Unanswerable(
            "request.uid is missing or not a string".into(),
        ));
    };
    let invalid = |message: String| ReviewError::Invalid {
        uid: uid.clone().into_owned(),
        message,
    };
    let api_version = review.api_version.as_deref().unwrap_or_default();
    if api_version != API_VERSION {
        return Err(invalid(format!(
            "apiVersion {api_version:?} is not supported: this webhook speaks {API_VERSION}"
        )));
    }
    let kind_field = review.kind.as_deref().unwrap_or_default();
    if kind_field != "AdmissionReview" {
        return Err(invalid(format!(
            "kind {kind_field:?} is not AdmissionReview"
        )));
    }
    let Some(kind) = request.kind.0.and_then(|k| k.kind.0) else {
        return Err(invalid("request.kind.kind is missing".into()));
    };
    let Some(operation) = request.operation.as_deref() else {
        return Err(invalid("request.operation is missing".into()));
    };
    let Some(operation) = OPERATIONS.into_iter().find(|o| *o == operation) else {
        return Err(invalid(format!(
            "request.operation {operation:?} is not an admission operation"
        )));
    };
    let object = request.object.unwrap_or_else(O::absent);
    if matches!(operation, "CREATE" | "UPDATE") && !object.is_object() {
        return Err(invalid(format!(
            "request.object must be an object for {operation}"
        )));
    }
    Ok(Request {
        uid,
        kind,
        operation,
        namespace: request.namespace.0.unwrap_or_default(),
        name: request.name.0.unwrap_or_default(),
        dry_run: request.dry_run.0.unwrap_or(false),
        object,
    })
}

/// An allowing response (the AdmissionReview's JSON), with the patch when it is not empty.
///
/// Written straight into bytes, not through a `Value`: the keys in the order a `Value` would
/// write them, strings escaped by serde_json, the patch in standard base64 as Go's
/// `[]byte` is.
pub fn allow(uid: &str, patch: &JsonPatch, warnings: &[String]) -> Vec<u8> {
    use base64::Engine as _;
    let patch = (!patch.is_empty()).then(|| patch.to_bytes());
    let encoded = patch.as_ref().map_or(0, |p| p.len().div_ceil(3) * 4);
    let mut out = Vec::with_capacity(160 + uid.len() + encoded);
    out.extend_from_slice(HEAD);
    out.extend_from_slice(br#""allowed":true"#);
    if let Some(patch) = patch {
        out.extend_from_slice(br#","patch":""#);
        let start = out.len();
        out.resize(start + encoded, 0);
        let written = base64::engine::general_purpose::STANDARD
            .encode_slice(&patch, &mut out[start..])
            .unwrap_or_default();
        out.truncate(start + written);
        out.extend_from_slice(br#"","patchType":"JSONPatch""#);
    }
    out.extend_from_slice(br#","uid":"#);
    write_json(&mut out, uid);
    if !warnings.is_empty() {
        out.extend_from_slice(br#","warnings":"#);
        write_json(&mut out, warnings);
    }
    out.extend_from_slice(b"}}");
    out
}

/// A refusing response (the AdmissionReview's JSON) with an HTTP-like code and a message.
pub fn deny(uid: &str, code: u16, message: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + uid.len() + message.len());
    out.extend_from_slice(HEAD);
    out.extend_from_slice(br#""allowed":false,"status":{"code":"#);
    out.extend_from_slice(code.to_string().as_bytes());
    out.extend_from_slice(br#","message":"#);
    write_json(&mut out, message);
    out.extend_from_slice(br#","status":"Failure"},"uid":"#);
    write_json(&mut out, uid);
    out.extend_from_slice(b"}}");
    out
}

/// What every response starts with, up to the first field of `response`.
const HEAD: &[u8] = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"#;

/// Writes `value` as JSON (strings escaped as serde_json escapes them).
fn write_json<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Writing strings into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

/// Records the object's name in the review span when the request did not carry one (objects
/// named by the API server from `generateName`).
pub(crate) fn record_name<O>(req: &Request<'_, O>, name: &str) {
    if req.name.is_empty() && !name.is_empty() {
        tracing::Span::current().record("name", name);
    }
}

/// `request.object` as a `Value`, or the refusal to answer with.
pub(crate) fn object_value(req: &Request<'_>) -> Result<Value, (u16, String)> {
    let object = req
        .object_value()
        .map_err(|e| (400, format!("request.object: {e}")))?;
    record_name(req, object_name(&object));
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let mut scratch = None;
        let r = parse(&v, &mut scratch).unwrap();
        assert_eq!(
            (
                &*r.uid,
                &*r.kind,
                r.operation,
                &*r.namespace,
                &*r.name,
                r.dry_run
            ),
            ("u1", "Pod", "CREATE", "ns", "", true)
        );
        assert_eq!(r.object_value().unwrap(), v["request"]["object"]);
    }

    #[test]
    fn reads_bytes_as_a_value_would() {
        // Escapes, a key twice (the last counts, as in a `Value`), fields of unexpected types.
        let body = br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u\u0031", "uid": "u2", "kind": {"kind": "Pod"},
                        "operation": "DELETE", "namespace": 7, "dryRun": "yes", "object": null}}"#;
        let mut scratch = None;
        let r = decode(body, &mut scratch).unwrap();
        assert_eq!(
            (
                &*r.uid,
                r.operation,
                &*r.namespace,
                r.dry_run,
                r.object.get()
            ),
            ("u2", "DELETE", "", false, "null")
        );
        assert!(scratch.is_some(), "read through a Value");
        let mut scratch = None;
        let r = decode(
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "caf\u00e9", "kind": {"kind": "Pod"}, "operation": "CONNECT"}}"#,
            &mut scratch,
        )
        .unwrap();
        assert_eq!((&*r.uid, r.object.get()), ("caf\u{e9}", "null"));
        assert!(scratch.is_none(), "decoded directly");
    }

    #[test]
    fn reads_the_pod_in_the_same_pass_as_a_second_pass_would() {
        use meshgate_core::view::{PodView, read_pod};
        let head = r#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": "#;
        let objects = [
            r#"{"metadata": {"name": "p", "labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i"}], "hostNetwork": true}}"#,
            // A key twice (the last counts, as in a `Value`), in the pod and around it.
            r#"{"metadata": {"name": "first", "name": "last"}, "spec": {"hostNetwork": 3}}"#,
            r#"{"metadata": [], "spec": {"initContainers": [{"name": "x"}, 7]}}"#,
            "{}",
        ];
        for object in objects {
            let body = format!("{head}{object}}}}}");
            let (mut one, mut two) = (None, None);
            let direct = decode_as::<Obj<PodView<'_>>>(body.as_bytes(), &mut one)
                .unwrap_or_else(|e| panic!("{object}: {e}"));
            let text = decode(body.as_bytes(), &mut two).unwrap_or_else(|e| panic!("{e}"));
            read_pod(text.object.get(), |second| {
                assert_eq!(direct.object.0.as_ref(), Some(second), "{object}");
            })
            .unwrap_or_else(|e| panic!("{object}: {e}"));
        }
        // Not an object: absent for a DELETE, refused for a CREATE, as for the text.
        let body = format!("{head}null}}}}").replace("CREATE", "DELETE");
        let mut scratch = None;
        let r = decode_as::<Obj<PodView<'_>>>(body.as_bytes(), &mut scratch)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(r.object.0.is_none());
        let body = format!("{head}\"pod\"}}}}");
        assert!(matches!(
            decode_as::<Obj<PodView<'_>>>(body.as_bytes(), &mut None),
            Err(ReviewError::Invalid { message, .. }) if message.contains("request.object")
        ));
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
            match parse(&v, &mut None) {
                Err(ReviewError::Unanswerable(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        let mut v = good();
        v["apiVersion"] = json!("admission.k8s.io/v1beta1");
        assert!(
            matches!(parse(&v, &mut None), Err(ReviewError::Invalid { message, .. }) if message.contains("v1beta1"))
        );
        let mut v = good();
        v["request"]["object"] = json!("x");
        assert!(
            matches!(parse(&v, &mut None), Err(ReviewError::Invalid { message, .. }) if message.contains("request.object"))
        );
        let mut v = good();
        v["request"]["operation"] = json!("PATCH");
        assert!(parse(&v, &mut None).is_err());
        // Bytes that are not JSON in a field nobody reads: refused all the same.
        for body in [
            &b"{\"apiVersion\": \"admission.k8s.io/v1\", \"x\": \"\xff\", \"request\": {}}"[..],
            br#"{"apiVersion": "admission.k8s.io/v1", "x": "\q", "request": {"uid": "u"}}"#,
            br#"{"apiVersion": "admission.k8s.io/v1", "request": {"uid": "\ud800"}}"#,
        ] {
            assert!(serde_json::from_slice::<Value>(body).is_err());
            assert!(
                matches!(decode(body, &mut None), Err(ReviewError::NotJson(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // A documented difference: a lone surrogate escape in a string nobody reads.
        let body =
            br#"{"apiVersion": "admission.k8s.io/v1", "x": "\ud800", "request": {"uid": "u"}}"#;
        assert!(serde_json::from_slice::<Value>(body).is_err());
        assert!(matches!(
            decode(body, &mut None),
            Err(ReviewError::Invalid { uid, .. }) if uid == "u"
        ));
        assert!(matches!(
            decode(b"{\"request\": ", &mut None),
            Err(ReviewError::NotJson(m)) if m.contains("EOF")
        ));
    }

    #[test]
    fn responses_are_well_formed() {
        let value = |bytes: Vec<u8>| -> Value {
            serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!("{e}: {}", String::from_utf8_lossy(&bytes));
            })
        };
        let mut p = JsonPatch::default();
        p.add("/metadata/labels", json!({"a": "b\"c"}));
        let uid = "u\"\\\u{1}é";
        let r = value(allow(uid, &p, &["w \"1\"".into(), "w2".into()]));
        assert_eq!(
            r,
            json!({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": {
                "uid": uid, "allowed": true, "patchType": "JSONPatch",
                // Go's []byte: standard base64, padded.
                "patch": k8s_openapi::ByteString(p.to_bytes()),
                "warnings": ["w \"1\"", "w2"],
            }})
        );
        // The keys in a `Value`'s order: the same bytes as serialising the `Value`.
        assert_eq!(
            String::from_utf8(allow(uid, &p, &["w".into()])).ok(),
            serde_json::to_string(&value(allow(uid, &p, &["w".into()]))).ok()
        );
        for len in 0..6 {
            let mut p = JsonPatch::default();
            p.add("/x", json!("y".repeat(len)));
            let r = value(allow("u", &p, &[]));
            assert_eq!(
                r["response"]["patch"],
                json!(k8s_openapi::ByteString(p.to_bytes()))
            );
        }
        let r = value(allow("u", &JsonPatch::default(), &[]));
        assert_eq!(
            r,
            json!({"apiVersion": API_VERSION, "kind": "AdmissionReview",
                   "response": {"uid": "u", "allowed": true}})
        );
        let r = value(deny("u\n", 400, "bad \"x\"\n"));
        assert_eq!(
            r,
            json!({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": {
                "uid": "u\n", "allowed": false,
                "status": {"code": 400, "message": "bad \"x\"\n", "status": "Failure"},
            }})
        );
        assert_eq!(
            String::from_utf8(deny("u", 500, "m")).ok(),
            serde_json::to_string(&value(deny("u", 500, "m"))).ok()
        );
    }
}
