//! The demo's real node: a kubelet with containerd and a CNI bridge on this machine
//! (`meshgate_testenv::node`), registering a Node that meshgate taints at CREATE; the mesh's
//! agents on it; the controller lifting the taint once they are Ready; and a gated pod that
//! really runs. The mesh is the real Istio in ambient mode when `tools/test.sh` has built it
//! ([`cached_istio`]), else meshgate's mesh stand-ins. The node is torn down before returning
//! and the host compared with its state before.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use meshgate_testenv::istio::{ISTIO_ENV, InstallOptions, Istio};
use meshgate_testenv::node::{NodeOptions, RealNode};
use serde_json::json;

use super::{Story, poll, taint_keys};

/// The environment variable `tools/demo.sh` sets to Helm's path when it is built and cached.
const HELM_ENV: &str = "MESHGATE_HELM";
/// The pod of the real node part.
const POD: &str = "web-real";
/// The ambient namespace the pod runs in (created by the demo).
const POD_NS: &str = "shop";

/// The real Istio and Helm, when `tools/demo.sh` found both built and cached
/// (`MESHGATE_ISTIO`, `MESHGATE_HELM`); the demo never builds them.
pub struct CachedIstio {
    pub istio: Istio,
    helm: PathBuf,
}

/// The real Istio if `MESHGATE_ISTIO` and `MESHGATE_HELM` name a complete build.
pub fn cached_istio() -> Option<CachedIstio> {
    std::env::var_os(ISTIO_ENV)?;
    let helm = PathBuf::from(std::env::var_os(HELM_ENV)?);
    let istio = Istio::find().ok()?;
    helm.is_file().then_some(CachedIstio { istio, helm })
}

/// What the real node part observed.
pub struct RealNodeReport {
    pub node: String,
    /// Which mesh ran there.
    pub mesh: String,
    pub taints_at_registration: Vec<String>,
    /// From the agents' start (the stand-ins' DaemonSets, or Istio's install) to the taint lifted.
    pub lifted_ms: u128,
    pub gate_line: String,
    /// Istio's node agent's annotation on the pod (`ambient.istio.io/redirection`).
    pub redirection: Option<String>,
}

/// The real node, with the real Istio or the stand-ins.
pub async fn story(
    story: &Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    istio: Option<&CachedIstio>,
    key: &str,
) -> anyhow::Result<RealNodeReport> {
    let (started, mesh) = match istio {
        Some(istio) => (
            start_with_istio(story, cp, client, istio, key).await?,
            format!("the real Istio {}", istio.istio.version),
        ),
        None => (
            start_with_stand_ins(story, cp, client, key).await?,
            "meshgate's mesh stand-ins".to_owned(),
        ),
    };
    let Started {
        node,
        taints_at_registration,
        lifted_ms,
    } = started;
    let name = node.name().to_owned();
    story.detail(&format!(
        "the mesh's agents on {name} are Ready; meshgate lifted the startup taint {lifted_ms} ms after the node registered"
    ));

    let pods: Api<Pod> = Api::namespaced(client.clone(), POD_NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": POD},
        "spec": {"nodeName": name, "automountServiceAccountToken": false, "enableServiceLinks": false,
                 "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "web", "image": meshgate_testenv::image::APP_IMAGE, "imagePullPolicy": "Never"}]},
    }))?;
    let created = pods.create(&PostParams::default(), &pod).await?;
    let uid = created.metadata.uid.clone().unwrap_or_default();
    let running = poll(
        &format!("{POD_NS}/{POD} to run"),
        Duration::from_secs(120),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get(POD).await.ok()?;
                (p.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(p)
            }
        },
    )
    .await?;
    let redirection = running
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("ambient.istio.io/redirection"))
        .cloned();
    let log = node.container_log(POD_NS, POD, &uid, "meshgate-wait", 0);
    let text = std::fs::read_to_string(&log)?;
    let gate_line = text
        .lines()
        .find_map(|l| {
            l.split_once(" meshgate-wait: ")
                .map(|(_, m)| format!("meshgate-wait: {m}"))
        })
        .unwrap_or_else(|| "<no line>".into());
    match &redirection {
        Some(r) => story.detail(&format!(
            "{POD_NS}/{POD} ran on {name}; Istio's node agent enrolled it (ambient.istio.io/redirection: {r}); its gate logged: {gate_line}"
        )),
        None => story.detail(&format!(
            "{POD_NS}/{POD} ran on {name}; its gate logged: {gate_line}"
        )),
    }
    let before = node.snapshot_before().clone();
    node.stop().await?;
    let changed = before.differences(&meshgate_testenv::host::HostSnapshot::take()?);
    if changed.is_empty() {
        story.detail("the real node stopped; the host is as it was (processes, mounts, links, netns, sysctls, iptables, ipsets: compared)");
    } else {
        story.detail(&format!(
            "the real node stopped; the host differs from before: {changed:?}"
        ));
    }
    Ok(RealNodeReport {
        node: name,
        mesh,
        taints_at_registration,
        lifted_ms,
        gate_line,
        redirection,
    })
}

