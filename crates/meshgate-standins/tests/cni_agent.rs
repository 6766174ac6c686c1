//! `mesh-cni-agent`: after its delay it installs the plugin and chains it into the node's
//! conflist (once, whatever else the list holds), then reports ready. Plain files: no root.

use std::process::Command;
use std::time::{Duration, Instant};

const AGENT: &str = env!("CARGO_BIN_EXE_mesh-cni-agent");
const PLUGIN: &str = env!("CARGO_BIN_EXE_mesh-cni");

#[test]
fn chains_the_plugin_after_its_delay_and_reports_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (conf, bin) = (dir.path().join("net.d"), dir.path().join("bin"));
    std::fs::create_dir_all(&conf).expect("conf dir");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let list = serde_json::json!({"cniVersion": "1.0.0", "name": "node",
        "plugins": [{"type": "bridge", "bridge": "cni0"}, {"type": "portmap"}]});
    std::fs::write(conf.join("10-node.conflist"), list.to_string()).expect("conflist");
    std::fs::write(conf.join("99-other.conflist"), list.to_string()).expect("other conflist");
    let ready = dir.path().join("ready");
    let started = Instant::now();
    let mut agent = Command::new(AGENT)
        .arg("--cni-conf-dir")
        .arg(&conf)
        .arg("--cni-bin-dir")
        .arg(&bin)
        .arg("--plugin")
        .arg(PLUGIN)
        .args(["--ready-delay", "0.5"])
        .arg("--ready-file")
        .arg(&ready)
        .spawn()
        .expect("agent");
    let check = || {
        Command::new(AGENT)
            .arg("--check-ready")
            .arg(&ready)
            .status()
            .expect("check")
            .success()
    };
    assert!(!check(), "not ready during its delay");
    while !check() {
        assert!(started.elapsed() < Duration::from_secs(10), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "ready only after the delay"
    );
    let _ = agent.kill();
    let _ = agent.wait();
    let chained: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(conf.join("10-node.conflist")).expect("read"),
    )
    .expect("json");
    let types: Vec<&str> = chained["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .filter_map(|p| p["type"].as_str())
        .collect();
    assert_eq!(types, ["bridge", "portmap", "mesh-cni"]);
    let other: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(conf.join("99-other.conflist")).expect("read"),
    )
    .expect("json");
    assert_eq!(other, list, "only the conflist the runtime uses is changed");
    assert!(bin.join("mesh-cni").exists(), "plugin installed");
}
