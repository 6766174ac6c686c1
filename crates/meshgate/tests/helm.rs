//! The Helm chart (`deploy/helm/meshgate`) with the real Helm (built from the Go module proxy by
//! `tools/helm/build.sh`): the chart is what `meshgate chart` generates from `install`; `helm
//! lint` passes for every profile; `helm template` gives the same objects as `meshgate install`
//! for every profile, repair mode and node-taint path; and on the real API server `helm install`
//! then `helm upgrade` keep the controller's CA and the caBundle, and the node taint at
//! registration keeps working.
//!
//! Run: `cargo test -p meshgate --test helm`.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

const NS: &str = "meshgate-system";
const IMAGE: &str = "registry.invalid/meshgate:9";

fn helm() -> PathBuf {
    meshgate_testenv::helm().expect("helm (MESHGATE_HELM, else tools/helm/build.sh)")
}

fn chart() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/helm/meshgate")
}

fn run(program: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {}: {}{}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The documents of a YAML stream, sorted by kind and name, without nulls.
fn objects(yaml: &str) -> Vec<Value> {
    let mut docs: Vec<Value> = meshgate_api::yaml::documents(yaml)
        .expect("YAML")
        .into_iter()
        .filter(|d| !d.is_null())
        .collect();
    docs.sort_by_key(|d| {
        format!(
            "{}/{}",
            d["kind"].as_str().unwrap_or_default(),
            d["metadata"]["name"].as_str().unwrap_or_default()
        )
    });
    docs
}

#[test]
fn the_chart_is_generated_from_install() {
    run(
        &meshgate_bin(),
        &["chart", "--check", chart().to_str().expect("path")],
    );
}

#[test]
fn lint_and_template_equal_install_for_every_combination() {
    let helm = helm();
    let chart = chart();
    let chart = chart.to_str().expect("path");
    for profile in meshgate::install::PROFILES {
        let values = format!("{chart}/values-{profile}.yaml");
        run(&helm, &["lint", chart, "-f", &values]);
        for repair in ["", "label", "delete"] {
            for taint in ["policy", "webhook"] {
                let templated = run(
                    &helm,
                    &[
                        "template",
                        "meshgate",
                        chart,
                        "--namespace",
                        NS,
                        "--include-crds",
                        "-f",
                        &values,
                        "--set",
                        &format!("image={IMAGE}"),
                        "--set",
                        &format!("repair={repair}"),
                        "--set",
                        &format!("nodeTaint={taint}"),
                    ],
                );
                let mut args = vec![
                    "install",
                    "--profile",
                    profile,
                    "--namespace",
                    NS,
                    "--image",
                    IMAGE,
                    "--node-taint",
                    taint,
                    // The chart decides the init gate with the webhook (crate::chart).
                    "--pod-gate",
                    "webhook",
                ];
                if !repair.is_empty() {
                    args.extend(["--repair", repair]);
                }
                let installed = run(&meshgate_bin(), &args);
                let from_install: Vec<Value> = objects(&installed)
                    .into_iter()
                    .filter(|d| d["kind"] != "Namespace")
                    .collect();
                let from_helm = objects(&templated);
                assert_eq!(
                    from_helm.len(),
                    from_install.len(),
                    "{profile}/{repair}/{taint}: {} objects from helm, {} from install",
                    from_helm.len(),
                    from_install.len()
                );
                for (h, i) in from_helm.iter().zip(&from_install) {
                    assert_eq!(
                        h, i,
                        "{profile}/{repair}/{taint}: {}/{} differs",
                        i["kind"], i["metadata"]["name"]
                    );
                }
            }
        }
    }
    // The webhook's NetworkPolicy and the policies' ConfigMap Roles: the same from both.
    let templated = run(
        &helm,
        &[
            "template",
            "meshgate",
            chart,
            "--namespace",
            NS,
            "-f",
            &format!("{chart}/values-istio-sidecar.yaml"),
            "--set",
            &format!("image={IMAGE}"),
            "--set",
            "nodeTaint=policy",
            "--set",
            "webhookIngressFrom={10.0.0.0/8,192.168.1.0/24}",
            "--set",
            "contextConfigMaps={shop/mesh-settings,default/egress}",
            "--set",
            "contextApiReads={services,deployments.apps,namespaces}",
            "--set",
            "existingKinds={services,gateways.networking.istio.io}",
            "--set",
            "taintKey=startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents",
        ],
    );
    let installed = run(
        &meshgate_bin(),
        &[
            "install",
            "--profile",
            "istio-sidecar",
            "--namespace",
            NS,
            "--image",
            IMAGE,
            "--node-taint",
            "policy",
            "--webhook-ingress-from",
            "10.0.0.0/8",
            "--webhook-ingress-from",
            "192.168.1.0/24",
            "--context-config-map",
            "shop/mesh-settings",
            "--context-config-map",
            "default/egress",
            "--context-api-read",
            "services",
            "--context-api-read",
            "deployments.apps",
            "--context-api-read",
            "namespaces",
            "--existing-kind",
            "services",
            "--existing-kind",
            "gateways.networking.istio.io",
            "--taint-key",
            "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents",
        ],
    );
    // The Roles for policies' context entries and backfill kinds: the same objects.
    let context_rbac = |docs: &[Value]| -> Vec<Value> {
        let mut found: Vec<Value> = docs
            .iter()
            .filter(|d| {
                d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("-context-") || n.ends_with("-existing-kinds"))
            })
            .cloned()
            .collect();
        found.sort_by_key(|d| {
            format!(
                "{}/{}/{}",
                d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]
            )
        });
        found
    };
    let (from_helm, from_install) = (
        context_rbac(&objects(&templated)),
        context_rbac(&objects(&installed)),
    );
    // Two ConfigMaps × two components × Role and RoleBinding, the apiCall reads (two components
    // × ClusterRole and ClusterRoleBinding) and the backfill's kinds (the controller's).
    assert_eq!(from_helm.len(), 14, "{from_helm:#?}");
    assert_eq!(from_helm, from_install);
    let policy_of = |docs: Vec<Value>| {
        docs.into_iter()
            .find(|d| d["kind"] == "NetworkPolicy")
            .expect("a NetworkPolicy")
    };
    let from_helm = policy_of(objects(&templated));
    assert_eq!(from_helm, policy_of(objects(&installed)));
    // The gate's key from `taintKey`: the same NodeGate, configuration, admission policy and
    // tolerations as `install --taint-key`.
    for kind in [
        "NodeGate",
        "ConfigMap",
        "MutatingAdmissionPolicy",
        "Deployment",
    ] {
        let of = |docs: Vec<Value>| -> Vec<Value> {
            docs.into_iter().filter(|d| d["kind"] == kind).collect()
        };
        let (h, i) = (of(objects(&templated)), of(objects(&installed)));
        assert!(!h.is_empty(), "{kind}");
        assert_eq!(h, i, "{kind} with taintKey");
    }
    assert_eq!(
        from_helm["spec"]["ingress"][0]["from"][1]["ipBlock"]["cidr"],
        "192.168.1.0/24"
    );
    // A wrong value is refused with the reason.
    let out = Command::new(&helm)
        .args(["template", "meshgate", chart, "--set", "profile=nope"])
        .output()
        .expect("helm runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("profile \"nope\": expected one of"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn install_and_upgrade_keep_the_ca_and_the_gates() {
    let helm = helm();
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let kubeconfig = cp.kubeconfig_path.to_str().expect("path").to_owned();
    let chart = chart();
    let chart = chart.to_str().expect("path");
    run(
        &helm,
        &[
            "install",
            "meshgate",
            chart,
            "--namespace",
            NS,
            "--create-namespace",
            "--kubeconfig",
            &kubeconfig,
            "--set",
            &format!("image={IMAGE}"),
        ],
    );
    // The controller, as the ServiceAccount the chart made: it creates the CA and the caBundle.
    let controller = ControllerTask::start(
        &cp,
        NS,
        meshgate::run::ControllerSettings {
            certs: Some(meshgate_controller::certs::CertSettings::new(NS)),
            policy_webhook: Some("meshgate".into()),
            native_policies: true,
            ..Default::default()
        },
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let state = || async {
        let ca = secrets
            .get_opt("meshgate-ca")
            .await
            .ok()
            .flatten()
            .and_then(|s| s.data)
            .and_then(|d| d.get("ca.crt").map(|b| b.0.clone()));
        let bundles: Vec<Vec<u8>> = mwcs
            .get("meshgate")
            .await
            .ok()
            .map(|m| {
                m.webhooks
                    .unwrap_or_default()
                    .iter()
                    .map(|h| {
                        h.client_config
                            .ca_bundle
                            .clone()
                            .map(|b| b.0)
                            .unwrap_or_default()
                    })
                    .collect()
            })
            .unwrap_or_default();
        (ca, bundles)
    };
    wait_for(
        "the controller's CA and caBundle",
        Duration::from_secs(60),
        || async {
            let (ca, bundles) = state().await;
            ca.is_some() && !bundles.is_empty() && bundles.iter().all(|b| !b.is_empty())
        },
    )
    .await;
    let before = state().await;

    // An upgrade that changes something: the repair loop on, and the gate keyed for the
    // Cluster Autoscaler.
    let key = "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents";
    run(
        &helm,
        &[
            "upgrade",
            "meshgate",
            chart,
            "--namespace",
            NS,
            "--kubeconfig",
            &kubeconfig,
            "--set",
            &format!("image={IMAGE}"),
            "--set",
            "repair=label",
            "--set",
            &format!("taintKey={key}"),
        ],
    );
    assert_eq!(
        state().await,
        before,
        "helm upgrade kept the CA and the caBundle"
    );
    let role = Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(client.clone())
        .get("meshgate-controller")
        .await
        .expect("role");
    assert!(
        role.rules.unwrap_or_default().iter().any(|r| {
            r.resources.iter().flatten().any(|res| res == "pods")
                && r.verbs.iter().any(|v| v == "patch")
        }),
        "the upgrade applied the repair RBAC"
    );
    // The gate still works: a new node is tainted at registration by the chart's admission
    // policy, with the new key (admission policies follow their objects asynchronously: a
    // dry-run create first).
    let nodes = Api::<Node>::all(client.clone());
    let mut n = 0;
    common::wait_for(
        "the upgraded key at registration",
        Duration::from_secs(30),
        || {
            n += 1;
            let nodes = nodes.clone();
            async move {
                let probe: Node =
                    serde_json::from_value(json!({"metadata": {"name": format!("probe-{n}")}}))
                        .expect("node");
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                nodes.create(&dry, &probe).await.is_ok_and(|n| {
                    n.spec
                        .and_then(|s| s.taints)
                        .is_some_and(|ts| ts.iter().any(|t| t.key == key))
                })
            }
        },
    )
    .await;
    let node: Node =
        serde_json::from_value(json!({"metadata": {"name": "helm-node"}})).expect("node");
    let created = Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("node");
    let keys: Vec<String> = created
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect();
    assert!(keys.iter().any(|k| k == key), "tainted at CREATE: {keys:?}");
    let owned = created
        .metadata
        .annotations
        .unwrap_or_default()
        .get("meshgate.dev/owned-taints")
        .cloned();
    assert_eq!(
        owned.as_deref(),
        Some(key),
        "the key recorded as meshgate's at CREATE"
    );
    controller.finish().await;
}
