//! `meshgate demo`: the startup race and its fix, on a real local control plane.
//!
//! Starts etcd, kube-apiserver and kube-scheduler on loopback (built from source and cached by
//! `tools/controlplane/build.sh`), runs meshgate's webhook (over TLS, called by the API server)
//! and controller in-process, configured as `meshgate install --profile istio-ambient` renders
//! by default, and plays a new node's arrival: where the real Karpenter is built and cached
//! (`MESHGATE_KARPENTER`, `autoscaled`) it launches the node, on KWOK, for a pending mesh pod;
//! else the demo creates the Node and the agent pods and reports their readiness as a kubelet
//! would. Then, where this host can run one
//! (`meshgate_testenv::node`), a real node joins: a kubelet with containerd and a CNI bridge, the
//! mesh's agents, and a gated pod that really runs; the host is compared with its state before
//! afterwards. The mesh there is the real Istio in ambient mode when it is built and cached
//! (`MESHGATE_ISTIO`, `MESHGATE_HELM`: `tools/demo.sh` sets them when `tools/test.sh` has built
//! them), else meshgate's mesh-like stand-ins (`real_node`).
//!
//! Every build happens before the story: the real node's images need meshgate's static binaries
//! (`meshgate_testenv::image::static_binaries`, once per source state), built first with one
//! progress line and Cargo's output in a log file (`MESHGATE_BUILD_LOG`, else
//! `<cache>/demo-build.log`), named at the end.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_api::{MutationPolicy, NodeGate, Profile};
use meshgate_core::registration::{Registration, WebhookTarget, webhook_configuration};
use serde_json::json;

use crate::run::{ControllerSettings, WebhookSettings};

mod autoscaled;
mod real_node;

/// Demo options.
#[derive(Clone, Debug, Default)]
pub struct DemoOptions {
    /// Leave the control plane and meshgate running until Ctrl-C.
    pub keep: bool,
}

struct Story {
    start: Instant,
    step: u32,
}

impl Story {
    fn say(&mut self, text: &str) {
        self.step += 1;
        println!(
            "[{:>6.1}s] {}. {text}",
            self.start.elapsed().as_secs_f64(),
            self.step
        );
    }
    fn detail(&self, text: &str) {
        println!("           {text}");
    }
}

async fn poll<F, Fut, T>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn taint_keys(n: &Node) -> Vec<String> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| {
            ts.iter()
                .map(|t| format!("{}:{}", t.key, t.effect))
                .collect()
        })
        .unwrap_or_default()
}

/// The kubeflow policy shipped in `deploy/policies/kubeflow.yaml` (embedded).
const KUBEFLOW_POLICY: &str = include_str!("../../../deploy/policies/kubeflow.yaml");

/// Where the builds' output goes: `MESHGATE_BUILD_LOG` (set by `tools/demo.sh`, which writes
/// its own builds' output there too), else `<cache>/demo-build.log`.
fn build_log() -> std::path::PathBuf {
    std::env::var_os("MESHGATE_BUILD_LOG").map_or_else(
        || meshgate_testenv::image::cache_dir().join("demo-build.log"),
        std::path::PathBuf::from,
    )
}

/// `MESHGATE_SKIP_REAL_NODE=1`: the tests' switch to leave the real node out.
fn real_node_skipped() -> bool {
    std::env::var_os("MESHGATE_SKIP_REAL_NODE").is_some_and(|v| v == "1")
}

