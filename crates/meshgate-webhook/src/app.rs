//! What the review handlers share: the configuration, the gate's planner, the caches and the
//! metrics, and what a handler returns.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use meshgate_api::GateConfig;
use meshgate_core::gate::Planner;
use meshgate_core::patch::JsonPatch;

use crate::{Sources, metrics::Metrics};

/// What a review handler needs.
#[derive(Clone, Debug)]
pub struct App {
    pub config: Arc<GateConfig>,
    /// The init gate's planning for `config`, built once.
    pub planner: Arc<Planner>,
    pub sources: Sources,
    pub metrics: Metrics,
    pub(crate) ready: Arc<AtomicBool>,
    /// The HTTPS admission server runs (`/healthz` fails once it has ended: the process can no
    /// longer serve, and the kubelet restarts it).
    pub(crate) serving: Arc<AtomicBool>,
}

impl App {
    pub fn new(config: GateConfig, sources: Sources, metrics: Metrics) -> Self {
        Self {
            planner: Arc::new(Planner::new(&config)),
            config: Arc::new(config),
            sources,
            metrics,
            ready: Arc::new(AtomicBool::new(true)),
            serving: Arc::new(AtomicBool::new(true)),
        }
    }
}

/// The result of a handler.
pub struct Handled {
    pub patch: JsonPatch,
    pub warnings: Vec<String>,
    pub outcome: &'static str,
}

impl Handled {
    /// Nothing to change, with the outcome word for metrics.
    pub fn unchanged(outcome: &'static str) -> Self {
        Self {
            patch: JsonPatch::default(),
            warnings: vec![],
            outcome,
        }
    }
}
