//! Variables (`{{ expression }}`), preconditions and `foreach`, as Kyverno evaluates them, for the
//! variables that need no API call.
//!
//! # Variables
//! A string of a mutation (a label or annotation value, a strategic-merge key or value, a JSON
//! patch path or value, a condition's key or value) may hold `{{ expression }}`: a JMESPath
//! expression (the maintained `jmespath` crate, with Kyverno's common string functions added:
//! `to_upper`, `to_lower`, `trim`, `split`, `replace_all`, `truncate`, `equal_fold`,
//! `compare`) over these variables:
//! * `request.object`: the object the mutations are written against, as the mutation finds it:
//!   the Pod, or for a workload matched as Pod-shaped its pod template (Kyverno's pod-controller
//!   rules rewrite `request.object.spec` to the template's the same way), or the object itself
//!   for any other kind;
//! * `request.operation` (`CREATE`, `UPDATE`), `request.namespace`;
//! * in a `foreach`: `element` and `elementIndex`.
//!
//! A string that is one variable and nothing else takes the variable's value with its type
//! (`"{{ request.object.spec.containers }}"` is a list); variables inside a longer string are
//! written as text (a string as is, any other value as JSON). `\{{` is a literal `{{`. A variable
//! that resolves to nothing (`null`) is an error naming it, as in Kyverno ("variable substitution
//! failed"); the policy then fails on that object, alone. Any other root (Kyverno's
//! `serviceAccountName`, `images`, `request.userInfo`, context entries) is rejected by
//! `validate`.
//!
//! # Conditions
//! `all` must all hold and, when `any` is not empty, one of `any`. Operators: `Equals` /
//! `NotEquals` (a string value is a wildcard pattern, `*` and `?`; numbers compare by value;
//! anything else by JSON equality), `AnyIn` / `AllIn` / `AnyNotIn` / `AllNotIn` (the key, a
//! value or a list, against the value, a value or a list, with wildcards), `In` / `NotIn`
//! (Kyverno's older forms: every key element in the value / none), `GreaterThan`,
//! `GreaterThanOrEquals`, `LessThan`, `LessThanOrEquals` (numbers, numeric strings and
//! Kubernetes quantities). A comparison of values of no comparable type is false.

use std::sync::OnceLock;

use jmespath::functions::{ArgumentType, CustomFunction, Signature};
use jmespath::{Rcvar, Runtime, Variable};
use meshgate_api::mutation_policy::{ConditionOperator, Conditions, PreCondition};
use serde_json::{Map, Value};

use super::pattern::wildcard_match;

/// The variable roots meshgate provides.
pub const ROOTS: [&str; 3] = ["request", "element", "elementIndex"];

/// The variables of one evaluation.
#[derive(Clone, Debug)]
pub struct Vars {
    json: Value,
}

impl Vars {
    /// `request.object`, `request.operation`, `request.namespace`.
    pub fn new(object: &Value, operation: &str, namespace: &str) -> Self {
        let mut request = Map::new();
        request.insert("object".into(), object.clone());
        request.insert("operation".into(), Value::String(operation.into()));
        request.insert("namespace".into(), Value::String(namespace.into()));
        let mut root = Map::new();
        root.insert("request".into(), Value::Object(request));
        Self {
            json: Value::Object(root),
        }
    }

    /// These variables with `element` and `elementIndex`.
    pub fn with_element(&self, element: &Value, index: usize) -> Self {
        let mut json = self.json.clone();
        if let Value::Object(m) = &mut json {
            m.insert("element".into(), element.clone());
            m.insert("elementIndex".into(), Value::from(index));
        }
        Self { json }
    }

    /// Evaluates one JMESPath expression.
    pub fn eval(&self, expression: &str) -> Result<Value, String> {
        let compiled = runtime()
            .compile(expression)
            .map_err(|e| format!("{{{{ {expression} }}}}: {}", first_line(&e.to_string())))?;
        let result = compiled
            .search(&self.json)
            .map_err(|e| format!("{{{{ {expression} }}}}: {}", first_line(&e.to_string())))?;
        serde_json::to_value(&*result).map_err(|e| format!("{{{{ {expression} }}}}: {e}"))
    }

