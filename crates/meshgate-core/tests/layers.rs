//! The house has no import circle: each top-level module of `src/` is a domain folder, and a
//! domain names another (`crate::<domain>`) only where [`MAY_USE`] allows it.
//!
//! Reads the sources as text: every `crate::<name>` outside a comment, in every file under a
//! domain's folder, must name its own domain or one the table allows. `crate::{..}` groups and
//! the root's re-exports (`crate::gate`, paths kept for the shells) are refused here, so each
//! path says its domain; `super::super` is refused too (a path out of a module's parent says
//! `crate::<domain>`). The table itself must have no circle.

use std::collections::{BTreeMap, BTreeSet};
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

/// This crate's directory: `CARGO_MANIFEST_DIR` as Cargo sets it when it runs the test, else
/// where the test was compiled. The compile-time path comes last: a build directory shared
/// between clones reuses a test binary compiled in another clone, whose path may be gone.
fn crate_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn src() -> PathBuf {
    crate_dir().join("src")
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
            .strip_prefix(crate_dir())
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

// ------------------------------------------------------------------------------------------
// Files: no two files (modules) of the crate import each other, directly or around a loop.

/// A module of the crate: its path (`policy::context`; `""` for the root), whether it is a
/// folder's `mod.rs` (or the root), and its source.
struct Module {
    path: String,
    folder: bool,
    text: String,
}

fn modules() -> Vec<Module> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|file| {
            let rel = file
                .strip_prefix(src())
                .expect("under src")
                .with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let folder = matches!(parts.last().map(String::as_str), Some("mod" | "lib"));
            if folder {
                parts.pop();
            }
            Module {
                path: parts.join("::"),
                folder,
                text: fs::read_to_string(&file).expect("read source"),
            }
        })
        .collect()
}

/// The longest prefix of `parts` that is a module.
fn resolve(parts: &[String], known: &BTreeSet<String>) -> Option<String> {
    (1..=parts.len())
        .rev()
        .map(|n| parts[..n].join("::"))
        .find(|p| known.contains(p))
}

/// `a::b::c` and `a::b::{c, d::e}` as lists of segments (`[a, b, c]`; `[a, b, c]`, `[a, b, d, e]`).
fn expand(path: &str) -> Vec<Vec<String>> {
    match path.find('{') {
        None => vec![
            path.split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        ],
        Some(open) => {
            let prefix: Vec<String> = path[..open]
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            let inner = path[open + 1..].trim_end_matches('}');
            inner
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|item| {
                    let mut parts = prefix.clone();
                    parts.extend(item.split("::").map(|s| s.trim().to_owned()));
                    parts
                })
                .collect()
        }
    }
}

/// The paths in a line of code that start with `crate::`, `super::`, `self::` or a child
/// module's name, each as `(first segment, the rest)`: `use a::{b, c};` gives one path.
fn module_paths(line: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let bytes: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let starts = (c.is_alphabetic() || c == '_')
            && (i == 0
                || !(bytes[i - 1].is_alphanumeric() || matches!(bytes[i - 1], '_' | '$' | ':')));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < bytes.len() && (bytes[j].is_alphanumeric() || bytes[j] == '_') {
            j += 1;
        }
        let first: String = bytes[i..j].iter().collect();
        if j + 1 < bytes.len() && bytes[j] == ':' && bytes[j + 1] == ':' {
            // The rest: segments, `::`, and one `{...}` group.
            let mut k = j + 2;
            let mut depth = 0;
            while k < bytes.len() {
                let ch = bytes[k];
                if ch == '{' {
                    depth += 1;
                } else if ch == '}' {
                    if depth == 0 {
                        break;
                    }
                    depth -= 1;
                    if depth == 0 {
                        k += 1;
                        break;
                    }
                } else if depth == 0 && !(ch.is_alphanumeric() || ch == '_' || ch == ':') {
                    break;
                }
                k += 1;
            }
            out.push((first, bytes[j + 2..k].iter().collect()));
            i = k;
        } else {
            i = j;
        }
    }
    out
}

