//! The node's CNI configuration list, with the mesh's plugin chained in or taken out.

use serde_json::{Value, json};

/// The plugin's `type` (its binary's name in the CNI bin directory).
pub const PLUGIN_TYPE: &str = "mesh-cni";

/// The conflist with the mesh's plugin appended to its chain (replacing an earlier entry of
/// ours, so that installing twice changes nothing).
pub fn with_plugin(conflist: &Value, entry: &Value) -> Result<Value, String> {
    let mut out = without_plugin(conflist)?;
    let plugins = out
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or("the CNI configuration has no \"plugins\" list")?;
    let mut entry = entry.clone();
    entry["type"] = json!(PLUGIN_TYPE);
    plugins.push(entry);
    Ok(out)
}

/// The conflist without the mesh's plugin.
pub fn without_plugin(conflist: &Value) -> Result<Value, String> {
    let mut out = conflist.clone();
    let plugins = out
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or("the CNI configuration has no \"plugins\" list")?;
    plugins.retain(|p| p["type"] != PLUGIN_TYPE);
    Ok(out)
}

/// The conflist file the container runtime uses: the first `*.conflist` by name, as the
/// runtimes pick one (with `max_conf_num = 1`).
pub fn pick(names: &[String]) -> Option<&String> {
    let mut lists: Vec<&String> = names.iter().filter(|n| n.ends_with(".conflist")).collect();
    lists.sort();
    lists.first().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bridge() -> Value {
        json!({"cniVersion": "1.0.0", "name": "node", "plugins": [
            {"type": "bridge", "bridge": "cni0"}, {"type": "portmap"}]})
    }

    #[test]
    fn chains_once_and_unchains() {
        let entry = json!({"redirectPort": 15001, "excludeNamespaces": ["kube-system"]});
        let once = with_plugin(&bridge(), &entry).expect("chained");
        let plugins = once["plugins"].as_array().expect("plugins");
        assert_eq!(plugins.len(), 3);
        assert_eq!(plugins[2]["type"], PLUGIN_TYPE);
        assert_eq!(plugins[2]["redirectPort"], 15001);
        assert_eq!(
            with_plugin(&once, &entry).expect("again"),
            once,
            "idempotent"
        );
        assert_eq!(without_plugin(&once).expect("unchained"), bridge());
        assert!(with_plugin(&json!({"type": "bridge"}), &entry).is_err());
    }

    #[test]
    fn picks_the_first_conflist() {
        let names = ["20-b.conflist", "10-a.conflist", "05-x.conf"].map(String::from);
        assert_eq!(pick(&names).map(String::as_str), Some("10-a.conflist"));
        assert_eq!(pick(&[]), None);
    }
}