    /// `value` with every variable substituted (see the module documentation).
    pub fn substitute(&self, value: &Value) -> Result<Value, String> {
        match value {
            Value::String(s) => self.substitute_str(s),
            Value::Array(items) => items
                .iter()
                .map(|v| self.substitute(v))
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array),
            Value::Object(m) => {
                let mut out = Map::new();
                for (k, v) in m {
                    let key = match self.substitute_str(k)? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    out.insert(key, self.substitute(v)?);
                }
                Ok(Value::Object(out))
            }
            other => Ok(other.clone()),
        }
    }

    /// A string with its variables substituted: the variable's value when the string is one
    /// variable, else text.
    pub fn substitute_str(&self, s: &str) -> Result<Value, String> {
        if !s.contains("{{") {
            return Ok(Value::String(s.to_owned()));
        }
        let parts = split(s)?;
        if let [Part::Variable(expr)] = parts.as_slice() {
            return self.resolved(expr);
        }
        let mut out = String::new();
        for part in parts {
            match part {
                Part::Text(t) => out.push_str(&t),
                Part::Variable(expr) => match self.resolved(&expr)? {
                    Value::String(v) => out.push_str(&v),
                    other => out.push_str(&other.to_string()),
                },
            }
        }
        Ok(Value::String(out))
    }

    fn resolved(&self, expr: &str) -> Result<Value, String> {
        match self.eval(expr)? {
            Value::Null => Err(format!(
                "variable {{{{ {expr} }}}} resolves to nothing (null)"
            )),
            v => Ok(v),
        }
    }

    /// Whether `conditions` hold.
    pub fn holds(&self, conditions: &Conditions) -> Result<bool, String> {
        for c in &conditions.all {
            if !self.condition(c)? {
                return Ok(false);
            }
        }
        if conditions.any.is_empty() {
            return Ok(true);
        }
        for c in &conditions.any {
            if self.condition(c)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn condition(&self, c: &PreCondition) -> Result<bool, String> {
        // A key that resolves to nothing compares as null (Kyverno: an absent field in a
        // precondition is not an error).
        let key = self.lenient(&c.key)?;
        let value = match &c.value {
            Some(v) => self.lenient(v)?,
            None => Value::Null,
        };
        Ok(compare(c.operator, &key, &value))
    }

    fn lenient(&self, v: &Value) -> Result<Value, String> {
        match v {
            Value::String(s) if s.contains("{{") => match split(s)?.as_slice() {
                [Part::Variable(expr)] => self.eval(expr),
                _ => self.substitute_str(s),
            },
            other => self.substitute(other),
        }
    }
}

/// `Equals` and friends on resolved values.
pub fn compare(op: ConditionOperator, key: &Value, value: &Value) -> bool {
    use ConditionOperator::*;
    let items = |v: &Value| -> Vec<Value> {
        match v {
            Value::Array(a) => a.clone(),
            other => vec![other.clone()],
        }
    };
    let member = |k: &Value, set: &Value| items(set).iter().any(|s| equals(k, s));
    match op {
        Equals => equals(key, value),
        NotEquals => !equals(key, value),
        AnyIn => items(key).iter().any(|k| member(k, value)),
        AllIn | In => {
            let keys = items(key);
            !keys.is_empty() && keys.iter().all(|k| member(k, value))
        }
        AnyNotIn => items(key).iter().any(|k| !member(k, value)),
        AllNotIn | NotIn => items(key).iter().all(|k| !member(k, value)),
        GreaterThan | GreaterThanOrEquals | LessThan | LessThanOrEquals => {
            let (Some(a), Some(b)) = (number(key), number(value)) else {
                return false;
            };
            match op {
                GreaterThan => a > b,
                GreaterThanOrEquals => a >= b,
                LessThan => a < b,
                _ => a <= b,
            }
        }
    }
}

/// A string value is a wildcard pattern; numbers compare by value.
fn equals(key: &Value, value: &Value) -> bool {
    match (key, value) {
        (Value::String(k), Value::String(v)) => wildcard_match(v, k),
        (Value::Number(_), Value::Number(_)) => number(key) == number(value),
        // Kyverno compares a number with a numeric string by value.
        (Value::Number(_), Value::String(_)) | (Value::String(_), Value::Number(_)) => {
            number(key).is_some() && number(key) == number(value)
        }
        (Value::Bool(k), Value::String(v)) => v == &k.to_string(),
        _ => key == value,
    }
}

/// A number, a numeric string, or a Kubernetes quantity (`500m`, `1Gi`), as a float.
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => {
            s.trim().parse::<f64>().ok().or_else(|| {
                crate::quantity::Quantity::parse(s.trim()).map(|q| q.nanos() as f64 / 1e9)
            })
        }
        _ => None,
    }
}

#[derive(Debug, PartialEq)]
enum Part {
    Text(String),
    Variable(String),
}

