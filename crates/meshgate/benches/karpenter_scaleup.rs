//! Scale-up beside the real Karpenter (v1.15.0, its KWOK provider) and KWOK v0.8.0: each
//! profile's default install against meshgate off, in alternating rounds on one control plane
//! (`tests/common/karpenter.rs`, the scenarios of the `karpenter` test).
//!
//! For each profile, `MESHGATE_BENCH_ROUNDS` pairs (default 5) of 6 one-CPU mesh pods created with
//! no node, then `MESHGATE_BENCH_BURST_ROUNDS` pairs (default 1) of a 200-pod burst (istio-ambient
//! only), printing:
//! * `RATIO nodeclaims-default-<profile>/none`: NodeClaims Karpenter launched with meshgate over
//!   without, median of the per-round ratios, with the spread;
//! * `VALUE early-default-<profile>` and `VALUE early-none-<profile>`: mesh pods bound before every
//!   agent of their node was Ready (the race; meshgate's must be 0);
//! * `VALUE release-p50-default-<profile>-ms`, `...-p99-...`: from the last agent Ready on a pod's
//!   node to the pod Running; `VALUE release-<leg>-p50-...` (with its p99) that time in legs:
//!   `untaint` (to the taint seen lifted: meshgate), `bind` (to the binding seen: the scheduler),
//!   `run` (to Running seen: KWOK);
//! * `VALUE schedulable-to-running-p50-<default|none>-<profile>-ms` (with its p99): from a pod's
//!   node first seen open to scheduling (Ready, no `NoSchedule`/`NoExecute` taint) to the pod
//!   Running, with meshgate and without: the scheduler's and the kubelets' share, the floor
//!   under the release;
//! * `RATIO scaleup-default-<profile>/none`: from the Deployment's creation to its last pod
//!   Running, with over without meshgate (the agents' start, 5 s here, is what meshgate waits for).
//!
//! Run: `MESHGATE_CONTROLPLANE_BIN=... MESHGATE_NODE_BIN=... MESHGATE_KARPENTER=... cargo bench -p
//! meshgate --bench karpenter_scaleup` (BENCHMARKS.md); `MESHGATE_BENCH_SCHEDULER_FLAGS` adds
//! kube-scheduler flags (e.g. `--kube-api-qps=500 --kube-api-burst=1000`).

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[path = "../tests/common/mod.rs"]
mod common;

use common::karpenter::*;
use meshgate_testenv::karpenter::{self, Autoscaler};

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    if xs.is_empty() {
        return f64::NAN;
    }
    xs[xs.len() / 2]
}

