//! The Helm chart (`deploy/helm/meshgate`), generated from `meshgate install` so that the two
//! can never disagree: `meshgate chart --write DIR` writes it, `--check DIR` fails when the
//! checked-in chart is stale (the `helm` test runs it, and compares `helm template` with
//! `meshgate install` for every profile, repair mode and node-taint path).
//!
//! How it is made: `install` is rendered for every combination of the values `profile`, `repair`
//! (`""`, `label`, `delete`) and the node taint path (`policy`, `webhook`), with placeholders for
//! the release namespace and the image. Each object becomes one template file; an object that
//! differs between combinations gets one block per variant, under a condition on the
//! combination (`meshgate.combo`). The placeholders become `{{ .Release.Namespace }}` and
//! `{{ .Values.image }}`. CRDs go to `crds/` (Helm installs them once and never upgrades or
//! deletes them, as it does for every chart). The install namespace is not part of the chart: Helm
//! creates it (`--create-namespace`), and a chart must not template its own release namespace.
//!
//! `nodeTaint: auto` (the default) picks the MutatingAdmissionPolicy where the cluster serves
//! `admissionregistration.k8s.io/v1` (Helm's `.Capabilities`), else the webhook, as `install`
//! does by discovery.

use std::collections::BTreeMap;
use std::path::Path;

use crate::install::{InstallOptions, NodeTaint, PROFILES, PodGate, RepairAction};
use meshgate_core::registration::PolicyApi;

const NAMESPACE: &str = "helm-release-namespace-placeholder";
const IMAGE: &str = "helm-image-placeholder";
/// The gate's taint key: under a prefix that passes every check `install` makes of a key, so
/// that the rendered objects keep their shape, and replaced by `{{ .Values.taintKey }}`.
const TAINT_KEY: &str = "readiness.k8s.io/helm-taint-key-placeholder";
const REPAIRS: [(&str, Option<RepairAction>); 3] = [
    ("", None),
    ("label", Some(RepairAction::Label)),
    ("delete", Some(RepairAction::Delete)),
];
const TAINTS: [&str; 2] = ["policy", "webhook"];

const CHART_YAML: &str = "\
apiVersion: v2
name: meshgate
description: Holds pods and nodes until the service mesh's node agents have set them up, and mutates workloads by policy.
type: application
version: 0.1.0
appVersion: \"0.1.0\"
";

const VALUES_YAML: &str = "\
# The mesh profile: istio-ambient, istio-sidecar, kubeflow (Istio sidecar mode with its policy),
# linkerd. As `meshgate install --profile`.
profile: istio-ambient
# meshgate's image (both binaries). As `meshgate install --image`.
image: meshgate/meshgate:0.1.0
# The key of the gate's startup taint. readiness.k8s.io/ keys are startup taints to Karpenter;
# under the Cluster Autoscaler use startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents (or
# list this key in its --startup-taint). helm template cannot look for an autoscaler; install
# --apply does. As `meshgate install --taint-key`.
taintKey: readiness.k8s.io/mesh-agents
# How new nodes get the startup taint at registration: policy (a MutatingAdmissionPolicy the API
# server evaluates), webhook, or auto (the policy where the cluster serves
# admissionregistration.k8s.io/v1). As `meshgate install --node-taint`.
nodeTaint: auto
# The controller's repair loop for pods whose gate timed out: \"\" (off), label, delete.
# As `meshgate install --repair`.
repair: \"\"
# Admit connections to the webhook's HTTPS port only from these CIDRs (a NetworkPolicy): the API
# server's source addresses, which differ per cluster. Empty: no NetworkPolicy.
# As `meshgate install --webhook-ingress-from`.
webhookIngressFrom: []
# ConfigMaps (NAMESPACE/NAME) that policies' configMap context entries read: the webhook may list
# and watch them, the controller get them, by name, and no other ConfigMap. A policy's
# status.configMaps lists the ones it needs. As `meshgate install --context-config-map`.
contextConfigMaps: []
# Resources (RESOURCE or RESOURCE.GROUP: namespaces, deployments.apps) that policies' apiCall
# context entries GET: the webhook and the controller may get and list them, cluster-wide.
# As `meshgate install --context-api-read`.
contextApiReads: []
# Kinds other than the workloads (RESOURCE or RESOURCE.GROUP: services,
# gateways.networking.istio.io) whose existing objects policies with existing.enabled mutate: the
# controller may list and patch them, cluster-wide. As `meshgate install --existing-kind`.
existingKinds: []
";

