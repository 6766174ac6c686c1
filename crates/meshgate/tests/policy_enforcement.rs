//! A MutatingAdmissionPolicy API that the API server serves but does not run (issue 43,
//! finding 1): kube-apiserver registers the API's storage from `--runtime-config` alone while its
//! admission plugin runs only with the `MutatingAdmissionPolicy` feature gate. Reproduced on
//! every minor with the gate set false and the beta API turned on by `--runtime-config` (as on
//! 1.34 and 1.35 with the beta API enabled alone; 1.36 and 1.37 serve v1 by default): discovery
//! lists the API. There:
//! * the probe finds the API stored only, and leaves nothing behind;
//! * `meshgate install --apply` says so and taints nodes at registration with its webhook;
//! * `meshgate check` fails on a node-taint policy that the API server stores and never runs
//!   (what `install` chose there before), naming the fix, and passes on an API server that runs it.
//!
//! Before the fix `install` chose the policy (discovery alone) and nothing was reported.
//!
//! Run: `cargo test -p meshgate --test policy_enforcement`.

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, DynamicObject, ListParams};
use meshgate::discovery::{PolicyEnforcement, policy_api, prove_policy_api};
use serde_json::Value;

const NS: &str = "meshgate-system";

/// A control plane with the policy API served (v1beta1 turned on, v1 where the minor serves it)
/// and its admission plugin on (`enforced`) or off.
async fn control_plane(enforced: bool) -> meshgate_testenv::ControlPlane {
    meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        apiserver_flags: vec![
            format!("--feature-gates=MutatingAdmissionPolicy={enforced}"),
            "--runtime-config=admissionregistration.k8s.io/v1beta1=true".into(),
        ],
        ..Default::default()
    })
    .await
    .expect("control plane starts")
}

/// meshgate's admission policies left in the cluster (probes included).
async fn policies(client: &kube::Client) -> Vec<String> {
    let api = policy_api(client).await.expect("the policy API is served");
    let ar = kube::discovery::ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: api
            .api_version()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .into(),
        api_version: api.api_version().into(),
        kind: "MutatingAdmissionPolicy".into(),
        plural: "mutatingadmissionpolicies".into(),
    };
    Api::<DynamicObject>::all_with(client.clone(), &ar)
        .list(&ListParams::default())
        .await
        .expect("policies")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// `meshgate check -o json`: the `registration` checks.
fn registration_checks(cp: &meshgate_testenv::ControlPlane) -> Vec<Value> {
    let out = meshgate_on(cp, &["check", "--namespace", NS, "-o", "json"]);
    let checks: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "check output: {e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    checks
        .into_iter()
        .filter(|c| c["name"] == "registration")
        .collect()
}

/// The default gate of a profile and its node-taint policy, as `install` rendered them where it
/// chose the policy.
async fn gate_with_policy(client: &kube::Client) {
    install_crds(client).await;
    let api = policy_api(client).await.expect("the policy API is served");
    let docs = meshgate::install::render(&meshgate::install::InstallOptions {
        node_taint: meshgate::install::NodeTaint::Policy(api),
        ..install_options("istio-ambient", NS)
    })
    .expect("render");
    let wanted: Vec<Value> = docs
        .into_iter()
        .filter(|d| {
            [
                "NodeGate",
                "MutatingAdmissionPolicy",
                "MutatingAdmissionPolicyBinding",
            ]
            .contains(&d["kind"].as_str().unwrap_or_default())
        })
        .collect();
    assert_eq!(wanted.len(), 3, "the gate, its policy and binding");
    meshgate::install::apply(client, &wanted, false, |_| {})
        .await
        .expect("applied");
}

#[tokio::test]
async fn a_policy_api_served_but_not_run_is_not_chosen() {
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let served = policy_api(&client).await;
    assert!(
        served.is_some(),
        "the cell reproduces the finding: discovery lists the API with its feature gate off"
    );
    let found = prove_policy_api(&client, "default", Duration::from_secs(5)).await;
    assert!(
        matches!(found, PolicyEnforcement::StoredOnly(api, _) if Some(api) == served),
        "{found:?}"
    );
    assert_eq!(
        policies(&client).await,
        Vec::<String>::new(),
        "no probe left"
    );

    let said = install_applied(&cp, "istio-ambient", NS);
    assert!(
        said.contains("served but NOT enforced"),
        "install says why: {said}"
    );
    assert!(
        said.contains("node taint at registration: webhook"),
        "install taints nodes with its webhook: {said}"
    );
    assert_eq!(
        policies(&client).await,
        Vec::<String>::new(),
        "no admission policy installed, no probe left"
    );
}

