//! meshgate beside the real Istio on the real node (`meshgate_testenv::istio`): istiod, its
//! sidecar injector and CA, the `istio-validation` check, the istio-cni node agent and its CNI
//! plugin, all built from Istio's Go module (`tools/istio/build.sh`, which pins the version)
//! and installed from Istio's own Helm charts of the same commit. Only the proxy process
//! (Envoy) is a stand-in (`mesh-proxy`: it answers the injected probes and listens on the
//! capture ports). meshgate is installed in the cluster as users install it
//! (`meshgate install --profile istio-sidecar`, the default strategy).
//!
//! Sidecar, CNI mode, each pod shape created in an `istio-injection=enabled` namespace and
//! injected by the real istiod:
//! * what the real components did: the injector's containers and `sidecar.istio.io/status`,
//!   the real `istio-validation`'s exit code, and the nat rules the real plugin wrote into the
//!   pod's network namespace (read there with the host's iptables, as the plugin wrote them);
//! * meshgate's verdict (`meshgate.dev/gate`) is the one docs/design.md's table gives for that
//!   shape, and the layer it names guards the pod: a scheduled pod is held by the taint alone (no request, no init container), a
//!   pod bound by `nodeName` gets `meshgate-wait`, whose redirect check passes behind the real
//!   plugin's rules;
//! * pods the real plugin leaves alone (opt-out, interception `NONE`, gateways) get no gate and
//!   start; every pod runs;
//! * the Node registers with meshgate's startup taint and Istio's own (`cni.istio.io/not-ready`,
//!   with Istio's untaint controller on): meshgate's pods tolerate Istio's, istiod waits for
//!   meshgate's, and each controller lifts its own once the real node agent is Ready;
//! * the race, for real: the node agent removed, pods created meanwhile fail the real
//!   `istio-validation` (126); when the agent is back, Istio's repair deletes them once, and
//!   meshgate does nothing in its way;
//! * no meshgate component was refused a request, and the teardown restores the host.
//!
//! Needs what `real_node` needs, and Istio's build (`MESHGATE_ISTIO`, else
//! tools/istio/build.sh, about 15 minutes cold on 2 cores) and Helm (`MESHGATE_HELM`, else
//! tools/helm/build.sh).
//!
//! Run: `cargo test -p meshgate --test real_istio -- --nocapture` (prints `measured:` lines).

mod common;

use std::time::{Duration, Instant};

use common::cluster::*;
use common::istio::*;
use common::taint_keys;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use meshgate_testenv::istio::ISTIO_NAMESPACE as ISTIO_NS;
use meshgate_testenv::istio::InstallOptions;
use meshgate_testenv::node::{NodeOptions, RealNode};
use serde_json::{Value, json};

const MESH_NS: &str = "mesh";
/// Istio's node readiness taint (`pilot.taint`, its untaint controller's default).
const ISTIO_TAINT: &str = "cni.istio.io/not-ready";

fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn init_names(p: &Pod) -> Vec<String> {
    p.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .map(|c| c.name.clone())
        .collect()
}

/// The nat table of the pod's network namespace, as both iptables back ends of the host read
/// it (the plugin picks one).
fn pod_nat_rules(node: &RealNode, p: &Pod) -> String {
    let uid = p.metadata.uid.as_deref().expect("uid");
    let pid = node.sandbox_pid(uid).expect("the pod's sandbox");
    let mut rules = String::new();
    for save in ["iptables-nft-save", "iptables-legacy-save"] {
        let out = std::process::Command::new(&node.tools().nsenter)
            .args(["-t", &pid.to_string(), "-n", save, "-t", "nat"])
            .env("PATH", meshgate_testenv::host::child_path())
            .output()
            .expect("nsenter runs");
        rules.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    rules
}

/// Whether the pod's main process runs: the app, or for a gateway its proxy.
fn running(p: &Pod, container: &str) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.name == container && c.state.as_ref().is_some_and(|s| s.running.is_some())
            })
        })
}

