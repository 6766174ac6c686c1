//! The init gate: the pod mutation that holds a pod's start until the node's mesh agent has set
//! the pod up, and the resource gate that keeps it off nodes whose agents are not Ready.
//!
//! # Where the gate goes
//! The gate is the **first** init container, before native sidecars (init containers with
//! `restartPolicy: Always`) too:
//! * every later container, sidecar proxies included, relies on traffic capture being in place,
//!   and init containers start strictly in order, so first is the only place that guards all;
//! * the sidecar-mode check listens on the proxy's outbound port to prove redirection, which it
//!   can only do before the proxy binds that port;
//! * a mesh injector that runs after meshgate (reinvocation) may put its own init containers in
//!   front; on the reinvocation meshgate moves its gate back to the front.
//!
//! # What is left alone
//! Operations other than CREATE, excluded namespaces, `hostNetwork` pods (they share the node's
//! network namespace: no per-pod capture exists to wait for), pods that opt out with the label or
//! annotation `meshgate.dev/inject: "false"`, pods no clause selects.

use meshgate_api::config::GateConfig;
use meshgate_api::names;
use serde_json::{Value, json};

use meshgate_api::config::SelectorClause;

use crate::patch::{JsonPatch, escape};
use crate::select::{Meta, selecting_clause};
use crate::view::{Obj, PodSpecView, PodView};

/// Why a pod was left untouched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    Operation,
    ExcludedNamespace,
    HostNetwork,
    OptedOut,
    NotSelected,
    NotAPod,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Operation => "operation",
            Skip::ExcludedNamespace => "excluded-namespace",
            Skip::HostNetwork => "host-network",
            Skip::OptedOut => "opted-out",
            Skip::NotSelected => "not-selected",
            Skip::NotAPod => "not-a-pod",
        }
    }
}

/// The outcome for one pod.
#[derive(Clone, Debug, PartialEq)]
pub enum PodPlan {
    /// Untouched, and why.
    Skip(Skip),
    /// Selected by `clause`; `patch` is empty when the pod already has everything.
    Mutate { clause: String, patch: JsonPatch },
}

impl PodPlan {
    /// A short word for logs and metrics.
    pub fn decision(&self) -> &'static str {
        match self {
            PodPlan::Skip(s) => s.as_str(),
            PodPlan::Mutate { patch, .. } if patch.is_empty() => "already-gated",
            PodPlan::Mutate { .. } => "mutated",
        }
    }
}

/// One admission request for a pod, reduced to what the gate reads.
#[derive(Clone, Copy, Debug)]
pub struct PodRequest<'a> {
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: &'a str,
    pub namespace: &'a str,
    /// The pod as JSON (the review's `request.object`).
    pub pod: &'a Value,
    /// The namespace's labels and annotations.
    pub namespace_meta: &'a Meta,
}

/// Whether the pod opts out of meshgate by label or annotation.
pub fn opted_out(pod: &Meta) -> bool {
    pod.labels.get(names::OPT_OUT).map(String::as_str) == Some("false")
        || pod.annotations.get(names::OPT_OUT).map(String::as_str) == Some("false")
}

/// Plans the gate and the resource gate for one pod.
///
/// Builds a [`Planner`] for `config` on every call; a server answering many reviews keeps one
/// [`Planner`] instead.
pub fn plan_pod(config: &GateConfig, req: &PodRequest<'_>) -> PodPlan {
    Planner::new(config).plan(req)
}

/// The init gate's planning for one [`GateConfig`], with everything that does not depend on the
/// pod (the selector clauses, the gate container) computed once.
#[derive(Clone, Debug)]
pub struct Planner {
    config: GateConfig,
    clauses: Vec<SelectorClause>,
    gate_container: Value,
}

impl Planner {
    pub fn new(config: &GateConfig) -> Self {
        Self {
            config: config.clone(),
            clauses: config.clauses(),
            gate_container: gate_container(config),
        }
    }

    pub fn config(&self) -> &GateConfig {
        &self.config
    }

