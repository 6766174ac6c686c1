//! Variables (`{{ expression }}`), preconditions and `foreach`, as Kyverno evaluates them, for the
//! variables that need no API call.
//!
//! # Variables
//! A string of a mutation (a label or annotation value, a strategic-merge key or value, a JSON
//! patch path or value, a condition's key or value) may hold `{{ expression }}`: a JMESPath
//! expression (the maintained `jmespath` crate, with Kyverno's common string functions added:
//! `to_upper`, `to_lower`, `trim`, `split`, `replace_all`, `truncate`, `equal_fold`,
//! `compare`, `regex_replace_all`, `regex_replace_all_literal`, `regex_match`) over these
//! variables:
//! * `request.object`: the object the mutations are written against, as the mutation finds it:
//!   the Pod, or for a workload matched as Pod-shaped its pod template (Kyverno's pod-controller
//!   rules rewrite `request.object.spec` to the template's the same way), or the object itself
//!   for any other kind;
//! * `request.operation` (`CREATE`, `UPDATE`), `request.namespace`;
//! * `images`: the parsed image references of the object's containers, init containers and
//!   ephemeral containers (see the `images` module);
//! * the mutation's `context` entries (Kyverno's `variable` entries: `value`, `jmesPath`,
//!   `default`), evaluated in order, each seeing the earlier ones; in a foreach, its own entries
//!   per element, after `element` is set;
//! * in a `foreach`: `element` and `elementIndex`.
//!
//! Substitution is Kyverno's (`pkg/engine/variables/vars.go`): a variable is `{{`, characters
//! other than braces (or one-level `{...}` groups), `}}`, not preceded by `\`; the innermost
//! variables are substituted first, pass after pass, so `{{ images.containers."{{ element.name
//! }}".tag }}` and `'{{ element.image }}'` inside a function call work. A string that is one
//! variable and nothing else takes the variable's value with its type (`null` included);
//! variables inside a longer string are written as text (a string as is, any other value as
//! JSON, `null` as `null`). `{{- x }}` substitutes once (its value is not searched for
//! variables). `\{{` is a literal `{{`. A `{{` that does not form a variable is text.
//!
//! Evaluation is Kyverno's JMESPath (`kyverno/go-jmespath`): a key missing from an object on
//! the expression's path is an error ("unknown key", the policy fails on that object, alone),
//! but not under `||`, in function arguments, comparisons or projections, and a field of a
//! `null` value is `null`: `{{ element.resources.limits.memory ||
//! element.resources.requests.memory }}` is `null` for a container with neither, and a
//! strategic-merge `null` then changes nothing. A context entry or `images` that cannot be
//! evaluated is an error only for the expressions that name it (Kyverno loads them lazily).
//! Any other root (Kyverno's `serviceAccountName`, `request.userInfo`) is rejected by
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

use jmespath::ast::Ast;
use jmespath::functions::{ArgumentType, CustomFunction, Signature};
use jmespath::{Rcvar, Runtime, Variable};
use meshgate_api::mutation_policy::{ConditionOperator, Conditions, ContextEntry, PreCondition};
use serde_json::{Map, Value};

use super::context::{self, ClusterData};
use super::pattern::wildcard_match;

/// The variable roots meshgate provides (besides the mutation's context entries).
pub const ROOTS: [&str; 4] = ["request", "element", "elementIndex", "images"];

/// The variables of one evaluation.
#[derive(Clone, Debug)]
pub struct Vars {
    json: Value,
    /// Variables that could not be loaded (`images` of an object with an invalid image, a
    /// context entry that failed), by name, with the reason: an error for an expression that
    /// names them, nothing otherwise (Kyverno loads them lazily).
    failed: Vec<(String, String)>,
}

impl Vars {
    /// `request.object`, `request.operation`, `request.namespace`, and `images` of the object.
    pub fn new(object: &Value, operation: &str, namespace: &str) -> Self {
        let mut request = Map::new();
        request.insert("object".into(), object.clone());
        request.insert("operation".into(), Value::String(operation.into()));
        request.insert("namespace".into(), Value::String(namespace.into()));
        let mut root = Map::new();
        root.insert("request".into(), Value::Object(request));
        let mut failed = Vec::new();
        match super::images::images(object) {
            Ok(images) if images.is_empty() => {}
            Ok(images) => {
                root.insert("images".into(), Value::Object(images));
            }
            Err(e) => failed.push(("images".to_owned(), e)),
        }
        Self {
            json: Value::Object(root),
            failed,
        }
    }

