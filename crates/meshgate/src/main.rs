//! `meshgate`: see `meshgate --help`.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use meshgate::run::{ControllerSettings, WebhookSettings};
use meshgate::{crds, logging, render, run};
use meshgate_api::GateConfig;
use meshgate_controller::leader::LeaseSettings;
use meshgate_wait::duration::parse_duration;

/// mimalloc rather than glibc's allocator: the webhook makes many small, short-lived allocations
/// on every worker thread (see BENCHMARKS.md, "Webhook throughput").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// meshgate keeps mesh pods off nodes whose mesh agent is not ready, holds pods until their
/// traffic is captured, and applies mutation policies (e.g. for init containers that need
/// network).
#[derive(Parser, Debug)]
#[command(name = "meshgate", version, about, long_about = None)]
struct Cli {
    /// Log as JSON lines (default when not on a terminal is text; set for clusters).
    #[arg(long, global = true, env = "MESHGATE_LOG_JSON")]
    log_json: bool,
    /// The log filter when `RUST_LOG` is not set: a level (error, warn, info, debug, trace) or
    /// tracing directives (`meshgate_controller=debug,info`).
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the HTTPS admission webhook.
    Webhook(WebhookArgs),
    /// Run the DRA gate's node plugin (a DaemonSet): registers with the kubelet as the driver
    /// of meshgate's gate devices and, before the kubelet creates a pod's sandbox, waits until
    /// the mesh will capture the pod on this node.
    Node(NodeArgs),
    /// Run the controllers (node gate), leader-elected.
    Controller(ControllerArgs),
    /// Print the CRDs, or check or write the checked-in copies.
    Crds {
        /// Fail unless the files in this directory match the generated CRDs.
        #[arg(long, conflicts_with = "write")]
        check: Option<PathBuf>,
        /// Write the CRDs into this directory.
        #[arg(long)]
        write: Option<PathBuf>,
    },
    /// Write the Helm chart (generated from `install`), or check the checked-in copy.
    Chart {
        /// Fail unless the chart in this directory is what `install` generates.
        #[arg(long, conflicts_with = "write")]
        check: Option<PathBuf>,
        /// Write the chart into this directory.
        #[arg(long)]
        write: Option<PathBuf>,
    },
    /// Apply policies to manifests offline and print the result.
    Render(RenderArgs),
    /// Render meshgate's manifests for a profile (YAML on stdout), or apply them.
    Install(InstallArgs),
    /// Show the startup race and its fix on a local real control plane (nothing to install).
    Demo {
        /// Leave the control plane and meshgate running; print how to reach and stop them.
        #[arg(long)]
        keep: bool,
    },
    /// What meshgate is doing: nodes per gate, policies, webhooks.
    Status {
        #[command(subcommand)]
        of: Option<StatusOf>,
        /// Output format.
        #[arg(short = 'o', long, default_value = "table", value_parser = ["table", "json", "yaml"], global = true)]
        output: String,
        /// Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
        #[arg(long, global = true)]
        kubeconfig: Option<PathBuf>,
    },
    /// Is the install healthy? Each check passes or fails with a hint; exits non-zero when any
    /// fails.
    Check {
        /// The namespace `install` used.
        #[arg(long, default_value = "meshgate-system")]
        namespace: String,
        /// Output format.
        #[arg(short = 'o', long, default_value = "text", value_parser = ["text", "json"])]
        output: String,
        /// Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
    /// Remove meshgate from the cluster: admission registrations first (nothing fails closed),
    /// then the components, then the taints and resources it put on nodes, then the rest of
    /// what `install` created. Safe to run again.
    Uninstall {
        /// The namespace `install` used.
        #[arg(long, default_value = "meshgate-system")]
        namespace: String,
        /// Also delete meshgate's CRDs, and with them every NodeGate and MutationPolicy.
        #[arg(long)]
        crds: bool,
        /// How long to wait for the controller's pods to stop.
        #[arg(long, default_value = "120s", value_parser = parse_duration)]
        wait: std::time::Duration,
        /// The Helm release that installed meshgate (the chart's uninstall hook passes it):
        /// Helm labels its objects `app.kubernetes.io/managed-by: Helm` and annotates them with
        /// the release; with it, those are removed too.
        #[arg(long)]
        helm_release: Option<String>,
        /// Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
    /// Convert policies of other tools.
    Import {
        #[command(subcommand)]
        from: ImportFrom,
    },
}

/// The flags of `meshgate webhook`.
#[derive(clap::Args, Debug)]
struct WebhookArgs {
    /// Gate configuration (YAML).
    #[arg(long, env = "MESHGATE_CONFIG")]
    config: Option<PathBuf>,
    #[arg(long, default_value = "/etc/meshgate/tls/tls.crt")]
    cert: PathBuf,
    #[arg(long, default_value = "/etc/meshgate/tls/tls.key")]
    key: PathBuf,
    /// The HTTPS address for reviews. The default, `[::]`, takes IPv4 and IPv6 connections
    /// (dual stack; IPv4-only and IPv6-only clusters alike).
    #[arg(long, default_value = "[::]:8443")]
    addr: SocketAddr,
    /// Plain HTTP for /healthz, /readyz, /metrics.
    #[arg(long, default_value = "[::]:8080")]
    health_addr: SocketAddr,
    /// Seconds between checks of the certificate files.
    #[arg(long, default_value_t = 5)]
    cert_poll_seconds: u64,
    /// Reviews answered at once (body reading included); more get 429 Too Many Requests
    /// at once, and the API server applies the webhook's failure policy. With the 3.5 MiB
    /// body limit this bounds memory: size the container's memory limit with it.
    #[arg(long, default_value_t = meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT)]
    max_in_flight: usize,
}

/// The flags of `meshgate node`.
#[derive(clap::Args, Debug)]
struct NodeArgs {
    /// The DRA driver (the gates' ResourceSlices and DeviceClasses name it).
    #[arg(long, default_value = meshgate_api::names::DRA_DRIVER)]
    driver: String,
    /// The kubelet's root directory (its `--root-dir`).
    #[arg(long, default_value = meshgate_node::DEFAULT_KUBELET_ROOT)]
    kubelet_root: PathBuf,
    /// The container runtime's CNI configuration directory.
    #[arg(long, default_value = meshgate_node::DEFAULT_CNI_CONF_DIR)]
    cni_conf_dir: PathBuf,
    /// The mesh's CNI plugin type that the active CNI configuration must chain.
    #[arg(long)]
    cni_plugin: Option<String>,
    /// A URL that must answer 2xx (plain http://IP:PORT/path; repeatable): an agent's
    /// readiness on the host network.
    #[arg(long = "ready-url")]
    ready_urls: Vec<String>,
    /// How long the kubelet's prepare call waits for the mesh before it fails (and the
    /// kubelet tries again at the pod's next sync, about a minute later). Below 45 s.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    prepare_wait: Duration,
    /// How often a waiting prepare checks the node again.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    poll: Duration,
    /// Plain HTTP for /healthz and /readyz (ready once the kubelet registered the plugin).
    #[arg(long, default_value = "127.0.0.1:9813")]
    health_addr: SocketAddr,
}

/// The flags of `meshgate controller`.
#[derive(clap::Args, Debug)]
struct ControllerArgs {
    /// Namespace of the leader Lease; empty disables leader election.
    #[arg(long, default_value = "meshgate-system", env = "POD_NAMESPACE")]
    lease_namespace: String,
    #[arg(long, default_value = "meshgate-controller")]
    lease_name: String,
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds the leader's lease is valid after its last renewal (renewed a third of it
    /// before expiry); at least 3.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..))]
    lease_seconds: u64,
    #[arg(long, default_value = "0.0.0.0:8080")]
    health_addr: SocketAddr,
    /// Create and rotate the webhook's CA and serving certificate in the lease namespace and
    /// keep the webhook configuration's caBundle current.
    #[arg(long)]
    manage_certs: bool,
    /// On start, write meshgate's CRDs at this version's schema where they exist and no
    /// newer meshgate wrote them (Helm installs a chart's crds/ once and never upgrades them).
    #[arg(long)]
    manage_crds: bool,
    /// Keep the rules of this MutatingWebhookConfiguration's policies webhook in line with
    /// the kinds the MutationPolicies name.
    #[arg(long)]
    policy_webhook_configuration: Option<String>,
    /// Compile each MutationPolicy that a MutatingAdmissionPolicy can express into one (and
    /// its binding), so that the API server applies it without calling the webhook; the
    /// policy's `Native` condition says which path serves it and why. Needs the API server
    /// to serve MutatingAdmissionPolicy (discovery); else every policy stays on the webhook.
    #[arg(long)]
    native_policies: bool,
    /// Patch the pod templates of existing workloads for policies with `spec.existing`
    /// (`false`: such policies apply at admission only; `install --workload-backfill=false`
    /// grants no workload `patch`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    workload_backfill: bool,
    /// The native gate: keep the init gate's MutatingAdmissionPolicy and the routes of the
    /// webhook's gate entries (namespaces with LimitRanges stay on the webhook) for the
    /// webhook configuration in this file (`install` passes the webhook's). Needs
    /// `--policy-webhook-configuration` (the entries' configuration).
    #[arg(long, requires = "policy_webhook_configuration")]
    native_gate_config: Option<std::path::PathBuf>,
    /// Namespaces in which policies never change anything (backfill, native policies),
    /// comma-separated: the webhook configuration's `excludedNamespaces` (`install` passes
    /// them). Default: the configuration's default.
    #[arg(long, value_delimiter = ',')]
    excluded_namespaces: Option<Vec<String>>,
    /// Report pods whose gate has been running this long (an Event `GateWaiting` per pod, the
    /// gauge `meshgate_controller_repair_gates_waiting`) and gates that timed out (an Event
    /// `GateTimedOut` when repair is off), e.g. `120s`; `0` turns it off. Watches pods.
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    gate_wait_threshold: std::time::Duration,
    /// Repair pods whose gate timed out: label them (or delete them, see --repair-action).
    #[arg(long)]
    repair: bool,
    #[arg(long, default_value = "label", value_parser = ["label", "delete"])]
    repair_action: String,
    /// Repair: say what would be done, change nothing.
    #[arg(long)]
    repair_dry_run: bool,
    /// Repair: also pods that started on a node before its agents were Ready.
    #[arg(long)]
    repair_started_early: bool,
    /// Nodes the node gate reconciles at once (each holds one API request and connection).
    #[arg(long, default_value_t = meshgate_controller::nodegate::DEFAULT_CONCURRENCY,
          value_parser = clap::value_parser!(u16).range(1..))]
    node_gate_concurrency: u16,
}