/// Whether this host runs the real node part: `MESHGATE_SKIP_REAL_NODE=1` says not to (the
/// tests' switch), else `meshgate_testenv::node::prerequisites` decides.
fn real_node_prerequisites() -> Result<(), String> {
    if real_node_skipped() {
        return Err("skipped (MESHGATE_SKIP_REAL_NODE=1)".into());
    }
    meshgate_testenv::node::prerequisites()
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Builds what the real node needs before the story starts: one progress line (prefixed with
/// `MESHGATE_BUILD_STEP`, e.g. `5/5`, when `tools/demo.sh` numbers its builds; `current` when
/// the binaries were built from this source state), Cargo's output to the log. Returns whether
/// it built.
async fn build_static_binaries(log: &std::path::Path) -> anyhow::Result<bool> {
    use std::io::Write as _;
    let step = std::env::var("MESHGATE_BUILD_STEP")
        .map(|s| format!("[{s}] "))
        .unwrap_or_default();
    print!(
        "build {step}meshgate's static binaries for the real node's images (cargo, release, static; cold: about 7-8 min on 2 cores) ... "
    );
    let _ = std::io::stdout().flush();
    if tokio::task::spawn_blocking(meshgate_testenv::image::current_static_binaries)
        .await?
        .is_some()
    {
        if std::env::var_os(meshgate_testenv::image::STATIC_BIN_ENV).is_some() {
            println!("given ({})", meshgate_testenv::image::STATIC_BIN_ENV);
        } else {
            println!("current (built from this source state)");
        }
        return Ok(false);
    }
    let start = Instant::now();
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if std::env::var_os("MESHGATE_BUILD_LOG").is_none() {
        // The demo's own log: this run's build only.
        std::fs::write(log, "")?;
    }
    let owned = log.to_owned();
    tokio::task::spawn_blocking(move || {
        meshgate_testenv::image::static_binaries_logged(Some(&owned))
    })
    .await??;
    println!("done in {} s", start.elapsed().as_secs());
    Ok(true)
}

/// The namespace `install` would put meshgate in (excluded from its gates).
const DEMO_NAMESPACE: &str = "meshgate-system";

/// The demo's new node: what placed it, and when meshgate lifted its taint.
struct NodeStory {
    node: String,
    /// Who launched the node, when an autoscaler did.
    launched: Option<String>,
    /// From the agents Ready to the taint gone.
    untaint_ms: u128,
    /// The real Karpenter, running until the workload has left.
    autoscaler: Option<meshgate_testenv::karpenter::Autoscaler>,
}

/// Creates the ambient pod `shop/web` (`resources` as given) and waits until the scheduler
/// holds it back; tells its init containers and why it is Pending.
async fn create_mesh_pod(
    story: &Story,
    client: &kube::Client,
    resources: serde_json::Value,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"containers": [{"name": "web", "image": "registry.invalid/web:1", "resources": resources}]},
    }))?;
    let stored = pods.create(&PostParams::default(), &pod).await?;
    let inits: Vec<String> = stored
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map(|cs| cs.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    story.detail(&if inits.is_empty() {
        "stored as written: no init container (the node's startup taint is what holds it)"
            .to_owned()
    } else {
        format!("stored with init containers {inits:?}")
    });
    let why = poll(
        "the scheduler to hold the pod back",
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get("web").await.ok()?;
                p.status?.conditions?.into_iter().find_map(|c| {
                    (c.type_ == "PodScheduled" && c.status == "False")
                        .then(|| c.message.unwrap_or_default())
                })
            }
        },
    )
    .await?;
    story.detail(&format!("Pending: {why}"));
    Ok(())
}

/// Waits until the scheduler binds `shop/web`; tells where; the node's name.
async fn wait_bound(story: &Story, client: &kube::Client) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    let bound = poll(
        "the scheduler to bind the pod",
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            async move { pods.get("web").await.ok()?.spec?.node_name }
        },
    )
    .await?;
    story.detail(&format!(
        "shop/web bound to {bound} once the taint was gone, with nothing added to it: it starts as it would without meshgate"
    ));
    Ok(bound)
}

