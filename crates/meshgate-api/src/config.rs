//! The init-gate configuration (`meshgate webhook --config FILE`).
//!
//! One value of [`GateConfig`] decides which pods get the gate, what the gate checks, and what the
//! generated `MutatingWebhookConfiguration` pre-filters: the webhook and its registration are
//! derived from the same source and cannot drift apart.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::selector::{LabelSelector, SelectorOperator};

/// A mesh whose pod selection meshgate knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// Namespaces labelled `istio.io/dataplane-mode=ambient`, unless the pod's own label says
    /// `none`, and pods labelled `istio.io/dataplane-mode=ambient`. The gate waits for the node
    /// proxy's in-pod listener.
    IstioAmbient,
    /// Namespaces labelled `istio-injection=enabled` or `istio.io/rev`, and pods labelled
    /// `sidecar.istio.io/inject=true`. The gate proves that outbound redirection works.
    IstioSidecar,
    /// Pods or namespaces annotated `linkerd.io/inject: enabled` (or `ingress`). The gate proves
    /// redirection.
    Linkerd,
}

impl Profile {
    pub const ALL: [Profile; 3] = [
        Profile::IstioAmbient,
        Profile::IstioSidecar,
        Profile::Linkerd,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Profile::IstioAmbient => "istio-ambient",
            Profile::IstioSidecar => "istio-sidecar",
            Profile::Linkerd => "linkerd",
        }
    }

    /// The readiness check that fits the mesh's capture mode (see [`crate::mesh`]).
    fn default_checks(self) -> Vec<GateCheck> {
        vec![self.record().check()]
    }

    /// The selection clauses of the profile (any one selects a pod).
    pub fn clauses(self) -> Vec<SelectorClause> {
        match self {
            // The mesh's default enablement: a namespace labelled ambient (a pod label `none`
            // opts out), or a pod labelled ambient in any namespace.
            Profile::IstioAmbient => vec![
                SelectorClause {
                    name: "istio-ambient".into(),
                    namespace_selector: LabelSelector::labels([(
                        "istio.io/dataplane-mode",
                        "ambient",
                    )]),
                    object_selector: LabelSelector::default().with(
                        "istio.io/dataplane-mode",
                        SelectorOperator::NotIn,
                        &["none"],
                    ),
                    ..SelectorClause::default()
                },
                SelectorClause {
                    name: "istio-ambient-pod".into(),
                    object_selector: LabelSelector::labels([(
                        "istio.io/dataplane-mode",
                        "ambient",
                    )]),
                    ..SelectorClause::default()
                },
            ],
            Profile::IstioSidecar => {
                let not_disabled = LabelSelector::default().with(
                    "sidecar.istio.io/inject",
                    SelectorOperator::NotIn,
                    &["false"],
                );
                vec![
                    SelectorClause {
                        name: "istio-injection".into(),
                        namespace_selector: LabelSelector::labels([("istio-injection", "enabled")]),
                        object_selector: not_disabled.clone(),
                        ..SelectorClause::default()
                    },
                    SelectorClause {
                        name: "istio-revision".into(),
                        namespace_selector: LabelSelector::default()
                            .with("istio.io/rev", SelectorOperator::Exists, &[])
                            .with("istio-injection", SelectorOperator::DoesNotExist, &[]),
                        object_selector: not_disabled,
                        ..SelectorClause::default()
                    },
                    SelectorClause {
                        name: "istio-pod".into(),
                        namespace_selector: LabelSelector::default().with(
                            "istio-injection",
                            SelectorOperator::NotIn,
                            &["disabled"],
                        ),
                        object_selector: LabelSelector::labels([(
                            "sidecar.istio.io/inject",
                            "true",
                        )]),
                        ..SelectorClause::default()
                    },
                ]
            }
            // Linkerd selects by annotation, which a webhook's selectors cannot see: the
            // clauses match every namespace and the webhook decides from the annotations.
            Profile::Linkerd => ["enabled", "ingress"]
                .into_iter()
                .flat_map(|mode| {
                    // `ingress` injects and redirects like `enabled` (the proxy runs in
                    // ingress mode).
                    let suffix = if mode == "enabled" { "" } else { "-ingress" };
                    [
                        SelectorClause {
                            name: format!("linkerd-pod{suffix}"),
                            pod_annotations: BTreeMap::from([(
                                "linkerd.io/inject".into(),
                                mode.into(),
                            )]),
                            ..SelectorClause::default()
                        },
                        SelectorClause {
                            name: format!("linkerd-namespace{suffix}"),
                            namespace_annotations: BTreeMap::from([(
                                "linkerd.io/inject".into(),
                                mode.into(),
                            )]),
                            pod_annotations_absent: BTreeMap::from([(
                                "linkerd.io/inject".into(),
                                "disabled".into(),
                            )]),
                            ..SelectorClause::default()
                        },
                    ]
                })
                .collect(),
        }
    }
}