/// The webhook's NetworkPolicy, as `install --webhook-ingress-from` renders it.
const NETWORK_POLICY: &str = "\
# Written with `meshgate install --webhook-ingress-from` (crates/meshgate/src/install.rs); the helm
# test compares the two.
{{- if .Values.webhookIngressFrom }}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  labels:
    app.kubernetes.io/component: webhook
    app.kubernetes.io/managed-by: meshgate
    app.kubernetes.io/name: meshgate
  name: meshgate-webhook
  namespace: {{ .Release.Namespace }}
spec:
  ingress:
  - from:
{{- range .Values.webhookIngressFrom }}
    - ipBlock:
        cidr: {{ . | quote }}
{{- end }}
    ports:
    - port: 8443
      protocol: TCP
  - ports:
    - port: 8080
      protocol: TCP
  podSelector:
    matchLabels:
      app.kubernetes.io/component: webhook
      app.kubernetes.io/name: meshgate
  policyTypes:
  - Ingress
{{- end }}
";

/// The Roles that let the webhook and the controller read the ConfigMaps policies' context
/// entries name, as `install --context-config-map` renders them.
const CONTEXT_CONFIG_MAPS: &str = "\
# Written with `meshgate install --context-config-map` (crates/meshgate/src/install.rs); the helm
# test compares the two.
{{- range .Values.contextConfigMaps }}
{{- $parts := splitList \"/\" . }}
{{- if ne (len $parts) 2 }}
{{- fail (printf \"contextConfigMaps %q: expected NAMESPACE/NAME\" .) }}
{{- end }}
{{- $ns := index $parts 0 }}
{{- $name := index $parts 1 }}
{{- range $component, $verbs := dict \"webhook\" (list \"list\" \"watch\") \"controller\" (list \"get\") }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  labels:
    app.kubernetes.io/component: {{ $component }}
    app.kubernetes.io/managed-by: meshgate
    app.kubernetes.io/name: meshgate
  name: meshgate-{{ $component }}-context-{{ $name }}
  namespace: {{ $ns }}
rules:
- apiGroups:
  - \"\"
  resourceNames:
  - {{ $name }}
  resources:
  - configmaps
  verbs:
{{- range $verbs }}
  - {{ . }}
{{- end }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  labels:
    app.kubernetes.io/component: {{ $component }}
    app.kubernetes.io/managed-by: meshgate
    app.kubernetes.io/name: meshgate
  name: meshgate-{{ $component }}-context-{{ $name }}
  namespace: {{ $ns }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: meshgate-{{ $component }}-context-{{ $name }}
subjects:
- kind: ServiceAccount
  name: meshgate-{{ $component }}
  namespace: {{ $.Release.Namespace }}
{{- end }}
{{- end }}
";

/// A template of ClusterRoles and bindings, one per component, with `verbs` on the resources of
/// the list value `value` (`RESOURCE[.GROUP]`), as `install::resource_grants` renders them for
/// `install FLAG`; the helm test compares the two.
fn resource_grants_template(
    flag: &str,
    value: &str,
    verbs: &[&str],
    components: &[&str],
    suffix: &str,
) -> String {
    let verbs: String = verbs.iter().map(|v| format!("  - {v}\n")).collect();
    let components = components
        .iter()
        .map(|c| format!("\"{c}\""))
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "\
# Written with `meshgate install {flag}` (crates/meshgate/src/install.rs); the helm test compares
# the two.
{{{{- if .Values.{value} }}}}
{{{{- $groups := dict }}}}
{{{{- range .Values.{value} }}}}
{{{{- $parts := splitList \".\" . }}}}
{{{{- $resource := first $parts }}}}
{{{{- $group := join \".\" (rest $parts) }}}}
{{{{- if not (regexMatch \"^[a-z0-9-]+$\" $resource) }}}}
{{{{- fail (printf \"{value} %q: expected RESOURCE or RESOURCE.GROUP\" .) }}}}
{{{{- end }}}}
{{{{- $_ := set $groups $group (append (get $groups $group | default list) $resource) }}}}
{{{{- end }}}}
{{{{- range $component := list {components} }}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  labels:
    app.kubernetes.io/component: {{{{ $component }}}}
    app.kubernetes.io/managed-by: meshgate
    app.kubernetes.io/name: meshgate
  name: meshgate-{{{{ $component }}}}-{suffix}
rules:
{{{{- range $group, $resources := $groups }}}}
- apiGroups:
  - {{{{ $group | quote }}}}
  resources:
{{{{- range ($resources | sortAlpha | uniq) }}}}
  - {{{{ . }}}}
{{{{- end }}}}
  verbs:
{verbs}{{{{- end }}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  labels:
    app.kubernetes.io/component: {{{{ $component }}}}
    app.kubernetes.io/managed-by: meshgate
    app.kubernetes.io/name: meshgate
  name: meshgate-{{{{ $component }}}}-{suffix}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: meshgate-{{{{ $component }}}}-{suffix}
subjects:
- kind: ServiceAccount
  name: meshgate-{{{{ $component }}}}
  namespace: {{{{ $.Release.Namespace }}}}
{{{{- end }}}}
{{{{- end }}}}
"
    )
}

const HELPERS: &str = "\
{{/* The node taint path: policy or webhook. */}}
{{- define \"meshgate.nodeTaint\" -}}
{{- if eq .Values.nodeTaint \"auto\" -}}
{{- if .Capabilities.APIVersions.Has \"admissionregistration.k8s.io/v1/MutatingAdmissionPolicy\" -}}policy{{- else -}}webhook{{- end -}}
{{- else -}}
{{- .Values.nodeTaint -}}
{{- end -}}
{{- end -}}

{{/* The combination of values the templates are generated for: profile/repair/nodeTaint. */}}
{{- define \"meshgate.combo\" -}}
{{- printf \"%s/%s/%s\" .Values.profile .Values.repair (include \"meshgate.nodeTaint\" .) -}}
{{- end -}}
";

fn validate_template() -> String {
    let profiles = PROFILES
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "{{{{- if not (has .Values.profile (list {profiles})) }}}}
{{{{- fail (printf \"profile %q: expected one of {}\" .Values.profile) }}}}
{{{{- end }}}}
{{{{- if not (has .Values.repair (list \"\" \"label\" \"delete\")) }}}}
{{{{- fail (printf \"repair %q: expected \\\"\\\", label or delete\" .Values.repair) }}}}
{{{{- end }}}}
{{{{- if not (has .Values.nodeTaint (list \"auto\" \"policy\" \"webhook\")) }}}}
{{{{- fail (printf \"nodeTaint %q: expected auto, policy or webhook\" .Values.nodeTaint) }}}}
{{{{- end }}}}
",
        PROFILES.join(", ")
    )
}

/// The install options of one combination.
pub fn options(profile: &str, repair: Option<RepairAction>, taint: &str) -> InstallOptions {
    InstallOptions {
        profile: profile.into(),
        namespace: NAMESPACE.into(),
        image: IMAGE.into(),
        node_taint: if taint == "policy" {
            NodeTaint::Policy(PolicyApi::V1)
        } else {
            NodeTaint::Webhook
        },
        // The chart's templates cannot list LimitRanges or run discovery at render time; the
        // native gate is `meshgate install`'s.
        pod_gate: PodGate::Webhook,
        strategy: crate::install::Strategy::default(),
        taint_key: TAINT_KEY.into(),
        node_paths: Default::default(),
        repair,
        webhook_ingress_from: Vec::new(),
        context_config_maps: Vec::new(),
        context_api_reads: Vec::new(),
        existing_kinds: Vec::new(),
    }
}

fn templated(yaml: &str) -> String {
    yaml.replace(NAMESPACE, "{{ .Release.Namespace }}")
        .replace(IMAGE, "{{ .Values.image }}")
        .replace(TAINT_KEY, "{{ .Values.taintKey }}")
}

/// `(path in the chart, content)` of every file.
pub fn files() -> anyhow::Result<Vec<(String, String)>> {
    // object key -> variant YAML -> combinations.
    let mut objects: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut crds = Vec::new();
    let mut all = Vec::new();
    for profile in PROFILES {
        for (repair_name, repair) in REPAIRS {
            for taint in TAINTS {
                let combo = format!("{profile}/{repair_name}/{taint}");
                all.push(combo.clone());
                for doc in crate::install::render(&options(profile, repair, taint))? {
                    let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
                    let name = doc["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    if kind == "Namespace" {
                        continue;
                    }
                    if kind == "CustomResourceDefinition" {
                        if !crds.iter().any(|(n, _)| n == &name) {
                            crds.push((name, meshgate_api::yaml::to_string(&doc)?));
                        }
                        continue;
                    }
                    let key = format!("{}-{}", kind.to_lowercase(), name);
                    objects
                        .entry(key)
                        .or_default()
                        .entry(meshgate_api::yaml::to_string(&doc)?)
                        .or_default()
                        .push(combo.clone());
                }
            }
        }
    }
    let mut out = vec![
        ("Chart.yaml".to_owned(), CHART_YAML.to_owned()),
        ("values.yaml".to_owned(), VALUES_YAML.to_owned()),
        ("templates/_helpers.tpl".to_owned(), HELPERS.to_owned()),
        ("templates/validate.yaml".to_owned(), validate_template()),
        (
            "templates/networkpolicy-meshgate-webhook.yaml".to_owned(),
            NETWORK_POLICY.to_owned(),
        ),
        (
            "templates/rbac-context-config-maps.yaml".to_owned(),
            CONTEXT_CONFIG_MAPS.to_owned(),
        ),
        (
            "templates/rbac-context-api-reads.yaml".to_owned(),
            resource_grants_template(
                "--context-api-read",
                "contextApiReads",
                &["get", "list"],
                &["controller", "webhook"],
                "context-api-reads",
            ),
        ),
        (
            "templates/rbac-existing-kinds.yaml".to_owned(),
            resource_grants_template(
                "--existing-kind",
                "existingKinds",
                &["get", "list", "patch"],
                &["controller"],
                "existing-kinds",
            ),
        ),
    ];
    for profile in PROFILES {
        out.push((
            format!("values-{profile}.yaml"),
            format!("# meshgate for the {profile} profile: helm install meshgate . -f values-{profile}.yaml\nprofile: {profile}\n"),
        ));
    }
    for (name, yaml) in crds {
        out.push((format!("crds/{name}.yaml"), yaml));
    }
    for (key, variants) in objects {
        let mut text = String::from(
            "# Generated by `meshgate chart --write` from `meshgate install`; do not edit.\n",
        );
        for (yaml, combos) in variants {
            if combos.len() == all.len() {
                text.push_str("---\n");
                text.push_str(&templated(&yaml));
            } else {
                let list = combos
                    .iter()
                    .map(|c| format!("\"{c}\""))
                    .collect::<Vec<_>>()
                    .join(" ");
                text.push_str(&format!(
                    "{{{{- if has (include \"meshgate.combo\" .) (list {list}) }}}}\n---\n{}{{{{- end }}}}\n",
                    templated(&yaml)
                ));
            }
        }
        out.push((format!("templates/{key}.yaml"), text));
    }
    Ok(out)
}

/// Writes the chart into `dir` (its generated files replaced).
pub fn write(dir: &Path) -> anyhow::Result<()> {
    for sub in ["templates", "crds"] {
        let d = dir.join(sub);
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
        }
    }
    for (path, text) in files()? {
        let p = dir.join(path);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(p, text)?;
    }
    Ok(())
}

/// Fails, naming the files, when `dir` differs from what `install` generates.
pub fn check(dir: &Path) -> anyhow::Result<()> {
    let expected = files()?;
    let mut stale: Vec<String> = expected
        .iter()
        .filter(|(p, t)| std::fs::read_to_string(dir.join(p)).ok().as_deref() != Some(t.as_str()))
        .map(|(p, _)| p.clone())
        .collect();
    for sub in ["templates", "crds"] {
        for entry in std::fs::read_dir(dir.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            let rel = format!("{sub}/{}", entry.file_name().to_string_lossy());
            if !expected.iter().any(|(p, _)| *p == rel) {
                stale.push(format!("{rel} (not generated)"));
            }
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        anyhow::bail!(
            "the chart in {} differs from `meshgate install`: {}; run `meshgate chart --write {}`",
            dir.display(),
            stale.join(", "),
            dir.display()
        )
    }
}
