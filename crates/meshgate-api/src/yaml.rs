//! YAML in and out, one way for every part of meshgate.
//!
//! * **Reading** ([`from_str`], [`documents`]): YAML 1.2 with the YAML 1.1 spellings Kubernetes'
//!   own reader accepts (`yes`/`no`/`on`/`off` are booleans, as for kubectl), into the target
//!   type through JSON, so that an error names the field's path (`spec.mutations[0].op`) or,
//!   for a syntax error, the line and column.
//! * **Writing** ([`to_string`]): strings that a YAML 1.1 reader (kubectl's) or a YAML 1.2
//!   reader would take for another type (`"yes"`, `"on"`, `"y"`, `"1_000"`, `"0777"`,
//!   `"2020-09-21T12:56:35Z"`, `"~"`, ...) are quoted, so every reader reads back the same JSON
//!   (the `yaml_readback` test checks it with Kubernetes' own YAML library).

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A YAML document that could not be read: where, and why.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Not YAML: the message names the line and column.
    #[error("{0}")]
    Syntax(String),
    /// YAML, but not the expected shape: the path of the field.
    #[error("{path}: {message}")]
    Field { path: String, message: String },
    /// A value YAML cannot hold.
    #[error("writing YAML: {0}")]
    Write(String),
}

fn read_options() -> serde_saphyr::Options {
    // One-line messages (`line L column C: ...`); the caller names the file.
    serde_saphyr::options! { with_snippet: false }
}

/// Deserializes JSON into `T`, naming the failing field's path.
pub fn from_value<T: DeserializeOwned>(v: serde_json::Value) -> Result<T, YamlError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        YamlError::Field {
            path,
            message: e.into_inner().to_string(),
        }
    })
}

/// One YAML (or JSON) document into `T`.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, YamlError> {
    let v: serde_json::Value = serde_saphyr::from_str_with_options(text, read_options())
        .map_err(|e| YamlError::Syntax(e.to_string()))?;
    from_value(v)
}

/// Every document of a multi-document stream, empty documents left out; an error names the
/// document's index (from 0).
pub fn documents(text: &str) -> Result<Vec<serde_json::Value>, (usize, YamlError)> {
    let mut bytes = text.as_bytes();
    let mut docs = Vec::new();
    for (index, v) in
        serde_saphyr::read_with_options::<_, serde_json::Value>(&mut bytes, read_options())
            .enumerate()
    {
        let v = v.map_err(|e| (index, YamlError::Syntax(e.to_string())))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// `value` as one YAML document. Strings with line breaks are literal blocks (`|`); long
/// one-line strings stay on one line (never folded: a CEL rule or a command line is kept as
/// written).
pub fn to_string<T: Serialize>(value: &T) -> Result<String, YamlError> {
    let options = serde_saphyr::ser_options! { folded_wrap_chars: usize::MAX };
    serde_saphyr::to_string_with_options(value, options)
        .map_err(|e| YamlError::Write(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strings_other_readers_would_retype_are_quoted() {
        for s in [
            "yes",
            "No",
            "ON",
            "off",
            "y",
            "N",
            "true",
            "False",
            "null",
            "~",
            "1_000",
            "0777",
            "0x1F",
            "1e3",
            ".inf",
            "-.NaN",
            "12:30",
            "2020-09-21T12:56:35Z",
            "2001-12-14",
            "<<",
            "=",
            "",
        ] {
            let text = to_string(&json!({ s: s })).expect("yaml");
            let back: serde_json::Value = from_str(&text).expect("reads back");
            assert_eq!(back, json!({ s: s }), "{s:?} written as {text:?}");
        }
    }

    #[test]
    fn errors_name_the_field_or_the_line() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct T {
            a: Vec<u8>,
        }
        let e = from_str::<T>("a: [1, x]\n").unwrap_err();
        assert!(e.to_string().starts_with("a[1]: invalid type"), "{e}");
        let e = from_str::<T>("a: [1\n").unwrap_err();
        assert!(
            matches!(e, YamlError::Syntax(ref m) if m.contains("line")),
            "{e}"
        );
        let (index, _) = documents("a: 1\n---\nb: [\n").unwrap_err();
        assert_eq!(index, 1);
    }
}