/// The flags of `meshgate render`.
#[derive(clap::Args, Debug)]
struct RenderArgs {
    /// Manifests (multi-document YAML; `-` for stdin).
    #[arg(short = 'f', long = "filename", required = true)]
    manifests: Vec<PathBuf>,
    /// MutationPolicy or Kyverno ClusterPolicy files.
    #[arg(long = "policy")]
    policies: Vec<PathBuf>,
    /// Labels of a namespace, as NS=key=value (repeatable), for namespaceSelector.
    /// Namespace objects in the manifests supply their labels and annotations too.
    #[arg(long = "namespace-label")]
    namespace_labels: Vec<String>,
    /// Also apply the init gate of an install profile to Pods and to the pod templates of
    /// workloads, exactly as the webhook would (after the policies, as at admission).
    #[arg(long, value_parser = meshgate::install::PROFILES)]
    profile: Option<String>,
    /// The gate configuration file the webhook reads (instead of --profile's).
    #[arg(long, conflicts_with = "profile")]
    config: Option<PathBuf>,
    /// Print the JSON patches instead of the objects.
    #[arg(long)]
    patch: bool,
    /// Print the result even when part of a policy cannot be applied (a Kyverno feature
    /// not converted, a policy failing on a document); what was left out goes to stderr.
    /// Without it, any such part is an error and nothing is printed.
    #[arg(long)]
    allow_partial: bool,
}

