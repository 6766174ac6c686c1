//! What the DRA gate's node plugin checks before it lets the kubelet create a pod's sandbox:
//! the node's active CNI configuration chains the mesh's CNI plugin, and the mesh agent's
//! readiness URLs answer 2xx. Pure rules; `meshgate-node` reads the files and probes the URLs.
//!
//! # Which CNI configuration is active
//! As the container runtime picks it (containerd's CRI through `github.com/containerd/go-cni`
//! `loadFromConfDir`, CRI-O through `ocicni`, both on libcni's `ConfFiles`; read from their
//! sources, not from a Go module cache, which held neither here):
//! * the files of the configuration directory (not subdirectories) whose extension
//!   (`filepath.Ext`, case-sensitive) is `.conf`, `.conflist` or `.json`;
//! * sorted by name, byte-wise (`sort.Strings` on the paths of one directory);
//! * the first one that loads is the default network, the one every pod gets:
//!   * a `.conflist` needs a string `name` and a non-empty `plugins` array whose entries each
//!     have a non-empty `type`;
//!   * a `.conf` or `.json` is a single plugin: it needs a non-empty top-level `type`, and
//!     counts as a one-plugin list (`ConfListFromConf`). A conflist written into a `.conf`
//!     file has no `type` and does not load.
//!
//! Differences, on purpose:
//! * go-cni fails the whole load when a file earlier in the order does not parse, and
//!   containerd then creates no pod network at all; CRI-O skips such a file. Here it is
//!   skipped, as CRI-O does: on containerd no sandbox gets a network then, so no pod starts
//!   outside the mesh either way.
//! * A conflist without `plugins` whose plugins libcni would load from `<dir>/<name>/*.conf`
//!   (CNI 1.1 and later) does not count: the shell reads no subdirectories.
//! * Go's `encoding/json` matches the plugin's `type` key case-insensitively; here it must be
//!   spelled `type`.

use std::fmt;

use serde_json::Value;

/// The extensions the runtimes read.
pub const CNI_EXTENSIONS: [&str; 3] = [".conf", ".conflist", ".json"];

/// Whether a file of the configuration directory is one the runtime would consider, by name.
pub fn is_cni_config_name(name: &str) -> bool {
    // Go's filepath.Ext: the suffix from the last '.', so "a.conf.bak" is ".bak".
    name.rfind('.')
        .is_some_and(|dot| CNI_EXTENSIONS.contains(&&name[dot..]))
}

/// The configuration the container runtime uses: the first of `files` (file name, content), in
/// name order, that is a CNI configuration and loads, with its content as a configuration list
/// (a single-plugin `.conf`/`.json` becomes `{"name", "cniVersion", "plugins": [it]}`).
/// `None`: no file loads, and the runtime has no pod network.
fn active_cni_config(files: &[(String, String)]) -> Option<(String, Value)> {
    let mut candidates: Vec<&(String, String)> = files
        .iter()
        .filter(|(name, _)| is_cni_config_name(name))
        .collect();
    candidates.sort_by(|a, b| a.0.cmp(&b.0));
    candidates
        .into_iter()
        .find_map(|(name, content)| load(name, content).map(|list| (name.clone(), list)))
}

/// One file as the runtime loads it, as a configuration list.
fn load(name: &str, content: &str) -> Option<Value> {
    let value: Value = serde_json::from_str(content).ok()?;
    if name.ends_with(".conflist") {
        value.get("name")?.as_str()?;
        let plugins = value.get("plugins")?.as_array()?;
        let all_typed = !plugins.is_empty() && plugins.iter().all(|p| plugin_type(p).is_some());
        all_typed.then_some(value)
    } else {
        plugin_type(&value)?;
        Some(serde_json::json!({
            "name": value.get("name").cloned().unwrap_or(Value::String(String::new())),
            "cniVersion": value.get("cniVersion").cloned().unwrap_or(Value::String(String::new())),
            "plugins": [value],
        }))
    }
}

/// A plugin's non-empty `type`.
fn plugin_type(plugin: &Value) -> Option<&str> {
    plugin
        .as_object()?
        .get("type")?
        .as_str()
        .filter(|t| !t.is_empty())
}