/// The demo's new node without an autoscaler: the demo registers the Node and the agent pods
/// and reports their readiness as a kubelet would.
async fn simulated_node(
    story: &mut Story,
    client: &kube::Client,
    key: &str,
) -> anyhow::Result<NodeStory> {
    story.say("A new node registers (think: the autoscaler added it)");
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(
        json!({"metadata": {"name": "node-1", "labels": {"kubernetes.io/os": "linux"}}}),
    )?;
    let created = nodes.create(&PostParams::default(), &node).await?;
    meshgate_testenv::make_node_ready(client, "node-1").await?;
    story.detail(&format!(
        "node-1 registered with taints {:?}",
        taint_keys(&created)
    ));
    story.detail("the kubelet reports Ready; the mesh agents on node-1 are still starting");

    story.say("A mesh pod is created in namespace shop (ambient mode)");
    create_mesh_pod(story, client, json!({})).await?;

    story.say("The CNI agent and the node proxy on node-1 become Ready");
    let agents: Api<Pod> = Api::namespaced(client.clone(), "mesh-system");
    for (name, app) in [
        ("mesh-cni-node-1", "mesh-cni"),
        ("mesh-node-proxy-node-1", "mesh-node-proxy"),
    ] {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"nodeName": "node-1", "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}]},
        }))?;
        agents.create(&PostParams::default(), &p).await?;
    }
    let ready_at = Instant::now();
    for name in ["mesh-cni-node-1", "mesh-node-proxy-node-1"] {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = json!({"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": now}]}});
        agents
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    poll("the taint to be removed", Duration::from_secs(30), || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get("node-1").await.ok()?;
            (!taint_keys(&n).iter().any(|t| t.starts_with(key))).then_some(())
        }
    })
    .await?;
    let untaint_ms = ready_at.elapsed().as_millis();
    story.detail(&format!(
        "meshgate removed the startup taint {untaint_ms} ms after the agents were Ready"
    ));
    let node = wait_bound(story, client).await?;
    Ok(NodeStory {
        node,
        launched: None,
        untaint_ms,
        autoscaler: None,
    })
}

/// Runs the demo.
/// Builds what `tools/demo.sh` builds when the demo runs without it (the control plane and, as
/// root, the node binaries), before the story: a progress line each (a cached one is done at
/// once), the scripts' output to the log. What the environment names already (`tools/demo.sh`
/// sets it) is not looked at again.
async fn prebuild(log: &std::path::Path, real_node: bool) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut steps: Vec<(&str, &str, &str, &str)> = vec![(
        "the control plane: etcd, kube-apiserver, kube-scheduler (Go)",
        "about 6 min",
        "MESHGATE_CONTROLPLANE_BIN",
        "tools/controlplane/build.sh",
    )];
    if real_node {
        steps.push((
            "the real node's kubelet, kube-controller-manager, kube-proxy (Go)",
            "about 2-5 min",
            "MESHGATE_NODE_BIN",
            "tools/node/build.sh",
        ));
    }
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir)?;
    }
    for (what, cold, env, script) in steps {
        if std::env::var_os(env).is_some() {
            continue;
        }
        print!("build {what} (cold: {cold} on 2 cores; cached after) ... ");
        let _ = std::io::stdout().flush();
        let start = Instant::now();
        let (env, script, owned) = (env.to_owned(), script.to_owned(), log.to_owned());
        tokio::task::spawn_blocking(move || {
            meshgate_testenv::built_logged(&env, &script, Some(&owned))
        })
        .await??;
        println!("done in {} s", start.elapsed().as_secs());
    }
    Ok(())
}

