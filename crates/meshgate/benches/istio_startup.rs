//! What meshgate's default gate costs a mesh pod's start behind the real Istio on the real
//! node: istiod's injector, the istio-cni node agent and its CNI plugin (built from Istio's Go
//! module, installed from Istio's charts, as `real_istio` installs them; the proxy and the
//! ambient node proxy are the stand-ins `real_istio` documents), with meshgate installed in the
//! cluster as users install it (`meshgate install --profile istio-<mode>`, the default
//! strategy).
//!
//! For each mode (`MESHGATE_BENCH_MODES`, default `sidecar,ambient`) a cluster of its own: the
//! control plane, meshgate, the real node, Istio in that mode (istiod tolerating meshgate's
//! startup taint, as docs/design.md tells ambient users), its agents Ready and the node
//! released. Then `MESHGATE_BENCH_ROUNDS` rounds (default 8), each four pods of the same app in
//! the mode's mesh namespace (`istio-injection=enabled`, or
//! `istio.io/dataplane-mode=ambient`), in an order shuffled anew every round:
//! * `istio-<mode>-scheduled`: opted out of meshgate (`meshgate.dev/inject: "false"`): Istio
//!   alone; placed by the scheduler;
//! * `meshgate-<mode>-scheduled`: the same pod with meshgate's default (for a scheduled pod,
//!   the gate resource);
//! * `istio-<mode>-bound`, `meshgate-<mode>-bound`: the same two, bound by `nodeName`, which no
//!   scheduling layer holds: meshgate's default is `meshgate-wait` in ambient mode, and nothing
//!   in sidecar mode, where the injector's own `istio-validation` holds the pod (the verdict
//!   `none: mesh-validates`; the ratio then shows what two identical pods differ by).
//!
//! Each is timed from the create call to the app container `Running` and to the pod `Ready`,
//! then deleted, and the next starts once the kubelet has torn it down. Before a time counts,
//! the pod is checked for what the real components did (the injector's
//! `sidecar.istio.io/status`, or the node agent's `ambient.istio.io/redirection: enabled`) and
//! for meshgate's verdict (`meshgate.dev/gate`: one with meshgate, printed with the figures;
//! none opted out): a bench that timed an uncaptured pod, or a pod meshgate did not see, fails
//! instead of printing.
//!
//! `RATIO meshgate-<mode>-<placement>/istio-<mode>-<placement>`: the median over rounds of the
//! round's ratio; `VALUE` lines give the medians and spread.
//!
//! Needs what `real_istio` needs (root, the node binaries, the control plane, Istio's build and
//! Helm: tools/test.sh builds them all). Run: `cargo bench -p meshgate --bench istio_startup`.
//! Without `--bench` (as `cargo test --benches` runs it) it does nothing.

use std::process::ExitCode;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use meshgate_testenv::istio::InstallOptions;
use meshgate_testenv::node::NodeOptions;
use serde_json::{Value, json};

#[path = "../tests/common/mod.rs"]
mod common;
mod pod_start;

