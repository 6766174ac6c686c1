//! The real Karpenter (its KWOK cloud provider) and KWOK beside a [`ControlPlane`], built by
//! `tools/karpenter/build.sh` (`MESHGATE_KARPENTER` names the directory it prints).
//!
//! [`Autoscaler::start`] starts kube-controller-manager (its node lifecycle controller lifts the
//! `node.kubernetes.io/not-ready` taint Karpenter waits for, its workload controllers run the
//! Deployments and DaemonSets), applies Karpenter's CRDs, one `KWOKNodeClass` and one `NodePool`
//! of the instance types given, then starts KWOK (managing only the Nodes Karpenter's KWOK
//! provider creates, annotated `kwok.x-k8s.io/node: fake`) and Karpenter (no leader election,
//! batching shortened to 100 ms idle / 2 s max). Dropping it stops the three processes.
//!
//! **Pods on KWOK's Nodes** get their status from KWOK's stages: KWOK's own node stages and its
//! pod delete and complete stages, and this module's pod stages ([`POD_STAGES`]):
//! * a pod is Running and Ready at once, except
//! * an agent pod (label [`AGENT_LABEL`]) becomes Running and Ready after the duration in its
//!   annotation [`READY_AFTER`] (`15s`), and
//! * an agent pod annotated [`FAILED`]` = "true"` loses its readiness (the agent failed).
//!
//! No container runs: `meshgate-wait` never runs on these Nodes (KWOK writes init containers'
//! statuses as completed); the real node tests hold pods for real.
//!
//! Karpenter serves its metrics and health ports on every address (it has no bind-address
//! setting); nothing is sent to them but from loopback.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use serde_json::{Value, json};

use crate::{ControlPlane, Error, Process, built, free_port, io};

/// The environment variable naming the directory `tools/karpenter/build.sh` prints.
pub const KARPENTER_BIN_ENV: &str = "MESHGATE_KARPENTER";
/// The label of an agent pod whose readiness the test controls.
pub const AGENT_LABEL: &str = "meshgate.dev/kwok-agent";
/// An agent pod's annotation: how long after it is created KWOK makes it Ready (`15s`).
pub const READY_AFTER: &str = "meshgate.dev/kwok-ready-after";
/// An agent pod's annotation: `"true"` makes KWOK mark it not Ready (the agent failed).
pub const FAILED: &str = "meshgate.dev/kwok-failed";
/// The annotation Karpenter's KWOK provider puts on its Nodes, which KWOK manages.
pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// The NodePool's and the KWOKNodeClass's name.
pub const NODE_POOL: &str = "default";

/// Where Karpenter, KWOK, their CRDs and KWOK's stages are: `MESHGATE_KARPENTER`, else what
/// `tools/karpenter/build.sh` prints (it builds them once, cached).
pub fn binaries() -> Result<PathBuf, Error> {
    built(KARPENTER_BIN_ENV, "tools/karpenter/build.sh")
}

/// One instance type of the KWOK provider: `c-<cpu>x-amd64-linux`, `cpu` cores and 4 GiB per
/// core, on demand in one zone, priced by its size.
#[derive(Clone, Debug)]
pub struct InstanceType {
    pub cpu: u32,
}

impl InstanceType {
    pub fn name(&self) -> String {
        format!("c-{}x-amd64-linux", self.cpu)
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name(),
            "architecture": "amd64",
            "operatingSystems": ["linux"],
            "resources": {"cpu": self.cpu.to_string(), "memory": format!("{}Gi", 4 * self.cpu),
                          "ephemeral-storage": "20Gi", "pods": "110"},
            "offerings": [{"Price": 0.025 * f64::from(self.cpu), "Available": true, "Requirements": [
                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["test-zone-a"]}]}],
        })
    }
}

/// How to start Karpenter.
#[derive(Clone, Debug)]
pub struct Options {
    /// The instance types Karpenter may launch.
    pub instance_types: Vec<InstanceType>,
    /// The NodePool's `disruption.consolidateAfter`.
    pub consolidate_after: String,
    /// The NodePool's CPU limit.
    pub cpu_limit: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            instance_types: vec![InstanceType { cpu: 4 }, InstanceType { cpu: 8 }],
            consolidate_after: "5s".into(),
            cpu_limit: 1000,
        }
    }
}