/// The flags of `meshgate install`.
#[derive(clap::Args, Debug)]
struct InstallArgs {
    #[arg(long, value_parser = meshgate::install::PROFILES)]
    profile: String,
    #[arg(long, default_value = "meshgate-system")]
    namespace: String,
    #[arg(long, default_value = "meshgate/meshgate:0.1.0")]
    image: String,
    /// Apply with server-side apply instead of printing.
    #[arg(long)]
    apply: bool,
    /// With --apply: validate on the server, persist nothing.
    #[arg(long, requires = "apply")]
    dry_run: bool,
    /// How new nodes get the startup taint at registration: `policy` (a
    /// MutatingAdmissionPolicy, evaluated by the API server), `webhook`, or `auto` (the policy
    /// where the API server runs it, proven by a probe policy; without --apply: as
    /// --kubernetes-version runs it by default).
    #[arg(long, default_value = "auto", value_parser = ["policy", "webhook", "auto"])]
    node_taint: String,
    /// Where the init gate is decided: `native` (a MutatingAdmissionPolicy the API server
    /// evaluates for the clauses CEL can decide, Istio ambient; the webhook for the others
    /// and for namespaces with LimitRanges), `webhook`, or `auto` (native where the API
    /// server runs the policy API and the profile has such clauses; without --apply: as
    /// --kubernetes-version runs it by default).
    #[arg(long, default_value = "auto", value_parser = ["native", "webhook", "auto"])]
    pod_gate: String,
    /// What holds mesh pods besides the startup taint on new nodes: `taint` (the taint alone;
    /// meshgate-wait only in pods it cannot hold: bound to a node, or tolerating it), `dra`
    /// (a DRA device per ready node and the node plugin's check before each pod's sandbox),
    /// `resource` (an extended resource in ready nodes' status), or `pod` (meshgate-wait in
    /// every mesh pod). With `dra` and `resource`, meshgate-wait guards only pods created
    /// bound to a node; node autoscalers cannot provision for either (refused where one is
    /// found).
    #[arg(long, default_value = meshgate::install::Strategy::default().as_str(), value_parser = ["taint", "dra", "resource", "pod"])]
    strategy: String,
    /// The key of the gate's startup taint. Default: the prefix the autoscaler found knows
    /// as a startup taint (Karpenter, or none found: `readiness.k8s.io/mesh-agents`; the
    /// Cluster Autoscaler: `startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents`);
    /// without --apply: `readiness.k8s.io/mesh-agents`.
    #[arg(long)]
    taint_key: Option<String>,
    /// Without --apply: the Kubernetes version to render for (`1.35`, `v1.35.4`), as its
    /// API server runs by default: admission policies from 1.36, the webhook before. Not
    /// given: 1.36 or later, said on stderr. With --apply the cluster is asked.
    #[arg(long, conflicts_with = "apply")]
    kubernetes_version: Option<String>,
    /// The kubelet's root directory on the nodes (the node plugin registers there).
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_root: String,
    /// The nodes' CNI configuration directory (the node plugin reads it).
    #[arg(long, default_value = "/etc/cni/net.d")]
    cni_conf_dir: String,
    /// The CNI plugin type the node plugin requires in the nodes' CNI configuration
    /// (default: the profile mesh's, e.g. `istio-cni`).
    #[arg(long)]
    cni_plugin: Option<String>,
    /// Run the controller's repair loop for pods whose gate timed out, and grant it the pod
    /// writes it needs: `label` (patch) or `delete` (patch, and create on pods/eviction: pods
    /// are evicted, so PodDisruptionBudgets hold). Off by default.
    #[arg(long, value_parser = ["label", "delete"])]
    repair: Option<String>,
    /// Admit connections to the webhook's HTTPS port only from these addresses (CIDR,
    /// repeatable): a NetworkPolicy. Give the API server's source addresses (they differ
    /// per cluster: the control plane's node or VPC range). Off by default.
    #[arg(long = "webhook-ingress-from")]
    webhook_ingress_from: Vec<String>,
    /// A ConfigMap (`NAMESPACE/NAME`, repeatable) that policies' `configMap` context
    /// entries read: the webhook may list and watch it, the controller get it, by name, and
    /// no other ConfigMap. A policy's `status.configMaps` lists the ones it needs.
    #[arg(long = "context-config-map")]
    context_config_maps: Vec<String>,
    /// A resource (`RESOURCE` or `RESOURCE.GROUP`, repeatable: `namespaces`,
    /// `deployments.apps`) that policies' `apiCall` context entries GET: the webhook and
    /// the controller may get and list it, cluster-wide.
    #[arg(long = "context-api-read")]
    context_api_reads: Vec<String>,
    /// A kind other than the workloads (`RESOURCE` or `RESOURCE.GROUP`, repeatable:
    /// `services`, `gateways.networking.istio.io`) whose existing objects policies with
    /// `existing.enabled` mutate: the controller may list and patch it, cluster-wide.
    #[arg(long = "existing-kind")]
    existing_kinds: Vec<String>,
    /// Patch existing workloads' pod templates for policies with `existing.enabled` (the
    /// controller gets `patch` on Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs
    /// and CronJobs, cluster-wide). `false`: no such grant; those policies apply at
    /// admission only.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    workload_backfill: bool,
    /// Compile policies a MutatingAdmissionPolicy can express into one (the controller gets
    /// `create`/`patch`/`delete` on MutatingAdmissionPolicies and their bindings,
    /// cluster-wide). `false`: no such grant; every policy is served by the webhook.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    native_policies: bool,
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

/// `meshgate status` of one thing.
#[derive(Subcommand, Debug)]
enum StatusOf {
    /// Why is this pod waiting: its gate verdict, what its gate waits for and for how long, and
    /// the gates of its node.
    Pod {
        /// NAMESPACE/NAME.
        pod: String,
    },
}

#[derive(Subcommand, Debug)]
enum ImportFrom {
    /// Kyverno ClusterPolicy mutate rules to MutationPolicy.
    Kyverno {
        file: PathBuf,
        /// Print the converted policies even when part of a rule cannot be converted (listed
        /// on stderr). Without it, any such part is an error and nothing is printed.
        #[arg(long)]
        allow_partial: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo tells its own story on stdout; only problems go to the log.
    let quiet =
        matches!(cli.command, Command::Demo { .. }) && std::env::var_os("RUST_LOG").is_none();
    logging::init(
        cli.log_json,
        if quiet {
            "warn"
        } else {
            cli.log_level.as_str()
        },
    );
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("meshgate: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run_command(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn client_for(kubeconfig: Option<PathBuf>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(&path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(identified(config, "meshgate"))?)
}

/// `config` with the User-Agent `<component>/<version>`: the API server records the part before
/// the `/` as the field manager of the component's creates, updates and patches (kube's client
/// sends no User-Agent of its own), and audit logs name the component.
fn identified(mut config: kube::Config, component: &str) -> kube::Config {
    if let Ok(agent) =
        http::HeaderValue::from_str(&format!("{component}/{}", env!("CARGO_PKG_VERSION")))
    {
        config.headers.push((http::header::USER_AGENT, agent));
    }
    config
}

/// Writes to stdout; a closed pipe (`meshgate ... | head`) ends the output quietly.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Prints the notes; refuses a half-applied result unless `allow_partial`, which prints what
/// was left out as warnings.
fn check_report(report: &render::Report, allow_partial: bool) -> anyhow::Result<()> {
    for n in &report.notes {
        eprintln!("note: {n}");
    }
    if report.partial.is_empty() {
        return Ok(());
    }
    let label = if allow_partial { "warning" } else { "error" };
    for p in &report.partial {
        eprintln!("{label}: not applied: {p}");
    }
    if allow_partial {
        return Ok(());
    }
    anyhow::bail!(
        "{} part(s) of the policies cannot be applied as written (listed above); nothing was printed. \
         Rewrite them, or pass --allow-partial to print the result without them",
        report.partial.len()
    )
}

async fn run_command(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Webhook(args) => webhook(args).await,
        Command::Node(args) => node(args).await,
        Command::Controller(args) => controller(args).await,
        Command::Crds { check, write } => {
            if let Some(dir) = check {
                crds::check(&dir)
            } else if let Some(dir) = write {
                crds::write(&dir)
            } else {
                emit(&crds::all_yaml()?)
            }
        }
        Command::Chart { check, write } => match (check, write) {
            (Some(dir), _) => meshgate::chart::check(&dir),
            (None, Some(dir)) => meshgate::chart::write(&dir),
            (None, None) => anyhow::bail!("chart: pass --write DIR or --check DIR"),
        },
        Command::Render(args) => render_command(args),
        Command::Install(args) => install(args).await,
        #[cfg(feature = "demo")]
        Command::Demo { keep } => meshgate::demo::run(meshgate::demo::DemoOptions { keep }).await,
        #[cfg(not(feature = "demo"))]
        Command::Demo { keep: _ } => anyhow::bail!(
            "this meshgate was built without the demo (it is not part of the shipped binary); run tools/demo.sh, or build with `cargo build -p meshgate --features demo`"
        ),
        Command::Status {
            of,
            output,
            kubeconfig,
        } => status(of, &output, kubeconfig).await,
        Command::Check {
            namespace,
            output,
            kubeconfig,
        } => check(&namespace, &output, kubeconfig).await,
        Command::Uninstall {
            namespace,
            crds,
            wait,
            helm_release,
            kubeconfig,
        } => {
            uninstall(
                meshgate::uninstall::UninstallOptions {
                    namespace,
                    crds,
                    wait,
                    helm_release,
                },
                kubeconfig,
            )
            .await
        }
        Command::Import {
            from:
                ImportFrom::Kyverno {
                    file,
                    allow_partial,
                },
        } => {
            let (out, report) = render::import_kyverno(&file)?;
            check_report(&report, allow_partial)?;
            emit(&out)
        }
    }
}

async fn webhook(args: WebhookArgs) -> anyhow::Result<()> {
    let WebhookArgs {
        max_in_flight,
        config,
        cert,
        key,
        addr,
        health_addr,
        cert_poll_seconds,
    } = args;
    let config = match config {
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            GateConfig::from_yaml(&path.display().to_string(), &text)?
        }
        None => GateConfig::default(),
    };
    // As long as the API server waits (the registrations' timeoutSeconds).
    let request_timeout = meshgate_core::registration::server_timeout(config.timeout_seconds);
    let client =
        kube::Client::try_from(identified(kube::Config::infer().await?, "meshgate-webhook"))?;
    let server = run::start_webhook(
        client,
        WebhookSettings {
            config,
            addr,
            health_addr,
            cert,
            key,
            cert_poll_interval: Duration::from_secs(cert_poll_seconds.max(1)),
            request_timeout,
            max_in_flight,
        },
    )
    .await?;
    tokio::select! {
        _ = run::shutdown_signal() => {}
        _ = server.stopped() => {
            // Exit, so that the kubelet restarts the container.
            anyhow::bail!("the admission server stopped; exiting");
        }
    }
    tracing::info!("SIGTERM: draining in-flight reviews");
    server.shutdown(Duration::from_secs(20)).await?;
    Ok(())
}

async fn node(args: NodeArgs) -> anyhow::Result<()> {
    let settings = meshgate_node::Settings {
        driver: args.driver,
        kubelet_root: args.kubelet_root,
        cni_conf_dir: args.cni_conf_dir,
        cni_plugin: args.cni_plugin,
        ready_urls: args.ready_urls,
        prepare_wait: args.prepare_wait,
        poll: args.poll,
        health_addr: args.health_addr,
    };
    meshgate_node::run(settings, run::shutdown_signal()).await?;
    Ok(())
}

async fn controller(args: ControllerArgs) -> anyhow::Result<()> {
    let ControllerArgs {
        lease_namespace,
        lease_name,
        identity,
        lease_seconds,
        health_addr,
        manage_certs,
        manage_crds,
        policy_webhook_configuration,
        native_policies,
        workload_backfill,
        native_gate_config,
        excluded_namespaces,
        gate_wait_threshold,
        repair,
        repair_action,
        repair_dry_run,
        repair_started_early,
        node_gate_concurrency,
    } = args;
    let repair = meshgate_core::repair::RepairSettings {
        enabled: repair,
        action: if repair_action == "delete" {
            meshgate_core::repair::RepairAction::Delete
        } else {
            meshgate_core::repair::RepairAction::Label
        },
        dry_run: repair_dry_run,
        detect_started_early: repair_started_early,
        waiting_threshold: (!gate_wait_threshold.is_zero()).then_some(gate_wait_threshold),
        ..Default::default()
    };
    let native_gate = match (native_gate_config, &policy_webhook_configuration) {
        (Some(path), Some(configuration)) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let config = GateConfig::from_yaml(&path.display().to_string(), &text)?;
            Some((config, configuration.clone()))
        }
        _ => None,
    };
    let config = identified(kube::Config::infer().await?, "meshgate-controller");
    let client = kube::Client::try_from(config.clone())?;
    // Evictions: no retry of a 429 inside the client (a PodDisruptionBudget's refusal;
    // the repair loop retries it itself).
    let mut config = config;
    config.default_retry = false;
    let evictions = kube::Client::try_from(config)?;
    let lease_namespace_for_certs = lease_namespace.clone();
    let lease = (!lease_namespace.is_empty()).then(|| LeaseSettings {
        namespace: lease_namespace,
        name: lease_name,
        identity: identity.unwrap_or_else(|| format!("meshgate-{}", std::process::id())),
        duration: lease_seconds,
        grace: (lease_seconds / 3).max(1),
    });
    run::run_controller(
        client,
        ControllerSettings {
            lease,
            health_addr: Some(health_addr),
            node_gate: meshgate_controller::nodegate::Settings {
                concurrency: node_gate_concurrency,
                node_plugin: meshgate_controller::nodegate::node_plugin_agent(
                    if lease_namespace_for_certs.is_empty() {
                        "meshgate-system"
                    } else {
                        &lease_namespace_for_certs
                    },
                ),
                ..Default::default()
            },
            certs: manage_certs
                .then(|| meshgate_controller::certs::CertSettings::new(&lease_namespace_for_certs)),
            manage_crds,
            repair,
            evictions: Some(meshgate_controller::repair::EvictionClient(evictions)),
            policy_webhook: policy_webhook_configuration,
            native_policies,
            native_gate,
            native_gate_proof: None,
            excluded_namespaces,
            no_workload_backfill: !workload_backfill,
        },
        run::shutdown_signal(),
    )
    .await?;
    Ok(())
}