    /// These variables with `element` and `elementIndex`.
    #[cfg(test)]
    fn with_element(&self, element: &Value, index: usize) -> Self {
        self.with_element_at(element, index, 0)
    }

    /// These variables with `element` and `elementIndex`, and `element<nesting>` and
    /// `elementIndex<nesting>` (Kyverno's `AddElement`, `pkg/engine/context/context.go`): the
    /// outer levels' stay visible under their numbered names.
    pub fn with_element_at(&self, element: &Value, index: usize, nesting: usize) -> Self {
        let mut out = self.clone();
        out.set("element", element.clone());
        out.set("elementIndex", Value::from(index));
        out.set(&format!("element{nesting}"), element.clone());
        out.set(&format!("elementIndex{nesting}"), Value::from(index));
        out
    }

    /// These variables with `request.object` (and `images`) of `object` (Kyverno's
    /// `AddResource` after a foreach entry changed the object).
    pub fn with_object(&self, object: &Value) -> Self {
        let mut out = self.clone();
        if let Some(request) = out.json.get_mut("request").and_then(Value::as_object_mut) {
            request.insert("object".into(), object.clone());
        }
        out.failed.retain(|(n, _)| n != "images");
        if let Value::Object(m) = &mut out.json {
            m.remove("images");
        }
        match super::images::images(object) {
            Ok(images) if images.is_empty() => {}
            Ok(images) => out.set("images", Value::Object(images)),
            Err(e) => out.failed.push(("images".to_owned(), e)),
        }
        out
    }

    fn set(&mut self, name: &str, value: Value) {
        self.failed.retain(|(n, _)| n != name);
        if let Value::Object(m) = &mut self.json {
            m.insert(name.to_owned(), value);
        }
    }

    /// These variables with the `context` entries, evaluated in order, each seeing the earlier
    /// ones (Kyverno's `variable` entries). An entry that fails is an error only for the
    /// expressions that name it, as Kyverno loads entries when a variable names them.
    pub fn with_context(&self, entries: &[ContextEntry], cluster: &dyn ClusterData) -> Self {
        let mut out = self.clone();
        for entry in entries {
            let value = match &entry.variable {
                Some(_) => out.context_value(entry),
                None => load(entry, cluster, &out),
            };
            match value {
                Ok(v) => out.set(&entry.name, v),
                Err(e) => {
                    if let Value::Object(m) = &mut out.json {
                        m.remove(&entry.name);
                    }
                    out.failed.retain(|(n, _)| n != &entry.name);
                    out.failed.push((
                        entry.name.clone(),
                        format!("context entry {:?}: {e}", entry.name),
                    ));
                }
            }
        }
        out
    }

    /// Kyverno's variable loader (`pkg/engine/context/loaders/variable.go`).
    fn context_value(&self, entry: &ContextEntry) -> Result<Value, String> {
        let Some(var) = &entry.variable else {
            return Err("not a variable entry".to_owned());
        };
        let path = match &var.jmes_path {
            Some(p) if !p.is_empty() => match self.substitute_str(p)? {
                Value::String(p) => Some(p),
                other => return Err(format!("jmesPath must be a string, not {other}")),
            },
            _ => None,
        };
        let default = var
            .default
            .as_ref()
            .map(|d| self.substitute(d))
            .transpose()?
            .filter(|d| !d.is_null());
        let output = match (&var.value, &path) {
            (Some(value), Some(path)) => {
                let value = self.substitute(value)?;
                match query(path, &value) {
                    Ok(v) => v,
                    Err(e) => default.ok_or(e)?,
                }
            }
            (Some(value), None) => self.substitute(value)?,
            (None, Some(path)) => match self.query(path) {
                Ok(Value::Null) => default.unwrap_or(Value::Null),
                Ok(v) => v,
                Err(e) => default.ok_or(e)?,
            },
            (None, None) => default.unwrap_or(Value::Null),
        };
        if output.is_null() {
            return Err("it evaluates to nothing (null)".to_owned());
        }
        Ok(output)
    }

