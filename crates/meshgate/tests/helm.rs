//! The Helm chart (`deploy/helm/meshgate`) with the real Helm (built from the Go module proxy by
//! `tools/helm/build.sh`): its generated data is current; `helm lint` passes for every profile;
//! `helm template` gives the same objects as `meshgate install` for every profile and every
//! `install` option (objects compared whole, the chart's own knobs at their defaults); every
//! knob lands on the objects it names; the schema refuses unknown and mistyped values; and on
//! the real API server `helm install` then `helm upgrade` (from this chart and from the chart at
//! `481bbe6`) keep the controller's CA, the nodes' taints and the gates, and upgrade the CRDs.
//!
//! Run: `cargo test -p meshgate --test helm`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

const NS: &str = "meshgate-system";
const IMAGE: &str = "registry.invalid/meshgate:v9";
/// What offline `helm template` renders for (the chart's `kubeVersion` refuses Helm's default,
/// 1.20): the control plane's minor.
const KUBE_VERSION: &str = "1.36.3";

fn helm() -> PathBuf {
    meshgate_testenv::helm().expect("helm (MESHGATE_HELM, else tools/helm/build.sh)")
}

fn chart() -> PathBuf {
    meshgate_testenv::workspace_dir().join("deploy/helm/meshgate")
}

fn output(program: &Path, args: &[&str]) -> std::process::Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()))
}

fn run(program: &Path, args: &[&str]) -> String {
    let out = output(program, args);
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

/// The documents of a YAML stream, sorted by kind, namespace and name, without nulls and the
/// Namespace (Helm's `--create-namespace`); the gate configuration parsed (it is compared as
/// data).
/// The objects of a YAML stream, sorted, without Helm hooks (see [`is_hook`]).
fn objects(yaml: &str) -> Vec<Value> {
    let mut docs = objects_with_hooks(yaml);
    docs.retain(|d| !is_hook(d));
    docs
}

fn objects_with_hooks(yaml: &str) -> Vec<Value> {
    let mut docs: Vec<Value> = meshgate_api::yaml::documents(yaml)
        .expect("YAML")
        .into_iter()
        .filter(|d| !d.is_null() && d["kind"] != "Namespace")
        .map(|mut d| {
            if let Some(text) = d["data"]["config.yaml"].as_str() {
                d["data"]["config.yaml"] = meshgate_api::yaml::from_str(text).expect("config");
            }
            d
        })
        .collect();
    docs.sort_by_key(|d| {
        format!(
            "{}/{}/{}",
            d["kind"].as_str().unwrap_or_default(),
            d["metadata"]["namespace"].as_str().unwrap_or_default(),
            d["metadata"]["name"].as_str().unwrap_or_default()
        )
    });
    docs
}

/// What `helm template` renders but `meshgate install` has no part in: Helm hooks (the
/// uninstall hook: `meshgate uninstall` is the CLI's own command).
fn is_hook(doc: &Value) -> bool {
    !doc["metadata"]["annotations"]["helm.sh/hook"].is_null()
}

/// `helm template` without its hooks.
fn template(sets: &[String]) -> Vec<Value> {
    let mut docs = template_all(sets);
    docs.retain(|d| !is_hook(d));
    docs
}

fn template_all(sets: &[String]) -> Vec<Value> {
    let chart = chart();
    let mut args = vec![
        "template",
        "--kube-version",
        KUBE_VERSION,
        "meshgate",
        chart.to_str().expect("path"),
        "--namespace",
        NS,
        "--include-crds",
    ];
    for s in sets {
        args.extend(["--set", s.as_str()]);
    }
    objects_with_hooks(&run(&helm(), &args))
}

fn install(args: &[String]) -> Vec<Value> {
    let mut all = vec!["install", "--namespace", NS];
    all.extend(args.iter().map(String::as_str));
    objects(&run(&meshgate_bin(), &all))
}

fn assert_same(case: &str, from_helm: &[Value], from_install: &[Value]) {
    let names = |docs: &[Value]| -> Vec<String> {
        docs.iter()
            .map(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]))
            .collect()
    };
    assert_eq!(names(from_helm), names(from_install), "{case}: the objects");
    for (h, i) in from_helm.iter().zip(from_install) {
        if let Some((at, left, right)) = difference(h, i, String::new()) {
            panic!(
                "{case}: {}/{} differs at {at}: helm template has {left}, meshgate install {right}",
                i["kind"], i["metadata"]["name"]
            );
        }
    }
}

