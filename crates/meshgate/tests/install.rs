//! `meshgate install`: every profile's manifests pass server-side dry-run apply on the real API
//! server, and golden files keep them reviewed.
//!
//! Run: `cargo test --workspace --test install`. Update the golden files after a reviewed change
//! with `MESHGATE_UPDATE_GOLDEN=1 cargo test -p meshgate --test install`.

mod common;

use meshgate::install::{InstallOptions, NodeTaint, PROFILES, RepairAction, apply, masked, render};
use meshgate_core::registration::PolicyApi;

fn options(profile: &str) -> InstallOptions {
    InstallOptions {
        profile: profile.into(),
        namespace: "meshgate-system".into(),
        image: "meshgate/meshgate:0.1.0".into(),
        node_taint: NodeTaint::Policy(PolicyApi::V1),
        pod_gate: meshgate::install::PodGate::Webhook,
        strategy: meshgate::install::Strategy::default(),
        taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
        node_paths: Default::default(),
        repair: None,
        webhook_ingress_from: Vec::new(),
        context_config_maps: Vec::new(),
        context_api_reads: Vec::new(),
        existing_kinds: Vec::new(),
        policies: Default::default(),
    }
}

#[test]
fn golden_manifests() {
    let dir = meshgate_testenv::workspace_dir().join("deploy/golden");
    for profile in PROFILES {
        let docs = render(&options(profile)).unwrap();
        let text = meshgate::render::to_yaml_stream(&masked(&docs)).unwrap();
        let path = dir.join(format!("{profile}.yaml"));
        if std::env::var_os("MESHGATE_UPDATE_GOLDEN").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
        }
        let golden = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            golden == text,
            "{} differs from the rendered manifests; review and update with MESHGATE_UPDATE_GOLDEN=1",
            path.display()
        );
    }
}

/// `install` never prints key material: no Secret, no private key, no caBundle (the controller
/// creates the CA and certificate in the cluster and writes the bundle).
#[test]
fn install_output_holds_no_key_material() {
    for profile in PROFILES {
        let docs = render(&options(profile)).unwrap();
        let text = meshgate::render::to_yaml_stream(&docs).unwrap();
        assert!(!text.contains("PRIVATE KEY"), "{profile}: a private key");
        assert!(
            !docs.iter().any(|d| d["kind"] == "Secret"),
            "{profile}: a Secret"
        );
        assert!(!text.contains("caBundle"), "{profile}: a caBundle");
    }
}

/// Offline, `install` renders what the Kubernetes version given runs by default: no admission
/// policy for 1.34 and 1.35 (their API servers run none by default; the webhook taints nodes
/// and gates pods), the policies from 1.36; without the version it says what it assumes.
#[test]
fn offline_install_renders_for_the_kubernetes_version_given() {
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshgate"))
            .args(["install", "--profile", "istio-ambient"])
            .args(extra)
            .output()
            .expect("meshgate runs");
        assert!(out.status.success(), "{out:?}");
        let docs =
            meshgate::render::parse_documents("stdout", &String::from_utf8_lossy(&out.stdout))
                .expect("YAML");
        let kinds: Vec<String> = docs
            .iter()
            .filter_map(|d| d["kind"].as_str().map(str::to_owned))
            .collect();
        let node_webhook = docs
            .iter()
            .filter(|d| d["kind"] == "MutatingWebhookConfiguration")
            .flat_map(|d| d["webhooks"].as_array().cloned().unwrap_or_default())
            .any(|w| w["name"].as_str().is_some_and(|n| n.starts_with("nodes.")));
        (
            kinds,
            node_webhook,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for version in ["1.34", "v1.35.4"] {
        let (kinds, node_webhook, _) = run(&["--kubernetes-version", version]);
        assert!(
            !kinds
                .iter()
                .any(|k| k.starts_with("MutatingAdmissionPolicy")),
            "{version}: {kinds:?}"
        );
        assert!(node_webhook, "{version}: the webhook taints nodes");
    }
    for version in ["1.36", "v1.37.2"] {
        let (kinds, node_webhook, said) = run(&["--kubernetes-version", version]);
        assert!(
            kinds.iter().any(|k| k == "MutatingAdmissionPolicy"),
            "{version}: {kinds:?}"
        );
        assert!(!node_webhook, "{version}");
        assert!(!said.contains("assuming"), "{said}");
    }
    let (_, _, said) = run(&[]);
    assert!(said.contains("assuming Kubernetes 1.36 or later"), "{said}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshgate"))
        .args([
            "install",
            "--profile",
            "istio-ambient",
            "--kubernetes-version",
            "136",
        ])
        .output()
        .expect("meshgate runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--kubernetes-version \"136\""),
        "{out:?}"
    );
}

