//! meshgate beside the real Karpenter (v1.15.0, its KWOK cloud provider) and KWOK v0.8.0
//! (`meshgate_testenv::karpenter`), on the real API server, scheduler and controller-manager.
//!
//! meshgate is installed as users install it, `meshgate install --profile P --apply` (its
//! default strategy and taint key, chosen with Karpenter found), the webhook and controller
//! running out of the cluster as their installed ServiceAccounts. The mesh's agents are
//! DaemonSets named as each profile's record says, whose pods KWOK makes Ready [`AGENT_DELAY`]
//! after they are created. For each profile, in alternating rounds with meshgate on and off
//! (off: its admission registrations deleted and its controller stopped, as the first steps of
//! `meshgate uninstall` leave a cluster), a Deployment of [`PODS`] mesh pods of one CPU is created
//! with no node in the cluster, and the test asserts what Karpenter, the scheduler and KWOK did,
//! from one watch of pods, nodes and NodeClaims (their resourceVersions order the events):
//! * Karpenter launched the same NodeClaims (count and instance types) as with meshgate off;
//! * with meshgate, no mesh pod was bound to a node before every agent of the gate was Ready
//!   there, and every one was Running soon after (the time is printed; the benchmark reports its
//!   percentiles); with meshgate off, pods were bound before (the race the test can see);
//! * the NodeClaim became `Initialized` only after meshgate lifted its taint.
//!
//! Then, with meshgate on: a burst of [`BURST`] pods over many new nodes (the same assertions,
//! beside the same burst with meshgate off); scale-down by consolidation with nothing of
//! meshgate's left; pods that tolerate every taint and pods bound by `nodeName` get the init
//! gate (KWOK runs no container, so its hold is proven on the real node, `real_node`); an agent
//! that fails in `Continuous` mode re-taints its node, and for a mesh pod that would have fit
//! there Karpenter launches at most one node, the pod running once the agent is back;
//! `install` refuses the resource strategy and a key Karpenter does not know, and `check` passes
//! the default and fails a gate keyed outside Karpenter's startup taints, naming the fix.
//!
//! Run: `cargo test -p meshgate --test karpenter -- --nocapture` (prints `measured:` lines).
//! Needs Karpenter and KWOK (`tools/karpenter/build.sh`, or `MESHGATE_KARPENTER`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use meshgate_testenv::karpenter::{self, Autoscaler};
use serde_json::json;

use common::karpenter::*;

async fn tolerating_and_bound_pods(cp: &meshgate_testenv::ControlPlane, client: &kube::Client) {
    let ns = cp
        .namespace("mesh-exempt", &[("istio.io/dataplane-mode", "ambient")])
        .await
        .expect("namespace");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let pod = |name: &str, spec: serde_json::Value| -> Pod {
        let mut spec = spec;
        spec["containers"] =
            json!([{"name": "app", "image": "app", "resources": {"requests": {"cpu": "1"}}}]);
        serde_json::from_value(json!({"metadata": {"name": name, "annotations": {"karpenter.sh/do-not-disrupt": "true"}}, "spec": spec})).expect("pod")
    };
    pods.create(
        &PostParams::default(),
        &pod(
            "tolerating",
            json!({"tolerations": [{"operator": "Exists"}]}),
        ),
    )
    .await
    .expect("tolerating pod");
    common::wait_for(
        "the tolerating pod to run on a node Karpenter launched",
        Duration::from_secs(120),
        || async { pods.get("tolerating").await.is_ok_and(|p| ready(&p)) },
    )
    .await;
    let node = pods
        .get("tolerating")
        .await
        .expect("pod")
        .spec
        .and_then(|s| s.node_name)
        .expect("bound");
    pods.create(
        &PostParams::default(),
        &pod("bound", json!({"nodeName": node})),
    )
    .await
    .expect("bound pod");
    for name in ["tolerating", "bound"] {
        let p = pods.get(name).await.expect("pod");
        let inits: Vec<String> = p
            .spec
            .iter()
            .flat_map(|s| s.init_containers.iter().flatten())
            .map(|c| c.name.clone())
            .collect();
        let verdict = p
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(meshgate_api::names::GATE_VERDICT))
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            inits.first().map(String::as_str),
            Some("meshgate-wait"),
            "{name}: {inits:?}"
        );
        assert!(
            verdict.starts_with("gated: --tcp-listening 15008"),
            "{name}: {verdict}"
        );
    }
    an_agent_that_fails_retaints_its_node_and_karpenter_launches_no_loop(client, &pods, &node)
        .await;
    let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .delete(&ns, &DeleteParams::default())
        .await;
}