pub async fn run(options: DemoOptions) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let log = build_log();
    prebuild(
        &log,
        !real_node_skipped() && meshgate_testenv::node::effective_uid() == Some(0),
    )
    .await?;
    // A real node (kubelet, containerd, CNI) joins later where this host can run one; its gate
    // image is written and imported by the test environment, never pulled.
    let real_node = tokio::task::spawn_blocking(real_node_prerequisites).await?;
    let built = match &real_node {
        Ok(()) => build_static_binaries(&log).await?,
        Err(_) => false,
    };
    // The real Istio on the real node when it is built and cached (never built here).
    let istio = match &real_node {
        Ok(()) => tokio::task::spawn_blocking(real_node::cached_istio).await?,
        Err(_) => None,
    };
    let mut story = Story {
        start: Instant::now(),
        step: 0,
    };
    story.say("Starting a local control plane: etcd, kube-apiserver, kube-scheduler (built from source, cached)");
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        scheduler: true,
        // Istio's components are clients of the API server, from the real node's pods.
        serve_pods: istio.is_some(),
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    story.detail(&format!("API server {} (Kubernetes v1.36)", cp.server));

    // What `meshgate install --profile istio-ambient` renders by default (one place owns the
    // defaults: its strategy and taint key).
    let strategy = crate::install::Strategy::default();
    let taint_key = meshgate_api::names::STARTUP_TAINT_KEY;
    let installed = install_step(
        &mut story,
        &cp,
        &client,
        real_node.is_ok(),
        strategy,
        taint_key,
    )
    .await?;
    gate_step(&mut story, &client, istio.is_some(), strategy, taint_key).await?;

    let mut node_story = if autoscaled::available() {
        autoscaled::launch(&mut story, &cp, &client, taint_key).await?
    } else {
        simulated_node(&mut story, &client, taint_key).await?
    };

    let kubeflow = kubeflow_step(&mut story, &client).await?;

    if let Some(autoscaler) = node_story.autoscaler.take() {
        autoscaled::scale_down(&mut story, &client, autoscaler, &node_story.node).await?;
    }

    let real = real_node_step(
        &mut story,
        &cp,
        &client,
        &real_node,
        istio.as_ref(),
        taint_key,
    )
    .await;

    summary(&mut story, &client, &node_story, &kubeflow, real.as_ref()).await?;

    if options.keep {
        println!();
        println!("The control plane and meshgate keep running. Try:");
        println!(
            "  kubectl --kubeconfig {} get nodegates,mutationpolicies,nodes,pods -A",
            cp.kubeconfig_path.display()
        );
        println!(
            "  meshgate status --kubeconfig {}",
            cp.kubeconfig_path.display()
        );
        println!("Stop with Ctrl-C (or SIGTERM): everything is torn down.");
        crate::run::shutdown_signal().await;
    }
    let _ = installed.stop.send(());
    let _ = installed.controller.await;
    installed.webhook.shutdown(Duration::from_secs(5)).await?;
    drop(cp);
    println!("Done: the control plane and meshgate are stopped; nothing is left running.");
    let logged = std::fs::metadata(&log).is_ok_and(|m| m.len() > 0);
    if built || (logged && std::env::var_os("MESHGATE_BUILD_LOG").is_some()) {
        println!("The builds' output: {}", log.display());
    }
    Ok(())
}

/// meshgate running in the demo: stopped at its end.
struct Installed {
    webhook: meshgate_webhook::Server,
    controller: tokio::task::JoinHandle<Result<(), meshgate_controller::run::RunError>>,
    stop: tokio::sync::oneshot::Sender<()>,
}

/// What the Kubeflow step saw on the stored notebook pod.
struct Kubeflow {
    /// The uid its `fetch-model` init container runs as.
    user: String,
    /// Its `traffic.sidecar.istio.io/excludeOutboundIPRanges`.
    excluded: String,
}