    /// Evaluates one JMESPath expression as Kyverno does: a key missing from an object on the
    /// expression's path is an error ("Unknown key"), except under `||`, function arguments,
    /// comparisons and projections; a value that is `null` is `null`.
    pub fn query(&self, expression: &str) -> Result<Value, String> {
        if let Some((_, why)) = self.failed.iter().find(|(n, _)| names(expression, n)) {
            return Err(format!("{{{{ {expression} }}}}: {why}"));
        }
        query(expression, &self.json)
    }

    /// Evaluates one JMESPath expression; a missing key gives `null`.
    pub fn eval(&self, expression: &str) -> Result<Value, String> {
        if let Some((_, why)) = self.failed.iter().find(|(n, _)| names(expression, n)) {
            return Err(format!("{{{{ {expression} }}}}: {why}"));
        }
        let (compiled, data) = compile(expression, &self.json)?;
        let result = compiled
            .search(&data)
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

    /// A string with its variables substituted, as Kyverno's `substituteVariablesIfAny`.
    pub fn substitute_str(&self, s: &str) -> Result<Value, String> {
        substitute_text(s, &|e| self.query(e))
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
        // A key that resolves to nothing compares as null (an absent field in a precondition
        // is not an error).
        let key = self.lenient(&c.key)?;
        let value = match &c.value {
            Some(v) => self.lenient(v)?,
            None => Value::Null,
        };
        Ok(compare(c.operator, &key, &value))
    }

    fn lenient(&self, v: &Value) -> Result<Value, String> {
        match v {
            Value::String(s) => substitute_text(s, &|e| self.eval(e)),
            Value::Array(items) => items
                .iter()
                .map(|v| self.lenient(v))
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array),
            Value::Object(m) => {
                let mut out = Map::new();
                for (k, v) in m {
                    let key = match substitute_text(k, &|e| self.eval(e))? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    out.insert(key, self.lenient(v)?);
                }
                Ok(Value::Object(out))
            }
            other => Ok(other.clone()),
        }
    }
}

/// Whether `expression` names the variable `name`: Kyverno's deferred loader's test
/// (`(?:\A|\z|\s|[^.0-9A-Za-z])NAME\b`).
fn names(expression: &str, name: &str) -> bool {
    if name.is_empty() {
        return false;
    }
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    expression.match_indices(name).any(|(at, _)| {
        let before = expression[..at].chars().next_back();
        let after = expression[at + name.len()..].chars().next();
        let starts =
            before.is_none_or(|c| c.is_whitespace() || !(c == '.' || c.is_ascii_alphanumeric()));
        let first_word = name.chars().next().is_some_and(word);
        let last_word = name.chars().next_back().is_some_and(word);
        // `\b` after the name: a change between word and non-word characters.
        let boundary = match after {
            None => last_word,
            Some(c) => word(c) != last_word,
        };
        starts && boundary && (first_word || before.is_some())
    })
}

fn compile<'a>(
    expression: &str,
    data: &Value,
) -> Result<(jmespath::Expression<'a>, Rcvar), String> {
    let compiled = runtime()
        .compile(expression)
        .map_err(|e| format!("{{{{ {expression} }}}}: {}", first_line(&e.to_string())))?;
    let data = Rcvar::new(
        Variable::from_serializable(data).map_err(|e| format!("{{{{ {expression} }}}}: {e}"))?,
    );
    Ok((compiled, data))
}

/// Whether a JMESPath expression compiles, and if not, why.
pub fn compiles(expression: &str) -> Result<(), String> {
    runtime()
        .compile(expression)
        .map(|_| ())
        .map_err(|e| first_line(&e.to_string()).to_owned())
}

/// One JMESPath expression over `data`, with Kyverno's "Unknown key" errors.
pub(crate) fn query(expression: &str, data: &Value) -> Result<Value, String> {
    let (compiled, data) = compile(expression, data)?;
    let fail = |e: &dyn std::fmt::Display| {
        format!("{{{{ {expression} }}}}: {}", first_line(&e.to_string()))
    };
    let result = compiled.search(&data).map_err(|e| fail(&e))?;
    if let Some(key) = missing(compiled.as_ast(), &data).map_err(|e| fail(&e))? {
        return Err(format!(
            "{{{{ {expression} }}}}: unknown key {key:?} in path (the field is missing; Kyverno does not substitute it)"
        ));
    }
    serde_json::to_value(&*result).map_err(|e| fail(&e))
}