/// One way to select a pod. Every set part must hold. Label parts are also given to the API
/// server as the webhook's selectors; annotation parts are decided by the webhook alone.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SelectorClause {
    /// A short name, used in the generated webhook's name (`<name>.gate.meshgate.dev`).
    pub name: String,
    #[serde(default, skip_serializing_if = "LabelSelector::is_empty")]
    pub namespace_selector: LabelSelector,
    #[serde(default, skip_serializing_if = "LabelSelector::is_empty")]
    pub object_selector: LabelSelector,
    /// Namespace annotations that must have these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub namespace_annotations: BTreeMap<String, String>,
    /// Pod annotations that must have these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
    /// Pod annotations that must not have these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations_absent: BTreeMap<String, String>,
}

impl SelectorClause {
    /// Whether the webhook needs the namespace's annotations to decide.
    pub fn needs_namespace_annotations(&self) -> bool {
        !self.namespace_annotations.is_empty()
    }
}

/// One readiness check of `meshgate-wait`. All configured checks must pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum GateCheck {
    /// A socket in LISTEN state on this port in the pod's network namespace.
    TcpListening { port: u16 },
    /// Outbound connections are redirected to this port (the proxy's outbound port).
    RedirectCheck { port: u16 },
    /// A connection to this Unix socket succeeds.
    UnixSocket { path: String },
    /// This file exists.
    File { path: String },
    /// An HTTP GET of this `http://IP:PORT/path` URL answers 2xx.
    Http { url: String },
}

impl GateCheck {
    /// The command-line arguments of `meshgate-wait` for this check.
    pub fn args(&self) -> [String; 2] {
        match self {
            GateCheck::TcpListening { port } => ["--tcp-listening".into(), port.to_string()],
            GateCheck::RedirectCheck { port } => ["--redirect-check".into(), port.to_string()],
            GateCheck::UnixSocket { path } => ["--unix-socket".into(), path.clone()],
            GateCheck::File { path } => ["--file".into(), path.clone()],
            GateCheck::Http { url } => ["--http".into(), url.clone()],
        }
    }
}

/// What the API server does when the webhook cannot be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum FailurePolicy {
    /// Pods are admitted without the gate (fail open).
    #[default]
    Ignore,
    /// Pod creation fails (fail closed).
    Fail,
}

/// The injected init container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct InitGate {
    pub enabled: bool,
    pub image: String,
    pub image_pull_policy: String,
    /// Path of the `meshgate-wait` binary inside the image.
    pub command: String,
    /// Checks; empty means the checks of the configured profiles.
    pub checks: Vec<GateCheck>,
    /// How long the gate waits before failing the pod's start (the kubelet restarts it).
    pub timeout_seconds: u32,
    /// User id the gate runs as (non-root).
    pub run_as_user: i64,
    pub cpu_request: String,
    pub memory_request: String,
    pub cpu_limit: String,
    pub memory_limit: String,
    /// The pod IP family that decides whether a redirect check has anything to prove: a pod
    /// whose traffic settings leave no address of this family redirected gets no gate. A
    /// target of the other family is given too where one is redirected; `meshgate-wait` uses
    /// the one the pod has a route for.
    pub primary_ip_family: IpFamily,
    /// Which gated pods get the init container. `All`: every one. `NodeBound`: only where the
    /// resource gate cannot hold the pod, because it is created with `spec.nodeName` and so
    /// never meets the scheduler; where the resource gate is off, every gated pod.
    /// `TaintExempt`: only where the node gate's startup taint cannot hold the pod: created
    /// with `spec.nodeName`, or tolerating one of [`GateConfig::node_taint_keys`] (or every
    /// taint). On a ready node an init container that passes at once still costs the pod about
    /// half a second of start (BENCHMARKS.md, pod start); the taint and the resource cost none.
    pub scope: InitGateScope,
}