/// The first place (a JSON pointer) where `a` and `b` differ, with both values there.
fn difference(a: &Value, b: &Value, at: String) -> Option<(String, Value, Value)> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    format!("{at}/{k}"),
                )
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(n, (x, y))| difference(x, y, format!("{at}/{n}"))),
        // The same number (Helm's toYaml writes 1000.0 as 1000).
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => None,
        _ if a == b => None,
        _ => Some((at, a.clone(), b.clone())),
    }
}

#[test]
fn the_charts_generated_data_is_current() {
    run(
        &meshgate_bin(),
        &["chart", "--check", chart().to_str().expect("path")],
    );
}

#[test]
fn lint_passes_and_the_templates_stay_small() {
    let chart = chart();
    let dir = chart.to_str().expect("path");
    for profile in meshgate::install::PROFILES {
        run(
            &helm(),
            &[
                "lint",
                "--strict",
                dir,
                "-f",
                &format!("{dir}/values-{profile}.yaml"),
            ],
        );
    }
    let mut lines = 0;
    for entry in std::fs::read_dir(chart.join("templates")).expect("templates") {
        let text = std::fs::read_to_string(entry.expect("entry").path()).expect("read");
        assert!(
            !text.contains("meshgate.combo"),
            "a template per combination"
        );
        lines += text.lines().count();
    }
    // About 900 lines of objects and helpers, and the uninstall hook (a Job and its RBAC).
    assert!(lines < 1100, "the templates have {lines} lines");
    // An archive ready to push to an OCI registry.
    let out = tempfile::tempdir().expect("dir");
    let said = run(
        &helm(),
        &[
            "package",
            dir,
            "--destination",
            out.path().to_str().expect("path"),
        ],
    );
    assert!(out.path().join("meshgate-0.1.0.tgz").exists(), "{said}");
}