/// The key whose absence makes the expression fail in Kyverno's JMESPath
/// (`kyverno/go-jmespath`: a field missing from an object is `NotFoundError`, which
/// subexpressions and the right side of `&&` pass on, and everything else swallows).
fn missing(ast: &Ast, data: &Rcvar) -> Result<Option<String>, jmespath::JmespathError> {
    match ast {
        Ast::Field { name, .. } => Ok(match &**data {
            Variable::Object(m) if !m.contains_key(name) => Some(name.clone()),
            _ => None,
        }),
        Ast::Subexpr { lhs, rhs, .. } => {
            if let Some(key) = missing(lhs, data)? {
                return Ok(Some(key));
            }
            let left = part(lhs, data)?;
            missing(rhs, &left)
        }
        Ast::And { lhs, rhs, .. } => {
            if !part(lhs, data)?.is_truthy() {
                return Ok(None);
            }
            missing(rhs, data)
        }
        _ => Ok(None),
    }
}

/// One part of an expression, evaluated on its own.
fn part(ast: &Ast, data: &Rcvar) -> Result<Rcvar, jmespath::JmespathError> {
    jmespath::Expression::new(String::new(), ast.clone(), runtime()).search(data)
}

/// Kyverno's variable pattern: `{{`, then characters other than braces or one-level `{...}`
/// groups, then `}}`, at the start of the string or after a character other than `\`
/// (`pkg/engine/variables/regex`). Each match: (start of the preceding character or of the
/// variable, start of the variable, end).
fn find_variables(s: &str) -> Vec<(usize, usize, usize)> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut last_end = 0;
    let mut i = 0;
    while i + 1 < bytes.len() {
        if !(bytes[i] == b'{' && bytes[i + 1] == b'{') {
            i += 1;
            continue;
        }
        let prefix = if i == 0 {
            Some(0)
        } else {
            let prev = s[..i].char_indices().next_back();
            prev.filter(|(at, c)| *c != '\\' && *at >= last_end)
                .map(|(at, _)| at)
        };
        let Some(prefix) = prefix else {
            i += 1;
            continue;
        };
        // The body: non-brace characters, or `{...}` without braces inside.
        let mut j = i + 2;
        let end = loop {
            match bytes.get(j) {
                None => break None,
                Some(b'}') => break (bytes.get(j + 1) == Some(&b'}')).then_some(j + 2),
                Some(b'{') => match bytes[j + 1..].iter().position(|b| *b == b'{' || *b == b'}') {
                    Some(k) if bytes[j + 1 + k] == b'}' => j += k + 2,
                    _ => break None,
                },
                Some(_) => j += 1,
            }
        };
        match end {
            Some(end) => {
                out.push((prefix, i, end));
                last_end = end;
                i = end;
            }
            None => i += 1,
        }
    }
    out
}

/// `{{ expr }}` → `expr`, and whether it is shallow (`{{- expr }}`: what it gives is not
/// substituted again).
fn expression_of(variable: &str) -> (String, bool) {
    let inner = variable.replace("{{", "").replace("}}", "");
    let inner = inner.trim();
    match inner.strip_prefix('-') {
        Some(rest) => (rest.trim().to_owned(), true),
        None => (inner.to_owned(), false),
    }
}