/// `install --apply` works while an aggregated API is down (a metrics server's APIService whose
/// Service does not exist: the API server answers 503 for its group): it looks up only the kinds
/// it applies. Before, a full discovery failed on that group and nothing was applied.
#[tokio::test]
async fn install_apply_survives_an_aggregated_api_that_is_down() {
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options::default())
        .await
        .expect("control plane starts");
    let client = cp.client().await.unwrap();
    let service: k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "v1beta1.metrics.k8s.io"},
            "spec": {"group": "metrics.k8s.io", "version": "v1beta1",
                     "service": {"namespace": "kube-system", "name": "metrics-server", "port": 443},
                     "insecureSkipTLSVerify": true,
                     "groupPriorityMinimum": 100, "versionPriority": 100},
        }))
        .unwrap();
    kube::Api::<k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService>::all(
        client.clone(),
    )
    .create(&Default::default(), &service)
    .await
    .expect("APIService");
    // The API server answers for the group, and it is an error: the API is down. (Asked
    // without the client's retries of a 503, which would wait for minutes.)
    let kc = kube::config::Kubeconfig::read_from(&cp.kubeconfig_path).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("config");
    config.default_retry = false;
    let once = kube::Client::try_from(config).expect("client");
    common::wait_for(
        "the aggregated API to be unavailable",
        std::time::Duration::from_secs(30),
        || async {
            once.list_api_group_resources("metrics.k8s.io/v1beta1")
                .await
                .is_err_and(|e| matches!(e, kube::Error::Api(ref s) if s.code == 503))
        },
    )
    .await;
    let started = std::time::Instant::now();
    let out = common::meshgate_on(
        &cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--namespace",
            "meshgate-system",
            "--apply",
        ],
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "install --apply: {said}");
    eprintln!(
        "measured: install --apply with an aggregated API down: {:.1?}",
        started.elapsed()
    );
    assert!(
        kube::Api::<meshgate_api::NodeGate>::all(client.clone())
            .get_opt("mesh-agents")
            .await
            .unwrap()
            .is_some(),
        "the gate was applied"
    );
}

#[test]
fn an_unknown_profile_is_named() {
    let err = render(&options("consul")).unwrap_err().to_string();
    assert!(
        err.contains("\"consul\"") && err.contains("istio-ambient"),
        "{err}"
    );
}

#[tokio::test]
async fn every_profile_passes_server_side_dry_run_apply() {
    let cp = common::control_plane(false).await;
    let client = cp.client().await.unwrap();
    // The policy API this API server serves (v1beta1 on 1.34 and 1.35).
    let served = meshgate::discovery::policy_api(&client)
        .await
        .expect("the policy API is served");
    let strategies = [
        meshgate::install::Strategy::Taint,
        meshgate::install::Strategy::Resource,
        meshgate::install::Strategy::Dra,
        meshgate::install::Strategy::Pod,
    ];
    for (profile, strategy) in PROFILES
        .iter()
        .flat_map(|p| strategies.iter().map(move |s| (*p, *s)))
    {
        let docs = render(&InstallOptions {
            strategy,
            taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
            node_taint: NodeTaint::Policy(served),
            ..options(profile)
        })
        .unwrap();
        // The namespace and the CRDs for real (namespaced objects and custom resources need
        // them to exist), everything else as a dry run.
        let (real, rest): (Vec<_>, Vec<_>) = docs
            .into_iter()
            .partition(|d| d["kind"] == "Namespace" || d["kind"] == "CustomResourceDefinition");
        apply(&client, &real, false, |_| {}).await.unwrap();
        let mut applied = Vec::new();
        apply(&client, &rest, true, |line| applied.push(line.to_owned()))
            .await
            .unwrap_or_else(|e| panic!("profile {profile} {strategy:?}: {e}"));
        assert_eq!(
            applied.len(),
            rest.len(),
            "profile {profile} {strategy:?}: every object validated"
        );
        assert!(
            applied
                .iter()
                .any(|l| l.starts_with("Deployment/meshgate-webhook"))
        );
        assert!(
            applied
                .iter()
                .any(|l| l.starts_with("MutatingWebhookConfiguration/meshgate"))
        );
    }
    // The webhook path for Node CREATE validates too.
    let mut webhook = options("istio-ambient");
    webhook.node_taint = NodeTaint::Webhook;
    let docs = render(&webhook).unwrap();
    assert!(!docs.iter().any(|d| d["kind"] == "MutatingAdmissionPolicy"));
    let rest: Vec<_> = docs
        .into_iter()
        .filter(|d| d["kind"] != "Namespace" && d["kind"] != "CustomResourceDefinition")
        .collect();
    apply(&client, &rest, true, |_| {}).await.unwrap();
    // Dry run persisted nothing.
    let mwcs =
        kube::Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
            client.clone(),
        );
    assert!(mwcs.get_opt("meshgate").await.unwrap().is_none());
}