/// Pod stages of this module (see the module documentation), in KWOK's `Stage` format.
pub const POD_STAGES: &str = r#"
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: meshgate-pod-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: '.metadata.labels["meshgate.dev/kwok-agent"]', operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: true, restartCount: 0, state: {running: {startedAt: {{ $now | Quote }}}}}
      {{ end }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: true, restartCount: 0, state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}}
      {{ end }}
      {{ with NodeIPsWith .spec.nodeName }}
      hostIP: {{ index . 0 | Quote }}
      {{ end }}
      {{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
      podIP: {{ index . 0 | Quote }}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: meshgate-agent-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: '.metadata.labels["meshgate.dev/kwok-agent"]', operator: Exists}
    - {key: '.metadata.annotations["meshgate.dev/kwok-failed"]', operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
  delay:
    durationMilliseconds: 0
    durationFrom:
      jq: {expression: '.metadata.annotations["meshgate.dev/kwok-ready-after"]'}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: true, restartCount: 0, state: {running: {startedAt: {{ $now | Quote }}}}}
      {{ end }}
      {{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
      podIP: {{ index . 0 | Quote }}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: meshgate-agent-failed}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: '.metadata.labels["meshgate.dev/kwok-agent"]', operator: Exists}
    - {key: '.metadata.annotations["meshgate.dev/kwok-failed"]', operator: In, values: ["true"]}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: NotIn, values: ["False"]}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "False", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "False", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: false, restartCount: 1, state: {running: {startedAt: {{ $now | Quote }}}}}
      {{ end }}
      phase: Running
"#;

/// KWOK's options. Every real node has its own kubelet, which starts its pods beside every
/// other node's; KWOK plays all the nodes' pods from one queue, four at a time by default, so a
/// burst released on thirty nodes at once would wait in KWOK's queue, not on any kubelet. One
/// worker per node of the largest burst the tests and benchmarks launch (200 pods over about
/// thirty nodes) keeps that queue out of the measured pod start. KWOK v0.8.0 does not default a
/// configuration read from a file (`pkg/config/vars.go` defaults only the one it makes when
/// none is given), so every other option is written with its default
/// (`pkg/apis/config/v1alpha1/zz_generated.defaults.go`).
pub const KWOK_CONFIGURATION: &str = r#"
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  podPlayStageParallelism: 32
  cidr: 10.0.0.0/24
  manageAllNodes: false
  enableDebuggingHandlers: true
  enableContentionProfiling: false
  enableProfilingHandler: true
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
"#;

/// KWOK's own stages this environment uses (from the built directory's `stages/`): node
/// initialization and heartbeat, pod deletion and completion. Its `pod-ready` is replaced by
/// [`POD_STAGES`].
const KWOK_STAGES: [&str; 4] = [
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-delete.yaml",
    "pod-complete.yaml",
];

/// Karpenter, KWOK and kube-controller-manager running beside a control plane.
pub struct Autoscaler {
    // Dropped in this order: Karpenter first, so nothing launches while the others stop.
    karpenter: Process,
    kwok: Process,
    controller_manager: Process,
    /// `karpenter=v1.15.0` and the like (the built directory's `version`).
    pub version: String,
    /// Karpenter's metrics on loopback (`http://127.0.0.1:PORT/metrics`).
    pub metrics_url: String,
    _dir: tempfile::TempDir,
}

/// NodeClaims (`karpenter.sh/v1`).
pub fn node_claims() -> ApiResource {
    crate::api_resource("karpenter.sh", "v1", "NodeClaim", "nodeclaims")
}

/// NodePools (`karpenter.sh/v1`).
pub fn node_pools() -> ApiResource {
    crate::api_resource("karpenter.sh", "v1", "NodePool", "nodepools")
}

async fn apply(client: &kube::Client, ar: &ApiResource, doc: &Value) -> Result<(), Error> {
    let name = doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let obj: DynamicObject =
        serde_json::from_value(doc.clone()).map_err(|e| Error::Kubeconfig(e.to_string()))?;
    Api::<DynamicObject>::all_with(client.clone(), ar)
        .patch(
            &name,
            &PatchParams::apply("meshgate-testenv").force(),
            &Patch::Apply(&obj),
        )
        .await?;
    Ok(())
}

