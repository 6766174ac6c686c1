//! RFC 6902 JSON patches, strictly or with the leniencies Kyverno applies to its
//! `patchesJson6902` (evanphx/json-patch v5 `ApplyOptions{SupportNegativeIndices,
//! AllowMissingPathOnRemove, EnsurePathExistsOnAdd}`), each chosen by
//! [`JsonPatchOptions`]:
//!
//! * **negative indices**: an array index below 0 counts from the end: `-1` is the last element
//!   for `remove`, `replace`, `test`, `copy`/`move` sources; for `add`, `-1` appends and
//!   `-(len+1)` inserts first (the index is `len + 1 + i`). Beyond that, an error.
//! * **missing path on remove**: a `remove` whose path (or parent) does not exist, or whose
//!   index is out of range, does nothing. A non-numeric array index is still an error.
//! * **path exists on add**: `add` creates missing (or `null`) parents: an array when the
//!   segment after it is a number or `-`, otherwise an object; an array is padded with `null`
//!   up to an index past its end. A scalar parent is still an error; `copy` and `move` create
//!   nothing.
//!
//! Strict (every option off): RFC 6902. A `replace` or `test` of a missing path is an error in
//! both modes (`test` of a missing path passes only for `null`, as in Kyverno's library).

use meshgate_api::mutation_policy::{JsonPatchOp, JsonPatchOperation, JsonPatchOptions};
use serde_json::Value;

/// Applies `ops` in order to `doc`. On an error, returns the failing operation's index and why,
/// and `doc` may be partly patched (the caller works on a copy).
pub fn apply(
    doc: &mut Value,
    ops: &[JsonPatchOperation],
    options: &JsonPatchOptions,
) -> Result<(), (usize, String)> {
    for (i, op) in ops.iter().enumerate() {
        apply_one(doc, op, options).map_err(|e| (i, e))?;
    }
    Ok(())
}

fn apply_one(doc: &mut Value, op: &JsonPatchOperation, o: &JsonPatchOptions) -> Result<(), String> {
    let path = tokens(&op.path)?;
    let value = || {
        op.value
            .clone()
            .ok_or_else(|| format!("{:?} {}: needs a value", op.op, op.path))
    };
    let from = || {
        op.from
            .as_deref()
            .ok_or_else(|| format!("{:?} {}: needs `from`", op.op, op.path))
            .and_then(tokens)
    };
    match op.op {
        JsonPatchOp::Add => add(
            doc,
            &path,
            value()?,
            o,
            o.ensure_path_exists_on_add,
            &op.path,
        ),
        JsonPatchOp::Remove => remove(doc, &path, o, &op.path).map(|_| ()),
        JsonPatchOp::Replace => {
            let target = get_mut(doc, &path, o)
                .ok_or_else(|| format!("replace {}: the path does not exist", op.path))?;
            *target = value()?;
            Ok(())
        }
        JsonPatchOp::Test => {
            // `value: null` reads as no value.
            let want = op.value.clone().unwrap_or(Value::Null);
            let found = get_mut(doc, &path, o).map(|v| &*v);
            let ok = match found {
                Some(v) => *v == want,
                None => want.is_null(),
            };
            if ok {
                Ok(())
            } else {
                Err(format!("test {}: value did not match", op.path))
            }
        }
        JsonPatchOp::Copy => {
            let from_tokens = from()?;
            let v = get_mut(doc, &from_tokens, o)
                .map(|v| v.clone())
                .ok_or_else(|| format!("copy from {:?}: the path does not exist", op.from))?;
            add(doc, &path, v, o, false, &op.path)
        }
        JsonPatchOp::Move => {
            let from_tokens = from()?;
            if path.len() > from_tokens.len() && path[..from_tokens.len()] == from_tokens[..] {
                return Err(format!(
                    "move {:?} to {}: cannot move a value into itself",
                    op.from, op.path
                ));
            }
            let strict_remove = JsonPatchOptions {
                allow_missing_path_on_remove: false,
                ..o.clone()
            };
            let v = remove(
                doc,
                &from_tokens,
                &strict_remove,
                op.from.as_deref().unwrap_or(""),
            )?
            .ok_or_else(|| format!("move from {:?}: the path does not exist", op.from))?;
            add(doc, &path, v, o, false, &op.path)
        }
    }
}

