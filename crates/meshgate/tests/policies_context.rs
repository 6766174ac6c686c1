//! ConfigMap context entries on the real API server (issue #30, cause 1): a MutationPolicy
//! whose `context` reads a ConfigMap, applied by the webhook and the controller's backfill, both
//! running as the ServiceAccounts `meshgate install --context-config-map` grants that one
//! ConfigMap to (list and watch for the webhook, get for the controller, by name).
//!
//! * the webhook serves the ConfigMap's data from its watch: a pod gets the value, and after the
//!   ConfigMap changes, new pods get the new value (no restart);
//! * the policy's status lists the ConfigMaps it reads;
//! * the backfill reads it too: an existing Deployment's pod template gets the value;
//! * a policy naming a ConfigMap that was not granted fails on the object, which is admitted
//!   without it (the webhook counts the failure), while the granted policy still applies;
//! * `meshgate render` with the ConfigMap in its input gives the same pod.
//!
//! Run: `cargo test -p meshgate --test policies_context`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_api::MutationPolicy;
use serde_json::{Value, json};

const INSTALL_NS: &str = "meshgate-system";
const ANNOTATION: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";

fn policy(name: &str, app_ns: &str, config_map: &str, existing: bool) -> Value {
    json!({"apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy", "metadata": {"name": name},
           "spec": {"match": {"kinds": ["Pod"], "namespaces": [app_ns]}, "podTemplates": true,
                    "existing": {"enabled": existing, "ratePerSecond": 100},
                    "mutations": [{
                        "context": [{"name": "mesh", "configMap": {"name": config_map, "namespace": app_ns}}],
                        "annotations": {"values": {ANNOTATION: "{{ mesh.data.exclude }}"}}}]}})
}

/// The annotation a pod gets at admission (a dry run unless `name` is given: the webhook
/// counts failures of real requests only).
async fn annotation_of(pods: &Api<Pod>, name: Option<&str>) -> Option<String> {
    let pod: Pod = serde_json::from_value(common::pod(name.unwrap_or("probe"))).expect("pod");
    let created = pods
        .create(
            &PostParams {
                dry_run: name.is_none(),
                ..Default::default()
            },
            &pod,
        )
        .await
        .expect("pod admitted");
    created
        .metadata
        .annotations
        .and_then(|a| a.get(ANNOTATION).cloned())
}