/// meshgate as `install` renders it by default: the CRDs, the webhook (its serving
/// certificate from a CA made now) and its registration, the controller.
async fn install_step(
    story: &mut Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    real_node: bool,
    strategy: crate::install::Strategy,
    taint_key: &str,
) -> anyhow::Result<Installed> {
    story.say("Installing meshgate: CRDs, webhook (TLS, CA generated now), controller");
    crate::install::apply(client, &crate::install::crd_documents()?, false, |_| {}).await?;
    let ca = meshgate_pki::Ca::new("meshgate-demo-ca", Duration::from_secs(24 * 3600))?;
    let serving = ca.issue_server(&["127.0.0.1"], Duration::from_secs(24 * 3600))?;
    let (cert, key) = (cp.dir().join("webhook.crt"), cp.dir().join("webhook.key"));
    std::fs::write(&cert, &serving.cert_pem)?;
    std::fs::write(&key, &serving.key_pem)?;
    // What `meshgate install --profile istio-ambient` renders by default (one place owns the
    // defaults: its strategy and taint key), with Istio's sidecar mode too for the kubeflow step.
    let mut config = crate::install::gate_config_for(
        "istio-ambient",
        DEMO_NAMESPACE,
        &meshgate_api::config::InitGate::default().image,
        strategy,
        taint_key,
    )?;
    config.profiles.push(Profile::IstioSidecar);
    if real_node {
        config.init_gate.image = meshgate_testenv::image::GATE_IMAGE.into();
        config.init_gate.image_pull_policy = "Never".into();
        config.init_gate.command = "/meshgate-wait".into();
    }
    let webhook = crate::run::start_webhook(
        client.clone(),
        WebhookSettings {
            config: config.clone(),
            addr: "127.0.0.1:0".parse()?,
            health_addr: "127.0.0.1:0".parse()?,
            cert,
            key,
            cert_poll_interval: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            max_in_flight: meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
        },
    )
    .await?;
    let mwc = webhook_configuration(&Registration {
        name: "meshgate",
        config: &config,
        target: WebhookTarget::Url(format!("https://127.0.0.1:{}", webhook.addr.port())),
        ca_bundle_pem: &ca.certificate().cert_pem,
        policies: true,
        // Nodes are tainted at registration by an admission policy the API server runs itself
        // (what `meshgate install` picks where it is served), not by this webhook.
        node_taint: false,
        native_gate: None,
    });
    let mwc: k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration =
        serde_json::from_value(mwc)?;
    Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
        client.clone(),
    )
    .patch(
        "meshgate",
        &PatchParams::apply("meshgate").force(),
        &Patch::Apply(&mwc),
    )
    .await?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let controller_client = client.clone();
    let controller = tokio::spawn(async move {
        crate::run::run_controller(
            controller_client,
            ControllerSettings {
                lease: None,
                health_addr: None,
                node_gate: meshgate_controller::nodegate::Settings {
                    status_interval: Duration::from_secs(1),
                    ..Default::default()
                },
                certs: None,
                // The demo applies the CRDs itself.
                manage_crds: false,
                repair: Default::default(),
                evictions: None,
                policy_webhook: None,
                native_policies: false,
                native_gate: None,
                native_gate_proof: None,
                excluded_namespaces: None,
                no_workload_backfill: false,
            },
            async move {
                let _ = stop_rx.await;
            },
        )
        .await
    });
    story.detail(&format!(
        "webhook https://127.0.0.1:{} (registered for pods: /mutate/pod-gate, /mutate/policies)",
        webhook.addr.port()
    ));

    Ok(Installed {
        webhook,
        controller,
        stop: stop_tx,
    })
}