/// Which modules each module names in its code (not its comments, its `pub use` re-exports or
/// its `#[cfg(test)]` tail).
fn module_edges(modules: &[Module]) -> BTreeMap<String, BTreeSet<String>> {
    let known: BTreeSet<String> = modules.iter().map(|m| m.path.clone()).collect();
    let mut edges = BTreeMap::new();
    for m in modules {
        let own: Vec<String> = m
            .path
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        // The module `super::` names, and where a child's name resolves.
        let parent: Vec<String> = if m.folder {
            own[..own.len().saturating_sub(1)].to_vec()
        } else {
            own[..own.len() - 1].to_vec()
        };
        let here: Vec<String> = if m.folder {
            own.clone()
        } else {
            parent.clone()
        };
        let children: BTreeSet<String> = m
            .text
            .lines()
            .filter_map(|l| {
                let l = l.trim();
                let l = l
                    .strip_prefix("pub(crate) ")
                    .or(l.strip_prefix("pub "))
                    .unwrap_or(l);
                l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
            })
            .collect();
        let mut out = BTreeSet::new();
        let mut in_reexport = false;
        for line in m.text.lines() {
            let code = line.trim_start();
            if code.starts_with("#[cfg(test)]") {
                break;
            }
            if code.starts_with("//") {
                continue;
            }
            // A `pub use` (to its `;`) publishes a module's items from its parent; it is how a
            // folder exposes its children, not a use of them.
            if code.starts_with("pub use ") || in_reexport {
                in_reexport = !code.trim_end().ends_with(';');
                continue;
            }
            for (first, rest) in module_paths(line) {
                let base: Vec<String> = match first.as_str() {
                    "crate" => Vec::new(),
                    "super" => parent.clone(),
                    "self" => own.clone(),
                    child if m.folder && children.contains(child) => {
                        let mut b = here.clone();
                        b.push(child.to_owned());
                        b
                    }
                    _ => continue,
                };
                for tail in expand(&rest) {
                    let mut parts = base.clone();
                    parts.extend(tail);
                    if let Some(target) = resolve(&parts, &known)
                        && target != m.path
                    {
                        out.insert(target);
                    }
                }
            }
        }
        edges.insert(m.path.clone(), out);
    }
    edges
}

/// The import circles: each a list of modules, each naming the next, the last naming the first.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Remove every module that names no remaining one (or that none names) until none can
    // be; what is left holds the circles. Then one circle per start, by a walk.
    let mut left: BTreeSet<&String> = edges.keys().collect();
    loop {
        let removable: Vec<&String> = left
            .iter()
            .copied()
            .filter(|m| {
                edges[*m].iter().all(|t| !left.contains(t))
                    || !left.iter().any(|o| edges[*o].contains(*m))
            })
            .collect();
        if removable.is_empty() {
            break;
        }
        for m in removable {
            left.remove(m);
        }
    }
    let mut out: Vec<Vec<String>> = Vec::new();
    for start in &left {
        if out.iter().any(|c| c.contains(start)) {
            continue;
        }
        // Breadth-first back to `start` through what is left.
        let mut prev: BTreeMap<&String, &String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([*start]);
        'search: while let Some(m) = queue.pop_front() {
            for t in edges[m].iter().filter(|t| left.contains(t)) {
                if t == *start {
                    let mut circle = vec![m.clone()];
                    let mut at = m;
                    while at != *start {
                        at = prev[at];
                        circle.push(at.clone());
                    }
                    circle.reverse();
                    out.push(circle);
                    break 'search;
                }
                if !prev.contains_key(t) {
                    prev.insert(t, m);
                    queue.push_back(t);
                }
            }
        }
    }
    out
}

#[test]
fn no_two_files_import_each_other() {
    let found = circles(&module_edges(&modules()));
    let shown: Vec<String> = found
        .iter()
        .map(|c| format!("{} -> {}", c.join(" -> "), c[0]))
        .collect();
    assert!(
        found.is_empty(),
        "{} import circle(s) between files of meshgate-core (move what both need into a third \
         file):\n{}",
        found.len(),
        shown.join("\n")
    );
}

#[test]
fn the_file_check_sees_a_circle() {
    let module = |path: &str, folder: bool, text: &str| Module {
        path: path.to_owned(),
        folder,
        text: text.to_owned(),
    };
    let house = [
        module("", true, "pub mod policy;\n"),
        module(
            "policy",
            true,
            "pub mod context;\npub mod variables;\npub use variables::{\n    Vars,\n};\nfn f() { variables::query(); }\n",
        ),
        module("policy::context", false, "use super::variables::Vars;\n"),
        module(
            "policy::variables",
            false,
            "use crate::policy::{context::load, other};\n// crate::policy::none\n",
        ),
        module(
            "policy::other",
            false,
            "#[cfg(test)]\nuse crate::policy::context;\n",
        ),
    ];
    let edges = module_edges(&house);
    assert_eq!(
        edges["policy::variables"],
        BTreeSet::from(["policy::context".to_owned(), "policy::other".to_owned()])
    );
    assert!(
        edges["policy::other"].is_empty(),
        "test code is not counted"
    );
    assert_eq!(
        edges["policy"],
        BTreeSet::from(["policy::variables".to_owned()])
    );
    assert_eq!(
        circles(&edges),
        [vec![
            "policy::context".to_owned(),
            "policy::variables".to_owned()
        ]]
    );
}
