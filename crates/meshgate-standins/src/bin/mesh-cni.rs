//! `mesh-cni`: a chained CNI plugin that installs a mesh-style outbound redirect in each new pod's
//! network namespace (see the crate docs). The container runtime runs it with `CNI_COMMAND`,
//! `CNI_NETNS` and `CNI_ARGS` set and the network configuration on stdin.

use std::io::{Read, Write};
use std::process::{Command, ExitCode, Stdio};

use meshgate_standins::cni::{CniError, Config, version_result};

fn main() -> ExitCode {
    let mut stdin = String::new();
    let _ = std::io::stdin().read_to_string(&mut stdin);
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let result = match command.as_str() {
        "VERSION" => {
            let version =
                Config::parse(&stdin).map_or_else(|_| "1.0.0".to_owned(), |c| c.cni_version);
            Ok(Some(version_result(&version)))
        }
        "ADD" => add(&stdin).map(Some),
        // The network namespace goes with the sandbox, and the rules with it.
        "DEL" | "CHECK" => Ok(None),
        other => Err(CniError::new(
            4,
            format!("CNI_COMMAND {other:?} is not ADD, DEL, CHECK or VERSION"),
        )),
    };
    match result {
        Ok(out) => {
            if let Some(out) = out {
                let _ = writeln!(std::io::stdout(), "{out}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let version =
                Config::parse(&stdin).map_or_else(|_| "1.0.0".to_owned(), |c| c.cni_version);
            let _ = writeln!(std::io::stdout(), "{}", e.to_json(&version));
            ExitCode::FAILURE
        }
    }
}

fn add(stdin: &str) -> Result<serde_json::Value, CniError> {
    let config = Config::parse(stdin)?;
    let args = std::env::var("CNI_ARGS").unwrap_or_default();
    if !config.redirects(&args) {
        return Ok(config.add_result());
    }
    let netns = std::env::var("CNI_NETNS")
        .ok()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| CniError::new(4, "CNI_NETNS is not set"))?;
    let mut child = Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .args(["iptables-restore", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CniError::new(5, format!("running nsenter iptables-restore: {e}")))?;
    if let Some(mut input) = child.stdin.take() {
        input
            .write_all(config.rules().as_bytes())
            .map_err(|e| CniError::new(5, format!("writing the rules: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| CniError::new(5, format!("waiting for iptables-restore: {e}")))?;
    if !out.status.success() {
        return Err(CniError::new(
            999,
            format!(
                "iptables-restore in {netns} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(config.add_result())
}