/// The ambient gate is `Continuous`: an agent that fails on a node Karpenter initialized gets the
/// node re-tainted after the grace period. For a mesh pod that would fit there Karpenter either
/// launches one node (a readiness taint on an initialized node can count as a real one to it) or
/// nominates the pod to a node it counts on; once the agent is back (its pod replaced) the pod
/// runs, and no more than one node was launched for it (no launch loop).
async fn an_agent_that_fails_retaints_its_node_and_karpenter_launches_no_loop(
    client: &kube::Client,
    pods: &Api<Pod>,
    node: &str,
) {
    let key = meshgate_api::names::STARTUP_TAINT_KEY;
    let agents = Api::<Pod>::namespaced(client.clone(), "istio-system");
    let proxy = agents
        .list(&kube::api::ListParams::default().labels("app=ztunnel"))
        .await
        .expect("agents")
        .items
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .and_then(|p| p.metadata.name)
        .expect("the node proxy on the node");
    agents
        .patch(
            &proxy,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"annotations": {meshgate_testenv::karpenter::FAILED: "true"}}}),
            ),
        )
        .await
        .expect("agent failed");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    common::wait_for(
        "the node re-tainted after the grace period",
        Duration::from_secs(60),
        || async {
            nodes.get(node).await.is_ok_and(|n| {
                n.spec
                    .and_then(|s| s.taints)
                    .is_some_and(|ts| ts.iter().any(|t| t.key == key))
            })
        },
    )
    .await;
    let claims =
        Api::<kube::api::DynamicObject>::all_with(client.clone(), &karpenter::node_claims());
    let before: std::collections::BTreeSet<String> = claims
        .list(&kube::api::ListParams::default())
        .await
        .expect("claims")
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "after-failure", "annotations": {"karpenter.sh/do-not-disrupt": "true"}},
        "spec": {"containers": [{"name": "app", "image": "app", "resources": {"requests": {"cpu": "1"}}}]}}))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("pod");
    // Karpenter decides: a new NodeClaim for the pod, or the pod nominated to a node it counts on
    // (its event). Either is its answer; then the agent comes back (its pod replaced, as a
    // DaemonSet does after a crash) and the pod runs.
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(
        client.clone(),
        pods.namespace().unwrap_or_default(),
    );
    common::wait_for(
        "Karpenter to launch a node for the pod or nominate it",
        Duration::from_secs(120),
        || async {
            let nominated = events
                .list(&kube::api::ListParams::default().fields("involvedObject.name=after-failure"))
                .await
                .is_ok_and(|l| {
                    l.items
                        .iter()
                        .any(|e| e.reason.as_deref() == Some("Nominated"))
                });
            let launched = claims
                .list(&kube::api::ListParams::default())
                .await
                .is_ok_and(|l| {
                    l.items.iter().any(|c| {
                        c.metadata
                            .name
                            .as_ref()
                            .is_some_and(|n| !before.contains(n))
                    })
                });
            nominated || launched
        },
    )
    .await;
    let _ = agents.delete(&proxy, &DeleteParams::default()).await;
    common::wait_for(
        "the pod to run once the agent is back",
        Duration::from_secs(120),
        || async { pods.get("after-failure").await.is_ok_and(|p| ready(&p)) },
    )
    .await;
    let placed = pods
        .get("after-failure")
        .await
        .expect("pod")
        .spec
        .and_then(|s| s.node_name)
        .expect("bound");
    let launched: Vec<String> = claims
        .list(&kube::api::ListParams::default())
        .await
        .expect("claims")
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| !before.contains(n))
        .collect();
    eprintln!(
        "measured: an agent failed on {node}: re-tainted; for a pod that fit there Karpenter launched {launched:?}; the pod runs on {placed} once the agent is back"
    );
    assert!(launched.len() <= 1, "no launch loop: {launched:?}");
    if placed == node {
        assert!(
            launched.is_empty(),
            "a node launched and not used: {launched:?}"
        );
    }
}

