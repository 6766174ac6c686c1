//! Shared pieces of the end-to-end tests: the real control plane, meshgate's webhook serving
//! over TLS with a CA made here, its registration, and waiting.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use meshgate_api::GateConfig;
use meshgate_core::registration::{Registration, WebhookTarget, webhook_configuration};
use meshgate_testenv::{ControlPlane, Options};

/// A runtime that outlives every test: servers shared by the tests of a binary run here, since
/// each `#[tokio::test]` has a runtime of its own that ends with the test.
pub fn background() -> tokio::runtime::Handle {
    static RT: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    RT.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("background runtime");
            let _ = tx.send(rt.handle().clone());
            rt.block_on(futures::future::pending::<()>());
        });
        rx.recv().expect("background runtime handle")
    })
    .clone()
}

pub async fn control_plane(scheduler: bool) -> Arc<ControlPlane> {
    meshgate_testenv::shared(Options {
        scheduler,
        ..Options::default()
    })
    .await
    .expect("control plane starts")
}

/// Applies meshgate's CRDs (server-side apply) and waits until they are established.
pub async fn install_crds(client: &Client) {
    let crds = meshgate::install::crd_documents().expect("crds render");
    meshgate::install::apply(client, &crds, false, |_| {})
        .await
        .expect("crds applied");
}

/// A running webhook and what the API server needs to call it.
pub struct Webhook {
    pub server: meshgate_webhook::Server,
    pub ca: meshgate_pki::Ca,
    pub url: String,
    pub health: String,
    pub dir: tempfile::TempDir,
}

impl Webhook {
    /// The registration for this webhook with `config`.
    pub fn registration<'a>(
        &'a self,
        name: &'a str,
        config: &'a GateConfig,
        policies: bool,
        node_taint: bool,
    ) -> serde_json::Value {
        webhook_configuration(&Registration {
            name,
            config,
            target: WebhookTarget::Url(self.url.clone()),
            ca_bundle_pem: &self.ca.certificate().cert_pem,
            policies,
            node_taint,
        })
    }
}

/// Starts meshgate's webhook on loopback with a serving certificate from a fresh CA. It runs on
/// the background runtime, so it lives as long as the test binary.
pub async fn start_webhook(cp: &ControlPlane, config: GateConfig) -> Webhook {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = meshgate_pki::Ca::new("meshgate-e2e-ca", Duration::from_secs(3600)).expect("ca");
    let serving = ca
        .issue_server(&["127.0.0.1", "localhost"], Duration::from_secs(3600))
        .expect("cert");
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &serving.cert_pem).expect("write cert");
    std::fs::write(&key, &serving.key_pem).expect("write key");
    let kubeconfig = cp.kubeconfig_path.clone();
    let settings = meshgate::run::WebhookSettings {
        config,
        addr: "127.0.0.1:0".parse().expect("addr"),
        health_addr: "127.0.0.1:0".parse().expect("addr"),
        cert,
        key,
        cert_poll_interval: Duration::from_millis(200),
        request_timeout: Duration::from_secs(10),
    };
    let server = background()
        .spawn(async move {
            let client = client_from(&kubeconfig).await;
            meshgate::run::start_webhook(client, settings)
                .await
                .expect("webhook starts")
        })
        .await
        .expect("webhook task");
    let url = format!("https://127.0.0.1:{}", server.addr.port());
    let health = format!("127.0.0.1:{}", server.health_addr.port());
    Webhook {
        server,
        ca,
        url,
        health,
        dir,
    }
}

/// A client built from a kubeconfig file (for the background runtime).
pub async fn client_from(kubeconfig: &std::path::Path) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .expect("config");
    Client::try_from(config).expect("client")
}

/// Creates or replaces a MutatingWebhookConfiguration.
pub async fn register(client: &Client, mwc: &serde_json::Value) {
    let mwc: MutatingWebhookConfiguration = serde_json::from_value(mwc.clone()).expect("mwc");
    let name = mwc.metadata.name.clone().expect("name");
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .patch(
            &name,
            &PatchParams::apply("meshgate-test").force(),
            &Patch::Apply(&mwc),
        )
        .await
        .expect("webhook registered");
}

#[allow(unused_imports)]
pub use meshgate_testenv::wait_for;

/// A minimal pod.
pub fn pod(name: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    })
}