/// The plugin `type`s of a configuration list, in the order the runtime calls them.
fn chained_types(config: &Value) -> Vec<String> {
    config["plugins"]
        .as_array()
        .map(|plugins| {
            plugins
                .iter()
                .filter_map(plugin_type)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// What the CNI check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CniVerdict {
    /// No CNI plugin is wanted: nothing to check.
    NotChecked,
    /// The active configuration `path` chains the wanted plugin.
    Chained { path: String },
    /// The active configuration `path` does not chain `plugin`; it chains `types`.
    NotChained {
        path: String,
        plugin: String,
        types: Vec<String>,
    },
    /// No file of `dir` loads as a CNI configuration.
    NoConfig { dir: String, plugin: String },
    /// `dir` could not be listed (the shell's `error`); a missing directory is `NoConfig`.
    Unreadable { dir: String, error: String },
}

impl CniVerdict {
    /// Whether the CNI side is ready.
    pub fn is_ready(&self) -> bool {
        matches!(self, CniVerdict::NotChecked | CniVerdict::Chained { .. })
    }
}

/// The CNI verdict for the files of `dir` (file name, content): whether the active
/// configuration chains `plugin` (a plugin `type`, e.g. `istio-cni`).
pub fn cni_verdict(dir: &str, plugin: Option<&str>, files: &[(String, String)]) -> CniVerdict {
    let Some(plugin) = plugin else {
        return CniVerdict::NotChecked;
    };
    match active_cni_config(files) {
        None => CniVerdict::NoConfig {
            dir: dir.to_string(),
            plugin: plugin.to_string(),
        },
        Some((name, config)) => {
            let path = join(dir, &name);
            let types = chained_types(&config);
            if types.iter().any(|t| t == plugin) {
                CniVerdict::Chained { path }
            } else {
                CniVerdict::NotChained {
                    path,
                    plugin: plugin.to_string(),
                    types,
                }
            }
        }
    }
}

fn join(dir: &str, name: &str) -> String {
    let dir = dir.trim_end_matches('/');
    if dir.is_empty() {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The result of one readiness probe: the HTTP status, or why there was none.
pub type ProbeResult = Result<u16, String>;

/// Whether the mesh is ready on the node, and if not, every reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeReadiness {
    /// What is not ready, one phrase each; empty when ready.
    pub problems: Vec<String>,
}

impl NodeReadiness {
    /// Ready: nothing is missing.
    pub fn is_ready(&self) -> bool {
        self.problems.is_empty()
    }
}

impl fmt::Display for NodeReadiness {
    /// `the mesh is ready on this node`, or `the mesh is not ready on this node: <problem>;
    /// <problem>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problems.is_empty() {
            f.write_str("the mesh is ready on this node")
        } else {
            write!(
                f,
                "the mesh is not ready on this node: {}",
                self.problems.join("; ")
            )
        }
    }
}

/// Combines the CNI verdict and the readiness probes (URL, result; a 2xx status is ready).
/// With nothing to check (no CNI plugin wanted, no URL) the node is ready.
pub fn node_readiness(cni: &CniVerdict, probes: &[(String, ProbeResult)]) -> NodeReadiness {
    let mut problems = Vec::new();
    match cni {
        CniVerdict::NotChecked | CniVerdict::Chained { .. } => {}
        CniVerdict::NotChained {
            path,
            plugin,
            types,
        } => {
            let chain = if types.is_empty() {
                "no plugin".to_string()
            } else {
                types.join(", ")
            };
            problems.push(format!(
                "the CNI configuration {path} does not chain \"{plugin}\" (it chains {chain})"
            ));
        }
        CniVerdict::NoConfig { dir, plugin } => problems.push(format!(
            "no CNI configuration in {dir} loads (wanted one that chains \"{plugin}\")"
        )),
        CniVerdict::Unreadable { dir, error } => problems.push(format!(
            "the CNI configuration directory {dir} cannot be read: {error}"
        )),
    }
    for (url, result) in probes {
        match result {
            Ok(code) if (200..300).contains(code) => {}
            Ok(code) => problems.push(format!("{url} answered {code}")),
            Err(e) => problems.push(format!("{url} did not answer: {e}")),
        }
    }
    NodeReadiness { problems }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, c)| (n.to_string(), c.to_string()))
            .collect()
    }

    const FLANNEL: &str = r#"{"name":"cbr0","cniVersion":"0.3.1","plugins":[
        {"type":"flannel","delegate":{"isDefaultGateway":true}},
        {"type":"portmap","capabilities":{"portMappings":true}}]}"#;
    const ISTIO: &str = r#"{"name":"cbr0","cniVersion":"0.3.1","plugins":[
        {"type":"flannel"},{"type":"portmap"},{"type":"istio-cni","kubernetes":{}}]}"#;
    const BRIDGE: &str = r#"{"cniVersion":"0.3.1","name":"mynet","type":"bridge","bridge":"cni0"}"#;

    #[test]
    fn the_first_file_by_name_that_loads_is_active() {
        let f = files(&[
            ("20-b.conflist", ISTIO),
            ("10-a.conflist", FLANNEL),
            ("05-notes.txt", ISTIO),
            ("01-broken.conflist", "{not json"),
        ]);
        let (name, config) = active_cni_config(&f).expect("a config");
        assert_eq!(name, "10-a.conflist");
        assert_eq!(chained_types(&config), ["flannel", "portmap"]);
    }

    #[test]
    fn names_sort_byte_wise_not_numerically() {
        let f = files(&[("9-a.conflist", FLANNEL), ("10-b.conflist", ISTIO)]);
        assert_eq!(active_cni_config(&f).expect("config").0, "10-b.conflist");
        let f = files(&[("a.conflist", FLANNEL), ("B.conflist", ISTIO)]);
        assert_eq!(active_cni_config(&f).expect("config").0, "B.conflist");
    }

    #[test]
    fn a_single_plugin_conf_or_json_is_a_one_plugin_list() {
        for name in ["10-bridge.conf", "10-bridge.json"] {
            let f = files(&[(name, BRIDGE), ("20-x.conflist", ISTIO)]);
            let (n, config) = active_cni_config(&f).expect("config");
            assert_eq!(n, name);
            assert_eq!(chained_types(&config), ["bridge"]);
            assert_eq!(config["name"], "mynet");
            assert_eq!(config["plugins"][0]["bridge"], "cni0");
        }
    }

    #[test]
    fn files_that_do_not_load_are_skipped() {
        for bad in [
            // A conflist in a .conf file: no top-level type.
            ("00-a.conf", ISTIO),
            // A plugin without a type, an empty type, a non-object.
            ("00-a.conf", r#"{"name":"x"}"#),
            ("00-a.json", r#"{"name":"x","type":""}"#),
            ("00-a.json", r#"["istio-cni"]"#),
            // A conflist without a name, with no plugins, with an untyped plugin.
            ("00-a.conflist", r#"{"plugins":[{"type":"istio-cni"}]}"#),
            ("00-a.conflist", r#"{"name":"x","plugins":[]}"#),
            ("00-a.conflist", r#"{"name":"x"}"#),
            (
                "00-a.conflist",
                r#"{"name":"x","plugins":[{"type":"istio-cni"},{"x":1}]}"#,
            ),
            (
                "00-a.conflist",
                r#"{"name":7,"plugins":[{"type":"istio-cni"}]}"#,
            ),
            // A single-plugin file named .conflist: no plugins array.
            ("00-a.conflist", BRIDGE),
            // Not JSON.
            ("00-a.conflist", ""),
        ] {
            let f = files(&[bad, ("10-b.conflist", FLANNEL)]);
            assert_eq!(
                active_cni_config(&f).expect("config").0,
                "10-b.conflist",
                "{bad:?}"
            );
        }
    }

    #[test]
    fn only_the_runtimes_extensions_count() {
        for name in [
            "a.conf.bak",
            "a.conflist.tmp",
            "a.CONFLIST",
            "a.yaml",
            "conflist",
            "a",
        ] {
            assert!(!is_cni_config_name(name), "{name}");
            assert_eq!(active_cni_config(&files(&[(name, ISTIO)])), None, "{name}");
        }
        for name in ["a.conf", "a.conflist", "a.json", ".conflist", "x.y.conf"] {
            assert!(is_cni_config_name(name), "{name}");
        }
        assert_eq!(active_cni_config(&[]), None);
    }

    #[test]
    fn chained_types_keep_the_order_and_ignore_junk() {
        assert_eq!(chained_types(&serde_json::json!({})), Vec::<String>::new());
        assert_eq!(
            chained_types(&serde_json::json!({"plugins": [{"type": "a"}, 3, {"type": "b"}]})),
            ["a", "b"]
        );
    }

    #[test]
    fn the_verdict_names_the_active_file_and_the_plugin() {
        let dir = "/etc/cni/net.d/";
        let f = files(&[("10-a.conflist", FLANNEL), ("20-b.conflist", ISTIO)]);
        assert_eq!(cni_verdict(dir, None, &f), CniVerdict::NotChecked);
        let v = cni_verdict(dir, Some("istio-cni"), &f);
        assert_eq!(
            v,
            CniVerdict::NotChained {
                path: "/etc/cni/net.d/10-a.conflist".into(),
                plugin: "istio-cni".into(),
                types: vec!["flannel".into(), "portmap".into()],
            }
        );
        assert!(!v.is_ready());
        let f = files(&[("10-a.conflist", ISTIO)]);
        let v = cni_verdict("/etc/cni/net.d", Some("istio-cni"), &f);
        assert_eq!(
            v,
            CniVerdict::Chained {
                path: "/etc/cni/net.d/10-a.conflist".into()
            }
        );
        assert!(v.is_ready());
        // The type must match exactly.
        assert!(!cni_verdict(dir, Some("istio"), &f).is_ready());
        assert_eq!(
            cni_verdict(dir, Some("istio-cni"), &[]),
            CniVerdict::NoConfig {
                dir: dir.into(),
                plugin: "istio-cni".into()
            }
        );
    }

    #[test]
    fn readiness_names_everything_that_is_not_ready() {
        let cni = CniVerdict::NotChained {
            path: "/etc/cni/net.d/10-x.conflist".into(),
            plugin: "istio-cni".into(),
            types: vec!["flannel".into()],
        };
        let probes = vec![
            ("http://127.0.0.1:8000/readyz".to_string(), Ok(503)),
            ("http://127.0.0.1:15021/healthz/ready".to_string(), Ok(200)),
            (
                "http://[::1]:9/".to_string(),
                Err("connection refused".to_string()),
            ),
        ];
        let r = node_readiness(&cni, &probes);
        assert!(!r.is_ready());
        assert_eq!(
            r.to_string(),
            "the mesh is not ready on this node: the CNI configuration \
             /etc/cni/net.d/10-x.conflist does not chain \"istio-cni\" (it chains flannel); \
             http://127.0.0.1:8000/readyz answered 503; \
             http://[::1]:9/ did not answer: connection refused"
        );
        let r = node_readiness(
            &CniVerdict::NoConfig {
                dir: "/etc/cni/net.d".into(),
                plugin: "istio-cni".into(),
            },
            &[],
        );
        assert_eq!(
            r.to_string(),
            "the mesh is not ready on this node: no CNI configuration in /etc/cni/net.d \
             loads (wanted one that chains \"istio-cni\")"
        );
        let r = node_readiness(
            &CniVerdict::Unreadable {
                dir: "/etc/cni/net.d".into(),
                error: "Permission denied (os error 13)".into(),
            },
            &[],
        );
        assert_eq!(
            r.to_string(),
            "the mesh is not ready on this node: the CNI configuration directory \
             /etc/cni/net.d cannot be read: Permission denied (os error 13)"
        );
        assert!(
            !CniVerdict::Unreadable {
                dir: String::new(),
                error: String::new()
            }
            .is_ready()
        );
    }

    #[test]
    fn ready_when_everything_checked_is_ready() {
        let ok = vec![
            ("http://127.0.0.1:8000/readyz".to_string(), Ok(200)),
            ("http://127.0.0.1:8001/".to_string(), Ok(204)),
        ];
        let chained = CniVerdict::Chained { path: "/x".into() };
        let r = node_readiness(&chained, &ok);
        assert!(r.is_ready());
        assert_eq!(r.to_string(), "the mesh is ready on this node");
        assert!(node_readiness(&CniVerdict::NotChecked, &[]).is_ready());
        for code in [199, 300, 302, 404, 500] {
            let probes = vec![("http://127.0.0.1:1/".to_string(), Ok(code))];
            assert!(!node_readiness(&chained, &probes).is_ready(), "{code}");
        }
    }
}
