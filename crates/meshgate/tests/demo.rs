//! `meshgate demo` on the real control plane, with simulated nodes (`MESHGATE_SKIP_REAL_NODE=1`):
//! the story runs to its end, and a healthy run prints no ERROR or WARN line and no build output
//! (the API server not ready yet is a retry at debug level; a watch that reconnects is info).
//!
//! Where Karpenter is built (`MESHGATE_KARPENTER`), the same with the real Karpenter launching the
//! demo's new node on KWOK.
//!
//! Then, where this host runs a real node and Istio is built (`MESHGATE_ISTIO`, `MESHGATE_HELM`,
//! as tools/test.sh and tools/demo.sh set them), the whole demo with its real node: it says it
//! runs the real Istio, and tells what the real components did (the node agent's annotation on
//! the pod, the gate's line, the host restored), again without ERROR or WARN.
//!
//! Needs the demo's harness: `cargo test -p meshgate --features demo --test demo` (tools/test.sh
//! runs it).

use std::process::Command;

/// Runs `meshgate demo` with `env` (`None`: the variable removed); asserts it succeeded, told
/// each of `told`, and printed no ERROR, WARN or build line; returns its stdout.
fn demo(env: &[(&str, Option<&std::ffi::OsStr>)], told: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut command = Command::new(env!("CARGO_BIN_EXE_meshgate"));
    command
        .arg("demo")
        .env("MESHGATE_BUILD_LOG", dir.path().join("build.log"))
        .env_remove("RUST_LOG");
    for (k, v) in env {
        match v {
            Some(v) => command.env(k, v),
            None => command.env_remove(k),
        };
    }
    let out = command.output().expect("meshgate demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "meshgate demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for told in told {
        assert!(stdout.contains(told), "the story tells {told:?}:\n{stdout}");
    }
    let noisy: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("ERROR") || l.contains("WARN") || l.contains("Compiling"))
        .collect();
    assert!(
        noisy.is_empty(),
        "a healthy demo printed ERROR, WARN or build lines:\n{}",
        noisy.join("\n")
    );
    stdout
}

#[test]
fn a_healthy_demo_prints_its_story_and_no_error_or_warning() {
    demo(
        &[
            ("MESHGATE_SKIP_REAL_NODE", Some("1".as_ref())),
            ("MESHGATE_KARPENTER", None),
        ],
        &[
            "1. Starting a local control plane",
            "renders it by default: startup taint readiness.k8s.io/mesh-agents",
            "A new node registers",
            "\"readiness.k8s.io/mesh-agents:NoSchedule\"]\n           the kubelet reports Ready",
            "shop/web bound to node-1 once the taint was gone, with nothing added to it",
            "A real node: not on this host",
            "skipped (MESHGATE_SKIP_REAL_NODE=1)",
            "Summary",
            "Done: the control plane and meshgate are stopped",
        ],
    );
}

/// Where Karpenter is built (`MESHGATE_KARPENTER`, as tools/test.sh sets it), the demo's new
/// node is one the real Karpenter launched for the pending mesh pod, on KWOK: tainted at
/// registration, Initialized only after meshgate lifted the taint, and consolidated away once
/// the workload left.
#[test]
fn the_demo_autoscaler_is_the_real_karpenter_when_it_is_built() {
    let (Some(karpenter), Some(node)) = (
        std::env::var_os("MESHGATE_KARPENTER"),
        std::env::var_os("MESHGATE_NODE_BIN"),
    ) else {
        eprintln!(
            "skipped: Karpenter is not built (MESHGATE_KARPENTER, MESHGATE_NODE_BIN: tools/test.sh sets them)"
        );
        return;
    };
    demo(
        &[
            ("MESHGATE_SKIP_REAL_NODE", Some("1".as_ref())),
            ("MESHGATE_KARPENTER", Some(&karpenter)),
            ("MESHGATE_NODE_BIN", Some(&node)),
        ],
        &[
            "Starting the real Karpenter",
            "A mesh pod is created in namespace shop (ambient mode); no node can run it yet",
            "stored as written: no init container",
            "Karpenter launches a node for it",
            "first seen with taints [\"readiness.k8s.io/mesh-agents:NoSchedule\"]",
            "meshgate removed the startup taint",
            "Initialized only once meshgate's taint was gone",
            "and its NodeClaim are gone",
            "Karpenter launched it (c-4x-amd64-linux) for the pending pod",
            "Done: the control plane and meshgate are stopped",
        ],
    );
}

#[test]
fn the_demo_runs_the_real_istio_on_the_real_node_when_it_is_built() {
    if std::env::var_os("MESHGATE_SKIP_REAL_NODE").is_some_and(|v| v == "1") {
        eprintln!("skipped: MESHGATE_SKIP_REAL_NODE=1");
        return;
    }
    if let Err(e) = meshgate_testenv::node::prerequisites() {
        eprintln!("skipped: {e}");
        return;
    }
    let (Some(istio), Some(helm)) = (
        std::env::var_os("MESHGATE_ISTIO"),
        std::env::var_os("MESHGATE_HELM"),
    ) else {
        eprintln!(
            "skipped: Istio is not built (MESHGATE_ISTIO, MESHGATE_HELM: tools/test.sh sets them)"
        );
        return;
    };
    let stdout = demo(
        &[
            ("MESHGATE_ISTIO", Some(&istio)),
            ("MESHGATE_HELM", Some(&helm)),
        ],
        &[
            "with the real Istio",
            "the NodeGate mesh-agents now waits for Istio's CNI agent and node proxy",
            "installed from its own charts with Helm",
            "Istio's node agent enrolled it (ambient.istio.io/redirection: enabled)",
            "its gate logged: meshgate-wait: ready after",
            "the host is as it was",
            "Done: the control plane and meshgate are stopped",
        ],
    );
    let summary = stdout
        .lines()
        .find(|l| l.contains("real node") && l.contains("ran the real Istio"))
        .unwrap_or_else(|| panic!("the summary names the real Istio:\n{stdout}"));
    assert!(
        summary.contains("tainted at registration [\"readiness.k8s.io/mesh-agents"),
        "the real node was tainted at registration by meshgate: {summary}"
    );
}