impl Autoscaler {
    /// Starts kube-controller-manager, KWOK and Karpenter beside `cp` and waits until Karpenter
    /// is ready and its NodePool is `Ready`.
    pub async fn start(cp: &ControlPlane, options: &Options) -> Result<Self, Error> {
        let (bin, node_bin) = tokio::task::spawn_blocking(|| {
            Ok::<_, Error>((
                binaries()?,
                built(crate::node::NODE_BIN_ENV, "tools/node/build.sh")?,
            ))
        })
        .await
        .map_err(|e| Error::Kubeconfig(e.to_string()))??;
        let version = std::fs::read_to_string(bin.join("version"))
            .map_err(io("reading Karpenter's version file"))?
            .trim()
            .replace('\n', ", ");
        let dir = tempfile::Builder::new()
            .prefix("meshgate-karpenter-")
            .tempdir()
            .map_err(io("creating Karpenter's directory"))?;
        let d = dir.path();
        let client = cp.client().await?;
        let kubeconfig = cp.kubeconfig_path.display().to_string();

        let controller_manager = controller_manager(cp, &node_bin, d)?;
        apply_crds(&client, &bin.join("crds")).await?;
        apply(
            &client,
            &crate::api_resource("karpenter.kwok.sh", "v1alpha1", "KWOKNodeClass", "kwoknodeclasses"),
            &json!({"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": NODE_POOL}}),
        )
        .await?;
        apply(&client, &node_pools(), &node_pool(options)).await?;

        // KWOK: its node and pod deletion stages, this module's pod stages.
        let stages = d.join("meshgate-pod-stages.yaml");
        std::fs::write(&stages, POD_STAGES).map_err(io("writing the pod stages"))?;
        let mut configs: Vec<String> = KWOK_STAGES
            .iter()
            .map(|s| bin.join("stages").join(s).display().to_string())
            .collect();
        configs.push(stages.display().to_string());
        let kwok_options = d.join("meshgate-kwok.yaml");
        std::fs::write(&kwok_options, KWOK_CONFIGURATION).map_err(io("writing KWOK's options"))?;
        configs.push(kwok_options.display().to_string());
        let home = d.join("home");
        std::fs::create_dir_all(&home).map_err(io("creating KWOK's home"))?;
        let kwok_port = free_port()?;
        let kwok = Process::spawn_with_env(
            "kwok",
            &bin.join("kwok"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                format!("--config={}", configs.join(",")),
                format!("--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"),
                "--node-lease-duration-seconds=40".into(),
                "--node-ip=127.0.0.1".into(),
                format!("--server-address=127.0.0.1:{kwok_port}"),
            ],
            // KWOK reads ~/.kwok/kwok.yaml when present: an empty home of its own.
            &[("HOME", home.as_os_str())],
            &d.join("kwok.log"),
        )?;
        crate::wait_http(
            &kwok,
            &format!("http://127.0.0.1:{kwok_port}/healthz"),
            Duration::from_secs(60),
        )
        .await?;