#[tokio::test]
async fn node_taint_auto_picks_the_admission_policy_on_this_api_server() {
    let cp = common::control_plane(false).await;
    let client = cp.client().await.unwrap();
    let served = meshgate::discovery::policy_api(&client).await;
    // v1 from 1.36; before, the beta the test environment turns on (Options::version_defaults).
    let want = if cp.minor >= meshgate_testenv::POLICY_API_GA_MINOR {
        PolicyApi::V1
    } else {
        PolicyApi::V1beta1
    };
    assert_eq!(served, Some(want), "Kubernetes 1.{}", cp.minor);
    let chosen = NodeTaint::choose("auto", served).unwrap();
    assert_eq!(chosen, NodeTaint::Policy(want));
    let docs = render(&InstallOptions {
        node_taint: chosen,
        pod_gate: meshgate::install::PodGate::Webhook,
        ..options("linkerd")
    })
    .unwrap();
    // The policy and its binding, and no webhook on Node CREATE.
    assert!(docs.iter().any(|d| d["kind"] == "MutatingAdmissionPolicy"));
    assert!(
        docs.iter()
            .any(|d| d["kind"] == "MutatingAdmissionPolicyBinding")
    );
    let mwc = docs
        .iter()
        .find(|d| d["kind"] == "MutatingWebhookConfiguration")
        .unwrap();
    assert!(
        !mwc["webhooks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["name"].as_str().unwrap().starts_with("nodes.")),
        "{mwc}"
    );
    // Without a policy API, auto falls back to the webhook; policy is refused.
    assert_eq!(NodeTaint::choose("auto", None).unwrap(), NodeTaint::Webhook);
    assert!(NodeTaint::choose("policy", None).is_err());
}

/// Each component's RBAC is what its enabled features need, checked by SubjectAccessReviews of
/// its ServiceAccount on the real API server: no pod writes without the repair loop, pod
/// `patch` for labelling repair, `patch` and `create` on `pods/eviction` (never `delete`) for
/// deleting repair, workload `patch`
/// (DaemonSets included) for policy backfill, nothing on Secrets cluster-wide.
#[tokio::test]
async fn rbac_is_what_the_enabled_features_need() {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let cp = common::control_plane(false).await;
    let client = cp.client().await.unwrap();
    let ns = "meshgate-rbac";
    let allowed =
        |sa: &'static str, verb: &'static str, group: &'static str, resource: &'static str| {
            let client = client.clone();
            let (resource, subresource) = resource
                .split_once('/')
                .map_or((resource, None), |(r, s)| (r, Some(s)));
            async move {
                let review = SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: Some(format!("system:serviceaccount:{ns}:{sa}")),
                        groups: Some(vec![
                            "system:serviceaccounts".into(),
                            format!("system:serviceaccounts:{ns}"),
                        ]),
                        resource_attributes: Some(ResourceAttributes {
                            verb: Some(verb.into()),
                            group: Some(group.into()),
                            resource: Some(resource.into()),
                            subresource: subresource.map(Into::into),
                            namespace: Some("apps".into()),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let out = kube::Api::<SubjectAccessReview>::all(client)
                    .create(&Default::default(), &review)
                    .await
                    .expect("subject access review");
                out.status.is_some_and(|s| s.allowed)
            }
        };
    for repair in [None, Some(RepairAction::Label), Some(RepairAction::Delete)] {
        common::install_identities_with(&client, "istio-ambient", ns, repair).await;
        // RBAC changes reach the authorizer's cache asynchronously.
        let want_patch = repair.is_some();
        let want_evict = repair == Some(RepairAction::Delete);
        common::wait_for(
            "the RBAC to take effect",
            std::time::Duration::from_secs(20),
            || async {
                allowed("meshgate-controller", "patch", "", "pods").await == want_patch
                    && allowed("meshgate-controller", "create", "", "pods/eviction").await
                        == want_evict
            },
        )
        .await;
        let c = "meshgate-controller";
        for (verb, group, resource, want) in [
            ("list", "", "pods", true),
            ("watch", "", "pods", true),
            ("patch", "", "pods", want_patch),
            ("create", "", "pods/eviction", want_evict),
            ("delete", "", "pods", false),
            ("patch", "", "nodes", true),
            ("patch", "", "nodes/status", true),
            ("patch", "apps", "deployments", true),
            ("patch", "apps", "statefulsets", true),
            ("patch", "apps", "daemonsets", true),
            ("patch", "batch", "cronjobs", true),
            ("patch", "meshgate.dev", "nodegates", true),
            ("list", "", "secrets", false),
            ("create", "", "pods", false),
            ("delete", "", "nodes", false),
        ] {
            assert_eq!(
                allowed(c, verb, group, resource).await,
                want,
                "controller {verb} {group}/{resource} (repair {repair:?})"
            );
        }
        let w = "meshgate-webhook";
        for (verb, group, resource, want) in [
            ("list", "", "namespaces", true),
            ("watch", "", "limitranges", true),
            ("list", "meshgate.dev", "mutationpolicies", true),
            ("patch", "", "pods", false),
            ("patch", "", "nodes", false),
            ("get", "", "secrets", false),
        ] {
            assert_eq!(
                allowed(w, verb, group, resource).await,
                want,
                "webhook {verb} {group}/{resource}"
            );
        }
    }

    // The policy features whose grants are cluster-admin strong, each on and off: the grant is
    // there exactly when its feature is.
    for (backfill, native) in [(false, false), (true, false), (false, true), (true, true)] {
        common::install_identities_of(
            &client,
            &meshgate::install::InstallOptions {
                policies: meshgate::install::PolicyFeatures {
                    workload_backfill: backfill,
                    native,
                },
                ..common::install_options("istio-ambient", ns)
            },
        )
        .await;
        let c = "meshgate-controller";
        let map = "mutatingadmissionpolicies";
        common::wait_for(
            "the RBAC to take effect",
            std::time::Duration::from_secs(20),
            || async {
                allowed(c, "patch", "apps", "deployments").await == backfill
                    && allowed(c, "create", "admissionregistration.k8s.io", map).await == native
            },
        )
        .await;
        let features = format!("workload backfill {backfill}, native policies {native}");
        for (verb, group, resource, want) in [
            ("patch", "apps", "deployments", backfill),
            ("patch", "apps", "statefulsets", backfill),
            ("patch", "apps", "daemonsets", backfill),
            ("patch", "apps", "replicasets", backfill),
            ("patch", "batch", "jobs", backfill),
            ("patch", "batch", "cronjobs", backfill),
            ("list", "apps", "deployments", true),
            ("watch", "apps", "daemonsets", true),
            ("create", "admissionregistration.k8s.io", map, native),
            ("patch", "admissionregistration.k8s.io", map, native),
            ("delete", "admissionregistration.k8s.io", map, native),
            (
                "delete",
                "admissionregistration.k8s.io",
                "mutatingadmissionpolicybindings",
                native,
            ),
        ] {
            assert_eq!(
                allowed(c, verb, group, resource).await,
                want,
                "controller {verb} {group}/{resource} ({features})"
            );
        }
    }
}

/// Without native policies, the native pod gate keeps `patch` on its own policy and binding,
/// by name, and nothing else on admission policies; `--existing-kind` needs the backfill.
#[test]
fn the_native_gate_alone_patches_its_own_policy() {
    let docs = meshgate::install::render(&meshgate::install::InstallOptions {
        pod_gate: meshgate::install::PodGate::Native(meshgate_core::registration::PolicyApi::V1),
        policies: meshgate::install::PolicyFeatures {
            workload_backfill: true,
            native: false,
        },
        ..common::install_options("istio-ambient", "meshgate-system")
    })
    .expect("install renders");
    let role = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "meshgate-controller")
        .expect("controller role");
    let admission: Vec<&serde_json::Value> = role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| r["apiGroups"][0] == "admissionregistration.k8s.io")
        .filter(|r| r["resources"][0] != "mutatingwebhookconfigurations")
        .collect();
    assert_eq!(
        admission,
        [&serde_json::json!({
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingadmissionpolicies", "mutatingadmissionpolicybindings"],
            "resourceNames": ["meshgate-pod-gate"],
            "verbs": ["patch"],
        })]
    );
    let controller_args = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "meshgate-controller")
        .map(|d| d["spec"]["template"]["spec"]["containers"][0]["args"].to_string())
        .expect("controller deployment");
    assert!(
        !controller_args.contains("--native-policies"),
        "{controller_args}"
    );

    let err = meshgate::install::render(&meshgate::install::InstallOptions {
        existing_kinds: vec!["services".into()],
        policies: meshgate::install::PolicyFeatures {
            workload_backfill: false,
            native: true,
        },
        ..common::install_options("istio-ambient", "meshgate-system")
    })
    .expect_err("--existing-kind without the backfill");
    assert!(err.to_string().contains("--existing-kind"), "{err}");
}