/// The reference tokens of a JSON pointer (`~1` is `/`, `~0` is `~`).
fn tokens(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(format!("path {pointer:?} must start with '/'"));
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

/// An index into an array of `len` elements. `for_add`: `-` and `len` are allowed (append).
fn index(token: &str, len: usize, o: &JsonPatchOptions, for_add: bool) -> Result<usize, String> {
    if token == "-" {
        return if for_add {
            Ok(len)
        } else {
            Err("`-` names no element".to_owned())
        };
    }
    let bad = || format!("{token:?} is not an array index");
    if token.starts_with('+') || (token.len() > 1 && token.starts_with('0')) {
        return Err(bad());
    }
    let i: i64 = token.parse().map_err(|_| bad())?;
    let len_i = i64::try_from(len).map_err(|_| bad())?;
    let resolved = if i < 0 {
        if !o.negative_indices {
            return Err(format!("negative index {i} (not enabled)"));
        }
        if for_add { len_i + 1 + i } else { len_i + i }
    } else {
        i
    };
    let limit = if for_add { len_i } else { len_i - 1 };
    if resolved < 0 || resolved > limit {
        return Err(format!("index {i} is out of range (length {len})"));
    }
    usize::try_from(resolved).map_err(|_| bad())
}

fn get_mut<'v>(doc: &'v mut Value, path: &[String], o: &JsonPatchOptions) -> Option<&'v mut Value> {
    let mut cur = doc;
    for t in path {
        cur = match cur {
            Value::Object(m) => m.get_mut(t)?,
            Value::Array(a) => {
                let i = index(t, a.len(), o, false).ok()?;
                a.get_mut(i)?
            }
            _ => return None,
        };
    }
    Some(cur)
}

fn is_array_token(t: &str) -> bool {
    t == "-" || t.parse::<i64>().is_ok()
}

/// Creates the missing (or `null`) containers along `parents`; `last` is the token after them.
fn ensure_parents(
    doc: &mut Value,
    parents: &[String],
    last: &str,
    o: &JsonPatchOptions,
) -> Result<(), String> {
    let mut cur = doc;
    for (k, t) in parents.iter().enumerate() {
        let next = parents.get(k + 1).map_or(last, String::as_str);
        let fresh = || {
            if is_array_token(next) {
                Value::Array(Vec::new())
            } else {
                Value::Object(serde_json::Map::new())
            }
        };
        cur = match cur {
            Value::Object(m) => {
                let slot = m.entry(t.clone()).or_insert(Value::Null);
                if slot.is_null() {
                    *slot = fresh();
                }
                slot
            }
            Value::Array(a) => {
                if t == "-" {
                    return Err("`-` cannot name a parent".to_owned());
                }
                let i: i64 = t
                    .parse()
                    .map_err(|_| format!("{t:?} is not an array index"))?;
                let i = if i < 0 {
                    if !o.negative_indices {
                        return Err(format!("negative index {i} (not enabled)"));
                    }
                    let len = i64::try_from(a.len()).unwrap_or(i64::MAX);
                    if a.is_empty() && i == -1 { 0 } else { len + i }
                } else {
                    i
                };
                let i = usize::try_from(i).map_err(|_| format!("index {t} is out of range"))?;
                if a.len() <= i {
                    a.resize(i + 1, Value::Null);
                }
                if a[i].is_null() {
                    a[i] = fresh();
                }
                &mut a[i]
            }
            _ => return Err("a parent is not an object or array".to_owned()),
        };
    }
    Ok(())
}