        let types = d.join("instance-types.json");
        let list: Vec<Value> = options
            .instance_types
            .iter()
            .map(InstanceType::json)
            .collect();
        std::fs::write(&types, Value::Array(list).to_string())
            .map_err(io("writing the instance types"))?;
        let (metrics, health) = (free_port()?, free_port()?);
        let (metrics_s, health_s) = (metrics.to_string(), health.to_string());
        let karpenter = Process::spawn_with_env(
            "karpenter",
            &bin.join("karpenter"),
            &[],
            &[
                ("KUBECONFIG", cp.kubeconfig_path.as_os_str()),
                ("DISABLE_LEADER_ELECTION", "true".as_ref()),
                ("METRICS_PORT", metrics_s.as_ref()),
                ("HEALTH_PROBE_PORT", health_s.as_ref()),
                ("BATCH_IDLE_DURATION", "100ms".as_ref()),
                ("BATCH_MAX_DURATION", "2s".as_ref()),
                ("INSTANCE_TYPES_FILE_PATH", types.as_os_str()),
                ("HOME", home.as_os_str()),
            ],
            &d.join("karpenter.log"),
        )?;
        crate::wait_http(
            &karpenter,
            &format!("http://127.0.0.1:{health}/readyz"),
            Duration::from_secs(90),
        )
        .await?;
        let pools = Api::<DynamicObject>::all_with(client.clone(), &node_pools());
        crate::wait_for(
            "Karpenter's NodePool to be Ready",
            Duration::from_secs(60),
            || {
                let pools = pools.clone();
                async move {
                    pools.get(NODE_POOL).await.ok().is_some_and(|p| {
                        p.data["status"]["conditions"].as_array().is_some_and(|cs| {
                            cs.iter()
                                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                        })
                    })
                }
            },
        )
        .await;
        Ok(Self {
            karpenter,
            kwok,
            controller_manager,
            version,
            metrics_url: format!("http://127.0.0.1:{metrics}/metrics"),
            _dir: dir,
        })
    }

    /// The last `n` lines of Karpenter's log (JSON lines).
    pub fn karpenter_log(&self, n: usize) -> String {
        self.karpenter.log_tail(n)
    }

    /// Karpenter's whole log.
    pub fn karpenter_log_path(&self) -> PathBuf {
        self._dir.path().join("karpenter.log")
    }

    /// Every process this environment started.
    pub fn pids(&self) -> Vec<u32> {
        [&self.karpenter, &self.kwok, &self.controller_manager]
            .iter()
            .map(|p| p.pid())
            .collect()
    }

    /// An error naming the first of the three that exited.
    pub fn check_alive(&self) -> Result<(), Error> {
        self.karpenter.check_alive()?;
        self.kwok.check_alive()?;
        self.controller_manager.check_alive()
    }
}

fn node_pool(options: &Options) -> Value {
    json!({
        "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": NODE_POOL},
        "spec": {
            "template": {"spec": {
                "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": NODE_POOL},
                "requirements": [
                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
                    {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]},
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                ],
                "expireAfter": "Never",
            }},
            "limits": {"cpu": options.cpu_limit.to_string()},
            "disruption": {"consolidationPolicy": "WhenEmptyOrUnderutilized",
                           "consolidateAfter": options.consolidate_after, "budgets": [{"nodes": "100%"}]},
        },
    })
}

/// Applies every CRD of `dir` and waits until each is Established.
async fn apply_crds(client: &kube::Client, dir: &Path) -> Result<(), Error> {
    let crds = crate::api_resource(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    let mut names = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(format!("reading {}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    for file in files {
        let text =
            std::fs::read_to_string(&file).map_err(io(format!("reading {}", file.display())))?;
        let doc: Value = serde_saphyr::from_str(&text)
            .map_err(|e| Error::Kubeconfig(format!("{}: {e}", file.display())))?;
        names.push(
            doc["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        apply(client, &crds, &doc).await?;
    }
    let api = Api::<DynamicObject>::all_with(client.clone(), &crds);
    for name in names {
        crate::wait_for(
            &format!("CRD {name} established"),
            Duration::from_secs(60),
            || {
                let api = api.clone();
                let name = name.clone();
                async move {
                    api.get(&name).await.ok().is_some_and(|c| {
                        c.data["status"]["conditions"].as_array().is_some_and(|cs| {
                            cs.iter()
                                .any(|c| c["type"] == "Established" && c["status"] == "True")
                        })
                    })
                }
            },
        )
        .await;
    }
    Ok(())
}

/// kube-controller-manager against the control plane, its controllers all on (node lifecycle,
/// Deployments, ReplicaSets, DaemonSets, garbage collection).
fn controller_manager(cp: &ControlPlane, node_bin: &Path, d: &Path) -> Result<Process, Error> {
    let kubeconfig = cp.kubeconfig_path.display().to_string();
    let port = free_port()?;
    Process::spawn(
        "kube-controller-manager",
        &node_bin.join("kube-controller-manager"),
        &[
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", d.join("kcm-certs").display()),
            "--leader-elect=false".into(),
            format!(
                "--service-account-private-key-file={}",
                cp.service_account_key_file().display()
            ),
            format!("--root-ca-file={}", cp.ca_file().display()),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--v=1".into(),
        ],
        &d.join("kube-controller-manager.log"),
    )
}