#[tokio::test]
async fn check_fails_on_a_node_taint_policy_the_api_server_does_not_run() {
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    gate_with_policy(&client).await;
    let checks = registration_checks(&cp);
    assert_eq!(checks.len(), 1, "{checks:?}");
    assert_eq!(checks[0]["ok"], false, "{checks:?}");
    let message = checks[0]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("does not get readiness.k8s.io/mesh-agents"),
        "{message}"
    );
    assert!(
        checks[0]["hint"]
            .as_str()
            .is_some_and(|h| h.contains("meshgate install --apply")),
        "{checks:?}"
    );
}

#[tokio::test]
async fn check_passes_where_the_api_server_runs_the_node_taint_policy() {
    let cp = control_plane(true).await;
    let client = cp.client().await.expect("client");
    let found = prove_policy_api(&client, "default", Duration::from_secs(30)).await;
    assert!(matches!(found, PolicyEnforcement::Enforced(_)), "{found:?}");
    gate_with_policy(&client).await;
    // The policy takes effect asynchronously: the check passes once a dry-run node is tainted.
    wait_registration_taint(&client, meshgate_api::names::STARTUP_TAINT_KEY, true).await;
    let checks = registration_checks(&cp);
    assert_eq!(checks.len(), 1, "{checks:?}");
    assert_eq!(checks[0]["ok"], true, "{checks:?}");
    // `meshgate status` names the policy in the version served (v1beta1 on 1.34 and 1.35).
    let out = meshgate_on(&cp, &["status"]);
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(
        status.contains(
            "NODE TAINT AT REGISTRATION: admission policy (meshgate-node-taint-mesh-agents)"
        ),
        "{status}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Each minor as it comes by default: 1.34 and 1.35 serve no policy API (its beta is off), so
/// `install --apply` taints nodes with its webhook; 1.36 and 1.37 run v1, proven by the probe,
/// and `install` takes the policy.
#[tokio::test]
async fn install_on_each_minors_defaults_takes_the_path_that_runs() {
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        version_defaults: true,
        ..Default::default()
    })
    .await
    .expect("control plane starts");
    let client = cp.client().await.expect("client");
    let found = prove_policy_api(&client, "default", Duration::from_secs(30)).await;
    let said = install_applied(&cp, "istio-ambient", NS);
    if cp.minor >= meshgate_testenv::POLICY_API_GA_MINOR {
        assert_eq!(
            found,
            PolicyEnforcement::Enforced(meshgate_core::registration::PolicyApi::V1)
        );
        assert!(
            said.contains("node taint at registration: MutatingAdmissionPolicy (admissionregistration.k8s.io/v1)"),
            "{said}"
        );
    } else {
        assert_eq!(found, PolicyEnforcement::NotServed);
        assert!(
            said.contains("no MutatingAdmissionPolicy API served"),
            "{said}"
        );
        assert!(
            said.contains("node taint at registration: webhook"),
            "{said}"
        );
    }
}

/// The node-taint policy on a Node that registers with no taint at all (issue 43, finding 4):
/// its JSON patch then creates the list, as an empty list and the taint appended. The shape it
/// had before, one list literal holding an `Object{}` (`value: [Object.spec.taints{...}]`),
/// aborts the request in kube-apiserver 1.34.x, 1.35 before 1.35.8 and 1.36 before 1.36.5
/// (docs/design.md, "Kubernetes versions"). Reachable only without the `TaintNodesByCondition`
/// admission plugin (it runs first and always adds a taint), so that plugin is off here. The
/// node registers, carrying the gate's taint, on every minor of the matrix.
#[tokio::test]
async fn the_node_taint_policy_creates_the_taint_list_on_a_node_without_taints() {
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        apiserver_flags: vec![
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition".into(),
        ],
        ..Default::default()
    })
    .await
    .expect("control plane starts");
    let client = cp.client().await.expect("client");
    gate_with_policy(&client).await;
    let key = meshgate_api::names::STARTUP_TAINT_KEY;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    // Active once a dry-run Node (with a taint of its own: the list exists) comes back with the
    // gate's taint too.
    let dry = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    let with_taint: k8s_openapi::api::core::v1::Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "probe"},
        "spec": {"taints": [{"key": "example.com/other", "effect": "NoSchedule"}]},
    }))
    .expect("node");
    wait_for(
        "the policy to taint nodes",
        Duration::from_secs(30),
        || async {
            nodes.create(&dry, &with_taint).await.is_ok_and(|n| {
                n.spec
                    .and_then(|s| s.taints)
                    .unwrap_or_default()
                    .iter()
                    .any(|t| t.key == key)
            })
        },
    )
    .await;
    let node: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "bare-node"}}))
            .expect("node");
    let created = nodes
        .create(&Default::default(), &node)
        .await
        .unwrap_or_else(|e| panic!("Kubernetes 1.{}: a Node with no taint: {e}", cp.minor));
    assert_eq!(
        taint_keys(&created),
        vec![key.to_owned()],
        "Kubernetes 1.{}",
        cp.minor
    );
}