    /// Plans for a pod given as a `Value`.
    pub fn plan(&self, req: &PodRequest<'_>) -> PodPlan {
        self.plan_view(
            req.operation,
            req.namespace,
            req.namespace_meta,
            &PodView::of(req.pod),
        )
    }

    /// Plans for a pod given as a [`PodView`] (see [`crate::view::read_pod`]): the same
    /// decision as [`Planner::plan`] on the `Value` of the same JSON.
    pub fn plan_view(
        &self,
        operation: &str,
        namespace: &str,
        namespace_meta: &Meta,
        pod: &PodView<'_>,
    ) -> PodPlan {
        let config = &self.config;
        if operation != "CREATE" {
            return PodPlan::Skip(Skip::Operation);
        }
        if config.excluded_namespaces.iter().any(|n| n == namespace) {
            return PodPlan::Skip(Skip::ExcludedNamespace);
        }
        let Some(spec) = pod.spec.get() else {
            return PodPlan::Skip(Skip::NotAPod);
        };
        if spec.host_network.0 == Some(true) {
            return PodPlan::Skip(Skip::HostNetwork);
        }
        let meta = pod.meta();
        if opted_out(&meta) {
            return PodPlan::Skip(Skip::OptedOut);
        }
        let Some(clause) = selecting_clause(&self.clauses, namespace_meta, &meta) else {
            return PodPlan::Skip(Skip::NotSelected);
        };
        let mut patch = JsonPatch::default();
        if config.init_gate.enabled {
            patch.extend(self.plan_init_gate(spec));
        }
        if config.resource_gate.enabled {
            patch.extend(plan_resource_request(&config.resource_gate.resource, spec));
        }
        PodPlan::Mutate {
            clause: clause.to_owned(),
            patch,
        }
    }

    fn plan_init_gate(&self, spec: &PodSpecView<'_>) -> JsonPatch {
        let mut patch = JsonPatch::default();
        match spec.init_containers.get() {
            None => patch.add(
                "/spec/initContainers",
                Value::Array(vec![self.gate_container.clone()]),
            ),
            Some(inits) => {
                let existing = inits.iter().position(|c| {
                    c.get().and_then(|c| c.name.as_deref()) == Some(names::GATE_CONTAINER)
                });
                match existing {
                    Some(0) => {}
                    Some(i) => patch.move_to(
                        format!("/spec/initContainers/{i}"),
                        "/spec/initContainers/0",
                    ),
                    None => patch.add("/spec/initContainers/0", self.gate_container.clone()),
                }
            }
        }
        patch
    }
}

/// The init container meshgate injects.
pub fn gate_container(config: &GateConfig) -> Value {
    let gate = &config.init_gate;
    let mut args: Vec<String> = config.checks().iter().flat_map(|c| c.args()).collect();
    args.push("--timeout".into());
    args.push(format!("{}s", gate.timeout_seconds));
    json!({
        "name": names::GATE_CONTAINER,
        "image": gate.image,
        "imagePullPolicy": gate.image_pull_policy,
        "command": [gate.command],
        "args": args,
        "resources": {
            "requests": {"cpu": gate.cpu_request, "memory": gate.memory_request},
            "limits": {"cpu": gate.cpu_limit, "memory": gate.memory_limit},
        },
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": gate.run_as_user,
            "runAsGroup": gate.run_as_user,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "privileged": false,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    })
}

