//! Istio on the real node for the tests and benches that need it (`real_istio`,
//! `istio_startup`): the common setup (meshgate installed in the cluster as users install it,
//! the real node, Istio's images), and waits on what Istio's components report.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use meshgate_testenv::image::{APP_IMAGE, MESHGATE_IMAGE};
use meshgate_testenv::istio::ISTIO_NAMESPACE as ISTIO_NS;
use meshgate_testenv::istio::{InstallOptions, Istio, Values, run_helm, tolerations};
use meshgate_testenv::node::{NodeOptions, RealNode};
use serde_json::{Value, json};

use super::cluster::*;

/// The longest wait for an Istio component or a pod.
pub const POD_LIMIT: Duration = Duration::from_secs(120);

/// Waits until istiod is Ready and has put its CA into the injector's registration and the
/// mesh namespace (the injected pods mount `istio-ca-root-cert`); panics with what was seen.
pub async fn wait_istiod(client: &kube::Client, node: &RealNode, mesh_ns: &str) {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::ConfigMap;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ISTIO_NS);
    let webhooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), mesh_ns);
    let mut last = String::new();
    let done = tokio::time::timeout(POD_LIMIT, async {
        loop {
            let ready = deployments
                .get("istiod")
                .await
                .ok()
                .and_then(|d| d.status?.ready_replicas)
                .unwrap_or(0);
            let patched = webhooks
                .get("istio-sidecar-injector")
                .await
                .ok()
                .and_then(|w| w.webhooks)
                .is_some_and(|hs| {
                    !hs.is_empty()
                        && hs
                            .iter()
                            .all(|h| h.client_config.ca_bundle.as_ref().is_some_and(|b| !b.0.is_empty()))
                });
            let root = maps.get_opt("istio-ca-root-cert").await.ok().flatten().is_some();
            last = format!("istiod ready replicas {ready}, injector caBundle {patched}, root cert in {mesh_ns} {root}");
            if ready >= 1 && patched && root {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if done.is_err() {
        let logs = pod_logs(client, node, ISTIO_NS, "app=istiod").await;
        panic!(
            "istiod not serving in {POD_LIMIT:?}: {last}\npods: {}\nistiod log:\n{}",
            pod_statuses(client, ISTIO_NS).await,
            last_lines(&logs, 40)
        );
    }
}

/// Waits until the node agent's pod on the node is Ready (it has chained the plugin and
/// written its kubeconfig); panics with its log.
pub async fn wait_node_agent(client: &kube::Client, node: &RealNode) {
    wait_agent_ready(client, node, "k8s-app=istio-cni-node").await;
}

/// Waits until the pod of an Istio DaemonSet (by its label) on the node is Ready; panics with
/// its log.
pub async fn wait_agent_ready(client: &kube::Client, node: &RealNode, label: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ISTIO_NS);
    let done = tokio::time::timeout(POD_LIMIT, async {
        loop {
            let list = pods
                .list(&kube::api::ListParams::default().labels(label))
                .await
                .expect("pods");
            if list
                .items
                .iter()
                .any(|p| ready(p) && p.metadata.deletion_timestamp.is_none())
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if done.is_err() {
        let logs = pod_logs(client, node, ISTIO_NS, label).await;
        panic!(
            "{label} not Ready in {POD_LIMIT:?}\nlog:\n{}\nkubelet:\n{}",
            last_lines(&logs, 40),
            node.log_tail("kubelet", 20)
        );
    }
}

pub fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A mesh namespace pod of the test app (no probes: Istio would rewrite them to the agent's
/// port, which the stand-in does not serve), with `extra` merged into its metadata and spec.
pub fn mesh_pod(name: &str, extra: Value) -> Pod {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "enableServiceLinks": false,
            "containers": [{"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never"}],
        },
    });
    merge(&mut pod, extra);
    serde_json::from_value(pod).expect("pod")
}

pub fn merge(into: &mut Value, from: Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

/// What both tests start from: Istio's and Helm's builds, a control plane with meshgate
/// installed in the cluster as users install it (`install --profile PROFILE`, the default
/// strategy), the real node (registering tainted at CREATE by meshgate's admission policy), and
/// Istio's images imported into it. The node agent's and node proxy's host directories
/// (hostPaths of Istio's charts) go with the node's teardown, unless they were there before
/// (`meshgate_testenv::host::FIXED_PATHS`).
pub struct Setup {
    /// One test of this binary at a time: a node's teardown restores the host (and sweeps
    /// control-plane links) for the next one, and checks that nothing of it is left.
    _serial: tokio::sync::MutexGuard<'static, ()>,
    pub istio: Istio,
    pub helm_bin: PathBuf,
    pub cp: meshgate_testenv::ControlPlane,
    pub client: kube::Client,
    pub node: RealNode,
    values_dir: tempfile::TempDir,
    /// The values Istio was installed with.
    values: std::sync::Mutex<Option<Values>>,
}

impl Setup {
    pub async fn start(profile: &str, options: NodeOptions) -> Self {
        static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _serial = SERIAL.lock().await;
        let istio = tokio::task::spawn_blocking(Istio::find)
            .await
            .expect("task")
            .expect("Istio's build (tools/istio/build.sh)");
        let helm_bin = meshgate_testenv::helm().expect("helm (tools/helm/build.sh)");
        eprintln!("Istio {} from {}", istio.version, istio.dir.display());
        let cp = serving_control_plane().await;
        let client = cp.client().await.expect("client");
        meshgate_cli(
            &cp,
            &[
                "install",
                "--profile",
                profile,
                "--image",
                MESHGATE_IMAGE,
                "--apply",
            ],
        );
        wait_node_taint_policy(&Api::all(client.clone())).await;
        let node = RealNode::start(&cp, options)
            .await
            .expect("the real node starts");
        let images = istio
            .write_images(
                &node.run_dir().join("istio-images"),
                &node.images().expect("images").binaries,
            )
            .expect("Istio's images");
        for image in &images {
            node.ctr(&["images", "import", &image.path.to_string_lossy()])
                .expect("image import");
        }
        Self {
            _serial,
            istio,
            helm_bin,
            cp,
            client,
            node,
            values_dir: tempfile::tempdir().expect("values dir"),
            values: std::sync::Mutex::new(None),
        }
    }

    /// Creates a namespace with `labels`.
    pub async fn namespace(&self, name: &str, labels: Value) {
        use k8s_openapi::api::core::v1::Namespace;
        Api::<Namespace>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))
                    .expect("namespace"),
            )
            .await
            .unwrap_or_else(|e| panic!("namespace {name}: {e}"));
    }

    /// Istio as `meshgate_testenv::istio` installs it.
    pub fn install_istio(&self, options: &InstallOptions) {
        let values = self
            .istio
            .install(
                &self.helm_bin,
                &self.cp.kubeconfig_path,
                &self.node,
                self.values_dir.path(),
                options,
            )
            .unwrap_or_else(|e| panic!("installing Istio: {e}"));
        *self.values.lock().expect("values") = Some(values);
    }

    fn installed(&self) -> Values {
        self.values
            .lock()
            .expect("values")
            .clone()
            .expect("Istio was installed")
    }

    pub fn helm(&self, args: &[&str]) -> String {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        run_helm(&self.helm_bin, &self.cp.kubeconfig_path, &args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Upgrades istiod with its values plus a toleration of meshgate's startup taint, as Istio's
    /// chart takes one (`pilot.tolerations`; istiod tolerates Istio's own readiness taint
    /// already).
    pub fn istiod_tolerates_the_gate(&self) {
        let values = self.values_dir.path().join("istiod-tolerations.json");
        let toleration = json!({"pilot": {"tolerations": tolerations(&[
            meshgate_api::names::STARTUP_TAINT_KEY.to_owned()
        ])}});
        std::fs::write(&values, toleration.to_string()).expect("values file");
        self.helm(&[
            "upgrade",
            "istiod",
            &self
                .istio
                .chart("istio-control/istio-discovery")
                .to_string_lossy(),
            "--namespace",
            ISTIO_NS,
            "--values",
            &self.installed().istiod.to_string_lossy(),
            "--values",
            &values.to_string_lossy(),
        ]);
    }

    /// Installs istio-cni again with the values it was first installed with.
    pub fn reinstall_node_agent(&self) {
        self.helm(&[
            "install",
            "istio-cni",
            &self.istio.chart("istio-cni").to_string_lossy(),
            "--namespace",
            ISTIO_NS,
            "--values",
            &self.installed().cni.to_string_lossy(),
        ]);
    }

    pub async fn tear_down(self) {
        tear_down(self.cp, self.node).await;
    }
}