/// Which gated pods the init gate covers ([`InitGate::scope`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum InitGateScope {
    #[default]
    All,
    NodeBound,
    TaintExempt,
}

/// An IP family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum IpFamily {
    #[default]
    IPv4,
    IPv6,
}

impl Default for InitGate {
    fn default() -> Self {
        Self {
            enabled: true,
            image: "meshgate/meshgate:0.1.0".into(),
            image_pull_policy: "IfNotPresent".into(),
            command: "/meshgate-wait".into(),
            checks: Vec::new(),
            timeout_seconds: 120,
            run_as_user: 65532,
            cpu_request: "10m".into(),
            memory_request: "8Mi".into(),
            cpu_limit: "100m".into(),
            memory_limit: "16Mi".into(),
            primary_ip_family: IpFamily::IPv4,
            scope: InitGateScope::All,
        }
    }
}

/// The scheduling gate: selected pods request one unit of an extended resource that the node
/// controller advertises only on nodes whose agents are Ready.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ResourceGate {
    pub enabled: bool,
    pub resource: String,
}

impl Default for ResourceGate {
    fn default() -> Self {
        Self {
            enabled: false,
            resource: crate::names::DEFAULT_RESOURCE.into(),
        }
    }
}

/// The whole gate configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct GateConfig {
    /// Meshes whose pod selection applies.
    pub profiles: Vec<Profile>,
    /// Extra selection clauses.
    pub selectors: Vec<SelectorClause>,
    /// Namespaces never touched (meshgate's own and the system namespaces, to avoid
    /// self-deadlock).
    pub excluded_namespaces: Vec<String>,
    pub init_gate: InitGate,
    pub resource_gate: ResourceGate,
    pub failure_policy: FailurePolicy,
    /// The API server's timeout for one call to the webhook (1 to 30).
    pub timeout_seconds: u8,
    /// The startup taint keys of the node gates (`NodeGate` `spec.taint.key`): with
    /// `initGate.scope: TaintExempt`, a pod that tolerates one of them gets the init gate, as
    /// the taint cannot hold it. `install` writes its gate's key and meshgate's earlier default
    /// key, which nodes tainted before an upgrade may still carry.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub node_taint_keys: Vec<String>,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            profiles: Vec::new(),
            selectors: Vec::new(),
            excluded_namespaces: vec!["kube-system".into(), "meshgate-system".into()],
            init_gate: InitGate::default(),
            resource_gate: ResourceGate::default(),
            failure_policy: FailurePolicy::default(),
            timeout_seconds: 5,
            node_taint_keys: Vec::new(),
        }
    }
}

/// A configuration error, naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: {source}")]
    Parse {
        file: String,
        #[source]
        source: crate::yaml::YamlError,
    },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