/// Kyverno's substitution of one string (`substituteVariablesIfAny`): the innermost variables
/// first, pass after pass until none is left; a string that is one variable takes its value
/// with its type (`null` included); a variable inside text is written as text (a string as
/// is, any other value as JSON, `null` as `null`); `\{{` is a literal `{{`.
fn substitute_text(
    s: &str,
    resolve: &dyn Fn(&str) -> Result<Value, String>,
) -> Result<Value, String> {
    let mut value = s.to_owned();
    let mut found = find_variables(&value);
    while !found.is_empty() {
        let original = value.clone();
        let mut shallow = false;
        for (prefix_at, at, end) in found {
            let prefix = original[prefix_at..at].to_owned();
            let variable = original[at..end].to_owned();
            let (expression, is_shallow) = expression_of(&variable);
            shallow = is_shallow;
            if expression.is_empty() {
                return Err(format!("{s:?}: an empty variable"));
            }
            let resolved = resolve(&expression)?;
            if original == variable {
                return Ok(resolved);
            }
            let mut text = match resolved {
                Value::String(v) => v,
                other => other.to_string(),
            };
            if shallow {
                text = text.replace("{{", "\\{{");
            }
            value = value.replacen(
                &format!("{prefix}{variable}"),
                &format!("{prefix}{text}"),
                1,
            );
        }
        found = if shallow {
            Vec::new()
        } else {
            find_variables(&value)
        };
    }
    Ok(Value::String(value.replace("\\{{", "{{")))
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
        Value::String(s) => s.trim().parse::<f64>().ok().or_else(|| {
            crate::object::quantity::Quantity::parse(s.trim()).map(|q| q.nanos() as f64 / 1e9)
        }),
        _ => None,
    }
}

/// A variable found in a string, as validation sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The expression between the braces.
    pub expression: String,
    /// Whether it holds inner variables (`{{ images.containers."{{ element.name }}".tag }}`),
    /// substituted first: its text is only known at admission.
    pub templated: bool,
}

/// The variables of `value` (strings and keys, recursively), innermost first.
pub fn variables_in(value: &Value) -> Vec<Found> {
    let mut out = Vec::new();
    collect(value, &mut out);
    out
}

fn variables_of(s: &str, out: &mut Vec<Found>) {
    // Each pass finds the innermost variables and replaces them with a placeholder; a
    // variable holding a placeholder is templated.
    const MARK: &str = "\u{1}";
    let mut value = s.to_owned();
    loop {
        let found = find_variables(&value);
        if found.is_empty() {
            return;
        }
        let mut shallow = false;
        let mut next = String::new();
        let mut copied = 0;
        for (_, at, end) in found {
            let (expression, is_shallow) = expression_of(&value[at..end]);
            shallow |= is_shallow;
            out.push(Found {
                templated: expression.contains(MARK),
                expression,
            });
            next.push_str(&value[copied..at]);
            next.push_str(MARK);
            copied = end;
        }
        next.push_str(&value[copied..]);
        if shallow {
            return;
        }
        value = next;
    }
}

fn collect(value: &Value, out: &mut Vec<Found>) {
    match value {
        Value::String(s) => variables_of(s, out),
        Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
        Value::Object(m) => {
            for (k, v) in m {
                variables_of(k, out);
                collect(v, out);
            }
        }
        _ => {}
    }
}

/// Whether `value` holds a variable (or an escaped `\{{`) anywhere.
pub fn has_variables(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains("{{"),
        Value::Array(a) => a.iter().any(has_variables),
        Value::Object(m) => m.iter().any(|(k, v)| k.contains("{{") || has_variables(v)),
        _ => false,
    }
}

/// What an expression may name.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scope<'a> {
    /// The foreach loops around the expression: inside one, `element` and `elementIndex`;
    /// inside N, also `element0` … `element<N-1>` and `elementIndex0` … (Kyverno's nesting).
    pub depth: usize,
    /// The context entries defined so far.
    pub context: &'a [String],
}

/// Checks one variable: it compiles (unless it holds inner variables), and its root is one
/// meshgate provides or a context entry in scope.
pub fn check(found: &Found, scope: Scope<'_>) -> Result<(), String> {
    let expression = found.expression.as_str();
    if !found.templated {
        runtime()
            .compile(expression)
            .map_err(|e| format!("{{{{ {expression} }}}}: {}", first_line(&e.to_string())))?;
    }
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
    if let Some(level) = element_level(&root) {
        if level >= scope.depth {
            return Err(format!(
                "{{{{ {expression} }}}}: {root} is only defined inside {} nested foreach",
                level + 1
            ));
        }
        return Ok(());
    }
    if !ROOTS.contains(&root.as_str()) && !scope.context.contains(&root) {
        return Err(format!(
            "{{{{ {expression} }}}}: variable {root:?} is not available (meshgate provides request.object, request.operation, request.namespace, images, the mutation's context entries, and element and elementIndex in a foreach)"
        ));
    }
    if scope.depth == 0 && root.starts_with("element") {
        return Err(format!(
            "{{{{ {expression} }}}}: {root} is only defined inside a foreach"
        ));
    }
    Ok(())
}

