//! Wildcards and the value patterns of conditional and global anchors.
//!
//! Kyverno evaluates an anchor's value with its `validate` pattern matcher. meshgate implements the
//! part of it that is meaningful for mutation conditions:
//!
//! * strings are wildcard patterns (`*` any run of characters, `?` exactly one character) that may
//!   be combined with `|` (any alternative), `&` (every part) and a leading `!` (negation), matched
//!   against the resource value rendered as text (strings as they are, numbers and booleans in
//!   their JSON form); `*` alone matches any present value, objects and lists included;
//! * numbers match numerically equal numbers (or strings that parse to them), booleans and `null`
//!   match themselves;
//! * an object matches an object holding every key of the pattern with a matching value
//!   (`{}` matches any object);
//! * a list whose first element is an object matches a list whose every element matches that
//!   first element; a list of scalars matches a list at least as long whose leading elements
//!   match pairwise; an empty list matches only an empty list.
//!
//! Kyverno's numeric comparison operators (`>`, `<`, `>=`, `<=`) and ranges (`1-10`) are not
//! implemented; [`unsupported_operator`] lets validation reject the former.

use serde_json::Value;

/// Shell-style match of `text` against `pattern`: `*` is any run of characters (also empty), `?`
/// exactly one character, everything else matches itself.
pub fn wildcard_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0usize, 0usize);
    // Position of the last `*` in the pattern and the text position it was tried at.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(c) if *c == '?' || *c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Whether the resource value `resource` satisfies the anchor value `pattern`.
pub fn value_matches(pattern: &Value, resource: &Value) -> bool {
    match pattern {
        Value::String(p) => {
            if p == "*" {
                return true;
            }
            match resource {
                Value::String(s) => string_matches(p, s),
                Value::Number(n) => string_matches(p, &n.to_string()),
                Value::Bool(b) => string_matches(p, if *b { "true" } else { "false" }),
                Value::Null => string_matches(p, ""),
                Value::Array(_) | Value::Object(_) => false,
            }
        }
        Value::Number(p) => match resource {
            Value::Number(r) => numbers_equal(p, r),
            Value::String(s) => s
                .trim()
                .parse::<f64>()
                .ok()
                .zip(p.as_f64())
                .is_some_and(|(a, b)| a == b),
            _ => false,
        },
        Value::Bool(p) => resource.as_bool() == Some(*p),
        Value::Null => resource.is_null(),
        Value::Object(p) => resource.as_object().is_some_and(|r| {
            p.iter()
                .all(|(k, pv)| r.get(k).is_some_and(|rv| value_matches(pv, rv)))
        }),
        Value::Array(p) => {
            let Some(r) = resource.as_array() else {
                return false;
            };
            match p.first() {
                None => r.is_empty(),
                Some(first @ Value::Object(_)) => r.iter().all(|re| value_matches(first, re)),
                Some(_) => {
                    r.len() >= p.len() && p.iter().zip(r).all(|(pe, re)| value_matches(pe, re))
                }
            }
        }
    }
}

fn numbers_equal(a: &serde_json::Number, b: &serde_json::Number) -> bool {
    if let (Some(x), Some(y)) = (a.as_i64(), b.as_i64()) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (a.as_u64(), b.as_u64()) {
        return x == y;
    }
    a.as_f64().zip(b.as_f64()).is_some_and(|(x, y)| x == y)
}

/// Kyverno's string pattern: `a|b` (either), `a&b` (both), `!a` (not), wildcards in each operand.
fn string_matches(pattern: &str, text: &str) -> bool {
    pattern.split('|').any(|alternative| {
        alternative
            .split('&')
            .all(|operand| match operand.strip_prefix('!') {
                Some(negated) => !wildcard_match(negated, text),
                None => wildcard_match(operand, text),
            })
    })
}

/// The first operand of a string pattern that uses a Kyverno operator meshgate does not
/// implement (`>`, `<`, `>=`, `<=`), if any.
pub fn unsupported_operator(pattern: &str) -> Option<&str> {
    pattern
        .split('|')
        .flat_map(|a| a.split('&'))
        .find(|operand| operand.starts_with('>') || operand.starts_with('<'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wildcards() {
        assert!(wildcard_match("*", ""));
        assert!(wildcard_match("*", "anything"));
        assert!(wildcard_match("*:latest", "nginx:latest"));
        assert!(!wildcard_match("*:latest", "nginx:1.25"));
        assert!(wildcard_match("team-?", "team-a"));
        assert!(!wildcard_match("team-?", "team-ab"));
        assert!(!wildcard_match("team-?", "team-"));
        assert!(wildcard_match("a*b*c", "aXXbYYc"));
        assert!(wildcard_match("a*b*c", "abc"));
        assert!(!wildcard_match("a*b*c", "acb"));
        assert!(wildcard_match("prod", "prod"));
        assert!(!wildcard_match("prod", "prod2"));
        assert!(wildcard_match("*-prod-*", "eu-prod-1"));
        assert!(wildcard_match("ünï*", "ünïcode"));
    }

    #[test]
    fn scalar_patterns() {
        assert!(value_matches(&json!("*:latest"), &json!("nginx:latest")));
        assert!(value_matches(&json!("*"), &json!({"a": 1})));
        assert!(value_matches(&json!("a|b"), &json!("b")));
        assert!(!value_matches(&json!("a|b"), &json!("c")));
        assert!(value_matches(&json!("!kube-*"), &json!("default")));
        assert!(!value_matches(&json!("!kube-*"), &json!("kube-system")));
        assert!(value_matches(&json!("x*&!*y"), &json!("xa")));
        assert!(!value_matches(&json!("x*&!*y"), &json!("xay")));
        assert!(value_matches(&json!(80), &json!(80)));
        assert!(value_matches(&json!(80), &json!("80")));
        assert!(value_matches(&json!("8?"), &json!(80)));
        assert!(value_matches(&json!(true), &json!(true)));
        assert!(!value_matches(&json!(true), &json!("true")));
        assert!(value_matches(&json!("true"), &json!(true)));
        assert!(value_matches(&Value::Null, &Value::Null));
        assert!(!value_matches(&json!("x"), &json!({"a": 1})));
    }

    #[test]
    fn structured_patterns() {
        assert!(value_matches(&json!({}), &json!({"medium": "Memory"})));
        assert!(!value_matches(&json!({}), &json!("x")));
        assert!(value_matches(
            &json!({"path": "/var/run/*"}),
            &json!({"path": "/var/run/docker.sock", "type": ""})
        ));
        assert!(!value_matches(
            &json!({"path": "/var/run/*"}),
            &json!({"type": ""})
        ));
        assert!(value_matches(
            &json!([{"name": "a*"}]),
            &json!([{"name": "ab"}, {"name": "ac"}])
        ));
        assert!(!value_matches(
            &json!([{"name": "a*"}]),
            &json!([{"name": "ab"}, {"name": "b"}])
        ));
        assert!(value_matches(&json!(["a", "b*"]), &json!(["a", "bc", "d"])));
        assert!(!value_matches(&json!(["a", "b*"]), &json!(["a"])));
        assert!(value_matches(&json!([]), &json!([])));
        assert!(!value_matches(&json!([]), &json!(["a"])));
    }

    #[test]
    fn operators_meshgate_does_not_implement() {
        assert_eq!(unsupported_operator(">3"), Some(">3"));
        assert_eq!(unsupported_operator("a|<=2"), Some("<=2"));
        assert_eq!(unsupported_operator("a|!b"), None);
    }
}