/// What each strategy renders: the gate configuration the webhook reads, the default NodeGate's
/// resource and, for DRA, the node plugin's DaemonSet (every taint tolerated, host network, no
/// API token) and the controller's writes of slices and classes.
#[test]
fn each_strategy_renders_its_layers() {
    use meshgate::install::Strategy;
    let find = |docs: &[serde_json::Value], kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .cloned()
    };
    for profile in PROFILES {
        for strategy in [
            Strategy::Taint,
            Strategy::Dra,
            Strategy::Resource,
            Strategy::Pod,
        ] {
            let docs = render(&InstallOptions {
                strategy,
                taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
                ..options(profile)
            })
            .unwrap();
            let config: meshgate_api::GateConfig = meshgate_api::yaml::from_str(
                find(&docs, "ConfigMap", "meshgate-config").unwrap()["data"]["config.yaml"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
            let gate = find(&docs, "NodeGate", "mesh-agents").unwrap();
            let plugin = find(&docs, "DaemonSet", "meshgate-node");
            let role = find(&docs, "ClusterRole", "meshgate-controller").unwrap();
            let writes_slices = role["rules"].as_array().unwrap().iter().any(|r| {
                r["resources"] == serde_json::json!(["resourceslices"])
                    && r["verbs"].as_array().unwrap().iter().any(|v| v == "create")
            });
            let what = format!("{profile} {strategy:?}");
            let key = meshgate_api::names::STARTUP_TAINT_KEY;
            assert_eq!(gate["spec"]["taint"]["key"], key, "{what}");
            match strategy {
                Strategy::Taint => {
                    // The taint holds the pods; the resource stays offered for pods admitted
                    // before an upgrade from the resource strategy, and none requests it.
                    assert!(!config.resource_gate.enabled, "{what}");
                    assert_eq!(
                        config.init_gate.scope,
                        meshgate_api::config::InitGateScope::TaintExempt,
                        "{what}"
                    );
                    assert_eq!(
                        config.node_taint_keys,
                        [key, meshgate_api::names::DEFAULT_TAINT_KEY],
                        "{what}"
                    );
                    assert_eq!(gate["spec"]["resource"]["provider"], "NodeStatus", "{what}");
                    assert!(plugin.is_none() && !writes_slices, "{what}");
                }
                Strategy::Pod => {
                    assert!(!config.resource_gate.enabled, "{what}");
                    assert_eq!(
                        config.init_gate.scope,
                        meshgate_api::config::InitGateScope::All,
                        "{what}"
                    );
                    assert!(gate["spec"]["resource"].is_null(), "{what}");
                    assert!(plugin.is_none() && !writes_slices, "{what}");
                }
                Strategy::Resource | Strategy::Dra => {
                    assert!(config.resource_gate.enabled, "{what}");
                    assert_eq!(
                        config.init_gate.scope,
                        meshgate_api::config::InitGateScope::NodeBound,
                        "{what}"
                    );
                    let provider = if strategy == Strategy::Dra {
                        "DRA"
                    } else {
                        "NodeStatus"
                    };
                    assert_eq!(gate["spec"]["resource"]["provider"], provider, "{what}");
                    assert_eq!(plugin.is_some(), strategy == Strategy::Dra, "{what}");
                    assert_eq!(writes_slices, strategy == Strategy::Dra, "{what}");
                }
            }
            if let Some(ds) = plugin {
                let spec = &ds["spec"]["template"]["spec"];
                assert_eq!(
                    spec["tolerations"],
                    serde_json::json!([{"operator": "Exists"}])
                );
                assert_eq!(spec["hostNetwork"], true);
                assert_eq!(spec["automountServiceAccountToken"], false);
                let args = spec["containers"][0]["args"].as_array().unwrap();
                let record = meshgate::install::mesh_profile(profile).unwrap().record();
                assert!(
                    args.windows(2)
                        .any(|w| w[0] == "--cni-plugin" && w[1] == record.cni_plugin),
                    "{what}: {args:?}"
                );
            }
        }
    }
}