/// Splits a string into text and `{{ }}` variables; `\{{` is literal.
fn split(s: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut rest = s;
    while let Some(at) = rest.find("{{") {
        if rest[..at].ends_with('\\') {
            text.push_str(&rest[..at - 1]);
            text.push_str("{{");
            rest = &rest[at + 2..];
            continue;
        }
        text.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| format!("{s:?}: a variable '{{{{' without its '}}}}'"))?;
        let expr = after[..end].trim();
        if expr.is_empty() {
            return Err(format!("{s:?}: an empty variable"));
        }
        if !text.is_empty() {
            parts.push(Part::Text(std::mem::take(&mut text)));
        }
        parts.push(Part::Variable(expr.to_owned()));
        rest = &after[end + 2..];
    }
    text.push_str(rest);
    if !text.is_empty() {
        parts.push(Part::Text(text));
    }
    Ok(parts)
}

/// The variables of `value` (strings and keys, recursively).
pub fn variables_in(value: &Value) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    collect(value, &mut out)?;
    Ok(out)
}

fn collect(value: &Value, out: &mut Vec<String>) -> Result<(), String> {
    let mut of = |s: &str| -> Result<(), String> {
        for p in split(s)? {
            if let Part::Variable(e) = p {
                out.push(e);
            }
        }
        Ok(())
    };
    match value {
        Value::String(s) => of(s),
        Value::Array(a) => a.iter().try_for_each(|v| collect(v, out)),
        Value::Object(m) => {
            for (k, v) in m {
                for p in split(k)? {
                    if let Part::Variable(e) = p {
                        out.push(e);
                    }
                }
                collect(v, out)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Whether `value` holds a variable anywhere.
pub fn has_variables(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains("{{"),
        Value::Array(a) => a.iter().any(has_variables),
        Value::Object(m) => m.iter().any(|(k, v)| k.contains("{{") || has_variables(v)),
        _ => false,
    }
}

/// Checks one expression: it compiles, and its root is one meshgate provides (`foreach`:
/// whether `element` and `elementIndex` are in scope).
pub fn check(expression: &str, foreach: bool) -> Result<(), String> {
    runtime()
        .compile(expression)
        .map_err(|e| format!("{{{{ {expression} }}}}: {}", first_line(&e.to_string())))?;
    let root: String = expression
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    let after = expression.trim_start()[root.len()..].trim_start();
    if root.is_empty() || after.starts_with('(') {
        // A literal, `@`, or a function call: its arguments name the roots.
        return Ok(());
    }
    if !ROOTS.contains(&root.as_str()) {
        return Err(format!(
            "{{{{ {expression} }}}}: variable {root:?} is not available (meshgate provides request.object, request.operation, request.namespace, and element and elementIndex in a foreach; context entries and other Kyverno variables are not supported)"
        ));
    }
    if !foreach && root.starts_with("element") {
        return Err(format!(
            "{{{{ {expression} }}}}: {root} is only defined inside a foreach"
        ));
    }
    Ok(())
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}

fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let mut rt = Runtime::new();
        rt.register_builtin_functions();
        let string = || ArgumentType::String;
        let text = |args: &[Rcvar], i: usize| -> String {
            args.get(i)
                .and_then(|a| a.as_string().cloned())
                .unwrap_or_default()
        };
        let out = |v: Variable| Ok(Rcvar::new(v));
        rt.register_function(
            "to_upper",
            Box::new(CustomFunction::new(
                Signature::new(vec![string()], None),
                Box::new(move |a, _| out(Variable::String(text(a, 0).to_uppercase()))),
            )),
        );
        rt.register_function(
            "to_lower",
            Box::new(CustomFunction::new(
                Signature::new(vec![string()], None),
                Box::new(move |a, _| out(Variable::String(text(a, 0).to_lowercase()))),
            )),
        );
        rt.register_function(
            "trim",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), string()], None),
                Box::new(move |a, _| {
                    let cut: Vec<char> = text(a, 1).chars().collect();
                    out(Variable::String(
                        text(a, 0).trim_matches(|c| cut.contains(&c)).to_owned(),
                    ))
                }),
            )),
        );
        rt.register_function(
            "split",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), string()], None),
                Box::new(move |a, _| {
                    let (s, sep) = (text(a, 0), text(a, 1));
                    let items: Vec<Rcvar> = if sep.is_empty() {
                        s.chars()
                            .map(|c| Rcvar::new(Variable::String(c.to_string())))
                            .collect()
                    } else {
                        s.split(sep.as_str())
                            .map(|p| Rcvar::new(Variable::String(p.to_owned())))
                            .collect()
                    };
                    out(Variable::Array(items))
                }),
            )),
        );
        rt.register_function(
            "replace_all",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), string(), string()], None),
                Box::new(move |a, _| {
                    out(Variable::String(
                        text(a, 0).replace(&text(a, 1), &text(a, 2)),
                    ))
                }),
            )),
        );
        rt.register_function(
            "truncate",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), ArgumentType::Number], None),
                Box::new(move |a, _| {
                    let n = a
                        .get(1)
                        .and_then(|v| v.as_number())
                        .map_or(0, |n| n.max(0.0) as usize);
                    out(Variable::String(text(a, 0).chars().take(n).collect()))
                }),
            )),
        );
        rt.register_function(
            "equal_fold",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), string()], None),
                Box::new(move |a, _| {
                    out(Variable::Bool(
                        text(a, 0).to_lowercase() == text(a, 1).to_lowercase(),
                    ))
                }),
            )),
        );
        rt.register_function(
            "compare",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), string()], None),
                Box::new(move |a, _| {
                    let ord = text(a, 0).cmp(&text(a, 1)) as i8;
                    out(Variable::Number(serde_json::Number::from(ord)))
                }),
            )),
        );
        rt
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vars() -> Vars {
        Vars::new(
            &json!({"metadata": {"name": "web", "labels": {"app": "shop"}},
                    "spec": {"containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:2"}]}}),
            "CREATE",
            "team-a",
        )
    }

    #[test]
    fn a_whole_string_variable_keeps_its_type_and_text_interpolates() {
        let v = vars();
        assert_eq!(
            v.substitute_str("{{ request.object.spec.containers[].name }}"),
            Ok(json!(["a", "b"]))
        );
        assert_eq!(
            v.substitute_str("{{request.namespace}}-{{ request.object.metadata.name }}"),
            Ok(json!("team-a-web"))
        );
        assert_eq!(
            v.substitute_str("n={{ length(request.object.spec.containers) }}"),
            Ok(json!("n=2"))
        );
        assert_eq!(
            v.substitute_str(r"\{{ literal }}"),
            Ok(json!("{{ literal }}"))
        );
        assert_eq!(
            v.substitute_str("{{ to_upper(request.operation) }}"),
            Ok(json!("CREATE"))
        );
        assert_eq!(
            v.substitute_str("{{ split(request.object.spec.containers[1].image, ':')[1] }}"),
            Ok(json!("2"))
        );
        let e = v.with_element(&json!({"name": "b"}), 1);
        assert_eq!(
            e.substitute(&json!({"name": "{{ element.name }}", "i": "{{ elementIndex }}"})),
            Ok(json!({"name": "b", "i": 1}))
        );
        let err = v
            .substitute_str("{{ request.object.metadata.missing }}")
            .expect_err("null");
        assert!(err.contains("resolves to nothing"), "{err}");
        assert!(v.substitute_str("{{ request.").is_err());
    }

    #[test]
    fn checks_name_unknown_roots_and_element_outside_foreach() {
        assert_eq!(check("request.object.metadata.name", false), Ok(()));
        assert_eq!(check("to_upper(request.namespace)", false), Ok(()));
        assert!(check("serviceAccountName", false).is_err());
        assert!(check("element.name", false).is_err());
        assert_eq!(check("element.name", true), Ok(()));
        assert!(check("request.object.[", false).is_err());
    }

    #[test]
    fn operators_follow_kyverno() {
        use ConditionOperator::*;
        assert!(compare(Equals, &json!("nginx:1.2"), &json!("nginx:*")));
        assert!(compare(NotEquals, &json!("CREATE"), &json!("UPDATE")));
        assert!(compare(Equals, &json!(3), &json!("3")));
        assert!(compare(AnyIn, &json!(["a", "x"]), &json!(["x", "y"])));
        assert!(!compare(AllIn, &json!(["a", "x"]), &json!(["x", "y"])));
        assert!(compare(AllIn, &json!("x"), &json!(["x*"])));
        assert!(compare(AnyNotIn, &json!(["a", "x"]), &json!(["x"])));
        assert!(compare(AllNotIn, &json!(["a", "b"]), &json!(["x"])));
        assert!(compare(GreaterThan, &json!("2Gi"), &json!("1Gi")));
        assert!(compare(LessThanOrEquals, &json!(1), &json!(1.0)));
        assert!(!compare(GreaterThan, &json!("abc"), &json!(1)));
        let v = vars();
        let c: Conditions = serde_json::from_value(json!({
            "all": [{"key": "{{ request.operation }}", "operator": "Equals", "value": "CREATE"}],
            "any": [{"key": "{{ request.object.metadata.labels.app }}", "operator": "AnyIn", "value": ["shop", "cart"]},
                    {"key": "{{ request.object.metadata.labels.missing }}", "operator": "Equals", "value": "x"}],
        }))
        .expect("conditions");
        assert_eq!(v.holds(&c), Ok(true));
    }
}