#[tokio::test]
async fn a_config_map_context_entry_is_read_from_the_granted_config_map_only() {
    let cp = control_plane(false).await;
    let admin = cp.client().await.expect("client");
    install_crds(&admin).await;
    let app_ns = cp.namespace("context", &[]).await.expect("namespace");
    let granted = "mesh-settings";
    install_identities_of(
        &admin,
        &meshgate::install::InstallOptions {
            context_config_maps: vec![format!("{app_ns}/{granted}")],
            ..install_options("istio-sidecar", INSTALL_NS)
        },
    )
    .await;
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &app_ns);
    for (name, exclude) in [(granted, "10.96.0.1/32"), ("not-granted", "0.0.0.0/0")] {
        config_maps
            .create(
                &PostParams::default(),
                &serde_json::from_value(
                    json!({"metadata": {"name": name}, "data": {"exclude": exclude}}),
                )
                .expect("config map"),
            )
            .await
            .expect("config map created");
    }
    // An existing workload, for the backfill.
    let deployments = existing_deployment(&admin, &app_ns).await;

    // The webhook and the controller, as their ServiceAccounts.
    let config = policies_only_config();
    let webhook = start_webhook_as(&cp, config.clone(), Some(INSTALL_NS)).await;
    register(
        &admin,
        &webhook.registration("meshgate-context", &config, true, false),
    )
    .await;
    let controller = ControllerTask::start(
        &cp,
        INSTALL_NS,
        meshgate::run::ControllerSettings {
            ..Default::default()
        },
    );

    let policies: Api<MutationPolicy> = Api::all(admin.clone());
    policies
        .create(
            &PostParams::default(),
            &serde_json::from_value(policy("context-granted", &app_ns, granted, true))
                .expect("policy"),
        )
        .await
        .expect("policy created");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &app_ns);
    wait_for(
        "a pod to get the value of the granted ConfigMap",
        Duration::from_secs(60),
        || async { annotation_of(&pods, None).await.as_deref() == Some("10.96.0.1/32") },
    )
    .await;

    // The status names the ConfigMap; the backfill (as the controller) read it.
    wait_for(
        "the policy's status to list its ConfigMap and the backfill to apply it",
        Duration::from_secs(60),
        || async {
            let listed = policies
                .get("context-granted")
                .await
                .ok()
                .and_then(|p| p.status)
                .is_some_and(|s| s.config_maps == vec![format!("{app_ns}/{granted}")]);
            let template = deployments
                .get("web")
                .await
                .ok()
                .and_then(|d| d.spec)
                .and_then(|s| s.template.metadata)
                .and_then(|m| m.annotations)
                .and_then(|a| a.get(ANNOTATION).cloned());
            listed && template.as_deref() == Some("10.96.0.1/32")
        },
    )
    .await;

    // The ConfigMap changes: new pods follow, from the webhook's watch.
    config_maps
        .patch(
            granted,
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"exclude": "10.96.0.10/32"}})),
        )
        .await
        .expect("config map changed");
    wait_for(
        "new pods to get the ConfigMap's new value",
        Duration::from_secs(60),
        || async { annotation_of(&pods, None).await.as_deref() == Some("10.96.0.10/32") },
    )
    .await;

    // A policy naming a ConfigMap that was not granted: the webhook's watch is refused, the
    // policy fails on the pod (counted), and the pod is admitted with the granted policy only.
    policies
        .create(
            &PostParams::default(),
            &serde_json::from_value(policy("context-not-granted", &app_ns, "not-granted", false))
                .expect("policy"),
        )
        .await
        .expect("policy created");
    let failures = || webhook.policy_failures(&["context-not-granted"]);
    let probes = std::sync::atomic::AtomicU32::new(0);
    wait_for(
        "the webhook to fail the policy whose ConfigMap it may not read",
        Duration::from_secs(60),
        || async {
            let n = probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            annotation_of(&pods, Some(&format!("probe-{n}"))).await;
            failures().await >= 1.0
        },
    )
    .await;
    // One more pod: its review failed the refused policy (counted once more) and applied the
    // granted one; the refused one, which would have written 0.0.0.0/0, changed nothing.
    let before = failures().await;
    let value = annotation_of(&pods, Some("third")).await;
    assert_eq!(
        failures().await,
        before + 1.0,
        "this review failed the policy"
    );
    assert_eq!(value.as_deref(), Some("10.96.0.10/32"));
    assert_eq!(
        policies
            .get("context-not-granted")
            .await
            .expect("policy")
            .status
            .map(|s| s.config_maps),
        Some(vec![format!("{app_ns}/not-granted")]),
        "the status says which ConfigMap the policy needs"
    );

    // `meshgate render`, given the ConfigMap, agrees with the webhook.
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = policy("context-granted", &app_ns, granted, false);
    let (policy_file, input) = (
        dir.path().join("policy.yaml"),
        dir.path().join("input.yaml"),
    );
    std::fs::write(&policy_file, serde_saphyr::to_string(&spec).expect("yaml")).expect("policy");
    let mut pod = common::pod("rendered");
    pod["metadata"]["namespace"] = json!(app_ns);
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": granted, "namespace": app_ns},
                    "data": {"exclude": "10.96.0.10/32"}});
    std::fs::write(
        &input,
        format!(
            "{}---\n{}",
            serde_saphyr::to_string(&cm).expect("yaml"),
            serde_saphyr::to_string(&pod).expect("yaml")
        ),
    )
    .expect("input");
    let out = std::process::Command::new(meshgate_bin())
        .args([
            "render",
            "--policy",
            &policy_file.display().to_string(),
            "-f",
            &input.display().to_string(),
        ])
        .output()
        .expect("meshgate render runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered: Vec<Value> = serde_saphyr::from_multiple(&stdout).expect("rendered YAML");
    let rendered_pod = rendered
        .iter()
        .find(|d| d["kind"] == "Pod")
        .expect("the pod is rendered");
    assert_eq!(
        rendered_pod["metadata"]["annotations"][ANNOTATION], "10.96.0.10/32",
        "render gives the webhook's value: {stdout}"
    );
    controller.finish().await;
}

const PORT_ANNOTATION: &str = "example.com/backend-port";

/// An existing Deployment `web` in `namespace` (no replicas), for the backfill.
async fn existing_deployment(admin: &kube::Client, namespace: &str) -> Api<Deployment> {
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), namespace);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"replicas": 0,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {"metadata": {"labels": {"app": "web"}},
                             "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}}}))
            .expect("deployment"),
        )
        .await
        .expect("deployment created");
    deployments
}

/// The port annotation a pod gets at admission (a dry run unless `name` is given).
async fn port_annotation(pods: &Api<Pod>, name: Option<&str>) -> Option<String> {
    let pod: Pod = serde_json::from_value(common::pod(name.unwrap_or("probe"))).expect("pod");
    let params = PostParams {
        dry_run: name.is_none(),
        ..Default::default()
    };
    pods.create(&params, &pod)
        .await
        .expect("pod admitted")
        .metadata
        .annotations
        .and_then(|a| a.get(PORT_ANNOTATION).cloned())
}