/// The NodeGate `install` renders for the profile, waiting for the demo's agents, and the
/// admission policy that taints new nodes at registration; returns once the policy applies.
async fn gate_step(
    story: &mut Story,
    client: &kube::Client,
    istio: bool,
    strategy: crate::install::Strategy,
    taint_key: &str,
) -> anyhow::Result<()> {
    story.say("A NodeGate: nodes wait for the CNI agent and the node proxy in mesh-system");
    for ns in ["mesh-system", "shop", "kubeflow-user"] {
        let mut labels = json!({});
        if ns == "shop" {
            labels = json!({"istio.io/dataplane-mode": "ambient"});
        }
        if ns == "kubeflow-user" {
            labels = json!({"istio-injection": "enabled"});
        }
        let obj: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(json!({"metadata": {"name": ns, "labels": labels}}))?;
        Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .create(&PostParams::default(), &obj)
            .await?;
        if istio {
            // A control plane that serves pods admits a pod only with its service account,
            // which the node's controller manager creates once it runs: the demo's pods come
            // before it.
            let account: k8s_openapi::api::core::v1::ServiceAccount =
                serde_json::from_value(json!({"metadata": {"name": "default"}}))?;
            Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), ns)
                .create(&PostParams::default(), &account)
                .await?;
        }
    }
    // The gate `install` renders for the profile, waiting for the demo's agents.
    let mut gate = crate::install::default_gate("istio-ambient", strategy, taint_key)?;
    gate.spec.agents = serde_json::from_value(json!([
        {"name": "cni", "namespace": "mesh-system", "selector": {"matchLabels": {"app": "mesh-cni"}}},
        {"name": "node-proxy", "namespace": "mesh-system", "selector": {"matchLabels": {"app": "mesh-node-proxy"}}},
    ]))?;
    Api::<NodeGate>::all(client.clone())
        .create(&PostParams::default(), &gate)
        .await?;
    // The admission policy that taints new nodes at registration (the API server evaluates it in
    // process: no webhook call), as `meshgate install --node-taint auto` picks it here.
    let api = crate::discovery::policy_api(client)
        .await
        .ok_or_else(|| anyhow::anyhow!("the API server serves no MutatingAdmissionPolicy"))?;
    for doc in meshgate_core::registration::node_taint_policy("mesh-agents", &gate.spec, api) {
        crate::install::apply(client, &[doc], false, |_| {}).await?;
    }
    // It takes effect asynchronously: dry-run a node until it comes back tainted.
    let probe_nodes: Api<Node> = Api::all(client.clone());
    let mut n = 0;
    poll(
        "the admission policy to be active",
        Duration::from_secs(30),
        || {
            n += 1;
            let nodes = probe_nodes.clone();
            async move {
                let probe: Node =
                    serde_json::from_value(json!({"metadata": {"name": format!("probe-{n}")}}))
                        .ok()?;
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                let created = nodes.create(&dry, &probe).await.ok()?;
                taint_keys(&created)
                    .iter()
                    .any(|t| t.starts_with(taint_key))
                    .then_some(())
            }
        },
    )
    .await?;
    story.detail(&format!(
        "as `meshgate install --profile istio-ambient` renders it by default: startup taint {taint_key} (a prefix autoscalers know as a startup taint), the init gate only in pods the taint cannot hold"
    ));
    story.detail(&format!(
        "new nodes get the startup taint at registration from a MutatingAdmissionPolicy ({})",
        api.api_version()
    ));

    Ok(())
}

/// A policy for an init container that needs the network, applied to a Kubeflow-style
/// notebook: what the stored pod says (the init container's uid, the excluded ranges).
async fn kubeflow_step(story: &mut Story, client: &kube::Client) -> anyhow::Result<Kubeflow> {
    story.say("Kubeflow-style namespace: an application init container that needs the network");
    for doc in crate::render::parse_documents("deploy/policies/kubeflow.yaml", KUBEFLOW_POLICY)? {
        let policy: MutationPolicy = serde_json::from_value(doc)?;
        Api::<MutationPolicy>::all(client.clone())
            .patch(
                policy.metadata.name.as_deref().unwrap_or("kubeflow"),
                &PatchParams::apply("meshgate").force(),
                &Patch::Apply(&policy),
            )
            .await?;
    }
    // No mesh injector runs here: the pod is written as Istio's injector leaves it in CNI mode
    // with a classic sidecar (validation first, the proxy a regular container).
    let kf: Api<Pod> = Api::namespaced(client.clone(), "kubeflow-user");
    let notebook = |name: &str| -> serde_json::Result<Pod> {
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {
                "sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"]}"}},
            "spec": {"initContainers": [
                        {"name": "istio-validation", "image": "registry.invalid/proxy:1", "securityContext": {"runAsUser": 1337}},
                        {"name": "fetch-model", "image": "registry.invalid/fetch:1"}],
                     "containers": [
                        {"name": "notebook", "image": "registry.invalid/notebook:1"},
                        {"name": "istio-proxy", "image": "registry.invalid/proxy:1", "args": ["proxy", "sidecar"]}]},
        }))
    };
    // The policy reaches the webhook's cache asynchronously: dry-run until it applies.
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let fetch_user = |p: &Pod| -> Option<i64> {
        p.spec
            .as_ref()?
            .init_containers
            .as_ref()?
            .iter()
            .find(|c| c.name == "fetch-model")?
            .security_context
            .as_ref()?
            .run_as_user
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if kf
            .create(&dry, &notebook("probe")?)
            .await
            .ok()
            .and_then(|p| fetch_user(&p))
            .is_some()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stored = kf
        .create(&PostParams::default(), &notebook("notebook")?)
        .await?;
    let user = fetch_user(&stored).map_or_else(|| "<unset>".to_owned(), |u| u.to_string());
    let verdict = stored
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("meshgate.dev/gate"))
        .cloned()
        .unwrap_or_else(|| "<none>".into());
    let excluded = stored
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("traffic.sidecar.istio.io/excludeOutboundIPRanges"))
        .cloned()
        .unwrap_or_else(|| "<none>".into());
    story.detail(&format!(
        "kubeflow-user/notebook: init container fetch-model runs as uid {user} (the proxy's, whose traffic is not redirected); excludeOutboundIPRanges {excluded}; gate verdict {verdict:?}"
    ));

    Ok(Kubeflow { user, excluded })
}

