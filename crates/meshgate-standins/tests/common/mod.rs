//! Shared by the network-namespace tests.

use std::process::Command;

/// Runs meshgate's gate (`gate`, the binary) with `args` in the network namespace at `netns`
/// as uid 65532 (non-root, as the init gate runs in a pod): its exit code and its line.
pub fn gate_in_netns(gate: &std::path::Path, netns: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .args([
            "setpriv",
            "--reuid",
            "65532",
            "--regid",
            "65532",
            "--clear-groups",
        ])
        .arg(gate)
        .args(args)
        .output()
        .expect("gate ran");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    )
}