fn spread(xs: &[f64]) -> (f64, f64) {
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// Prints the figures of `pairs` (with meshgate, without) under `name`.
fn report(name: &str, pairs: &[(Round, Round)]) {
    let ratio = |f: &dyn Fn(&Round) -> f64| -> Vec<f64> {
        pairs.iter().map(|(w, n)| f(w) / f(n)).collect()
    };
    let claims = ratio(&|r| r.launched.len() as f64);
    let (lo, hi) = spread(&claims);
    println!(
        "RATIO nodeclaims-default-{name}/none: {:.2} (spread {lo:.2}-{hi:.2}, {} rounds)",
        median(claims.clone()),
        pairs.len()
    );
    // Each pair's launches, and how many came after the scheduler had started binding the
    // round's pods (Karpenter re-plans around the scheduler's placements: its own variation).
    let per_pair: Vec<String> = pairs
        .iter()
        .map(|(w, n)| {
            format!(
                "{}/{} ({}/{} after a binding)",
                w.launched.len(),
                n.launched.len(),
                w.launched_after_binding,
                n.launched_after_binding
            )
        })
        .collect();
    println!(
        "VALUE nodeclaims-per-pair-{name} (with/without): {}",
        per_pair.join(", ")
    );
    let scaleup = ratio(&|r| r.elapsed.as_secs_f64());
    let (lo, hi) = spread(&scaleup);
    println!(
        "RATIO scaleup-default-{name}/none: {:.2} (spread {lo:.2}-{hi:.2})",
        median(scaleup.clone())
    );
    let early_with: usize = pairs.iter().map(|(w, _)| w.early).sum();
    let early_without: usize = pairs.iter().map(|(_, n)| n.early).sum();
    let pods: usize = pairs.iter().map(|(w, _)| w.release.len()).sum();
    println!("VALUE early-default-{name}: {early_with} of {pods} pods");
    println!("VALUE early-none-{name}: {early_without}");
    let release: Vec<Duration> = pairs.iter().flat_map(|(w, _)| w.release.clone()).collect();
    println!(
        "VALUE release-p50-default-{name}-ms: {:.0}",
        percentile(&release, 50.0).as_secs_f64() * 1000.0
    );
    println!(
        "VALUE release-p99-default-{name}-ms: {:.0}",
        percentile(&release, 99.0).as_secs_f64() * 1000.0
    );
    // Where the release's time goes (docs/design.md, "Autoscalers").
    for (i, leg) in ["untaint", "bind", "run"].iter().enumerate() {
        let xs: Vec<Duration> = pairs
            .iter()
            .flat_map(|(w, _)| w.legs.iter().map(|l| l[i]))
            .collect();
        println!(
            "VALUE release-{leg}-p50-default-{name}-ms: {:.0} (p99 {:.0})",
            percentile(&xs, 50.0).as_secs_f64() * 1000.0,
            percentile(&xs, 99.0).as_secs_f64() * 1000.0
        );
    }
    // The same scheduler and kubelets without meshgate: from a node open to scheduling to its
    // pods Running, both ways (the floor under the release above).
    for (way, pick) in [
        (
            "default",
            &(|p: &(Round, Round)| p.0.from_schedulable.clone())
                as &dyn Fn(&(Round, Round)) -> Vec<Duration>,
        ),
        ("none", &|p: &(Round, Round)| p.1.from_schedulable.clone()),
    ] {
        let xs: Vec<Duration> = pairs.iter().flat_map(pick).collect();
        println!(
            "VALUE schedulable-to-running-p50-{way}-{name}-ms: {:.0} (p99 {:.0}, {} pods)",
            percentile(&xs, 50.0).as_secs_f64() * 1000.0,
            percentile(&xs, 99.0).as_secs_f64() * 1000.0,
            xs.len()
        );
    }
    let same = pairs.iter().all(|(w, n)| w.launched == n.launched);
    println!("VALUE same-instance-types-{name}: {same}");
}

#[tokio::main]
async fn main() -> ExitCode {
    if !std::env::args().any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rounds = env_count("MESHGATE_BENCH_ROUNDS", 5).max(1);
    let bursts = env_count("MESHGATE_BENCH_BURST_ROUNDS", 1);
    // Extra kube-scheduler flags, e.g. its client's rate limit (`--kube-api-qps=500
    // --kube-api-burst=1000`): the scheduler's status patch of every failed attempt and its
    // bindings share that limit (on 2 shared cores raising it did not shorten a burst's
    // release: docs/design.md, "Autoscalers").
    let scheduler_flags: Vec<String> = std::env::var("MESHGATE_BENCH_SCHEDULER_FLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    println!(
        "VALUE scheduler-flags: {}",
        if scheduler_flags.is_empty() {
            "(defaults)".to_string()
        } else {
            scheduler_flags.join(" ")
        }
    );
    let cp = match meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        scheduler: true,
        scheduler_flags,
        ..Default::default()
    })
    .await
    {
        Ok(cp) => cp,
        Err(e) => {
            eprintln!("karpenter_scaleup: control plane: {e}");
            return ExitCode::FAILURE;
        }
    };
    let scaler = match Autoscaler::start(&cp, &karpenter::Options::default()).await {
        Ok(k) => k,
        Err(e) => {
            eprintln!("karpenter_scaleup: Karpenter: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("VALUE karpenter: {}", scaler.version);
    let client = cp.client().await.expect("client");
    let seen = Arc::new(Mutex::new(Seen::default()));
    let watches = watch(&client, &seen);
    create_agents(&client).await;
    for profile in PROFILES {
        let (mut mg, _) = Meshgate::install(&cp, profile).await;
        delete_all_nodes(&client).await;
        let mut pairs = Vec::new();
        for pair in 0..rounds {
            if pair > 0 {
                mg.on(&cp, &client).await;
            }
            let label = format!("default-{profile} round {pair}");
            let with = round(&cp, &client, &seen, profile, PODS, &label, false).await;
            mg.off(&client).await;
            let label = format!("none-{profile} round {pair}");
            let without = round(&cp, &client, &seen, profile, PODS, &label, false).await;
            pairs.push((with, without));
        }
        report(profile, &pairs);
    }
    if bursts > 0 {
        let profile = "istio-ambient";
        let (mut mg, _) = Meshgate::install(&cp, profile).await;
        delete_all_nodes(&client).await;
        let mut pairs = Vec::new();
        for pair in 0..bursts {
            if pair > 0 {
                mg.on(&cp, &client).await;
            }
            let label = format!("default-{profile} burst {pair}");
            let with = round(&cp, &client, &seen, profile, BURST, &label, false).await;
            mg.off(&client).await;
            let label = format!("none-{profile} burst {pair}");
            let without = round(&cp, &client, &seen, profile, BURST, &label, false).await;
            pairs.push((with, without));
        }
        report(&format!("{profile}-{BURST}"), &pairs);
    }
    for w in watches {
        w.abort();
    }
    if let Err(e) = scaler.check_alive() {
        eprintln!("karpenter_scaleup: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
