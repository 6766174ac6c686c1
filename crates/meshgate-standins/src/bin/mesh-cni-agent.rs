//! `mesh-cni-agent`: the CNI stand-in's node agent (a DaemonSet with the host's CNI directories
//! mounted). After `--ready-delay` seconds it copies the `mesh-cni` plugin into the CNI bin
//! directory and chains it into the node's conflist (the first `*.conflist` by name in the CNI
//! conf directory), then writes `--ready-file`, as a mesh's CNI agent does: pods whose sandbox
//! is created before that get no redirect. `--check-ready FILE` exits 0 when FILE exists.
//!
//! Usage: mesh-cni-agent --cni-conf-dir DIR --cni-bin-dir DIR --plugin PATH
//!        [--ready-delay SECONDS] [--ready-file PATH] [--entry JSON] | --check-ready PATH

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use meshgate_standins::conflist::{PLUGIN_TYPE, pick, with_plugin};

struct Args {
    conf_dir: PathBuf,
    bin_dir: PathBuf,
    plugin: PathBuf,
    delay: f64,
    ready_file: PathBuf,
    entry: serde_json::Value,
}

fn args() -> Result<Result<Args, bool>, String> {
    let (mut conf_dir, mut bin_dir, mut plugin) = (None, None, None);
    let mut delay = 0.0;
    let mut ready_file = PathBuf::from("/run/mesh-cni-agent/ready");
    let mut entry = serde_json::json!({"excludeNamespaces": ["kube-system"]});
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--check-ready" => return Ok(Err(Path::new(&value()?).exists())),
            "--cni-conf-dir" => conf_dir = Some(PathBuf::from(value()?)),
            "--cni-bin-dir" => bin_dir = Some(PathBuf::from(value()?)),
            "--plugin" => plugin = Some(PathBuf::from(value()?)),
            "--ready-delay" => {
                delay = value()?
                    .parse()
                    .map_err(|_| "--ready-delay takes seconds".to_owned())?
            }
            "--ready-file" => ready_file = PathBuf::from(value()?),
            "--entry" => {
                entry = serde_json::from_str(&value()?)
                    .map_err(|e| format!("--entry is not JSON: {e}"))?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Ok(Args {
        conf_dir: conf_dir.ok_or("--cni-conf-dir is required")?,
        bin_dir: bin_dir.ok_or("--cni-bin-dir is required")?,
        plugin: plugin.ok_or("--plugin is required")?,
        delay,
        ready_file,
        entry,
    }))
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(Ok(a)) => a,
        Ok(Err(ready)) => {
            return if ready {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            };
        }
        Err(e) => {
            eprintln!("mesh-cni-agent: {e}");
            return ExitCode::from(2);
        }
    };
    std::thread::sleep(Duration::from_secs_f64(a.delay.max(0.0)));
    match install(&a) {
        Ok(file) => eprintln!(
            "mesh-cni-agent: ready after {}s: {PLUGIN_TYPE} chained into {}",
            a.delay,
            file.display()
        ),
        Err(e) => {
            eprintln!("mesh-cni-agent: {e}");
            return ExitCode::FAILURE;
        }
    }
    loop {
        std::thread::park();
    }
}

/// Copies the plugin, chains it into the conflist (write to a temporary file, then rename: the
/// runtime never reads half a file), then writes the ready file. Returns the conflist's path.
fn install(a: &Args) -> Result<PathBuf, String> {
    let target = a.bin_dir.join(PLUGIN_TYPE);
    let tmp = a.bin_dir.join(format!(".{PLUGIN_TYPE}.tmp"));
    std::fs::copy(&a.plugin, &tmp).map_err(|e| format!("copying the plugin: {e}"))?;
    std::fs::rename(&tmp, &target).map_err(|e| format!("installing the plugin: {e}"))?;
    let names: Vec<String> = std::fs::read_dir(&a.conf_dir)
        .map_err(|e| format!("reading {}: {e}", a.conf_dir.display()))?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    let name = pick(&names).ok_or_else(|| format!("no *.conflist in {}", a.conf_dir.display()))?;
    let file = a.conf_dir.join(name);
    let text =
        std::fs::read_to_string(&file).map_err(|e| format!("reading {}: {e}", file.display()))?;
    let conflist: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let chained =
        with_plugin(&conflist, &a.entry).map_err(|e| format!("{}: {e}", file.display()))?;
    let tmp = a.conf_dir.join(format!(".{name}.tmp"));
    let body = serde_json::to_string_pretty(&chained).map_err(|e| e.to_string())?;
    std::fs::write(&tmp, body).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &file).map_err(|e| format!("replacing {}: {e}", file.display()))?;
    if let Some(dir) = a.ready_file.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&a.ready_file, "ready\n").map_err(|e| format!("writing the ready file: {e}"))?;
    Ok(file)
}