fn api_call_policy(name: &str, app_ns: &str, path: &str, existing: bool) -> Value {
    json!({"apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy", "metadata": {"name": name},
           "spec": {"match": {"kinds": ["Pod"], "namespaces": [app_ns]}, "podTemplates": true,
                    "existing": {"enabled": existing, "ratePerSecond": 100},
                    "mutations": [{
                        "context": [{"name": "port", "apiCall": {"urlPath": path,
                                     "jmesPath": "to_string(spec.ports[0].port)"}}],
                        "annotations": {"values": {PORT_ANNOTATION: "{{ port }}"}}}]}})
}

/// `apiCall` context entries GET as the installed identities: the webhook at admission (each
/// review reads the current object: a changed Service reaches the next pod), the controller in
/// the backfill; a path the identities were not granted (`--context-api-read`) fails the policy,
/// counted, and the pod is admitted with the others.
#[tokio::test]
async fn an_api_call_entry_reads_what_the_installed_identities_may_get() {
    let cp = control_plane(false).await;
    let admin = cp.client().await.expect("client");
    install_crds(&admin).await;
    let app_ns = cp.namespace("apicall", &[]).await.expect("namespace");
    install_identities_of(
        &admin,
        &meshgate::install::InstallOptions {
            context_api_reads: vec!["services".into()],
            ..install_options("istio-sidecar", INSTALL_NS)
        },
    )
    .await;
    let services: Api<k8s_openapi::api::core::v1::Service> =
        Api::namespaced(admin.clone(), &app_ns);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "backend"}, "spec": {"ports": [{"port": 8443}]}}),
            )
            .expect("service"),
        )
        .await
        .expect("service created");
    let deployments = existing_deployment(&admin, &app_ns).await;

    let config = policies_only_config();
    let webhook = start_webhook_as(&cp, config.clone(), Some(INSTALL_NS)).await;
    register(
        &admin,
        &webhook.registration("meshgate-apicall", &config, true, false),
    )
    .await;
    let controller = ControllerTask::start(&cp, INSTALL_NS, Default::default());
    let policies: Api<MutationPolicy> = Api::all(admin.clone());
    let service_path = "/api/v1/namespaces/{{ request.namespace }}/services/backend";
    policies
        .create(
            &PostParams::default(),
            &serde_json::from_value(api_call_policy("api-granted", &app_ns, service_path, true))
                .expect("policy"),
        )
        .await
        .expect("policy created");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &app_ns);
    let dry_run_port = || port_annotation(&pods, None);
    wait_for(
        "a pod to get the Service's port, read by the webhook",
        Duration::from_secs(60),
        || async { dry_run_port().await.as_deref() == Some("8443") },
    )
    .await;
    wait_for(
        "the backfill, as the controller, to read it into the Deployment's template",
        Duration::from_secs(60),
        || async {
            deployments
                .get("web")
                .await
                .ok()
                .and_then(|d| d.spec)
                .and_then(|s| s.template.metadata)
                .and_then(|m| m.annotations)
                .and_then(|a| a.get(PORT_ANNOTATION).cloned())
                .as_deref()
                == Some("8443")
        },
    )
    .await;
    // Each review reads the Service as it is now.
    services
        .patch(
            "backend",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ports": [{"port": 9443}]}})),
        )
        .await
        .expect("service changed");
    assert_eq!(dry_run_port().await.as_deref(), Some("9443"));

    // A Secret was not granted: the policy reading one fails on every pod (counted), and the
    // pod is admitted with the granted policy's value.
    let secret_path = "/api/v1/namespaces/{{ request.namespace }}/secrets/backend";
    policies
        .create(
            &PostParams::default(),
            &serde_json::from_value(api_call_policy(
                "api-not-granted",
                &app_ns,
                secret_path,
                false,
            ))
            .expect("policy"),
        )
        .await
        .expect("policy created");
    let failures = || webhook.policy_failures(&["api-not-granted"]);
    let probes = std::sync::atomic::AtomicU32::new(0);
    let create_pod = |n: u32| {
        let name = format!("real-{n}");
        let pods = pods.clone();
        async move { port_annotation(&pods, Some(&name)).await }
    };
    wait_for(
        "the webhook to fail the policy whose GET is forbidden",
        Duration::from_secs(60),
        || async {
            create_pod(probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed)).await;
            failures().await >= 1.0
        },
    )
    .await;
    let before = failures().await;
    let port = create_pod(1000).await;
    assert_eq!(
        failures().await,
        before + 1.0,
        "this review failed the policy"
    );
    assert_eq!(port.as_deref(), Some("9443"), "the granted policy applied");
    controller.finish().await;
}