fn add(
    doc: &mut Value,
    path: &[String],
    value: Value,
    o: &JsonPatchOptions,
    ensure: bool,
    pointer: &str,
) -> Result<(), String> {
    let Some((last, parents)) = path.split_last() else {
        *doc = value;
        return Ok(());
    };
    if ensure {
        ensure_parents(doc, parents, last, o).map_err(|e| format!("add {pointer}: {e}"))?;
    }
    let parent = get_mut(doc, parents, o)
        .ok_or_else(|| format!("add {pointer}: the parent does not exist"))?;
    match parent {
        Value::Object(m) => {
            m.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(a) => {
            let i = index(last, a.len(), o, true).map_err(|e| format!("add {pointer}: {e}"))?;
            a.insert(i, value);
            Ok(())
        }
        _ => Err(format!(
            "add {pointer}: the parent is not an object or array"
        )),
    }
}

/// Removes and returns the value at `path`; `Ok(None)` when it is missing and the options
/// allow that.
fn remove(
    doc: &mut Value,
    path: &[String],
    o: &JsonPatchOptions,
    pointer: &str,
) -> Result<Option<Value>, String> {
    let Some((last, parents)) = path.split_last() else {
        return Err(format!(
            "remove {pointer:?}: cannot remove the whole object"
        ));
    };
    let missing = || {
        if o.allow_missing_path_on_remove {
            Ok(None)
        } else {
            Err(format!("remove {pointer}: the path does not exist"))
        }
    };
    let Some(parent) = get_mut(doc, parents, o) else {
        return missing();
    };
    match parent {
        Value::Object(m) => match m.remove(last) {
            Some(v) => Ok(Some(v)),
            None => missing(),
        },
        Value::Array(a) => {
            if last.parse::<i64>().is_err() {
                return Err(format!("remove {pointer}: {last:?} is not an array index"));
            }
            match index(last, a.len(), o, false) {
                Ok(i) => Ok(Some(a.remove(i))),
                Err(e) if o.allow_missing_path_on_remove && !e.contains("not enabled") => Ok(None),
                Err(e) => Err(format!("remove {pointer}: {e}")),
            }
        }
        _ => missing(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kyverno() -> JsonPatchOptions {
        JsonPatchOptions {
            negative_indices: true,
            allow_missing_path_on_remove: true,
            ensure_path_exists_on_add: true,
        }
    }

    fn run(doc: Value, ops: Value, o: &JsonPatchOptions) -> Result<Value, (usize, String)> {
        let ops: Vec<JsonPatchOperation> = serde_json::from_value(ops).expect("ops");
        let mut doc = doc;
        apply(&mut doc, &ops, o).map(|()| doc)
    }

    #[test]
    fn negative_indices_as_kyverno() {
        let d = json!({"a": [1, 2, 3]});
        let k = kyverno();
        let add = |p: &str| run(d.clone(), json!([{"op": "add", "path": p, "value": 9}]), &k);
        assert_eq!(add("/a/-1").unwrap(), json!({"a": [1, 2, 3, 9]}));
        assert_eq!(add("/a/-4").unwrap(), json!({"a": [9, 1, 2, 3]}));
        assert!(add("/a/-5").is_err());
        assert_eq!(add("/a/3").unwrap(), json!({"a": [1, 2, 3, 9]}));
        assert!(add("/a/4").is_err());
        let one = |op: &str| {
            run(
                d.clone(),
                json!([{"op": op, "path": "/a/-1", "value": 3}]),
                &k,
            )
        };
        assert_eq!(one("replace").unwrap(), json!({"a": [1, 2, 3]}));
        assert_eq!(one("remove").unwrap(), json!({"a": [1, 2]}));
        assert!(one("test").is_ok());
        // Strict: an error.
        let strict = JsonPatchOptions::default();
        assert!(
            run(
                d.clone(),
                json!([{"op": "remove", "path": "/a/-1"}]),
                &strict
            )
            .is_err()
        );
    }

    #[test]
    fn remove_of_a_missing_path_is_a_no_op_when_allowed() {
        let d = json!({"a": [1], "m": {"k": 1}});
        for path in ["/m/nope", "/x/y/z", "/a/5", "/a/-3"] {
            let ops = json!([{"op": "remove", "path": path}]);
            assert_eq!(
                run(d.clone(), ops.clone(), &kyverno()).unwrap(),
                d,
                "{path}"
            );
            let err = run(d.clone(), ops, &JsonPatchOptions::default()).unwrap_err();
            assert!(
                err.1.contains(path) || err.1.contains("range") || err.1.contains("negative"),
                "{err:?}"
            );
        }
        assert!(run(d, json!([{"op": "remove", "path": "/a/x"}]), &kyverno()).is_err());
    }

    #[test]
    fn add_creates_missing_parents_when_allowed() {
        let k = kyverno();
        let add = |d: Value, p: &str| run(d, json!([{"op": "add", "path": p, "value": 1}]), &k);
        assert_eq!(
            add(json!({}), "/a/b/c").unwrap(),
            json!({"a": {"b": {"c": 1}}})
        );
        assert_eq!(
            add(json!({}), "/n/2/p").unwrap(),
            json!({"n": [null, null, {"p": 1}]})
        );
        assert_eq!(
            add(json!({"n": null}), "/n/k").unwrap(),
            json!({"n": {"k": 1}})
        );
        assert_eq!(
            add(json!({"a": [1, 2, 3]}), "/a/5/p").unwrap(),
            json!({"a": [1, 2, 3, null, null, {"p": 1}]})
        );
        assert!(add(json!({}), "/n/-/p").is_err());
        assert!(add(json!({"s": "x"}), "/s/k").is_err());
        let strict = run(
            json!({}),
            json!([{"op": "add", "path": "/a/b", "value": 1}]),
            &JsonPatchOptions::default(),
        );
        assert!(strict.unwrap_err().1.contains("/a/b"));
    }

    #[test]
    fn replace_and_test_of_missing_paths() {
        let k = kyverno();
        assert!(
            run(
                json!({}),
                json!([{"op": "replace", "path": "/a", "value": 1}]),
                &k
            )
            .is_err()
        );
        assert!(
            run(
                json!({}),
                json!([{"op": "test", "path": "/a", "value": null}]),
                &k
            )
            .is_ok()
        );
        let err = run(
            json!({"a": 1}),
            json!([{"op": "test", "path": "/a", "value": 2}]),
            &k,
        )
        .unwrap_err();
        assert_eq!(err.0, 0);
        assert!(err.1.contains("value did not match"));
    }

    #[test]
    fn copy_and_move_create_nothing_and_escape_pointers() {
        let k = kyverno();
        let d = json!({"a/b": {"~": 1}, "c": {}});
        let out = run(
            d.clone(),
            json!([{"op": "copy", "from": "/a~1b/~0", "path": "/c/x"}]),
            &k,
        )
        .unwrap();
        assert_eq!(out["c"]["x"], 1);
        assert!(
            run(
                d.clone(),
                json!([{"op": "copy", "from": "/c", "path": "/n/x"}]),
                &k
            )
            .is_err()
        );
        let out = run(
            d.clone(),
            json!([{"op": "move", "from": "/a~1b", "path": "/c/m"}]),
            &k,
        )
        .unwrap();
        assert_eq!(out, json!({"c": {"m": {"~": 1}}}));
        assert!(run(d, json!([{"op": "move", "from": "/c", "path": "/c/d"}]), &k).is_err());
    }
}
