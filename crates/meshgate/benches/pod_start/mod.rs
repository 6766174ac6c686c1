//! How the pod start benches (`pod_startup`, `istio_startup`) start, time and remove a pod on
//! the real node, order their rounds, and print what they measured.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use meshgate_testenv::node::RealNode;
use serde_json::Value;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Longest wait for one pod.
pub const POD_LIMIT: Duration = Duration::from_secs(60);

/// A count from the environment, else `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `0..n` in an order shuffled by `seed` (splitmix64 and Fisher-Yates): each round its own
/// order, the same for the same round in every run.
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// What one pod's start took, and the pod as it was when Ready.
pub struct Started {
    pub to_running: Duration,
    pub to_ready: Duration,
    pub pod: Pod,
}

impl Started {
    pub fn uid(&self) -> &str {
        self.pod.metadata.uid.as_deref().unwrap_or_default()
    }
}

/// Creates the pod and times it from the create call to its `app` container `Running` and to
/// the pod `Ready`, as a watch on the pod (established before the create) sees it.
pub async fn start_pod(pods: &Api<Pod>, pod: &Value, name: &str) -> Result<Started, Error> {
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher::watcher(pods.clone(), cfg).boxed();
    // The watch is established (its initial list done) before the pod exists.
    loop {
        match tokio::time::timeout(POD_LIMIT, stream.next()).await {
            Ok(Some(Ok(watcher::Event::InitDone))) => break,
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => return Err(e.into()),
            _ => return Err(format!("{name}: no watch").into()),
        }
    }
    let t = Instant::now();
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(pod.clone())?,
    )
    .await?;
    let mut to_running = None;
    while t.elapsed() < POD_LIMIT {
        let ev = match tokio::time::timeout(POD_LIMIT, stream.next()).await {
            Ok(Some(ev)) => ev?,
            _ => break,
        };
        let (watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = ev else {
            continue;
        };
        if to_running.is_none() && app_running(&p) {
            to_running = Some(t.elapsed());
        }
        if let Some(to_running) = to_running
            && pod_ready(&p)
        {
            return Ok(Started {
                to_running,
                to_ready: t.elapsed(),
                pod: p,
            });
        }
    }
    let p = pods.get(name).await?;
    Err(format!(
        "{name}: not running and ready after {POD_LIMIT:?}: {}",
        serde_json::to_string(&p.status).unwrap_or_default()
    )
    .into())
}

pub fn app_running(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.name == "app" && c.state.as_ref().is_some_and(|s| s.running.is_some()))
}

pub fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Deletes the pod and waits until the object is gone.
pub async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<(), Error> {
    pods.delete(name, &DeleteParams::default()).await?;
    let t = Instant::now();
    while t.elapsed() < POD_LIMIT {
        match pods.get_opt(name).await? {
            None => return Ok(()),
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    Err(format!("{name}: not gone after {POD_LIMIT:?}").into())
}

/// Waits until the kubelet has torn the pod's sandbox down: the next pod starts on a quiet
/// node.
pub async fn wait_torn_down(node: &RealNode, uid: &str) -> Result<(), Error> {
    let t = Instant::now();
    while node.sandbox_pid(uid).is_ok() {
        if t.elapsed() > POD_LIMIT {
            return Err(format!("the sandbox of pod {uid} is still there").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Deletes the pod and waits until it is gone from the API and from the node.
pub async fn remove_pod(pods: &Api<Pod>, node: &RealNode, started: &Started) -> Result<(), Error> {
    let name = started.pod.metadata.name.as_deref().unwrap_or_default();
    delete_pod(pods, name).await?;
    wait_torn_down(node, started.uid()).await
}

/// The times of every round, by what was measured.
#[derive(Default)]
pub struct Rounds {
    running: BTreeMap<String, Vec<Duration>>,
    ready: BTreeMap<String, Vec<Duration>>,
    /// Per round: name → time to Running.
    rounds: Vec<BTreeMap<String, Duration>>,
}

impl Rounds {
    pub fn new_round(&mut self) {
        self.rounds.push(BTreeMap::new());
    }

    pub fn record(&mut self, name: &str, started: &Started) {
        self.running
            .entry(name.to_owned())
            .or_default()
            .push(started.to_running);
        self.ready
            .entry(name.to_owned())
            .or_default()
            .push(started.to_ready);
        if let Some(round) = self.rounds.last_mut() {
            round.insert(name.to_owned(), started.to_running);
        }
    }

    /// The last round's times, for a progress line.
    pub fn last(&self) -> String {
        self.rounds
            .last()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k} {}ms", v.as_millis()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `VALUE <name>-running-ms: median (spread min-max); ready-ms median (min-max)`.
    pub fn print_values(&self, names: &[&str]) {
        for name in names {
            let (Some(r), Some(q)) = (self.running.get(*name), self.ready.get(*name)) else {
                continue;
            };
            println!(
                "VALUE {name}-running-ms: {} (spread {}-{}); ready-ms {} ({}-{})",
                median_ms(r),
                min_ms(r),
                max_ms(r),
                median_ms(q),
                min_ms(q),
                max_ms(q)
            );
        }
    }

    /// `RATIO <name>/<baseline>`: the median over rounds of the round's ratio of the two times
    /// to Running (the same round's pods, so that a slow stretch of the node weighs on both),
    /// with its spread.
    pub fn print_ratio(&self, name: &str, baseline: &str) {
        let v: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|r| Some(r.get(name)?.as_secs_f64() / r.get(baseline)?.as_secs_f64()))
            .collect();
        if v.is_empty() {
            return;
        }
        println!(
            "RATIO {name}/{baseline}: {:.2} (spread {:.2}-{:.2}, {} rounds)",
            meshgate_testenv::measure::median(v.clone()),
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            v.len()
        );
    }
}

pub fn median_ms(v: &[Duration]) -> u128 {
    let mut s = v.to_vec();
    s.sort();
    meshgate_testenv::measure::quantile(&s, 0.5).as_millis()
}

pub fn min_ms(v: &[Duration]) -> u128 {
    v.iter().min().copied().unwrap_or_default().as_millis()
}

pub fn max_ms(v: &[Duration]) -> u128 {
    v.iter().max().copied().unwrap_or_default().as_millis()
}