async fn legacy_gate_fails_check(cp: &meshgate_testenv::ControlPlane, client: &kube::Client) {
    let gate: meshgate_api::NodeGate = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "NodeGate", "metadata": {"name": "legacy-key"},
        "spec": {"taint": {"key": meshgate_api::names::DEFAULT_TAINT_KEY}, "dryRun": true,
                 "nodeSelector": {"matchLabels": {"pool": "none"}},
                 "agents": [{"name": "cni", "namespace": "istio-system", "selector": {"matchLabels": {"k8s-app": "istio-cni-node"}}}]},
    }))
    .expect("gate");
    let gates = Api::<meshgate_api::NodeGate>::all(client.clone());
    gates
        .create(&PostParams::default(), &gate)
        .await
        .expect("gate");
    let out = cli(cp, &["check", "--namespace", NS, "-o", "json"]).await;
    let checks: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check's JSON");
    assert!(!out.status.success(), "check fails");
    let failed: Vec<&serde_json::Value> = checks
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["name"] == "autoscalers" && c["ok"] == false)
        .collect();
    assert!(
        failed.len() == 1
            && failed[0]["message"]
                .as_str()
                .is_some_and(|m| m.contains("legacy-key") && m.contains("Karpenter"))
            && failed[0]["hint"]
                .as_str()
                .is_some_and(|h| h.contains("--taint-key readiness.k8s.io/mesh-agents")),
        "{failed:#?}"
    );
    let _ = gates.delete("legacy-key", &DeleteParams::default()).await;
}