/// The real node, where this host can run one: its report, or why it did not complete.
async fn real_node_step(
    story: &mut Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    real_node: &Result<(), String>,
    istio: Option<&real_node::CachedIstio>,
    taint_key: &str,
) -> Option<real_node::RealNodeReport> {
    match real_node {
        Ok(_) => {
            story.say(match istio {
                Some(i) => format!(
                    "A real node joins: containerd, runc, a CNI bridge and a kubelet on this machine, with the real Istio {} in ambient mode",
                    i.istio.version
                ),
                None => "A real node joins: containerd, runc, a CNI bridge and a kubelet on this machine".to_owned(),
            }.as_str());
            match real_node::story(story, cp, client, istio, taint_key).await {
                Ok(r) => Some(r),
                Err(e) => {
                    story.detail(&format!("the real node did not complete: {e:#}"));
                    None
                }
            }
        }
        Err(e) => {
            story.say("A real node: not on this host");
            story.detail(e);
            None
        }
    }
}

/// What the demo observed, from the cluster's status and each step's report.
async fn summary(
    story: &mut Story,
    client: &kube::Client,
    node_story: &NodeStory,
    kubeflow: &Kubeflow,
    real: Option<&real_node::RealNodeReport>,
) -> anyhow::Result<()> {
    story.say("Summary");
    let status = crate::status::collect(client).await?;
    print!("{}", crate::status::table(&status));
    println!();
    let NodeStory {
        node,
        launched,
        untaint_ms,
        ..
    } = node_story;
    if let Some(launched) = launched {
        println!("  {node}: {launched};");
    }
    println!(
        "  {node} was held by its startup taint until both agents were Ready; the taint lifted {untaint_ms} ms after;"
    );
    println!(
        "  shop/web waited Pending, then was bound to {node} without an init container: the taint held it, nothing was added to the pod;"
    );
    println!(
        "  kubeflow-user/notebook: its init container fetch-model runs as uid {}, nothing else of the pod left the mesh (excludeOutboundIPRanges {}).",
        kubeflow.user, kubeflow.excluded
    );

    match real {
        Some(r) => {
            println!(
                "  real node {} ran {}: tainted at registration {:?}; the taint lifted {} ms after it registered, once its CNI agent and node proxy were Ready;",
                r.node, r.mesh, r.taints_at_registration, r.lifted_ms
            );
            if let Some(redirection) = &r.redirection {
                println!(
                    "    Istio's node agent enrolled shop/web-real (ambient.istio.io/redirection: {redirection});"
                );
            }
            println!(
                "    shop/web-real really ran there: meshgate-wait logged \"{}\" before the app started.",
                r.gate_line
            );
        }
        None => {
            println!("  (no real node ran: the nodes above are simulated; no gate binary executed)")
        }
    }

    Ok(())
}