/// The level N of `element<N>` or `elementIndex<N>` (Kyverno's per-level element variables).
pub fn element_level(name: &str) -> Option<usize> {
    let digits = name
        .strip_prefix("elementIndex")
        .or_else(|| name.strip_prefix("element"))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
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
        // Kyverno's regular-expression functions (`pkg/engine/jmespath/functions.go`): Go's
        // RE2 syntax, which the `regex` crate shares; a number as the source or the replacement
        // is written as Go writes it (`strconv.FormatFloat(f, 'f', -1, 32)`), and `$1` /
        // `${name}` in a replacement expand as Go's `Regexp.Expand` does.
        let pattern = move |args: &[Rcvar]| {
            let re = text(args, 0);
            regex::Regex::new(&re).map_err(|e| {
                jmespath::JmespathError::new(
                    &re,
                    0,
                    jmespath::ErrorReason::Parse(format!("invalid regular expression: {e}")),
                )
            })
        };
        let either = || ArgumentType::Union(vec![ArgumentType::String, ArgumentType::Number]);
        let go_text = |args: &[Rcvar], i: usize| -> String {
            match args.get(i).map(|a| &**a) {
                Some(Variable::String(s)) => s.clone(),
                Some(Variable::Number(n)) => match n.as_i64() {
                    Some(i) => i.to_string(),
                    None => (n.as_f64().unwrap_or_default() as f32).to_string(),
                },
                _ => String::new(),
            }
        };
        rt.register_function(
            "regex_replace_all",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), either(), either()], None),
                Box::new(move |a, _| {
                    let re = pattern(a)?;
                    out(Variable::String(
                        re.replace_all(&go_text(a, 1), go_text(a, 2).as_str())
                            .into_owned(),
                    ))
                }),
            )),
        );
        rt.register_function(
            "regex_replace_all_literal",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), either(), either()], None),
                Box::new(move |a, _| {
                    let re = pattern(a)?;
                    out(Variable::String(
                        re.replace_all(&go_text(a, 1), regex::NoExpand(&go_text(a, 2)))
                            .into_owned(),
                    ))
                }),
            )),
        );
        rt.register_function(
            "regex_match",
            Box::new(CustomFunction::new(
                Signature::new(vec![string(), either()], None),
                Box::new(move |a, _| {
                    let re = pattern(a)?;
                    out(Variable::Bool(re.is_match(&go_text(a, 1))))
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

/// Reads a `configMap` or `apiCall` entry through `cluster`; `vars` substitute an `apiCall`'s
/// path and `jmesPath`.
fn load(entry: &ContextEntry, cluster: &dyn ClusterData, vars: &Vars) -> Result<Value, String> {
    if let Some(call) = &entry.api_call {
        return api_call(call, cluster, vars);
    }
    let Some(cm) = &entry.config_map else {
        return Err("not a configMap or apiCall entry".to_owned());
    };
    let namespace = if cm.namespace.is_empty() {
        context::DEFAULT_NAMESPACE
    } else {
        &cm.namespace
    };
    match cluster.config_map(namespace, &cm.name)? {
        Some(object) => Ok(context::config_map_value(&object)),
        None => Err(format!("ConfigMap {namespace}/{} not found", cm.name)),
    }
}

fn api_call(
    call: &meshgate_api::mutation_policy::ContextApiCall,
    cluster: &dyn ClusterData,
    vars: &Vars,
) -> Result<Value, String> {
    let text = |v: Value, field: &str| match v {
        Value::String(s) => Ok(s),
        other => Err(format!("apiCall.{field} must be text, not {other}")),
    };
    let path = text(vars.substitute_str(&call.url_path)?, "urlPath")?;
    let parsed = context::api_path(&path).map_err(|e| format!("apiCall.urlPath: {e}"))?;
    if let Some(own) = &call.confined_to {
        let under_own = parsed.namespace.as_deref() == Some(own.as_str());
        if !under_own {
            return Err(format!(
                "apiCall.urlPath: {path:?}: a NamespacedMutationPolicy reads only under its own namespace ({own})"
            ));
        }
    }
    let data = match cluster.get(&path) {
        Ok(data) => data,
        Err(e) => return call.default.clone().ok_or(e),
    };
    match &call.jmes_path {
        Some(p) if !p.is_empty() => {
            let p = text(vars.substitute_str(p)?, "jmesPath")?;
            query(&p, &data)
        }
        _ => Ok(data),
    }
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
            .expect_err("missing");
        assert!(err.contains("unknown key \"missing\""), "{err}");
    }

    fn checked(expression: &str, foreach: bool, context: &[String]) -> Result<(), String> {
        let found = Found {
            expression: expression.to_owned(),
            templated: false,
        };
        check(
            &found,
            Scope {
                depth: usize::from(foreach),
                context,
            },
        )
    }

    #[test]
    fn checks_name_unknown_roots_and_element_outside_foreach() {
        assert_eq!(checked("request.object.metadata.name", false, &[]), Ok(()));
        assert_eq!(checked("to_upper(request.namespace)", false, &[]), Ok(()));
        assert_eq!(checked("images.containers.app.tag", false, &[]), Ok(()));
        assert!(checked("serviceAccountName", false, &[]).is_err());
        assert!(checked("team", false, &[]).is_err());
        assert_eq!(checked("team.name", false, &["team".to_owned()]), Ok(()));
        assert!(checked("element.name", false, &[]).is_err());
        assert_eq!(checked("element.name", true, &[]), Ok(()));
        assert!(checked("request.object.[", false, &[]).is_err());
        // Nested variables: the inner one is checked, the outer one by its root only.
        let found = variables_in(&json!(
            r#"{{ images.containers."{{ element.name }}".registry }}"#
        ));
        assert_eq!(
            found,
            vec![
                Found {
                    expression: "element.name".into(),
                    templated: false
                },
                Found {
                    expression: "images.containers.\"\u{1}\".registry".into(),
                    templated: true
                },
            ]
        );
    }

    #[test]
    fn regex_functions_are_kyvernos() {
        let v = vars();
        let e = v.with_element(&json!({"name": "b", "image": "docker.io/library/b:2"}), 1);
        assert_eq!(
            e.substitute_str(
                r"{{ regex_replace_all('^docker.io/(library/)?', element.image, 'mirror.local/') }}"
            ),
            Ok(json!("mirror.local/b:2"))
        );
        // `$1` expands in regex_replace_all, not in regex_replace_all_literal.
        assert_eq!(
            e.substitute_str(r"{{ regex_replace_all(':(.*)$', element.image, '@$1') }}"),
            Ok(json!("docker.io/library/b@2"))
        );
        assert_eq!(
            e.substitute_str(r"{{ regex_replace_all_literal(':(.*)$', element.image, '@$1') }}"),
            Ok(json!("docker.io/library/b@$1"))
        );
        // Numbers as source and replacement, written as Go writes them.
        assert_eq!(
            e.substitute_str("{{ regex_replace_all('0', `8080`, `1.5`) }}"),
            Ok(json!("81.581.5"))
        );
        assert_eq!(
            e.substitute_str("{{ regex_match('^b$', element.name) }}"),
            Ok(json!(true))
        );
        assert_eq!(
            e.substitute_str("{{ regex_match('^[0-9]+$', elementIndex) }}"),
            Ok(json!(true))
        );
        let bad = e.substitute_str("{{ regex_match('(', element.name) }}");
        assert!(
            bad.as_ref()
                .is_err_and(|m| m.contains("invalid regular expression")),
            "{bad:?}"
        );
    }

    #[test]
    fn nested_variables_are_substituted_inner_first() {
        let v = vars();
        let e = v.with_element(&json!({"name": "b", "image": "b:2"}), 1);
        assert_eq!(
            e.substitute_str(r#"{{ images.containers."{{element.name}}".tag }}"#),
            Ok(json!("2"))
        );
        assert_eq!(
            e.substitute_str(r#"{{ images.containers."{{element.name}}".registry }}"#),
            Ok(json!("docker.io"))
        );
        // An inner variable inside a quoted function argument.
        assert_eq!(
            e.substitute_str(
                r"{{ regex_replace_all('^([^:]+):.*$', '{{element.image}}', 'mirror.local/$1') }}"
            ),
            Ok(json!("mirror.local/b"))
        );
        assert_eq!(
            e.substitute_str("{{ to_upper('{{element.name}}') }}-{{elementIndex}}"),
            Ok(json!("B-1"))
        );
        // Escaped: left as text, unescaped once.
        assert_eq!(
            e.substitute_str(r"\{{ element.name }} is {{ element.name }}"),
            Ok(json!("{{ element.name }} is b"))
        );
        // Shallow: what it gives is not substituted again.
        let w = v.with_element(&json!("{{ request.namespace }}"), 0);
        assert_eq!(
            w.substitute_str("x {{- element }}"),
            Ok(json!("x {{ request.namespace }}"))
        );
        assert_eq!(w.substitute_str("x {{ element }}"), Ok(json!("x team-a")));
        // Two adjacent variables.
        assert_eq!(
            v.substitute_str("{{request.namespace}}{{request.operation}}"),
            Ok(json!("team-aCREATE"))
        );
        // Not a variable at all: text.
        assert_eq!(v.substitute_str("{{ request."), Ok(json!("{{ request.")));
    }

    #[test]
    fn null_and_missing_keys_follow_kyvernos_jmespath() {
        let v = vars().with_element(&json!({"name": "a", "resources": {"limits": null}}), 0);
        // A value that is null: the whole string becomes null, embedded it is the text null.
        assert_eq!(
            v.substitute_str("{{ element.resources.limits }}"),
            Ok(Value::Null)
        );
        assert_eq!(
            v.substitute_str("{{ element.resources.limits.memory }}"),
            Ok(Value::Null),
            "a field of a null value is null, not an error"
        );
        assert_eq!(
            v.substitute_str("m={{ element.resources.limits }}"),
            Ok(json!("m=null"))
        );
        // `||` over missing keys gives null, not an error.
        assert_eq!(
            v.substitute_str(
                "{{ element.resources.requests.memory || element.resources.requests.cpu }}"
            ),
            Ok(Value::Null)
        );
        assert_eq!(
            v.substitute_str("{{ element.resources.requests.memory || '1Gi' }}"),
            Ok(json!("1Gi"))
        );
        // A missing key on the path is Kyverno's "Unknown key" error.
        let err = v
            .substitute_str("{{ element.resources.requests.memory }}")
            .expect_err("missing key");
        assert!(err.contains("\"requests\""), "{err}");
        assert!(v.substitute_str("{{ element.missing && 'x' }}").is_ok());
        assert!(
            v.substitute_str("{{ element.name && element.missing }}")
                .is_err()
        );
        assert_eq!(
            v.substitute_str("{{ length(element.missing || `[]`) }}"),
            Ok(json!(0))
        );
    }

    #[test]
    fn context_entries_are_evaluated_in_order() {
        let entries: Vec<ContextEntry> = serde_json::from_value(json!([
            {"name": "app", "variable": {"jmesPath": "request.object.metadata.labels.app"}},
            {"name": "tier", "variable": {"jmesPath": "request.object.metadata.labels.tier", "default": "{{ app }}-default"}},
            {"name": "names", "variable": {"value": {"all": "{{ request.object.spec.containers[].name }}"}, "jmesPath": "all[0]"}},
            {"name": "gone", "variable": {"jmesPath": "request.object.metadata.labels.none"}},
            {"name": "fixed", "variable": {"value": "v-{{ tier }}"}},
        ]))
        .expect("entries");
        let v = vars().with_context(&entries, &crate::policy::context::NoCluster);
        assert_eq!(v.substitute_str("{{ app }}"), Ok(json!("shop")));
        assert_eq!(v.substitute_str("{{ tier }}"), Ok(json!("shop-default")));
        assert_eq!(v.substitute_str("{{ names }}"), Ok(json!("a")));
        assert_eq!(v.substitute_str("{{ fixed }}"), Ok(json!("v-shop-default")));
        // A failing entry is an error only where it is named.
        let err = v.substitute_str("{{ gone }}").expect_err("failed entry");
        assert!(err.contains("context entry \"gone\""), "{err}");
        assert_eq!(
            v.substitute_str("{{ request.object.metadata.name }}"),
            Ok(json!("web"))
        );
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