use common::cluster::{wait_meshgate_ready, wait_taint_lifted};
use common::istio::{POD_LIMIT as ISTIO_LIMIT, Setup, mesh_pod, wait_agent_ready, wait_istiod};
use pod_start::*;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The mesh namespace of every mode.
const NS: &str = "mesh";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Sidecar,
    Ambient,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Sidecar => "sidecar",
            Mode::Ambient => "ambient",
        }
    }

    fn namespace_labels(self) -> Value {
        match self {
            Mode::Sidecar => json!({"istio-injection": "enabled"}),
            Mode::Ambient => json!({"istio.io/dataplane-mode": "ambient"}),
        }
    }

    /// What the real Istio did to the pod: its injector's status, or its node agent's
    /// redirection.
    fn captured(self, p: &Pod) -> bool {
        let annotations = p.metadata.annotations.as_ref();
        match self {
            Mode::Sidecar => annotations.is_some_and(|a| a.contains_key("sidecar.istio.io/status")),
            Mode::Ambient => {
                annotations.and_then(|a| a.get("ambient.istio.io/redirection"))
                    == Some(&"enabled".to_owned())
            }
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    if !std::env::args().any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rounds = env_count("MESHGATE_BENCH_ROUNDS", 8).max(1);
    let modes = std::env::var("MESHGATE_BENCH_MODES").unwrap_or_else(|_| "sidecar,ambient".into());
    for mode in modes.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        let mode = match mode {
            "sidecar" => Mode::Sidecar,
            "ambient" => Mode::Ambient,
            other => {
                eprintln!("istio_startup: unknown mode {other:?} (sidecar, ambient)");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = bench(mode, rounds).await {
            eprintln!("istio_startup: {}: {e}", mode.name());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

async fn bench(mode: Mode, rounds: usize) -> Result<(), Error> {
    eprintln!(
        "istio_startup: {}: control plane, meshgate, the real node, Istio",
        mode.name()
    );
    let setup = Setup::start(
        &format!("istio-{}", mode.name()),
        NodeOptions {
            proxy: true,
            // The real ambient node agent reads the host's network namespace through
            // /host/proc/1 (see `real_istio`).
            own_namespaces: mode == Mode::Ambient,
            ..NodeOptions::default()
        },
    )
    .await;
    let (client, node) = (&setup.client, &setup.node);
    setup.namespace(NS, mode.namespace_labels()).await;
    let t = Instant::now();
    setup.install_istio(&InstallOptions {
        ambient: mode == Mode::Ambient,
        istiod_tolerates: vec![meshgate_api::names::STARTUP_TAINT_KEY.to_owned()],
    });
    wait_meshgate_ready(client, node).await;
    wait_agent_ready(client, node, "k8s-app=istio-cni-node").await;
    if mode == Mode::Ambient {
        wait_agent_ready(client, node, "app=ztunnel").await;
    }
    wait_taint_lifted(client, node, ISTIO_LIMIT).await;
    wait_istiod(client, node, NS).await;
    eprintln!(
        "istio_startup: {}: Istio installed -> agents Ready, node released, istiod serving in {:.1?}",
        mode.name(),
        t.elapsed()
    );

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let kinds = ["istio", "meshgate"];
    let placements = ["scheduled", "bound"];
    let mut variants = Vec::new();
    for placement in placements {
        for kind in kinds {
            variants.push((kind, placement));
        }
    }
    let label = |kind: &str, placement: &str| format!("{kind}-{}-{placement}", mode.name());
    let mut times = Rounds::default();
    let mut verdicts = std::collections::BTreeMap::new();
    let mut n = 0usize;
    let outcome: Result<(), Error> = async {
        for round in 0..rounds {
            times.new_round();
            for i in shuffled(variants.len(), round as u64) {
                let (kind, placement) = variants[i];
                n += 1;
                let name = format!("{kind}-{placement}-{n}");
                let mut extra = json!({});
                if kind == "istio" {
                    extra["metadata"] = json!({"labels": {meshgate_api::names::OPT_OUT: "false"}});
                }
                if placement == "bound" {
                    extra["spec"] = json!({"nodeName": node.name()});
                }
                let pod = serde_json::to_value(mesh_pod(&name, extra))?;
                let started = start_pod(&pods, &pod, &name).await?;
                if let Some(v) = check(mode, kind, &started.pod)? {
                    verdicts.insert(label(kind, placement), v);
                }
                times.record(&label(kind, placement), &started);
                remove_pod(&pods, node, &started).await?;
            }
            eprintln!(
                "istio_startup: {}: round {}: {}",
                mode.name(),
                round + 1,
                times.last()
            );
        }
        Ok(())
    }
    .await;
    if outcome.is_ok() {
        println!(
            "\n== {} mesh pod start behind the real Istio {} (create -> app Running; -> Ready), {rounds} rounds",
            mode.name(),
            setup.istio.version
        );
        for (name, verdict) in &verdicts {
            println!("{name}: meshgate's verdict {verdict:?}");
        }
        let names: Vec<String> = variants.iter().map(|(k, p)| label(k, p)).collect();
        times.print_values(&names.iter().map(String::as_str).collect::<Vec<_>>());
        for placement in placements {
            times.print_ratio(&label("meshgate", placement), &label("istio", placement));
        }
    }
    setup.tear_down().await;
    outcome
}

/// The pod was captured by the real Istio, and carries meshgate's verdict only with meshgate;
/// the verdict, if any.
fn check(mode: Mode, kind: &str, p: &Pod) -> Result<Option<String>, Error> {
    let name = p.metadata.name.as_deref().unwrap_or_default();
    if !mode.captured(p) {
        return Err(format!(
            "{name}: Istio did not capture it ({} mode): annotations {:?}",
            mode.name(),
            p.metadata.annotations
        )
        .into());
    }
    let verdict = p
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(meshgate_api::names::GATE_VERDICT))
        .cloned();
    match (kind, &verdict) {
        ("meshgate", Some(_)) | ("istio", None) => Ok(verdict),
        _ => Err(format!(
            "{name}: meshgate's verdict {verdict:?} (expected one with meshgate, none opted out)"
        )
        .into()),
    }
}