/// Requests (and limits, as the API server requires for extended resources) one unit of the
/// gate resource in the first app container, unless it asks for it already.
fn plan_resource_request(resource: &str, spec: &PodSpecView<'_>) -> JsonPatch {
    let mut patch = JsonPatch::default();
    let Some(container) = spec
        .containers
        .get()
        .and_then(|c| c.first())
        .and_then(Obj::get)
    else {
        return patch;
    };
    let res = escape(resource);
    let base = "/spec/containers/0/resources";
    let Some(resources) = container.resources.get() else {
        patch.add(
            base,
            json!({"requests": {resource: "1"}, "limits": {resource: "1"}}),
        );
        return patch;
    };
    for (field, keys) in [
        ("requests", &resources.requests),
        ("limits", &resources.limits),
    ] {
        match keys.get() {
            None => patch.add(format!("{base}/{field}"), json!({resource: "1"})),
            Some(k) if !k.contains(resource) => {
                patch.add(format!("{base}/{field}/{res}"), json!("1"));
            }
            Some(_) => {}
        }
    }
    patch
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_api::Profile;
    use meshgate_api::config::GateCheck;

    fn config() -> GateConfig {
        GateConfig {
            profiles: vec![Profile::IstioAmbient],
            ..GateConfig::default()
        }
    }

    fn ambient() -> Meta {
        Meta {
            labels: [("istio.io/dataplane-mode".to_owned(), "ambient".to_owned())].into(),
            ..Meta::default()
        }
    }

    fn plan(config: &GateConfig, ns: &str, ns_meta: &Meta, pod: &Value) -> PodPlan {
        plan_pod(
            config,
            &PodRequest {
                operation: "CREATE",
                namespace: ns,
                pod,
                namespace_meta: ns_meta,
            },
        )
    }

    fn mutated(config: &GateConfig, pod: &Value) -> Value {
        match plan(config, "apps", &ambient(), pod) {
            PodPlan::Mutate { patch, .. } => patch.apply(pod).unwrap(),
            other => panic!("expected a mutation, got {other:?}"),
        }
    }

    fn pod() -> Value {
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app", "image": "app"}]}})
    }

    fn init_names(pod: &Value) -> Vec<&str> {
        pod["spec"]["initContainers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn pod_without_init_containers_gets_the_gate() {
        let out = mutated(&config(), &pod());
        assert_eq!(init_names(&out), ["meshgate-wait"]);
        let gate = &out["spec"]["initContainers"][0];
        assert_eq!(gate["command"], json!(["/meshgate-wait"]));
        assert_eq!(
            gate["args"],
            json!(["--tcp-listening", "15008", "--timeout", "120s"])
        );
        let sc = &gate["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(gate["resources"]["limits"]["memory"], "16Mi");
        assert_eq!(
            out["spec"]["containers"],
            pod()["spec"]["containers"],
            "app untouched"
        );
    }

    #[test]
    fn gate_goes_before_existing_init_containers_and_native_sidecars() {
        let mut p = pod();
        p["spec"]["initContainers"] = json!([
            {"name": "migrate", "image": "db"},
            {"name": "proxy", "image": "proxy", "restartPolicy": "Always"},
        ]);
        let out = mutated(&config(), &p);
        assert_eq!(init_names(&out), ["meshgate-wait", "migrate", "proxy"]);
        assert_eq!(out["spec"]["initContainers"][2]["restartPolicy"], "Always");
    }

    #[test]
    fn reinvocation_adds_no_second_gate_and_moves_it_first() {
        let once = mutated(&config(), &pod());
        assert_eq!(
            plan(&config(), "apps", &ambient(), &once),
            PodPlan::Mutate {
                clause: "istio-ambient".into(),
                patch: JsonPatch::default()
            }
        );
        // Another injector put its container in front after meshgate ran.
        let mut moved = once.clone();
        moved["spec"]["initContainers"]
            .as_array_mut()
            .unwrap()
            .insert(0, json!({"name": "mesh-init", "image": "x"}));
        let out = mutated(&config(), &moved);
        assert_eq!(init_names(&out), ["meshgate-wait", "mesh-init"]);
        assert_eq!(mutated(&config(), &out), out, "idempotent");
    }

    #[test]
    fn left_untouched() {
        let c = config();
        let none = Meta::default();
        assert_eq!(
            plan(&c, "apps", &none, &pod()),
            PodPlan::Skip(Skip::NotSelected)
        );
        assert_eq!(
            plan(&c, "kube-system", &ambient(), &pod()),
            PodPlan::Skip(Skip::ExcludedNamespace)
        );
        let mut host = pod();
        host["spec"]["hostNetwork"] = json!(true);
        assert_eq!(
            plan(&c, "apps", &ambient(), &host),
            PodPlan::Skip(Skip::HostNetwork)
        );
        let mut out = pod();
        out["metadata"]["labels"] = json!({"meshgate.dev/inject": "false"});
        assert_eq!(
            plan(&c, "apps", &ambient(), &out),
            PodPlan::Skip(Skip::OptedOut)
        );
        let mut out = pod();
        out["metadata"]["annotations"] = json!({"meshgate.dev/inject": "false"});
        assert_eq!(
            plan(&c, "apps", &ambient(), &out),
            PodPlan::Skip(Skip::OptedOut)
        );
        let mut none_mode = pod();
        none_mode["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "none"});
        assert_eq!(
            plan(&c, "apps", &ambient(), &none_mode),
            PodPlan::Skip(Skip::NotSelected)
        );
        for op in ["UPDATE", "DELETE", "CONNECT"] {
            let req = PodRequest {
                operation: op,
                namespace: "apps",
                pod: &pod(),
                namespace_meta: &ambient(),
            };
            assert_eq!(plan_pod(&c, &req), PodPlan::Skip(Skip::Operation));
        }
    }

    #[test]
    fn missing_fields_do_not_break_planning() {
        let c = config();
        assert_eq!(
            plan(&c, "apps", &ambient(), &json!({})),
            PodPlan::Skip(Skip::NotAPod)
        );
        assert_eq!(
            plan(&c, "apps", &ambient(), &json!({"spec": 3})),
            PodPlan::Skip(Skip::NotAPod)
        );
        // No metadata, no containers: the gate still goes in, the resource gate has no target.
        let mut rc = c.clone();
        rc.resource_gate.enabled = true;
        let p = json!({"spec": {}});
        let out = mutated(&rc, &p);
        assert_eq!(init_names(&out), ["meshgate-wait"]);
        // Labels that are not strings are ignored, not a crash.
        let odd = json!({"metadata": {"labels": {"a": 1}}, "spec": {"containers": []}});
        assert!(matches!(
            plan(&c, "apps", &ambient(), &odd),
            PodPlan::Mutate { .. }
        ));
    }

    #[test]
    fn ephemeral_containers_are_left_alone() {
        let mut p = pod();
        p["spec"]["ephemeralContainers"] = json!([{"name": "debug", "image": "busybox"}]);
        let out = mutated(&config(), &p);
        assert_eq!(
            out["spec"]["ephemeralContainers"],
            p["spec"]["ephemeralContainers"]
        );
    }

    #[test]
    fn resource_gate_requests_one_unit_once() {
        let mut c = config();
        c.resource_gate.enabled = true;
        let out = mutated(&c, &pod());
        let r = &out["spec"]["containers"][0]["resources"];
        assert_eq!(r["requests"]["meshgate.dev/mesh-ready"], "1");
        assert_eq!(r["limits"]["meshgate.dev/mesh-ready"], "1");
        assert_eq!(mutated(&c, &out), out, "idempotent");

        let mut p = pod();
        p["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
        let out = mutated(&c, &p);
        let r = &out["spec"]["containers"][0]["resources"];
        assert_eq!(
            r["requests"],
            json!({"cpu": "1", "meshgate.dev/mesh-ready": "1"})
        );
        assert_eq!(r["limits"], json!({"meshgate.dev/mesh-ready": "1"}));
    }

    #[test]
    fn configured_checks_are_combined_in_the_arguments() {
        let mut c = config();
        c.init_gate.checks = vec![
            GateCheck::TcpListening { port: 15008 },
            GateCheck::File {
                path: "/var/run/ready".into(),
            },
        ];
        c.init_gate.timeout_seconds = 30;
        let gate = gate_container(&c);
        assert_eq!(
            gate["args"],
            json!([
                "--tcp-listening",
                "15008",
                "--file",
                "/var/run/ready",
                "--timeout",
                "30s"
            ])
        );
    }
}