/// Every profile, strategy, node-taint path, init-gate path and repair mode, the policy
/// features on and off, and every list option: `helm template --set ...` equals `meshgate
/// install ...`.
#[test]
fn template_equals_install_for_every_option() {
    let mut cases = 0;
    for (p, profile) in meshgate::install::PROFILES.iter().enumerate() {
        for (s, strategy) in ["taint", "dra", "resource", "pod"].iter().enumerate() {
            for (t, taint) in ["policy", "webhook"].iter().enumerate() {
                let repair = ["", "label", "delete"][(p + s + t) % 3];
                let native = meshgate::install::PodGate::choose(
                    "native",
                    Some(meshgate_core::registration::PolicyApi::V1),
                    profile,
                    meshgate::install::Strategy::choose(strategy).expect("strategy"),
                )
                .is_ok();
                let pod_gates: &[&str] = if native {
                    &["native", "webhook"]
                } else {
                    &["webhook"]
                };
                for pod_gate in pod_gates {
                    let case = format!("{profile}/{strategy}/{taint}/{pod_gate}/{repair:?}");
                    let mut sets = vec![
                        format!("profile={profile}"),
                        format!("strategy={strategy}"),
                        format!("nodeTaint={taint}"),
                        format!("podGate={pod_gate}"),
                        format!("repair={repair}"),
                        "image.registry=registry.invalid".into(),
                        "image.repository=meshgate".into(),
                        "image.tag=v9".into(),
                    ];
                    let mut args: Vec<String> = [
                        "--profile",
                        profile,
                        "--strategy",
                        strategy,
                        "--node-taint",
                        taint,
                        "--pod-gate",
                        pod_gate,
                        "--image",
                        IMAGE,
                    ]
                    .map(String::from)
                    .to_vec();
                    if !repair.is_empty() {
                        args.extend(["--repair".into(), repair.into()]);
                    }
                    // The policy features in every combination (the list options below name
                    // existing kinds, which need the backfill).
                    let features = p + s + t;
                    let backfill = features % 2 == 0 || (p + s) % 2 == 1;
                    let native_policies = (features / 2) % 2 == 0;
                    sets.push(format!("policies.workloadBackfill={backfill}"));
                    sets.push(format!("policies.native={native_policies}"));
                    args.push(format!("--workload-backfill={backfill}"));
                    args.push(format!("--native-policies={native_policies}"));
                    if (p + s) % 2 == 1 {
                        // The gate's key, the node plugin's paths and every list option.
                        let key = "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents";
                        sets.extend([
                            format!("taintKey={key}"),
                            "nodePaths.kubeletRoot=/var/data/kubelet".into(),
                            "nodePaths.cniConfDir=/opt/cni/conf".into(),
                            "nodePaths.cniPlugin=mesh-cni".into(),
                            "webhookIngressFrom={10.0.0.0/8,fd00::/8}".into(),
                            "contextConfigMaps={shop/mesh-settings,default/egress}".into(),
                            "contextApiReads={services,deployments.apps,namespaces}".into(),
                            "existingKinds={services,gateways.networking.istio.io}".into(),
                        ]);
                        for (flag, value) in [
                            ("--taint-key", key),
                            ("--kubelet-root", "/var/data/kubelet"),
                            ("--cni-conf-dir", "/opt/cni/conf"),
                            ("--cni-plugin", "mesh-cni"),
                            ("--webhook-ingress-from", "10.0.0.0/8"),
                            ("--webhook-ingress-from", "fd00::/8"),
                            ("--context-config-map", "shop/mesh-settings"),
                            ("--context-config-map", "default/egress"),
                            ("--context-api-read", "services"),
                            ("--context-api-read", "deployments.apps"),
                            ("--context-api-read", "namespaces"),
                            ("--existing-kind", "services"),
                            ("--existing-kind", "gateways.networking.istio.io"),
                        ] {
                            args.extend([flag.into(), value.into()]);
                        }
                    }
                    assert_same(&case, &template(&sets), &install(&args));
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} configurations: helm template equals meshgate install");
    // The defaults are install's offline defaults (every profile's values file), for a
    // cluster that serves admission policies v1 (what offline install assumes; Helm's own list
    // of APIs without a cluster lacks them, and `auto` then chooses the webhook).
    for profile in meshgate::install::PROFILES {
        let chart = chart();
        let dir = chart.to_str().expect("path");
        let from_helm = objects(&run(
            &helm(),
            &[
                "template",
                "--kube-version",
                KUBE_VERSION,
                "meshgate",
                dir,
                "--namespace",
                NS,
                "--include-crds",
                "-f",
                &format!("{dir}/values-{profile}.yaml"),
                "--api-versions",
                "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
            ],
        ));
        let from_install = install(&["--profile".into(), profile.into()]);
        assert_same(&format!("{profile} defaults"), &from_helm, &from_install);
    }
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind}/{name} rendered"))
}

/// The uninstall hook: Helm runs `meshgate uninstall` for the release's namespace before it
/// deletes anything, on the controller's placement (so on nodes meshgate's taint holds), under
/// RBAC of its own that `meshgate uninstall` does not delete (no `managed-by: meshgate` label);
/// `uninstallHook.enabled=false` renders none of it.
#[test]
fn the_uninstall_hook_runs_meshgate_uninstall_before_helm_deletes() {
    let hooks: Vec<Value> = template_all(&["uninstallHook.timeoutSeconds=45".to_owned()])
        .into_iter()
        .filter(is_hook)
        .collect();
    let kinds: Vec<String> = hooks
        .iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap_or_default(),
                d["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "ClusterRole/meshgate-uninstall",
            "ClusterRoleBinding/meshgate-uninstall",
            "Job/meshgate-uninstall",
            "Role/meshgate-uninstall",
            "RoleBinding/meshgate-uninstall",
            "ServiceAccount/meshgate-uninstall",
        ]
    );
    for d in &hooks {
        let annotations = &d["metadata"]["annotations"];
        assert_eq!(annotations["helm.sh/hook"], "pre-delete", "{d}");
        assert_eq!(
            annotations["helm.sh/hook-delete-policy"], "before-hook-creation,hook-succeeded",
            "{d}"
        );
        assert!(
            d["metadata"]["labels"][meshgate_api::names::MANAGED_BY].is_null(),
            "meshgate uninstall would delete the hook's own {}: {d}",
            d["kind"]
        );
        // The Job only after its identity and grants exist.
        let weight: i32 = annotations["helm.sh/hook-weight"]
            .as_str()
            .and_then(|w| w.parse().ok())
            .expect("a weight");
        assert_eq!(weight < 0, d["kind"] != "Job", "{d}");
    }
    let job = find(&hooks, "Job", "meshgate-uninstall");
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "meshgate-uninstall");
    assert_eq!(pod["restartPolicy"], "Never");
    let args = &pod["containers"][0]["args"];
    assert_eq!(
        args.as_array().expect("args")[..7],
        [
            json!("uninstall"),
            json!("--namespace"),
            json!(NS),
            json!("--wait"),
            json!("45s"),
            json!("--helm-release"),
            json!("meshgate")
        ]
    );
    let controller = find(&template(&[]), "Deployment", "meshgate-controller").clone();
    assert_eq!(
        pod["tolerations"], controller["spec"]["template"]["spec"]["tolerations"],
        "the hook runs where the controller runs, on nodes meshgate's taint holds"
    );
    assert_eq!(
        pod["containers"][0]["image"],
        controller["spec"]["template"]["spec"]["containers"][0]["image"]
    );
    assert!(
        template_all(&["uninstallHook.enabled=false".to_owned()])
            .iter()
            .all(|d| !is_hook(d)),
        "no hook when it is turned off"
    );
}