fn render_command(args: RenderArgs) -> anyhow::Result<()> {
    let RenderArgs {
        manifests,
        policies,
        namespace_labels,
        profile,
        config,
        patch,
        allow_partial,
    } = args;
    let mut labels: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for item in &namespace_labels {
        let mut parts = item.splitn(3, '=');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(ns), Some(k), Some(v)) if !ns.is_empty() && !k.is_empty() => {
                labels
                    .entry(ns.into())
                    .or_default()
                    .insert(k.into(), v.into());
            }
            _ => anyhow::bail!("--namespace-label {item:?}: expected NS=key=value"),
        }
    }
    let gate = match (&profile, &config) {
        (Some(p), _) => Some(meshgate::install::gate_config(
            p,
            "meshgate-system",
            &meshgate_api::config::InitGate::default().image,
        )?),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            Some(meshgate_api::GateConfig::from_yaml(
                &file.display().to_string(),
                &text,
            )?)
        }
        (None, None) => None,
    };
    // A profile's own policies apply as install puts them in the cluster.
    let builtin = match &profile {
        Some(p) => render::policies_of(
            &format!("--profile {p}"),
            meshgate::install::profile_policies(p)?,
        )?,
        None => Default::default(),
    };
    let (out, report) = render::render(
        &manifests,
        &policies,
        &labels,
        gate.as_ref(),
        builtin,
        patch,
    )?;
    check_report(&report, allow_partial)?;
    emit(&out)
}