/// The real node with the mesh's agents Ready on it and meshgate's taint lifted.
struct Started {
    node: RealNode,
    taints_at_registration: Vec<String>,
    /// From the node's registration to the taint lifted.
    lifted_ms: u128,
}

/// Waits until the gate's taint `key` is off the node; the time since `start`.
async fn wait_released(
    nodes: &Api<Node>,
    name: &str,
    key: &str,
    start: Instant,
    limit: Duration,
) -> anyhow::Result<u128> {
    poll("the real node's taint to be lifted", limit, || {
        let (nodes, name) = (nodes.clone(), name.to_owned());
        async move {
            let n = nodes.get(&name).await.ok()?;
            (!taint_keys(&n).iter().any(|t| t.starts_with(key))).then_some(())
        }
    })
    .await?;
    Ok(start.elapsed().as_millis())
}

/// The real Istio in ambient mode: the simulated node leaves (Istio's DaemonSets would place
/// pods on a node no kubelet runs), the NodeGate waits for Istio's agents as `meshgate install
/// --profile istio-ambient` sets it, the real node starts with Istio's images, and Istio is
/// installed from its charts (istiod tolerating meshgate's startup taint: the node proxy needs
/// istiod, docs/design.md).
async fn start_with_istio(
    story: &Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    istio: &CachedIstio,
    key: &str,
) -> anyhow::Result<Started> {
    let nodes: Api<Node> = Api::all(client.clone());
    if nodes.get_opt("node-1").await?.is_some() {
        nodes.delete("node-1", &DeleteParams::default()).await?;
        let all: Api<Pod> = Api::all(client.clone());
        for p in all
            .list(&ListParams::default().fields("spec.nodeName=node-1"))
            .await?
        {
            let (Some(ns), Some(name)) = (p.metadata.namespace, p.metadata.name) else {
                continue;
            };
            Api::<Pod>::namespaced(client.clone(), &ns)
                .delete(&name, &DeleteParams::default().grace_period(0))
                .await?;
        }
        story.detail("the simulated node-1 left, and its pods with it (Istio's DaemonSets would place pods on a node no kubelet runs)");
    }
    let gate =
        crate::install::default_gate("istio-ambient", crate::install::Strategy::default(), key)?;
    Api::<meshgate_api::NodeGate>::all(client.clone())
        .patch(
            "mesh-agents",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"agents": gate.spec.agents}})),
        )
        .await?;
    story.detail("the NodeGate mesh-agents now waits for Istio's CNI agent and node proxy in istio-system, as `meshgate install --profile istio-ambient` sets it");

    let node = RealNode::start(
        cp,
        NodeOptions {
            // Istio's agents reach the API server through the `kubernetes` Service.
            proxy: true,
            // The real ambient node agent reads the host's network namespace through
            // /host/proc/1 at start, which some hosts' init denies: the node gets its own.
            own_namespaces: true,
            ..NodeOptions::default()
        },
    )
    .await?;
    let registered_at = Instant::now();
    let name = node.name().to_owned();
    let taints_at_registration = taint_keys(&nodes.get(&name).await?);
    story.detail(&format!(
        "{name} registered (kubelet Ready {:.2?} after its start) with taints {taints_at_registration:?}",
        node.timings.ready_after_kubelet_start,
    ));
    let images = istio.istio.write_images(
        &node.run_dir().join("istio-images"),
        &node.images()?.binaries,
    )?;
    for image in &images {
        node.ctr(&["images", "import", &image.path.to_string_lossy()])?;
    }
    let values = node.run_dir().join("istio-values");
    let (istio_build, helm, kubeconfig) = (
        istio.istio.clone(),
        istio.helm.clone(),
        cp.kubeconfig_path.clone(),
    );
    let options = InstallOptions {
        ambient: true,
        istiod_tolerates: vec![key.to_owned()],
    };
    let node = tokio::task::spawn_blocking(move || {
        istio_build
            .install(&helm, &kubeconfig, &node, &values, &options)
            .map(|_| node)
    })
    .await??;
    story.detail(&format!(
        "Istio {} installed from its own charts with Helm: istiod (tolerating meshgate's startup taint), the istio-cni node agent and plugin in ambient mode, the node proxy (a stand-in the real agent feeds over ZDS)",
        istio.istio.version
    ));
    let lifted_ms =
        wait_released(&nodes, &name, key, registered_at, Duration::from_secs(240)).await?;
    Ok(Started {
        node,
        taints_at_registration,
        lifted_ms,
    })
}