#[test]
fn every_knob_lands_on_its_objects() {
    let values = tempfile::NamedTempFile::new().expect("file");
    let component = |extra: &str| {
        format!(
            "
  replicas: 3
  resources: {{requests: {{cpu: 200m, memory: 64Mi}}, limits: {{memory: 1Gi}}}}
  nodeSelector: {{pool: system}}
  tolerations: [{{key: dedicated, operator: Equal, value: system, effect: NoSchedule}}]
  affinity: {{nodeAffinity: {{requiredDuringSchedulingIgnoredDuringExecution: {{nodeSelectorTerms: [{{matchExpressions: [{{key: zone, operator: In, values: [a]}}]}}]}}}}}}
  topologySpreadConstraints: [{{maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: DoNotSchedule, labelSelector: {{matchLabels: {{app.kubernetes.io/name: meshgate}}}}}}]
  priorityClassName: system-cluster-critical
  podAnnotations: {{example.com/team: platform}}
  podLabels: {{team: platform}}
  podSecurityContext: {{runAsNonRoot: true, runAsUser: 1000, runAsGroup: 1000, seccompProfile: {{type: RuntimeDefault}}}}
  securityContext: {{readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities: {{drop: [ALL]}}, runAsUser: 1001}}
  extraArgs: [--example-flag]
  podDisruptionBudget: {{enabled: true, minAvailable: 2}}{extra}"
        )
    };
    std::fs::write(
        values.path(),
        format!(
            "strategy: dra
image: {{registry: mirror.invalid, repository: team/meshgate, tag: v9, pullPolicy: Always}}
imagePullSecrets: [{{name: mirror-pull}}]
logLevel: debug
logFormat: text
webhook:{}
controller:{}
nodePlugin:
  resources: {{requests: {{cpu: 5m, memory: 8Mi}}, limits: {{memory: 32Mi}}}}
  nodeSelector: {{kubernetes.io/os: linux, pool: mesh}}
  tolerations: [{{key: dedicated, operator: Exists}}]
  affinity: {{}}
  priorityClassName: system-node-critical
  podAnnotations: {{example.com/team: platform}}
  podLabels: {{team: platform}}
  securityContext: {{runAsUser: 0, readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities: {{drop: [ALL]}}}}
  extraArgs: [--example-flag]
serviceMonitor: {{enabled: true, interval: 15s, labels: {{release: prometheus}}}}
",
            component(""),
            component("")
        ),
    )
    .expect("values");
    let chart = chart();
    let docs = objects(&run(
        &helm(),
        &[
            "template",
            "--kube-version",
            KUBE_VERSION,
            "meshgate",
            chart.to_str().expect("path"),
            "--namespace",
            NS,
            "-f",
            values.path().to_str().expect("path"),
        ],
    ));
    let image = "mirror.invalid/team/meshgate:v9";
    for name in ["meshgate-webhook", "meshgate-controller"] {
        let d = find(&docs, "Deployment", name);
        let pod = &d["spec"]["template"];
        let spec = &pod["spec"];
        let c = &spec["containers"][0];
        assert_eq!(d["spec"]["replicas"], 3, "{name}");
        assert_eq!(c["image"], image, "{name}");
        assert_eq!(c["imagePullPolicy"], "Always", "{name}");
        assert_eq!(
            spec["imagePullSecrets"],
            json!([{"name": "mirror-pull"}]),
            "{name}"
        );
        assert_eq!(c["resources"]["limits"]["memory"], "1Gi", "{name}");
        assert_eq!(spec["nodeSelector"], json!({"pool": "system"}), "{name}");
        let tolerations = spec["tolerations"].as_array().expect("tolerations");
        assert!(
            tolerations.iter().any(|t| t["key"] == "dedicated"),
            "{name}"
        );
        assert!(
            tolerations
                .iter()
                .any(|t| t["key"] == "readiness.k8s.io/mesh-agents"),
            "{name}: meshgate's own toleration stays"
        );
        assert_eq!(
            spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                [0]["matchExpressions"][0]["key"],
            "zone"
        );
        assert_eq!(spec["topologySpreadConstraints"][0]["maxSkew"], 1, "{name}");
        assert_eq!(
            spec["priorityClassName"], "system-cluster-critical",
            "{name}"
        );
        assert_eq!(
            pod["metadata"]["annotations"]["example.com/team"],
            "platform"
        );
        assert_eq!(pod["metadata"]["labels"]["team"], "platform");
        assert_eq!(
            pod["metadata"]["labels"]["meshgate.dev/inject"], "false",
            "never gated"
        );
        assert_eq!(spec["securityContext"]["runAsUser"], 1000, "{name}");
        assert_eq!(c["securityContext"]["runAsUser"], 1001, "{name}");
        let args: Vec<&str> = c["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(args.contains(&"--example-flag"), "{name}: {args:?}");
        assert!(!args.contains(&"--log-json"), "{name}: text logs");
        assert!(
            args.windows(2).any(|w| w == ["--log-level", "debug"]),
            "{name}"
        );
        let pdb = find(&docs, "PodDisruptionBudget", name);
        assert_eq!(pdb["spec"]["minAvailable"], 2, "{name}");
        let monitor = find(&docs, "ServiceMonitor", name);
        assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
        assert_eq!(monitor["spec"]["endpoints"][0]["interval"], "15s");
        find(&docs, "Service", &format!("{name}-metrics"));
    }
    let node = find(&docs, "DaemonSet", "meshgate-node");
    let spec = &node["spec"]["template"]["spec"];
    assert_eq!(spec["containers"][0]["image"], image);
    assert_eq!(
        spec["containers"][0]["resources"]["limits"]["memory"],
        "32Mi"
    );
    assert_eq!(spec["nodeSelector"]["pool"], "mesh");
    assert_eq!(
        spec["tolerations"],
        json!([{"key": "dedicated", "operator": "Exists"}])
    );
    assert_eq!(spec["imagePullSecrets"], json!([{"name": "mirror-pull"}]));
    assert_eq!(
        node["spec"]["template"]["metadata"]["labels"]["team"],
        "platform"
    );
    // meshgate-wait, the init gate, comes from the same image.
    // (objects() parsed the configuration.)
    let config = &find(&docs, "ConfigMap", "meshgate-config")["data"]["config.yaml"];
    assert_eq!(config["initGate"]["image"], image);
    assert_eq!(config["initGate"]["imagePullPolicy"], "Always");
}

/// The chart says which Kubernetes it is for: Helm refuses it on a cluster older than the
/// oldest minor meshgate is tested on (1.34), and takes it on each tested minor.
#[test]
fn the_chart_refuses_a_kubernetes_older_than_it_supports() {
    let chart = chart();
    let template = |version: &str| {
        output(
            &helm(),
            &[
                "template",
                "meshgate",
                chart.to_str().expect("path"),
                "--kube-version",
                version,
            ],
        )
    };
    let out = template("1.33.5");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "rendered for 1.33");
    assert!(
        err.contains("kubeVersion") && err.contains(">=1.34.0-0"),
        "{err}"
    );
    for version in ["1.34.0", "1.35.4", "1.36.3", "1.37.2"] {
        let out = template(version);
        assert!(
            out.status.success(),
            "{version}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_schema_refuses_unknown_and_mistyped_values() {
    let chart = chart();
    for (set, says) in [
        ("webhook.replica=2", "replica"),
        ("profile=nope", "profile"),
        ("strategy=fast", "strategy"),
        ("controller.replicas=two", "replicas"),
        ("taintKey=not a key", "taintKey"),
        ("webhookIngressFrom={10.0.0.0}", "webhookIngressFrom"),
        ("imageTag=1", "imageTag"),
    ] {
        let out = output(
            &helm(),
            &[
                "template",
                "--kube-version",
                KUBE_VERSION,
                "meshgate",
                chart.to_str().expect("path"),
                "--set",
                set,
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--set {set} rendered");
        assert!(
            err.contains("values don't meet the specifications of the schema")
                && err.contains(says),
            "--set {set}: {err}"
        );
    }
}

/// The controller's CA and the caBundle of every webhook entry.
async fn ca_state(client: &kube::Client) -> (Option<Vec<u8>>, Vec<Vec<u8>>) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
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
}

/// The controller, as the ServiceAccount the chart made (it creates the CA and the caBundle),
/// once both are there; `manage_crds` as the chart's args since this change.
async fn start_controller(
    cp: &meshgate_testenv::ControlPlane,
    manage_crds: bool,
) -> ControllerTask {
    let client = cp.client().await.expect("client");
    let controller = ControllerTask::start(
        cp,
        NS,
        meshgate::run::ControllerSettings {
            certs: Some(meshgate_controller::certs::CertSettings::new(NS)),
            policy_webhook: Some("meshgate".into()),
            native_policies: true,
            manage_crds,
            ..Default::default()
        },
    );
    wait_for(
        "the controller's CA and caBundle",
        Duration::from_secs(60),
        || async {
            let (ca, bundles) = ca_state(&client).await;
            ca.is_some() && !bundles.is_empty() && bundles.iter().all(|b| !b.is_empty())
        },
    )
    .await;
    controller
}

/// Whether the chart chose the admission policy for the taint at registration: it does where the
/// API server serves `admissionregistration.k8s.io/v1` (1.36+); before, it registers its webhook
/// on Node CREATE, which this test does not run.
async fn chart_chose_the_policy(client: &kube::Client) -> bool {
    let webhooks = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get("meshgate")
        .await
        .expect("the chart's webhook configuration");
    let node_webhook = webhooks
        .webhooks
        .unwrap_or_default()
        .iter()
        .any(|w| w.name.starts_with("nodes."));
    let served = meshgate::discovery::policy_api(client).await
        == Some(meshgate_core::registration::PolicyApi::V1);
    assert_eq!(
        node_webhook, !served,
        "the chart registers its node webhook exactly where it cannot use the policy"
    );
    served
}

/// A node created now, with the taints and owned-taints annotation it was stored with (the
/// admission policy follows its objects asynchronously: dry-run creates first, until one
/// carries `key`). Where the chart chose its webhook (not run here), the node as the
/// controller taints it after its registration.
async fn new_node(client: &kube::Client, name: &str, key: &str) -> (Vec<String>, Option<String>) {
    let nodes = Api::<Node>::all(client.clone());
    let policy = chart_chose_the_policy(client).await;
    if policy {
        wait_registration_taint(client, key, true).await;
    }
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).expect("node");
    let mut created = nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("node");
    if !policy {
        wait_for(
            "the controller to taint the node",
            Duration::from_secs(30),
            || async {
                nodes
                    .get(name)
                    .await
                    .is_ok_and(|n| taint_keys(&n).iter().any(|k| k == key))
            },
        )
        .await;
        created = nodes.get(name).await.expect("node");
    }
    let keys = created
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect();
    let owned = created
        .metadata
        .annotations
        .unwrap_or_default()
        .get("meshgate.dev/owned-taints")
        .cloned();
    (keys, owned)
}

#[tokio::test]
async fn install_and_upgrade_keep_the_ca_and_the_gates() {
    let helm = helm();
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let kubeconfig = cp.kubeconfig_path.to_str().expect("path").to_owned();
    let chart = chart();
    let chart = chart.to_str().expect("path");
    let image = [
        "--set",
        "image.registry=registry.invalid",
        "--set",
        "image.repository=meshgate",
        "--set",
        "image.tag=v9",
    ];
    let mut args = vec![
        "install",
        "meshgate",
        chart,
        "--namespace",
        NS,
        "--create-namespace",
        "--kubeconfig",
        &kubeconfig,
    ];
    args.extend(image);
    run(&helm, &args);
    let controller = start_controller(&cp, true).await;
    let before = ca_state(&client).await;

    // An upgrade that changes something: the repair loop on, and the gate keyed for the
    // Cluster Autoscaler.
    let key = "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents";
    let set_key = format!("taintKey={key}");
    let mut args = vec![
        "upgrade",
        "meshgate",
        chart,
        "--namespace",
        NS,
        "--kubeconfig",
        &kubeconfig,
        "--set",
        "repair=label",
        "--set",
        &set_key,
    ];
    args.extend(image);
    run(&helm, &args);
    assert_eq!(
        ca_state(&client).await,
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
    // A new node is tainted at registration with the new key, recorded as meshgate's.
    let (keys, owned) = new_node(&client, "helm-node", key).await;
    assert!(keys.iter().any(|k| k == key), "tainted at CREATE: {keys:?}");
    assert_eq!(
        owned.as_deref(),
        Some(key),
        "the key recorded as meshgate's at CREATE"
    );
    controller.finish().await;
    // Helm labels the release's objects its own: `meshgate uninstall` without the release
    // would find none of them, so it refuses, naming the release.
    let out = meshgate_on(&cp, &["uninstall", "--namespace", NS]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "uninstall ran: {said}");
    assert!(
        said.contains("installed by Helm release meshgate")
            && said.contains("--helm-release meshgate"),
        "{said}"
    );
}

/// The chart at `481bbe6` (generated templates, the gate keyed
/// `node.meshgate.dev/agent-not-ready`) upgraded to this one on a cluster with a held node and
/// an older NodeGate CRD: the CA, the caBundle and the gate stay, the node stays held (its key
/// replaced by the new one), and the new CRD schema is served once the new controller runs.
#[tokio::test]
async fn upgrade_from_the_chart_at_481bbe6_keeps_nodes_held_and_upgrades_the_crds() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let helm = helm();
    let old = tempfile::tempdir().expect("dir");
    let repo = meshgate_testenv::workspace_dir();
    let archive = Command::new("git")
        .current_dir(&repo)
        .args(["archive", "--format=tar", "481bbe6", "deploy/helm/meshgate"])
        .output()
        .expect("git (the chart at 481bbe6 comes from this repository's history)");
    assert!(
        archive.status.success(),
        "git archive 481bbe6: {} (a clone with its history is needed)",
        String::from_utf8_lossy(&archive.stderr)
    );
    let tar = old.path().join("chart.tar");
    std::fs::write(&tar, &archive.stdout).expect("tar");
    run(
        Path::new("tar"),
        &[
            "-xf",
            tar.to_str().expect("path"),
            "-C",
            old.path().to_str().expect("path"),
        ],
    );
    let old_chart = old.path().join("deploy/helm/meshgate");

    // A control plane of its own: the other test installs the same release in the shared one.
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options::default())
        .await
        .expect("control plane starts");
    let client = cp.client().await.expect("client");
    let kubeconfig = cp.kubeconfig_path.to_str().expect("path").to_owned();
    run(
        &helm,
        &[
            "install",
            "meshgate",
            old_chart.to_str().expect("path"),
            "--namespace",
            NS,
            "--create-namespace",
            "--kubeconfig",
            &kubeconfig,
            "--set",
            &format!("image={IMAGE}"),
        ],
    );
    // The controller of that release (which did not write CRDs).
    let controller = start_controller(&cp, false).await;
    let before = ca_state(&client).await;
    let old_key = meshgate_api::names::DEFAULT_TAINT_KEY;
    let (keys, _) = new_node(&client, "held-node", old_key).await;
    assert!(
        keys.iter().any(|k| k == old_key),
        "held at CREATE: {keys:?}"
    );

    // An older CRD: the NodeGate schema without `maxRetainted`.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let path = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/maxRetainted";
    let patch: json_patch::Patch =
        serde_json::from_value(json!([{"op": "remove", "path": path}])).expect("patch");
    crds.patch(
        "nodegates.meshgate.dev",
        &Default::default(),
        &kube::api::Patch::<()>::Json(patch),
    )
    .await
    .expect("an older CRD");
    let served = |crd: &CustomResourceDefinition| {
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| s.properties.as_ref())
            .and_then(|p| p.get("spec"))
            .and_then(|s| s.properties.as_ref())
            .is_some_and(|p| p.contains_key("maxRetainted"))
    };
    assert!(!served(
        &crds.get("nodegates.meshgate.dev").await.expect("crd")
    ));

    // The upgrade: Helm leaves crds/ alone; the new controller's rollout (its Deployment's
    // args changed) writes the CRDs.
    let chart = chart();
    run(
        &helm,
        &[
            "upgrade",
            "meshgate",
            chart.to_str().expect("path"),
            "--namespace",
            NS,
            "--kubeconfig",
            &kubeconfig,
            "--set",
            "image.registry=registry.invalid",
            "--set",
            "image.repository=meshgate",
            "--set",
            "image.tag=v9",
        ],
    );
    let deployment = Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), NS)
        .get("meshgate-controller")
        .await
        .expect("controller");
    let args = deployment
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].args.clone().unwrap_or_default())
        .unwrap_or_default();
    assert!(
        args.iter().any(|a| a == "--manage-crds"),
        "the upgraded controller writes CRDs: {args:?}"
    );
    controller.finish().await;
    let controller = start_controller(&cp, true).await;
    assert_eq!(
        ca_state(&client).await,
        before,
        "the upgrade kept the CA and the caBundle"
    );
    wait_for(
        "the upgraded CRD schema served",
        Duration::from_secs(30),
        || async { served(&crds.get("nodegates.meshgate.dev").await.expect("crd")) },
    )
    .await;
    let gate = Api::<meshgate_api::NodeGate>::all(client.clone())
        .get("mesh-agents")
        .await
        .expect("the gate stays");
    let new_key = meshgate_api::names::STARTUP_TAINT_KEY;
    assert_eq!(gate.spec.taint.key, new_key);
    // The held node: held throughout, under the new key once the controller replaced the old.
    let nodes = Api::<Node>::all(client.clone());
    wait_for(
        "the held node's key replaced",
        Duration::from_secs(60),
        || async {
            let node = nodes.get("held-node").await.expect("node");
            let keys = taint_keys(&node);
            assert!(
                keys.iter().any(|k| k == new_key || k == old_key),
                "the node was released: {keys:?}"
            );
            keys.iter().any(|k| k == new_key) && !keys.iter().any(|k| k == old_key)
        },
    )
    .await;
    let (keys, _) = new_node(&client, "new-node", new_key).await;
    assert!(
        keys.iter().any(|k| k == new_key),
        "new nodes get the new key: {keys:?}"
    );
    controller.finish().await;
}