async fn install(args: InstallArgs) -> anyhow::Result<()> {
    let InstallArgs {
        profile,
        namespace,
        image,
        apply,
        dry_run,
        node_taint,
        pod_gate,
        strategy,
        taint_key,
        kubernetes_version,
        kubelet_root,
        cni_conf_dir,
        cni_plugin,
        repair,
        webhook_ingress_from,
        context_config_maps,
        context_api_reads,
        existing_kinds,
        workload_backfill,
        native_policies,
        kubeconfig,
    } = args;
    let strategy = meshgate::install::Strategy::choose(&strategy)?;
    let client = if apply {
        Some(client_for(kubeconfig).await?)
    } else {
        None
    };
    let found = match &client {
        Some(c) => {
            let (found, notes) = meshgate::autoscaler::detect(c).await;
            for note in notes {
                eprintln!("autoscalers: not read: {note}");
            }
            Some(found)
        }
        None => None,
    };
    let taint_key =
        meshgate::install::choose_taint_key(taint_key, found.as_deref(), strategy, |line| {
            eprintln!("{line}")
        })?;
    let served = policy_api(client.as_ref(), kubernetes_version.as_deref(), dry_run).await?;
    let node_taint = meshgate::install::NodeTaint::choose(&node_taint, served)?;
    eprintln!("node taint at registration: {}", node_taint.describe());
    let pod_gate = meshgate::install::PodGate::choose(&pod_gate, served, &profile, strategy)?;
    eprintln!("pod gate: {}", pod_gate.describe());
    eprintln!("strategy: {}", strategy.describe());
    let docs = meshgate::install::render(&meshgate::install::InstallOptions {
        profile,
        namespace,
        image,
        node_taint,
        pod_gate,
        strategy,
        taint_key,
        node_paths: meshgate::install::NodePaths {
            kubelet_root,
            cni_conf_dir,
            cni_plugin,
        },
        repair: repair.map(|r| {
            if r == "delete" {
                meshgate::install::RepairAction::Delete
            } else {
                meshgate::install::RepairAction::Label
            }
        }),
        webhook_ingress_from,
        context_config_maps,
        context_api_reads,
        existing_kinds,
        policies: meshgate::install::PolicyFeatures {
            workload_backfill,
            native: native_policies,
        },
    })?;
    apply_or_print(client, &docs, dry_run).await
}

