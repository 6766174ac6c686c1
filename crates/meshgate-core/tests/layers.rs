//! The house has no import circle: each top-level module of `src/` is a domain folder, and a
//! domain names another (`crate::<domain>`) only where [`MAY_USE`] allows it.
//!
//! Reads the sources as text: every `crate::<name>` outside a comment, in every file under a
//! domain's folder, must name its own domain or one the table allows. `crate::{..}` groups and
//! the root's re-exports (`crate::gate`, paths kept for the shells) are refused here, so each
//! path says its domain; `super::super` is refused too (a path out of a module's parent says
//! `crate::<domain>`). The table itself must have no circle.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Which domain may use which, top layer first. A domain always uses itself.
const MAY_USE: &[(&str, &[&str])] = &[
    // How meshgate plugs into admission, for every domain.
    ("admission", &["pod_gate", "node_gate", "policy", "object"]),
    // The three domains: none uses another.
    ("pod_gate", &["object"]),
    ("node_gate", &["object"]),
    ("policy", &["object"]),
    // The controller's leadership on a Lease.
    ("leader", &[]),
    // The leaf: Kubernetes objects, patches, quantities, CEL.
    ("object", &[]),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The domain a file belongs to: its folder under `src/` (or its name, for a single-file
/// module); `None` for the crate root.
fn domain_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).expect("under src");
    let first = rel.components().next()?.as_os_str().to_str()?.to_owned();
    if first == "lib.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_owned())
}

/// The names following each `crate::` in a line of code (not `$crate::`, not in a comment).
fn crate_paths(line: &str) -> Vec<String> {
    let code = line.trim_start();
    if code.starts_with("//") {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + "crate::".len()..];
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            let name: String = if after.starts_with('{') {
                "{".into()
            } else {
                after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect()
            };
            out.push(name);
        }
        rest = after;
    }
    out
}

/// Every path that breaks the table, as `file:line: why`.
fn violations(table: &BTreeMap<&str, &[&str]>) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files.sort();
    let mut out = Vec::new();
    for file in &files {
        let Some(domain) = domain_of(file) else {
            continue;
        };
        let shown = file
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .expect("under the crate")
            .display();
        let Some(allowed) = table.get(domain.as_str()) else {
            out.push(format!(
                "{shown}: `{domain}` is not in MAY_USE (a new domain needs its row)"
            ));
            continue;
        };
        let text = fs::read_to_string(file).expect("read source");
        for (n, line) in text.lines().enumerate() {
            let at = format!("{shown}:{}: {}", n + 1, line.trim());
            if !line.trim_start().starts_with("//") && line.contains("super::super") {
                out.push(format!(
                    "{at}\n    `super::super`: name the domain (`crate::{domain}::…`)"
                ));
            }
            for used in crate_paths(line) {
                if used.starts_with('{') {
                    out.push(format!(
                        "{at}\n    `crate::{{..}}`: one `crate::<domain>::…` path each"
                    ));
                } else if !table.contains_key(used.as_str()) {
                    out.push(format!(
                        "{at}\n    `crate::{used}` is no domain (the root's re-exports are for the shells): use `crate::<domain>::{used}`"
                    ));
                } else if used != domain && !allowed.contains(&used.as_str()) {
                    out.push(format!(
                        "{at}\n    `{domain}` uses `{used}`; MAY_USE allows `{domain}` only {allowed:?}"
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn the_table_has_no_circle() {
    let table: BTreeMap<&str, &[&str]> = MAY_USE.iter().copied().collect();
    // Repeatedly remove a domain that uses no remaining one; what cannot be removed is a circle.
    let mut left: Vec<&str> = table.keys().copied().collect();
    while let Some(i) = left
        .iter()
        .position(|d| table[d].iter().all(|u| !left.contains(u)))
    {
        left.remove(i);
    }
    assert!(left.is_empty(), "MAY_USE has a circle among {left:?}");
    for (domain, uses) in MAY_USE {
        for used in *uses {
            assert!(
                table.contains_key(used),
                "{domain} may use unknown `{used}`"
            );
        }
    }
}

#[test]
fn every_domain_is_a_folder_in_src() {
    for (domain, _) in MAY_USE {
        assert!(
            src().join(domain).join("mod.rs").is_file(),
            "src/{domain}/mod.rs is missing"
        );
    }
}

#[test]
fn domains_use_only_what_the_table_allows() {
    let table: BTreeMap<&str, &[&str]> = MAY_USE.iter().copied().collect();
    let found = violations(&table);
    assert!(
        found.is_empty(),
        "{} path(s) against tests/layers.rs MAY_USE:\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn the_check_sees_a_path() {
    assert_eq!(
        crate_paths("use crate::policy::native::X; f(crate::object::cel::s(), $crate::m)"),
        ["policy", "object"]
    );
    assert_eq!(
        crate_paths("    // see crate::policy"),
        Vec::<String>::new()
    );
    assert_eq!(crate_paths("use crate::{a, b};"), ["{"]);
}
