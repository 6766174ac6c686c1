//! The chained CNI plugin's logic: which pods it redirects and the rules it installs.

use serde_json::{Value, json};

/// The CNI versions this plugin speaks.
pub const SUPPORTED_VERSIONS: [&str; 4] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// The plugin's settings, from its entry in the conflist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub cni_version: String,
    /// The proxy's outbound port: redirected TCP goes there.
    pub redirect_port: u16,
    /// The proxy's uid and gid, whose traffic is left alone.
    pub proxy_uid: u32,
    /// Pod namespaces the plugin leaves alone.
    pub exclude_namespaces: Vec<String>,
    /// The previous plugin's result, passed on unchanged.
    pub prev_result: Option<Value>,
}

/// A problem with the plugin's input, answered as a CNI error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniError {
    /// CNI error code (the spec's: 4 invalid environment variables, 5 I/O failure, 6 failed to
    /// decode content, 7 invalid network config, 999 other).
    pub code: u32,
    pub msg: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
        }
    }

    fn config(msg: impl Into<String>) -> Self {
        Self::new(7, msg)
    }

    /// The error as the CNI spec writes it on stdout.
    pub fn to_json(&self, cni_version: &str) -> Value {
        json!({"cniVersion": cni_version, "code": self.code, "msg": self.msg})
    }
}

impl Config {
    /// Parses the plugin's stdin.
    pub fn parse(stdin: &str) -> Result<Self, CniError> {
        let v: Value = serde_json::from_str(stdin)
            .map_err(|e| CniError::new(6, format!("network config is not JSON: {e}")))?;
        let field_u64 = |name: &str, default: u64| -> Result<u64, CniError> {
            match v.get(name) {
                None => Ok(default),
                Some(n) => n
                    .as_u64()
                    .ok_or_else(|| CniError::config(format!("{name} must be a number, got {n}"))),
            }
        };
        let redirect_port = u16::try_from(field_u64("redirectPort", 15001)?)
            .map_err(|_| CniError::config("redirectPort must be a port"))?;
        let proxy_uid = u32::try_from(field_u64("proxyUid", 1337)?)
            .map_err(|_| CniError::config("proxyUid must be a uid"))?;
        let exclude_namespaces = match v.get("excludeNamespaces") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|n| {
                    n.as_str().map(str::to_owned).ok_or_else(|| {
                        CniError::config(format!("excludeNamespaces: {n} is not a string"))
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(CniError::config(format!(
                    "excludeNamespaces must be a list, got {other}"
                )));
            }
        };
        Ok(Self {
            cni_version: v
                .get("cniVersion")
                .and_then(Value::as_str)
                .unwrap_or("1.0.0")
                .to_owned(),
            redirect_port,
            proxy_uid,
            exclude_namespaces,
            prev_result: v.get("prevResult").cloned(),
        })
    }

    /// Whether the pod (from `CNI_ARGS`) gets the redirect.
    pub fn redirects(&self, cni_args: &str) -> bool {
        let namespace = cni_args
            .split(';')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "K8S_POD_NAMESPACE")
            .map(|(_, v)| v);
        match namespace {
            // Not a Kubernetes pod: nothing to do.
            None => false,
            Some(ns) => !self.exclude_namespaces.iter().any(|e| e == ns),
        }
    }

    /// The `iptables-restore --noflush` input that installs the redirect: outbound TCP to the
    /// proxy's port, except loopback and the proxy's own uid and gid (modelled on the meshes'
    /// sidecar rules).
    pub fn rules(&self) -> String {
        let (port, uid) = (self.redirect_port, self.proxy_uid);
        format!(
            "*nat\n\
             :MESH_OUTPUT - [0:0]\n\
             :MESH_REDIRECT - [0:0]\n\
             -A MESH_REDIRECT -p tcp -j REDIRECT --to-ports {port}\n\
             -A OUTPUT -p tcp -j MESH_OUTPUT\n\
             -A MESH_OUTPUT -o lo -j RETURN\n\
             -A MESH_OUTPUT -m owner --uid-owner {uid} -j RETURN\n\
             -A MESH_OUTPUT -m owner --gid-owner {uid} -j RETURN\n\
             -A MESH_OUTPUT -j MESH_REDIRECT\n\
             COMMIT\n"
        )
    }

    /// What `ADD` prints: the previous result, or an empty result of our version.
    pub fn add_result(&self) -> Value {
        self.prev_result
            .clone()
            .unwrap_or_else(|| json!({"cniVersion": self.cni_version}))
    }
}

/// What `VERSION` prints.
pub fn version_result(cni_version: &str) -> Value {
    json!({"cniVersion": cni_version, "supportedVersions": SUPPORTED_VERSIONS})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_its_entry_and_passes_the_previous_result_on() {
        let c = Config::parse(
            r#"{"cniVersion":"1.0.0","name":"n","type":"mesh-cni","redirectPort":4140,"proxyUid":2102,
                "excludeNamespaces":["kube-system"],"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.244.0.5/24"}]}}"#,
        )
        .expect("config");
        assert_eq!(c.redirect_port, 4140);
        assert_eq!(c.proxy_uid, 2102);
        assert_eq!(c.add_result()["ips"][0]["address"], "10.244.0.5/24");
        assert!(c.rules().contains("REDIRECT --to-ports 4140"));
        assert!(c.rules().contains("--uid-owner 2102 -j RETURN"));
        assert!(c.rules().ends_with("COMMIT\n"));
    }

    #[test]
    fn defaults_and_bad_input() {
        let c = Config::parse(r#"{"cniVersion":"0.4.0"}"#).expect("config");
        assert_eq!((c.redirect_port, c.proxy_uid), (15001, 1337));
        assert_eq!(c.add_result(), json!({"cniVersion": "0.4.0"}));
        assert_eq!(Config::parse("nope").expect_err("not JSON").code, 6);
        for bad in [
            r#"{"redirectPort":"x"}"#,
            r#"{"redirectPort":70000}"#,
            r#"{"excludeNamespaces":"kube-system"}"#,
            r#"{"excludeNamespaces":[1]}"#,
        ] {
            let e = Config::parse(bad).expect_err(bad);
            assert_eq!(e.code, 7, "{bad}");
            assert_eq!(e.to_json("1.0.0")["code"], 7);
        }
    }

    #[test]
    fn excluded_namespaces_and_non_pods_are_left_alone() {
        let c = Config::parse(r#"{"excludeNamespaces":["kube-system","mesh-system"]}"#)
            .expect("config");
        assert!(c.redirects("IgnoreUnknown=1;K8S_POD_NAMESPACE=apps;K8S_POD_NAME=web"));
        assert!(!c.redirects("K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns"));
        assert!(!c.redirects(""));
        assert_eq!(
            version_result("1.0.0")["supportedVersions"],
            json!(SUPPORTED_VERSIONS)
        );
    }
}