/// meshgate's mesh stand-ins, as DaemonSets from images the test environment writes: the node
/// proxy (Ready after 2 s; it then listens inside each pod, as an ambient node proxy does) and
/// the CNI agent (Ready after 1 s, once it has chained its plugin, which redirects each new
/// pod's outbound TCP to the node proxy's in-pod port 15001).
async fn start_with_stand_ins(
    story: &Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    key: &str,
) -> anyhow::Result<Started> {
    let daemonset = |app: &str,
                     command: Vec<String>,
                     privileged: bool,
                     volumes: serde_json::Value,
                     mounts: serde_json::Value|
     -> anyhow::Result<DaemonSet> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": app},
            "spec": {
                // Its own label too: a DaemonSet adopts every pod its selector matches, and the
                // simulated agents above carry `app` alone.
                "selector": {"matchLabels": {"app": app, "meshgate.dev/stand-in": "real-node"}},
                "template": {
                    "metadata": {"labels": {"app": app, "meshgate.dev/stand-in": "real-node"}},
                    "spec": {
                        "hostPID": privileged,
                        "automountServiceAccountToken": false,
                        "enableServiceLinks": false,
                        "terminationGracePeriodSeconds": 1,
                        "nodeSelector": {"kubernetes.io/hostname": NodeOptions::default().name},
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [{
                            "name": "agent", "image": meshgate_testenv::image::AGENTS_IMAGE, "imagePullPolicy": "Never",
                            "command": command,
                            "securityContext": {"privileged": privileged},
                            "readinessProbe": {"exec": {"command": [command[0].clone(), "--check-ready", "/tmp/ready"]}, "periodSeconds": 1},
                            "volumeMounts": mounts,
                        }],
                        "volumes": volumes,
                    },
                },
            },
        }))?)
    };
    let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "mesh-system");
    daemonsets
        .create(
            &PostParams::default(),
            &daemonset(
                "mesh-node-proxy",
                args(&[
                    "/mesh-node-proxy",
                    "--ready-delay",
                    "2",
                    "--ready-file",
                    "/tmp/ready",
                ]),
                true,
                json!([]),
                json!([]),
            )?,
        )
        .await?;
    let node = RealNode::start(cp, NodeOptions::default()).await?;
    let registered_at = Instant::now();
    let name = node.name().to_owned();
    let nodes: Api<Node> = Api::all(client.clone());
    let entry = json!({"excludeNamespaces": ["kube-system", "mesh-system"]}).to_string();
    daemonsets
        .create(
            &PostParams::default(),
            &daemonset(
                "mesh-cni",
                vec![
                    "/mesh-cni-agent".into(), "--cni-conf-dir".into(), "/host/net.d".into(),
                    "--cni-bin-dir".into(), "/host/bin".into(), "--plugin".into(), "/mesh-cni".into(),
                    "--ready-delay".into(), "1".into(), "--ready-file".into(), "/tmp/ready".into(),
                    "--entry".into(), entry,
                ],
                false,
                json!([{"name": "net-d", "hostPath": {"path": node.cni_conf_dir(), "type": "Directory"}},
                       {"name": "bin", "hostPath": {"path": node.cni_bin_dir(), "type": "Directory"}}]),
                json!([{"name": "net-d", "mountPath": "/host/net.d"}, {"name": "bin", "mountPath": "/host/bin"}]),
            )?,
        )
        .await?;
    let taints_at_registration = taint_keys(&nodes.get(&name).await?);
    story.detail(&format!(
        "{name} registered (kubelet Ready {:.2?} after its start) with taints {taints_at_registration:?}; the mesh's agents: meshgate's stand-ins (tools/test.sh builds the real Istio, which the demo then uses)",
        node.timings.ready_after_kubelet_start,
    ));
    let lifted_ms =
        wait_released(&nodes, &name, key, registered_at, Duration::from_secs(60)).await?;
    Ok(Started {
        node,
        taints_at_registration,
        lifted_ms,
    })
}