/// The API server stops running MutatingAdmissionPolicies under a running controller (its
/// feature gate turned off, as a changed control plane may), then runs them again: the
/// controller, proving it on its interval as its installed identity, routes every namespace's
/// pods back to the webhook (the gate entries' selectors as for `Routes::All`) with the Event
/// `NativeGateNotEnforced`, and routes them to the policy again once it runs
/// (`NativeGateEnforced`). Before, it trusted discovery for the life of the process: pods in
/// every namespace without a LimitRange went ungated.
#[tokio::test]
async fn the_native_gate_goes_back_to_the_webhook_while_the_api_server_does_not_run_it() {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use meshgate::install::{InstallOptions, PodGate, Strategy};
    use meshgate_core::native_gate::Routes;
    use meshgate_core::registration::native_gate_entries;

    let enforced = |on: bool| vec![format!("--feature-gates=MutatingAdmissionPolicy={on}")];
    let mut cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        apiserver_flags: enforced(true),
        ..Default::default()
    })
    .await
    .expect("control plane");
    let admin = cp.client().await.expect("client");
    let Some(api) = policy_api(&admin).await else {
        eprintln!("skipped: this API server serves no MutatingAdmissionPolicy API by default");
        return;
    };
    let config = meshgate::install::gate_config_for(
        "istio-ambient",
        NS,
        "meshgate/meshgate:test",
        Strategy::Pod,
        meshgate_api::names::STARTUP_TAINT_KEY,
    )
    .expect("config");
    let docs = meshgate::install::render(&InstallOptions {
        pod_gate: PodGate::Native(api),
        ..install_options("istio-ambient", NS)
    })
    .expect("render");
    apply_but_deployments(&admin, docs).await;
    let controller = ControllerTask::start(
        &cp,
        NS,
        meshgate::run::ControllerSettings {
            lease: Some(meshgate_controller::leader::LeaseSettings {
                namespace: NS.into(),
                name: "meshgate-controller".into(),
                identity: "proof-test".into(),
                duration: 15,
                grace: 5,
            }),
            native_policies: true,
            native_gate: Some((config.clone(), "meshgate".into())),
            native_gate_proof: Some(Duration::from_secs(2)),
            ..Default::default()
        },
    );

    // The gate entries' namespace selectors as stored, against what `routes` renders.
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
    let routed_as = |routes: Routes| {
        let (mwcs, config) = (mwcs.clone(), config.clone());
        async move {
            let want = native_gate_entries(&config, &routes);
            let Ok(Some(mwc)) = mwcs.get_opt("meshgate").await else {
                return false;
            };
            let hooks = mwc.webhooks.unwrap_or_default();
            !want.is_empty()
                && want.iter().all(|(name, selector)| {
                    hooks.iter().any(|h| {
                        h.name == *name
                            && serde_json::to_value(&h.namespace_selector).ok().as_ref()
                                == Some(selector)
                    })
                })
        }
    };
    let event = |reason: &'static str| {
        let admin = admin.clone();
        async move {
            Api::<k8s_openapi::api::events::v1::Event>::all(admin)
                .list(&Default::default())
                .await
                .is_ok_and(|l| l.items.iter().any(|e| e.reason.as_deref() == Some(reason)))
        }
    };
    let no_limit_ranges = || Routes::Namespaces(Vec::new());
    wait_for(
        "the policy to gate every namespace (no LimitRange anywhere)",
        Duration::from_secs(60),
        || routed_as(no_limit_ranges()),
    )
    .await;

    cp.restart_apiserver_with(&enforced(false))
        .await
        .expect("API server restarted with the plugin off");
    wait_for(
        "every namespace back to the webhook",
        Duration::from_secs(60),
        || routed_as(Routes::All),
    )
    .await;
    wait_for(
        "the Event NativeGateNotEnforced",
        Duration::from_secs(30),
        || event("NativeGateNotEnforced"),
    )
    .await;

    cp.restart_apiserver_with(&enforced(true))
        .await
        .expect("API server restarted with the plugin on");
    wait_for(
        "the policy to gate every namespace again",
        Duration::from_secs(90),
        || routed_as(no_limit_ranges()),
    )
    .await;
    wait_for(
        "the Event NativeGateEnforced",
        Duration::from_secs(30),
        || event("NativeGateEnforced"),
    )
    .await;
    controller.finish().await;
    // The probes left nothing behind.
    let probes = Api::<DynamicObject>::all_with(
        admin.clone(),
        &kube::api::ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: api.api_version().rsplit('/').next().unwrap_or("v1").into(),
            api_version: api.api_version().into(),
            kind: "MutatingAdmissionPolicy".into(),
            plural: "mutatingadmissionpolicies".into(),
        },
    )
    .list(&ListParams::default().labels(meshgate_core::registration::PROBE_LABEL))
    .await
    .expect("policies listed");
    assert!(probes.items.is_empty(), "no probe policy left behind");
}
