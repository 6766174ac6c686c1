//! `meshgate demo` on the real control plane, with simulated nodes (`MESHGATE_SKIP_REAL_NODE=1`):
//! the story runs to its end, and a healthy run prints no ERROR or WARN line and no build output
//! (the API server not ready yet is a retry at debug level; a watch that reconnects is info).
//!
//! Needs the demo's harness: `cargo test -p meshgate --features demo --test demo` (tools/test.sh
//! runs it).

use std::process::Command;

#[test]
fn a_healthy_demo_prints_its_story_and_no_error_or_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_meshgate"))
        .arg("demo")
        .env("MESHGATE_SKIP_REAL_NODE", "1")
        .env("MESHGATE_BUILD_LOG", dir.path().join("build.log"))
        .env_remove("RUST_LOG")
        .output()
        .expect("meshgate demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "meshgate demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for told in [
        "1. Starting a local control plane",
        "A real node: not on this host",
        "skipped (MESHGATE_SKIP_REAL_NODE=1)",
        "Summary",
        "Done: the control plane and meshgate are stopped",
    ] {
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
}