/// Applies `docs` with `client`, one progress line each, or prints them without one.
async fn apply_or_print(
    client: Option<kube::Client>,
    docs: &[serde_json::Value],
    dry_run: bool,
) -> anyhow::Result<()> {
    let Some(client) = client else {
        return emit(&render::to_yaml_stream(docs)?);
    };
    let total = docs.len();
    let mut n = 0;
    meshgate::install::apply(&client, docs, dry_run, |line| {
        n += 1;
        eprintln!("[{n}/{total}] {line}");
    })
    .await?;
    eprintln!(
        "meshgate installed{}",
        if dry_run {
            " (dry run: nothing persisted)"
        } else {
            ""
        }
    );
    Ok(())
}

/// The admission policy API `install` may use: what the cluster runs (`client`), or offline
/// what the Kubernetes version given runs by default (1.36 and later when none is given).
async fn policy_api(
    client: Option<&kube::Client>,
    kubernetes_version: Option<&str>,
    dry_run: bool,
) -> anyhow::Result<Option<meshgate_core::registration::PolicyApi>> {
    Ok(match &client {
        Some(c) => {
            // Served is not enough: the API server must run what it serves.
            let found = meshgate::discovery::policy_enforcement(c, dry_run).await;
            eprintln!("admission policies: {}", found.describe());
            found.usable()
        }
        // Offline: what the version given runs by default, else 1.36+ (v1 is GA there).
        None => {
            use meshgate_core::registration::PolicyApi;
            match &kubernetes_version {
                Some(v) => {
                    PolicyApi::enforced_by_default(PolicyApi::minor_of(v).ok_or_else(|| {
                        anyhow::anyhow!(
                            "--kubernetes-version {v:?}: expected 1.MINOR or v1.MINOR.PATCH"
                        )
                    })?)
                }
                None => {
                    eprintln!(
                        "offline: assuming Kubernetes 1.36 or later (it runs MutatingAdmissionPolicy v1 by default); for 1.34 or 1.35 give --kubernetes-version (their API servers run none by default: the webhook then taints nodes and gates pods)"
                    );
                    Some(PolicyApi::V1)
                }
            }
        }
    })
}