/// Waits for the kubelet's `FailedCreatePodSandBox` Event on the pod whose message has
/// `message` (the CNI plugin's refusal); returns the message.
async fn wait_sandbox_refused(client: &kube::Client, pod: &str, message: &str) -> String {
    use k8s_openapi::api::core::v1::Event;
    let events: Api<Event> = Api::namespaced(client.clone(), MESH_NS);
    let params = kube::api::ListParams::default().fields(&format!("involvedObject.name={pod}"));
    let found = tokio::time::timeout(POD_LIMIT, async {
        loop {
            let list = events.list(&params).await.expect("events");
            if let Some(m) = list.items.iter().find_map(|e| {
                (e.reason.as_deref() == Some("FailedCreatePodSandBox"))
                    .then(|| e.message.clone().unwrap_or_default())
                    .filter(|m| m.contains(message))
            }) {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| {
        panic!("pod {pod}: no FailedCreatePodSandBox Event saying {message:?} in {POD_LIMIT:?}")
    })
}

/// What one pod shape is expected to show.
struct Shape {
    name: &'static str,
    extra: Value,
    /// The container whose `Running` means the pod started.
    main: &'static str,
    /// Injected by istiod (`sidecar.istio.io/status`).
    injected: bool,
    /// The real plugin redirected its outbound traffic (`ISTIO_REDIRECT` in its nat table).
    redirected: bool,
    /// meshgate's verdict, as docs/design.md's table gives it (a prefix); `None`: the pod is
    /// not sent to meshgate (its registration's selectors) and carries no verdict.
    verdict: Option<&'static str>,
    /// The real plugin refuses the pod's sandbox with this message (the pod never runs).
    refused: Option<&'static str>,
}

#[tokio::test]
async fn real_istio_sidecar_cni_mode_pods_get_the_verdicts_of_the_design_table() {
    if !can_run() {
        return;
    }
    // The Node also registers with Istio's own readiness taint, which Istio's untaint
    // controller lifts.
    let setup = Setup::start(
        "istio-sidecar",
        NodeOptions {
            proxy: true,
            register_with_taints: vec![ISTIO_TAINT.to_owned()],
            ..NodeOptions::default()
        },
    )
    .await;
    let (istio, client, node) = (&setup.istio, &setup.client, &setup.node);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let registered = taint_keys(&nodes.get(node.name()).await.expect("node"));
    assert!(
        registered.iter().any(|k| k == ISTIO_TAINT)
            && registered
                .iter()
                .any(|k| k == meshgate_api::names::STARTUP_TAINT_KEY),
        "the Node registered with both taints: {registered:?}"
    );
    let t = Instant::now();
    setup
        .namespace(MESH_NS, json!({"istio-injection": "enabled"}))
        .await;
    setup.install_istio(&InstallOptions::default());
    wait_meshgate_ready(client, node).await;
    wait_node_agent(client, node).await;
    eprintln!(
        "measured: Istio installed -> istio-cni's node agent Ready {:.2?}",
        t.elapsed()
    );
    wait_taint_lifted(client, node, POD_LIMIT).await;
    wait_istiod(client, node, MESH_NS).await;
    eprintln!(
        "measured: Istio installed -> istiod serving {:.2?}",
        t.elapsed()
    );
    // No deadlock and no taint war: meshgate's pods tolerate Istio's taint (istiod tolerates
    // only its own and waits for meshgate's); each controller lifts its own taint, Istio's
    // untaint controller once the CNI agent is Ready (its log says so).
    meshgate_testenv::wait_for(
        "Istio's untaint controller to lift its taint",
        POD_LIMIT,
        || {
            let nodes = nodes.clone();
            let name = node.name().to_owned();
            async move {
                nodes
                    .get(&name)
                    .await
                    .is_ok_and(|n| !taint_keys(&n).iter().any(|k| k == ISTIO_TAINT))
            }
        },
    )
    .await;
    let n = nodes.get(node.name()).await.expect("node");
    let istiod_log = pod_logs(client, node, ISTIO_NS, "app=istiod").await;
    let removed = format!("removed readiness taint from node {}", node.name());
    assert!(
        istiod_log.iter().any(|(_, l)| l.contains(&removed)),
        "istiod's untaint controller logged {removed:?}"
    );
    assert!(
        taint_keys(&n).is_empty(),
        "both taints lifted: {:?}",
        taint_keys(&n)
    );

    // The real node agent chained its plugin into the node's CNI configuration.
    wait_conflist(node, true).await;

    let resource = meshgate_api::names::DEFAULT_RESOURCE;
    let shapes = [
        Shape {
            name: "plain",
            extra: json!({}),
            main: "app",
            injected: true,
            redirected: true,
            verdict: Some("gated: taint readiness.k8s.io/mesh-agents"),
            refused: None,
        },
        // Created bound to the node: no scheduler, so no resource can hold it; the injector's
        // own istio-validation comes first and holds it (and Istio's repair acts on its
        // failure), so meshgate puts nothing in front of it.
        Shape {
            name: "bound",
            extra: json!({"spec": {"nodeName": node.name()}}),
            main: "app",
            injected: true,
            redirected: true,
            verdict: Some("none: mesh-validates"),
            refused: None,
        },
        // The label opt-out: neither the injector's registration nor meshgate's selects it.
        Shape {
            name: "opted-out",
            extra: json!({"metadata": {"labels": {"sidecar.istio.io/inject": "false"}}}),
            main: "app",
            injected: false,
            redirected: false,
            verdict: None,
            refused: None,
        },
        // The annotation opt-out: both are called; the injector declines it, so meshgate
        // sees a pod without a proxy.
        Shape {
            name: "opted-out-by-annotation",
            extra: json!({"metadata": {"annotations": {"sidecar.istio.io/inject": "false"}}}),
            main: "app",
            injected: false,
            redirected: false,
            verdict: Some("none: no-proxy"),
            refused: None,
        },
        Shape {
            name: "no-interception",
            extra: json!({"metadata": {"annotations": {"sidecar.istio.io/interceptionMode": "NONE"}}}),
            main: "app",
            injected: true,
            redirected: false,
            verdict: Some("none: interception-none"),
            refused: Some("interceptionMode invalid: NONE"),
        },
        Shape {
            name: "exclude-all",
            extra: json!({"metadata": {"annotations": {"traffic.sidecar.istio.io/excludeOutboundIPRanges": "0.0.0.0/0"}}}),
            main: "app",
            injected: true,
            redirected: true,
            verdict: Some("none: nothing-redirected"),
            refused: None,
        },
        // A gateway as its Deployment asks for one: the `gateway` template, image `auto`
        // (defaulted to pull `Always`, which this node without a registry cannot: the
        // Deployment of a user without a registry says `IfNotPresent`).
        Shape {
            name: "gateway",
            extra: json!({
                "metadata": {"annotations": {"inject.istio.io/templates": "gateway"},
                             "labels": {"sidecar.istio.io/inject": "true"}},
                "spec": {"containers": [{"name": "istio-proxy", "image": "auto", "imagePullPolicy": "IfNotPresent"}]},
            }),
            main: "istio-proxy",
            injected: true,
            redirected: false,
            verdict: Some("none: gateway"),
            refused: None,
        },
    ];
    let pods: Api<Pod> = Api::namespaced(client.clone(), MESH_NS);
    let mut created = Vec::new();
    for s in &shapes {
        pods.create(&PostParams::default(), &mesh_pod(s.name, s.extra.clone()))
            .await
            .unwrap_or_else(|e| panic!("pod {}: {e}", s.name));
        created.push(Instant::now());
    }
    let mut failures = Vec::new();
    for (s, created) in shapes.iter().zip(created) {
        let p = if let Some(message) = s.refused {
            let seen = wait_sandbox_refused(client, s.name, message).await;
            eprintln!(
                "measured: {} created -> its sandbox refused by the real plugin {:.2?}: {seen}",
                s.name,
                created.elapsed()
            );
            pods.get(s.name).await.expect("pod")
        } else {
            let p = wait_pod(
                &pods,
                node,
                s.name,
                "its main container Running",
                POD_LIMIT,
                |p| running(p, s.main),
            )
            .await;
            eprintln!(
                "measured: {} created -> {} Running {:.2?}",
                s.name,
                s.main,
                created.elapsed()
            );
            p
        };
        let inits = init_names(&p);
        let verdict = annotation(&p, meshgate_api::names::GATE_VERDICT);
        let status = annotation(&p, "sidecar.istio.io/status");
        let rules = if s.refused.is_some() {
            String::new()
        } else {
            pod_nat_rules(node, &p)
        };
        let redirected = rules.contains("-A ISTIO_REDIRECT") && rules.contains("--to-ports 15001");
        eprintln!(
            "{}: init containers {inits:?}, verdict {verdict:?}, injected {}, redirected {redirected}",
            s.name,
            status.is_some()
        );
        let mut fail = |what: String| failures.push(format!("{}: {what}", s.name));
        if status.is_some() != s.injected {
            fail(format!(
                "injected by istiod: {} (expected {})",
                status.is_some(),
                s.injected
            ));
        }
        if redirected != s.redirected {
            fail(format!(
                "the real plugin redirected: {redirected} (expected {}); nat table:\n{rules}",
                s.redirected
            ));
        }
        let verdict_as_designed = match (verdict, s.verdict) {
            (Some(v), Some(expected)) => v.starts_with(expected),
            (v, expected) => v == expected,
        };
        if !verdict_as_designed {
            fail(format!(
                "meshgate's verdict {verdict:?}, the design table says {:?}",
                s.verdict
            ));
        }
        let verdict = verdict.unwrap_or_default();
        if let Some(v) = init_status(&p, "istio-validation") {
            let code = v
                .state
                .as_ref()
                .and_then(|st| st.terminated.as_ref())
                .map(|t| t.exit_code);
            if code != Some(0) {
                fail(format!("the real istio-validation ended {code:?}, not 0"));
            }
        } else if s.redirected {
            fail("no istio-validation check in a redirected pod".into());
        }
        if s.refused.is_some() {
            continue;
        }
        let requests_resource = p.spec.iter().flat_map(|sp| &sp.containers).any(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .is_some_and(|r| r.contains_key(resource))
        });
        let gated_by_resource = verdict.contains("resource");
        if requests_resource != gated_by_resource {
            fail(format!(
                "requests {resource}: {requests_resource} (expected {gated_by_resource})"
            ));
        }
        let has_gate = inits.first().map(String::as_str) == Some("meshgate-wait");
        if has_gate != verdict.contains("--redirect-check") {
            fail(format!(
                "meshgate-wait first: {has_gate}; init containers {inits:?}"
            ));
        }
        if has_gate {
            let line = gate_log_line(node, MESH_NS, &p);
            eprintln!("{}: meshgate-wait: {line}", s.name);
            if !line.starts_with("ready after")
                || !line.contains("redirect-check 15001")
                || line.contains("not checked")
            {
                fail(format!(
                    "meshgate-wait did not pass its redirect check behind the real plugin: {line:?}"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "against the real Istio {}:\n{}",
        istio.version,
        failures.join("\n")
    );

    // The race, for real: the node agent stops on a ready node (its DaemonSet removed, as an
    // uninstall or a broken upgrade does) and takes its plugin out of the node's CNI
    // configuration; pods that start then get no rules.
    setup.helm(&["uninstall", "istio-cni", "--namespace", ISTIO_NS, "--wait"]);
    wait_conflist(node, false).await;
    let early = [
        ("early", json!({})),
        ("early-bound", json!({"spec": {"nodeName": node.name()}})),
    ];
    for (name, extra) in &early {
        pods.create(&PostParams::default(), &mesh_pod(name, extra.clone()))
            .await
            .unwrap_or_else(|e| panic!("pod {name}: {e}"));
    }
    let mut uids = Vec::new();
    for (name, _) in &early {
        // The real istio-validation refuses the unredirected pod: exit code 126, retried by
        // the kubelet; the app never starts.
        let p = wait_pod(
            &pods,
            node,
            name,
            "istio-validation to fail (126)",
            POD_LIMIT,
            |p| validation_exit_codes(p).contains(&126),
        )
        .await;
        assert!(
            app_status(&p).is_none_or(|a| a.state.as_ref().is_none_or(|st| st.running.is_none())),
            "{name}: the app must not run unredirected"
        );
        assert!(
            !pod_nat_rules(node, &p).contains("ISTIO_REDIRECT"),
            "{name}: its sandbox has no rules"
        );
        let verdict = annotation(&p, meshgate_api::names::GATE_VERDICT).unwrap_or_default();
        eprintln!("{name}: istio-validation failed (126); meshgate's verdict {verdict:?}");
        uids.push(p.metadata.uid.clone().unwrap_or_default());
    }
    // The agent comes back: its repair controller deletes each broken pod, once (one actor:
    // Istio's repair; meshgate, without repair by default, leaves them alone, and put nothing
    // in front of istio-validation that would keep Istio's repair from seeing the failure).
    // Pods created then are redirected and run.
    let back = Instant::now();
    setup.reinstall_node_agent();
    wait_node_agent(client, node).await;
    wait_conflist(node, true).await;
    for ((name, _), uid) in early.iter().zip(&uids) {
        let gone = tokio::time::timeout(POD_LIMIT, async {
            loop {
                match pods.get_opt(name).await.expect("pod read") {
                    Some(p) if p.metadata.uid.as_ref() == Some(uid) => {}
                    _ => return,
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        let log = pod_logs(client, node, ISTIO_NS, "k8s-app=istio-cni-node").await;
        let deleted_by_istio = log.iter().any(|(_, l)| {
            l.contains("Pod detected as broken, deleting")
                && l.contains(&format!("{MESH_NS}/{name}"))
        });
        assert!(
            gone.is_ok() && deleted_by_istio,
            "{name}: deleted by Istio's repair controller ({:?}); its log:\n{}",
            gone,
            last_lines(&log, 30)
        );
        eprintln!(
            "measured: {name}: node agent back -> deleted by Istio's repair {:.2?}",
            back.elapsed()
        );
    }
    for (name, extra) in &early {
        let name = format!("{name}-again");
        pods.create(&PostParams::default(), &mesh_pod(&name, extra.clone()))
            .await
            .unwrap_or_else(|e| panic!("pod {name}: {e}"));
        let p = wait_pod(&pods, node, &name, "the app Running", POD_LIMIT, |p| {
            running(p, "app")
        })
        .await;
        assert!(
            pod_nat_rules(node, &p).contains("-A ISTIO_REDIRECT"),
            "{name}: redirected by the real plugin"
        );
    }

    assert_no_refused_requests(client, node).await;
    drop(pods);
    setup.tear_down().await;
}

const AMBIENT_NS: &str = "ambient";
/// The node agent's annotation once the node proxy has acked the pod (`pending`: rules in
/// place, no node proxy took it).
const REDIRECTION: &str = "ambient.istio.io/redirection";

/// Waits until the scheduler reports a pod of `label` in Istio's namespace unschedulable
/// (`PodScheduled` False, reason `Unschedulable`); returns its message.
async fn wait_unschedulable(client: &kube::Client, label: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ISTIO_NS);
    let found = tokio::time::timeout(POD_LIMIT, async {
        loop {
            let list = pods
                .list(&kube::api::ListParams::default().labels(label))
                .await
                .expect("pods");
            if let Some(m) = list.items.iter().find_map(|p| {
                p.status
                    .as_ref()?
                    .conditions
                    .as_ref()?
                    .iter()
                    .find_map(|c| {
                        (c.type_ == "PodScheduled" && c.reason.as_deref() == Some("Unschedulable"))
                            .then(|| c.message.clone().unwrap_or_default())
                    })
            }) {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("no {label} pod reported Unschedulable in {POD_LIMIT:?}"))
}

/// The seconds in the gate's `ready after 1.855s: ...` (or `8ms: ...`) line.
fn gate_waited(line: &str) -> Option<f64> {
    let d = line
        .strip_prefix("ready after ")?
        .split_whitespace()
        .next()?
        .trim_end_matches(':');
    match d.strip_suffix("ms") {
        Some(ms) => ms.parse::<f64>().ok().map(|ms| ms / 1000.0),
        None => d.strip_suffix('s')?.parse().ok(),
    }
}

/// Istio ambient on the real node: istiod, the real istio-cni node agent and plugin in ambient
/// mode, and the node proxy stand-in fed by the agent over ZDS (Istio's `ztunnel` chart with
/// the stand-in's image). meshgate installed with `--profile istio-ambient`, the default
/// strategy. The node runs in namespaces of its own (`NodeOptions::own_namespaces`: the real
/// agent stats `/host/proc/1/ns/net` at start, which this VM's init denies).
#[tokio::test]
async fn real_istio_ambient_the_gate_holds_until_the_real_node_agent_has_enrolled_the_pod() {
    if !can_run() {
        return;
    }
    let setup = Setup::start(
        "istio-ambient",
        NodeOptions {
            proxy: true,
            own_namespaces: true,
            ..NodeOptions::default()
        },
    )
    .await;
    let (istio, client, node) = (&setup.istio, &setup.client, &setup.node);
    setup
        .namespace(AMBIENT_NS, json!({"istio.io/dataplane-mode": "ambient"}))
        .await;
    let t = Instant::now();
    setup.install_istio(&InstallOptions {
        ambient: true,
        ..Default::default()
    });
    wait_meshgate_ready(client, node).await;
    wait_agent_ready(client, node, "k8s-app=istio-cni-node").await;
    // The node proxy needs istiod (it mounts istiod's root certificate, and the real one takes
    // its certificates and configuration from istiod); istiod as Istio's chart has it tolerates
    // only Istio's taint, so on a node that only meshgate's taint keeps from it, nothing ever
    // becomes Ready: the scheduler says why.
    let unschedulable = wait_unschedulable(client, "app=istiod").await;
    let taints = taint_keys(
        &Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
            .get(node.name())
            .await
            .expect("node"),
    );
    assert!(
        unschedulable.contains("untolerated taint")
            && taints == [meshgate_api::names::STARTUP_TAINT_KEY],
        "istiod held off the node by meshgate's taint alone: {unschedulable}; taints {taints:?}"
    );
    eprintln!("istiod without a toleration of meshgate's taint: {unschedulable}");
    // What docs/design.md tells users of the ambient gate: istiod tolerates the gate's taint.
    setup.istiod_tolerates_the_gate();
    wait_agent_ready(client, node, "app=ztunnel").await;
    eprintln!(
        "measured: Istio ambient installed -> node agent and node proxy Ready {:.2?}",
        t.elapsed()
    );
    // meshgate's node gate lifts its taint only once both agents are Ready.
    wait_taint_lifted(client, node, POD_LIMIT).await;
    wait_conflist(node, true).await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), AMBIENT_NS);
    let node_proxy_log = || pod_logs(client, node, ISTIO_NS, "app=ztunnel");
    // Each pod: enrolled by the real agent (its annotation, the in-pod rules it wrote), handed
    // to the node proxy (its log), and held by the layer meshgate's verdict names.
    let mut failures = Vec::new();
    for (name, extra, verdict) in [
        (
            "plain",
            json!({}),
            "gated: taint readiness.k8s.io/mesh-agents",
        ),
        (
            "bound",
            json!({"spec": {"nodeName": node.name()}}),
            "--tcp-listening 15008",
        ),
    ] {
        let created = Instant::now();
        pods.create(&PostParams::default(), &mesh_pod(name, extra))
            .await
            .unwrap_or_else(|e| panic!("pod {name}: {e}"));
        let p = wait_pod(&pods, node, name, "the app Running", POD_LIMIT, |p| {
            running(p, "app")
        })
        .await;
        eprintln!(
            "measured: {name} created -> app Running {:.2?}",
            created.elapsed()
        );
        let mut fail = |what: String| failures.push(format!("{name}: {what}"));
        let redirection = annotation(&p, REDIRECTION);
        if redirection != Some("enabled") {
            fail(format!("{REDIRECTION}: {redirection:?}, not \"enabled\""));
        }
        let rules = pod_nat_rules(node, &p);
        if !(rules.contains("-A ISTIO_OUTPUT") && rules.contains("--to-ports 15001")) {
            fail(format!(
                "no in-pod redirect to 15001 from the real agent:\n{rules}"
            ));
        }
        let v = annotation(&p, meshgate_api::names::GATE_VERDICT).unwrap_or_default();
        if !v.contains(verdict) {
            fail(format!(
                "meshgate's verdict {v:?}, the design table says {verdict:?}"
            ));
        }
        let has_gate = init_names(&p).first().map(String::as_str) == Some("meshgate-wait");
        if has_gate != v.contains("--tcp-listening") {
            fail(format!("meshgate-wait first: {has_gate}; verdict {v:?}"));
        }
        if has_gate {
            let line = gate_log_line(node, AMBIENT_NS, &p);
            eprintln!("{name}: meshgate-wait: {line}");
            if !line.starts_with("ready after") || !line.contains("tcp-listening 15008") {
                fail(format!(
                    "the gate did not see the node proxy listen: {line:?}"
                ));
            }
        }
        let enrolled = format!("enrolled {AMBIENT_NS}/{name} ");
        if !node_proxy_log()
            .await
            .iter()
            .any(|(_, l)| l.contains(&enrolled))
        {
            fail("the node agent never handed it to the node proxy".into());
        }
    }
    assert!(
        failures.is_empty(),
        "ambient, against the real Istio {}:\n{}",
        istio.version,
        failures.join("\n")
    );

    // The race, for real: the node agent goes (its DaemonSet removed: it takes its plugin out
    // of the node's CNI configuration); a pod bound to the node starts meanwhile, with no
    // plugin, so nothing enrols it: its gate holds. The agent comes back, finds the pod among
    // the node's processes and enrols it live; only then does the gate pass.
    setup.helm(&["uninstall", "istio-cni", "--namespace", ISTIO_NS, "--wait"]);
    wait_conflist(node, false).await;
    pods.create(
        &PostParams::default(),
        &mesh_pod("early", json!({"spec": {"nodeName": node.name()}})),
    )
    .await
    .expect("pod early");
    let p = wait_pod(
        &pods,
        node,
        "early",
        "meshgate-wait Running",
        POD_LIMIT,
        |p| {
            init_status(p, "meshgate-wait")
                .and_then(|s| s.state.as_ref())
                .is_some_and(|s| s.running.is_some())
        },
    )
    .await;
    let held_from = Instant::now();
    assert_eq!(annotation(&p, REDIRECTION), None, "nothing enrolled it");
    assert!(!running(&p, "app"), "the app waits behind the gate");
    setup.reinstall_node_agent();
    let back = held_from.elapsed();
    let p = wait_pod(&pods, node, "early", "the app Running", POD_LIMIT, |p| {
        running(p, "app")
    })
    .await;
    let line = gate_log_line(node, AMBIENT_NS, &p);
    eprintln!(
        "early: meshgate-wait: {line}; the agent was reinstalled {back:.2?} after the gate started"
    );
    assert_eq!(
        annotation(&p, REDIRECTION),
        Some("enabled"),
        "the real agent enrolled the running pod"
    );
    assert!(
        pod_nat_rules(node, &p).contains("--to-ports 15001"),
        "the real agent wrote the in-pod rules into the running pod"
    );
    let waited = gate_waited(&line).unwrap_or_else(|| panic!("the gate's line: {line:?}"));
    assert!(
        line.contains("tcp-listening 15008") && waited >= back.as_secs_f64(),
        "the gate held until the node proxy listened, past the agent's return ({back:.2?}): {line:?}"
    );
    assert!(
        node_proxy_log()
            .await
            .iter()
            .any(|(_, l)| l.contains(&format!("enrolled {AMBIENT_NS}/early "))),
        "the node proxy was handed the early pod"
    );

    assert_no_refused_requests(client, node).await;
    drop(pods);
    setup.tear_down().await;
}

/// Exit codes of the pod's `istio-validation` runs (the current and the last).
fn validation_exit_codes(p: &Pod) -> Vec<i32> {
    init_status(p, "istio-validation")
        .into_iter()
        .flat_map(|s| [s.state.as_ref(), s.last_state.as_ref()])
        .flatten()
        .filter_map(|st| st.terminated.as_ref().map(|t| t.exit_code))
        .collect()
}

/// Waits until the node's CNI configuration chains the `istio-cni` plugin (`chained`) or not.
async fn wait_conflist(node: &RealNode, chained: bool) {
    let read = || {
        std::fs::read_dir(node.cni_conf_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".conflist"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    };
    meshgate_testenv::wait_for(
        if chained {
            "the node agent to chain istio-cni"
        } else {
            "the stopping node agent to take istio-cni out of the CNI configuration"
        },
        POD_LIMIT,
        || {
            let has = read().contains("\"istio-cni\"");
            async move { has == chained }
        },
    )
    .await;
}