#[tokio::test]
async fn meshgate_beside_the_real_karpenter() {
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        scheduler: true,
        ..Default::default()
    })
    .await
    .expect("control plane");
    let karpenter = Autoscaler::start(&cp, &karpenter::Options::default())
        .await
        .expect("Karpenter and KWOK start");
    eprintln!("measured: Karpenter running ({})", karpenter.version);
    let client = cp.client().await.expect("client");
    let seen = Arc::new(Mutex::new(Seen::default()));
    let watches = watch(&client, &seen);
    create_agents(&client).await;

    // install refuses what Karpenter cannot provision for, naming the fix; the default passes.
    for (args, fix) in [
        (vec!["--strategy", "resource"], "--strategy taint"),
        (vec!["--strategy", "dra"], "--strategy taint"),
        (
            vec!["--taint-key", "node.meshgate.dev/agent-not-ready"],
            "--taint-key readiness.k8s.io/mesh-agents",
        ),
    ] {
        let mut all = vec![
            "install",
            "--profile",
            "istio-ambient",
            "--namespace",
            NS,
            "--apply",
            "--dry-run",
        ];
        all.extend(&args);
        let out = cli(&cp, &all).await;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("would stop the cluster from scaling")
                && err.contains(fix),
            "install {args:?}: {err}"
        );
    }

    for (i, profile) in PROFILES.iter().enumerate() {
        let pairs = if i == 0 { 5 } else { 2 };
        let (mut mg, said) = Meshgate::install(&cp, profile).await;
        eprintln!("{profile}: installed");
        if i == 0 {
            assert!(
                said.contains("autoscaler found: Karpenter")
                    && said
                        .contains("gate taint: readiness.k8s.io/mesh-agents (Karpenter was found"),
                "{said}"
            );
            // The gate's key is one Karpenter knows, and check says so.
            let out = cli(&cp, &["check", "--namespace", NS, "-o", "json"]).await;
            let checks: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("check's JSON");
            let autoscalers: Vec<&serde_json::Value> = checks
                .as_array()
                .expect("checks")
                .iter()
                .filter(|c| c["name"] == "autoscalers")
                .collect();
            assert!(
                !autoscalers.is_empty() && autoscalers.iter().all(|c| c["ok"] == true),
                "{autoscalers:#?}"
            );
        }
        // Nodes Karpenter launched for the installed Deployments before they were scaled to 0.
        delete_all_nodes(&client).await;
        let mut with = Vec::new();
        let mut without = Vec::new();
        for pair in 0..pairs {
            if pair > 0 {
                mg.on(&cp, &client).await;
            }
            let r = round(
                &cp,
                &client,
                &seen,
                profile,
                PODS,
                &format!("default-{profile} round {pair}"),
                false,
            )
            .await;
            eprintln!(
                "measured: default-{profile} round {pair}: NodeClaims {:?}, early {}, release p50 {:.2?} max {:.2?}",
                r.launched,
                r.early,
                percentile(&r.release, 50.0),
                percentile(&r.release, 100.0)
            );
            with.push(r);
            mg.off(&client).await;
            let r = round(
                &cp,
                &client,
                &seen,
                profile,
                PODS,
                &format!("none-{profile} round {pair}"),
                false,
            )
            .await;
            eprintln!(
                "measured: none-{profile} round {pair}: NodeClaims {:?}, early {}",
                r.launched, r.early
            );
            without.push(r);
        }
        for (w, n) in with.iter().zip(&without) {
            assert_eq!(
                w.launched, n.launched,
                "{profile}: Karpenter launched the same NodeClaims with meshgate as without"
            );
            assert_eq!(
                w.early, 0,
                "{profile}: no mesh pod bound before its node's agents were Ready"
            );
            assert_eq!(
                w.initialized_early, 0,
                "{profile}: NodeClaims Initialized only after meshgate lifted its taint"
            );
            assert!(
                n.early > 0,
                "{profile}: without meshgate the race shows (pods bound before the agents were Ready): {n:?}"
            );
        }
        let release: Vec<Duration> = with.iter().flat_map(|r| r.release.clone()).collect();
        eprintln!(
            "measured: {profile}: NodeClaims with/without meshgate {}/{} over {pairs} rounds; agents Ready -> mesh pod Running p50 {:.2?} p99 {:.2?}",
            with.iter().map(|r| r.launched.len()).sum::<usize>(),
            without.iter().map(|r| r.launched.len()).sum::<usize>(),
            percentile(&release, 50.0),
            percentile(&release, 99.0)
        );
    }
    // A burst over many new nodes, beside the same burst with meshgate off; the nodes of the
    // gated burst go by consolidation.
    let (mut mg, _) = Meshgate::install(&cp, "istio-ambient").await;
    delete_all_nodes(&client).await;
    let with = round(
        &cp,
        &client,
        &seen,
        "istio-ambient",
        BURST,
        "default-istio-ambient burst",
        true,
    )
    .await;
    mg.off(&client).await;
    let without = round(
        &cp,
        &client,
        &seen,
        "istio-ambient",
        BURST,
        "none-istio-ambient burst",
        false,
    )
    .await;
    eprintln!(
        "measured: burst of {BURST}: NodeClaims with/without meshgate {}/{}, early {}/{}; agents Ready -> mesh pod Running p50 {:.2?} p99 {:.2?}",
        with.launched.len(),
        without.launched.len(),
        with.early,
        without.early,
        percentile(&with.release, 50.0),
        percentile(&with.release, 99.0)
    );
    assert!(
        with.launched.len() >= 10,
        "the burst takes many nodes: {with:?}"
    );
    // Karpenter packs a burst by its batches (pods arrive over seconds, as the ReplicaSet
    // controller creates them, and it re-plans around the pods the scheduler has already
    // placed), so two bursts of the same pods differ by a node either way: 30 and 31 NodeClaims
    // over five rounds of Karpenter alone, and pairs of 31/30 and 30/31 with and without
    // meshgate (`karpenter_scaleup`, BENCHMARKS.md). meshgate must add no more than that one
    // node of Karpenter's own variation; a launch loop (a node every 10 s per tainted node, as
    // with a key Karpenter does not know) adds many.
    let cpus = |r: &Round| -> u32 {
        r.launched
            .iter()
            .filter_map(|t| t.strip_prefix("c-")?.split('x').next()?.parse::<u32>().ok())
            .sum()
    };
    let largest = karpenter::Options::default()
        .instance_types
        .iter()
        .map(|t| t.cpu)
        .max()
        .unwrap_or(0);
    assert!(
        cpus(&with) <= cpus(&without) + largest,
        "the burst: no more capacity than Karpenter alone launched, give or take its own one node: {} against {} CPUs ({:?} / {:?})",
        cpus(&with),
        cpus(&without),
        with.launched,
        without.launched
    );
    assert_eq!(
        with.early, 0,
        "the burst: no mesh pod bound before its node's agents were Ready"
    );
    assert_eq!(
        with.initialized_early, 0,
        "the burst: Initialized after the taint was lifted"
    );

    // Pods the taint cannot hold get the init gate: one that tolerates every taint (Karpenter
    // provisions for it as for any pod), and one created bound to that node by name.
    mg.on(&cp, &client).await;
    tolerating_and_bound_pods(&cp, &client).await;

    // A gate keyed outside Karpenter's startup taints: check fails and names the fix.
    legacy_gate_fails_check(&cp, &client).await;
    mg.off(&client).await;
    delete_all_nodes(&client).await;

    for w in watches {
        w.abort();
    }
    karpenter
        .check_alive()
        .expect("Karpenter, KWOK and the controller-manager ran throughout");
}
