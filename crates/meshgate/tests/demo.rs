//! `meshgate demo` on the real control plane, with simulated nodes (`MESHGATE_SKIP_REAL_NODE=1`):
//! the story runs to its end, and a healthy run prints no ERROR or WARN line and no build output
//! (the API server not ready yet is a retry at debug level; a watch that reconnects is info).
//!
//! Then, where this host runs a real node and Istio is built (`MESHGATE_ISTIO`, `MESHGATE_HELM`,
//! as tools/test.sh and tools/demo.sh set them), the whole demo with its real node: it says it
//! runs the real Istio, and tells what the real components did (the node agent's annotation on
//! the pod, the gate's line, the host restored), again without ERROR or WARN.
//!
//! Needs the demo's harness: `cargo test -p meshgate --features demo --test demo` (tools/test.sh
//! runs it).

use std::process::Command;

/// Runs `meshgate demo` with `env`; asserts it succeeded, told each of `told`, and printed no
/// ERROR, WARN or build line; returns its stdout.
fn demo(env: &[(&str, &std::ffi::OsStr)], told: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut command = Command::new(env!("CARGO_BIN_EXE_meshgate"));
    command
        .arg("demo")
        .env("MESHGATE_BUILD_LOG", dir.path().join("build.log"))
        .env_remove("RUST_LOG");
    for (k, v) in env {
        command.env(k, v);
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
        &[("MESHGATE_SKIP_REAL_NODE", "1".as_ref())],
        &[
            "1. Starting a local control plane",
            "A real node: not on this host",
            "skipped (MESHGATE_SKIP_REAL_NODE=1)",
            "Summary",
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
        &[("MESHGATE_ISTIO", &istio), ("MESHGATE_HELM", &helm)],
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
        summary.contains("tainted at registration [\"node.meshgate.dev/"),
        "the real node was tainted at registration by meshgate: {summary}"
    );
}