/// `meshgate status` (`status pod NS/NAME`: why a pod waits).
async fn status(
    of: Option<StatusOf>,
    output: &str,
    kubeconfig: Option<PathBuf>,
) -> anyhow::Result<()> {
    if let Some(StatusOf::Pod { pod }) = of {
        let (namespace, name) = pod
            .split_once('/')
            .ok_or_else(|| anyhow::anyhow!("status pod {pod:?}: expected NAMESPACE/NAME"))?;
        let client = client_for(kubeconfig).await?;
        let report = meshgate::status::pod(&client, namespace, name).await?;
        return match output {
            "json" => emit(&(serde_json::to_string_pretty(&report)? + "\n")),
            "yaml" => emit(&meshgate_api::yaml::to_string(&report)?),
            _ => emit(&meshgate::status::pod_text(&report)),
        };
    }
    let client = client_for(kubeconfig).await?;
    let status = meshgate::status::collect(&client).await?;
    match output {
        "json" => emit(&(serde_json::to_string_pretty(&status)? + "\n")),
        "yaml" => emit(&meshgate_api::yaml::to_string(&status)?),
        _ => emit(&meshgate::status::table(&status)),
    }
}

/// `meshgate check`: fails when a check does.
async fn check(namespace: &str, output: &str, kubeconfig: Option<PathBuf>) -> anyhow::Result<()> {
    let client = client_for(kubeconfig).await?;
    let checks = meshgate::check::run(&client, namespace).await?;
    if output == "json" {
        emit(&(serde_json::to_string_pretty(&checks)? + "\n"))?;
    } else {
        emit(&meshgate::check::text(&checks))?;
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        anyhow::bail!("{failed} check(s) failed");
    }
    Ok(())
}

/// `meshgate uninstall`.
async fn uninstall(
    options: meshgate::uninstall::UninstallOptions,
    kubeconfig: Option<PathBuf>,
) -> anyhow::Result<()> {
    let client = client_for(kubeconfig).await?;
    meshgate::uninstall::uninstall(&client, &options, |line| eprintln!("{line}")).await?;
    eprintln!("meshgate is uninstalled");
    Ok(())
}