impl GateConfig {
    /// Parses YAML (or JSON) and validates; `file` names the source in errors.
    pub fn from_yaml(file: &str, text: &str) -> Result<Self, ConfigError> {
        let config: GateConfig =
            crate::yaml::from_str(text).map_err(|source| ConfigError::Parse {
                file: file.into(),
                source,
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Every clause: the profiles' then the user's.
    pub fn clauses(&self) -> Vec<SelectorClause> {
        self.profiles
            .iter()
            .flat_map(|p| p.clauses())
            .chain(self.selectors.iter().cloned())
            .collect()
    }

    /// The checks the gate runs: configured ones, else the profiles', without repeats.
    pub fn checks(&self) -> Vec<GateCheck> {
        let mut checks = if self.init_gate.checks.is_empty() {
            self.profiles
                .iter()
                .flat_map(|p| p.default_checks())
                .collect()
        } else {
            self.init_gate.checks.clone()
        };
        let mut seen = Vec::with_capacity(checks.len());
        checks.retain(|c| {
            let new = !seen.contains(c);
            if new {
                seen.push(c.clone());
            }
            new
        });
        checks
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            field: field.into(),
            message,
        };
        if !(1..=30).contains(&self.timeout_seconds) {
            return Err(invalid(
                "timeoutSeconds",
                format!("must be 1 to 30, got {}", self.timeout_seconds),
            ));
        }
        let mut names = Vec::new();
        for (i, c) in self.clauses().iter().enumerate() {
            let field = format!("selectors[{i}]");
            if c.name.is_empty()
                || !c
                    .name
                    .chars()
                    .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '-')
            {
                return Err(invalid(
                    &format!("{field}.name"),
                    format!("{:?} must be lowercase letters, digits and '-'", c.name),
                ));
            }
            if names.contains(&c.name) {
                return Err(invalid(
                    &format!("{field}.name"),
                    format!("{:?} is used twice", c.name),
                ));
            }
            names.push(c.name.clone());
            c.namespace_selector
                .validate()
                .map_err(|m| invalid(&format!("{field}.namespaceSelector"), m))?;
            c.object_selector
                .validate()
                .map_err(|m| invalid(&format!("{field}.objectSelector"), m))?;
        }
        let gate = &self.init_gate;
        if gate.scope == InitGateScope::TaintExempt && self.node_taint_keys.is_empty() {
            return Err(invalid(
                "nodeTaintKeys",
                "initGate.scope TaintExempt needs the gates' taint keys (the pods that tolerate one get the init gate)".into(),
            ));
        }
        if gate.enabled {
            if gate.image.is_empty() {
                return Err(invalid("initGate.image", "must not be empty".into()));
            }
            if !["Always", "IfNotPresent", "Never"].contains(&gate.image_pull_policy.as_str()) {
                return Err(invalid(
                    "initGate.imagePullPolicy",
                    format!(
                        "{:?} is not Always, IfNotPresent or Never",
                        gate.image_pull_policy
                    ),
                ));
            }
            if gate.timeout_seconds == 0 {
                return Err(invalid(
                    "initGate.timeoutSeconds",
                    "must be positive".into(),
                ));
            }
            if gate.run_as_user == 0 {
                return Err(invalid(
                    "initGate.runAsUser",
                    "the gate never runs as root".into(),
                ));
            }
            if self.checks().is_empty() {
                return Err(invalid(
                    "initGate.checks",
                    "no checks: set checks or a profile".into(),
                ));
            }
            for (i, check) in self.checks().iter().enumerate() {
                if let GateCheck::Http { url } = check
                    && !url.starts_with("http://")
                {
                    return Err(invalid(
                        &format!("initGate.checks[{i}].http.url"),
                        format!("{url:?} must be http://IP:PORT/path (no DNS, no TLS)"),
                    ));
                }
            }
        }
        if self.resource_gate.enabled && !self.resource_gate.resource.contains('/') {
            return Err(invalid(
                "resourceGate.resource",
                format!(
                    "{:?} must be a domain-qualified extended resource name",
                    self.resource_gate.resource
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_bring_their_checks_and_clauses() {
        let c = GateConfig {
            profiles: vec![Profile::IstioAmbient, Profile::IstioSidecar],
            ..GateConfig::default()
        };
        c.validate().unwrap();
        // Ambient: namespace and pod-label enrolment; sidecar: injection label, revision, pod.
        let names: Vec<String> = c.clauses().into_iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "istio-ambient",
                "istio-ambient-pod",
                "istio-injection",
                "istio-revision",
                "istio-pod"
            ]
        );
        assert_eq!(
            c.checks(),
            vec![
                GateCheck::TcpListening { port: 15008 },
                GateCheck::RedirectCheck { port: 15001 }
            ]
        );
    }

    #[test]
    fn errors_name_the_field() {
        let err =
            GateConfig::from_yaml("c.yaml", "profiles: [istio-ambient]\ntimeoutSeconds: 99\n")
                .unwrap_err();
        assert_eq!(err.to_string(), "timeoutSeconds: must be 1 to 30, got 99");
        let err = GateConfig::from_yaml("c.yaml", "profiles: [nope]\n").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("c.yaml: profiles[0]: unknown variant"),
            "{err}"
        );
        let err = GateConfig::from_yaml("c.yaml", "initGate: {checks: []}\n").unwrap_err();
        assert!(err.to_string().starts_with("initGate.checks"), "{err}");
        let err = GateConfig::from_yaml("c.yaml", "profiles: [linkerd]\nbogus: 1\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `bogus`"), "{err}");
    }
}
