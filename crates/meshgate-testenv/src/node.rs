//! One real node in the local cluster: containerd (Debian's), kubelet and
//! kube-controller-manager (and kube-proxy on request, all three built by `tools/node/build.sh`),
//! pods on a CNI bridge (`cni0`, 10.244.0.0/24), images written by [`crate::image`] and imported
//! with `ctr`.
//!
//! Everything of a node lives in a run directory `<tmp>/meshgate-node-*`: containerd's config,
//! root, state and socket, the CNI configuration and IPAM state, the kubelet's root, certificate
//! and volume-plugin directories and the pods' logs. What the kubelet, containerd 1.6 and the CNI
//! plugins change outside it (see [`crate::host`]) is recorded in a [`HostSnapshot`] before the
//! node starts and put back when it stops ([`RealNode::stop`], or [`Drop`]).
//!
//! **One node per host.** Some paths are fixed (`/var/lib/kubelet/device-plugins`,
//! `/var/log/containers`, `/var/lib/cni`, `/run/containerd/s`, `/run/netns`), and so are `cni0`,
//! the pod cgroups and the iptables chain names. [`RealNode::start`] takes an exclusive `flock`
//! on [`STATE_DIR`]`/lock` for the node's life and writes the snapshot to
//! [`STATE_DIR`]`/state.json`. A test process that dies holding a node (SIGKILL, abort) loses
//! its kubelet, containerd and controllers with it (`setpriv --pdeathsig KILL`), but containerd's
//! shims, the containers, mounts, network namespaces and iptables rules stay: the next
//! [`RealNode::start`] (or [`sweep`]) finds the state file, whose owner no longer holds the lock,
//! and restores the host from it first.
//!
//! The API server authorizes the kubelet (`system:node:<name>` in `system:nodes`, a client
//! certificate from the control plane's CA) through a ClusterRoleBinding of the built-in
//! ClusterRole `system:node` to the group `system:nodes`: the test control plane runs RBAC
//! without the Node authorizer.
//!
//! Logs through the API server (`kubectl logs`) do not work: the node's InternalIP is the host's
//! first address while the kubelet serves on 127.0.0.1 only. Read container logs from
//! [`RealNode::container_log`].

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::{Deserialize, Serialize};

use crate::host::{self, HostSnapshot, RUN_DIR_PREFIX, which};
use crate::image::TestImages;
use crate::{ControlPlane, Error, Process, free_port, io, kubeconfig_yaml};

/// Where the host lock and the snapshot of the running (or crashed) node live.
pub const STATE_DIR: &str = "/run/meshgate-testenv-node";
/// The environment variable naming the directory of kubelet, kube-controller-manager and
/// kube-proxy (what `tools/node/build.sh` prints).
pub const NODE_BIN_ENV: &str = "MESHGATE_NODE_BIN";
/// The environment variable naming the directory of an older kubelet (what
/// `MESHGATE_KUBELET_MINOR=<minor> tools/node/build.sh` prints): the node then runs that kubelet
/// beside the default kube-controller-manager and kube-proxy (a kubelet older than its API
/// server, as the version skew policy allows).
pub const KUBELET_BIN_ENV: &str = "MESHGATE_KUBELET_BIN";
/// The pods' subnet on `cni0`; kube-controller-manager's node IPAM gives the (first) node the
/// same range from 10.244.0.0/16.
pub const POD_CIDR: &str = "10.244.0.0/24";
/// The containerd namespace the CRI plugin uses.
pub const K8S_NAMESPACE: &str = "k8s.io";

/// How to start the node.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// The Node's name (and the kubelet's `system:node:<name>` identity).
    pub name: String,
    /// Start kube-controller-manager (node IPAM, node lifecycle, workload controllers).
    pub controller_manager: bool,
    /// Start kube-proxy (iptables mode).
    pub proxy: bool,
    /// How long to wait for the Node to be Ready.
    pub ready_timeout: Duration,
    /// Taint keys (effect `NoSchedule`) the kubelet registers its Node with, as a node pool's
    /// `--register-with-taints` does.
    pub register_with_taints: Vec<String>,
    /// containerd and the kubelet run in a PID and a mount namespace of the node's own (as a
    /// kind node's do), with `/proc` that namespace's and its mounts shared among themselves.
    /// For node agents that read the node's `/proc` through a hostPath and need its PID 1
    /// (Istio's ambient node agent stats `/proc/1/ns/net` at start, which the init of some
    /// hosts lets no one open, this test VM's among them), or that mount the node's netns
    /// directory `HostToContainer` (containerd requires its source to be a shared or slave
    /// mount). The mounts the node makes vanish with it. The kubelet is then stopped with
    /// SIGKILL, not SIGTERM. Off by default: the host's namespaces.
    pub own_namespaces: bool,
}

impl Default for NodeOptions {
    fn default() -> Self {
        Self {
            name: "meshgate-node".into(),
            controller_manager: true,
            proxy: false,
            ready_timeout: Duration::from_secs(120),
            register_with_taints: Vec::new(),
            own_namespaces: false,
        }
    }
}

/// The programs a node runs, found on this host.
#[derive(Clone, Debug)]
pub struct NodeTools {
    /// kubelet, kube-controller-manager, kube-proxy.
    pub node_bin: PathBuf,
    /// The kubelet the node runs: `node_bin`'s, or `MESHGATE_KUBELET_BIN`'s.
    pub kubelet: PathBuf,
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    pub nsenter: PathBuf,
    pub unshare: PathBuf,
    /// The CNI plugins' directory.
    pub cni_bin: PathBuf,
}

/// Checks that this host can run a node and finds the programs: root, the node binaries
/// (`MESHGATE_NODE_BIN`, else `tools/node/build.sh`, which builds them once), and what
/// `tools/node/packages.sh` installs. The error lists everything that is missing.
pub fn prerequisites() -> Result<NodeTools, Error> {
    let mut missing = Vec::new();
    if effective_uid() != Some(0) {
        missing.push(
            "root (the kubelet writes cgroups, mounts, network namespaces and iptables rules)"
                .to_owned(),
        );
    }
    let node_bin = match node_binaries() {
        Ok(dir) => {
            for b in ["kubelet", "kube-controller-manager", "kube-proxy"] {
                if !dir.join(b).is_file() {
                    missing.push(format!(
                        "{} (from tools/node/build.sh; {NODE_BIN_ENV}={})",
                        dir.join(b).display(),
                        dir.display()
                    ));
                }
            }
            dir
        }
        Err(e) => {
            missing.push(format!("the node binaries: {e}"));
            PathBuf::new()
        }
    };
    let mut find = |name: &str, package: &str| -> PathBuf {
        which(name).unwrap_or_else(|| {
            missing.push(format!(
                "{name} (Debian package {package}; tools/node/packages.sh)"
            ));
            PathBuf::new()
        })
    };
    let containerd = find("containerd", "containerd");
    let ctr = find("ctr", "containerd");
    find("containerd-shim-runc-v2", "containerd");
    find("runc", "runc");
    for t in ["iptables", "ip6tables", "iptables-save", "ip6tables-save"] {
        find(t, "iptables");
    }
    find("ip", "iproute2");
    let nsenter = find("nsenter", "util-linux");
    let unshare = find("unshare", "util-linux");
    for t in ["mount", "umount"] {
        find(t, "mount");
    }
    find("setpriv", "util-linux");
    find("kill", "procps");
    let cni_bin = ["/usr/lib/cni", "/opt/cni/bin"]
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("bridge").is_file())
        .unwrap_or_else(|| PathBuf::from("/usr/lib/cni"));
    for plugin in ["bridge", "host-local", "loopback", "portmap"] {
        if !cni_bin.join(plugin).is_file() {
            missing.push(format!(
                "{} (Debian package containernetworking-plugins; tools/node/packages.sh)",
                cni_bin.join(plugin).display()
            ));
        }
    }
    let kubelet = match std::env::var_os(KUBELET_BIN_ENV) {
        Some(dir) => {
            let k = PathBuf::from(dir).join("kubelet");
            if !k.is_file() {
                missing.push(format!(
                    "{} (from MESHGATE_KUBELET_MINOR=<minor> tools/node/build.sh; {KUBELET_BIN_ENV})",
                    k.display()
                ));
            }
            k
        }
        None => node_bin.join("kubelet"),
    };
    if !missing.is_empty() {
        return Err(Error::NodeUnsupported(missing));
    }
    Ok(NodeTools {
        node_bin,
        kubelet,
        containerd,
        ctr,
        nsenter,
        unshare,
        cni_bin,
    })
}

/// The effective user id of this process (`/proc/self/status`).
pub fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// `MESHGATE_NODE_BIN`, else what `tools/node/build.sh` prints (it builds once, cached).
fn node_binaries() -> Result<PathBuf, Error> {
    node_binaries_logged(None)
}

/// [`node_binaries`], the build's progress appended to `log` when given.
pub fn node_binaries_logged(log: Option<&Path>) -> Result<PathBuf, Error> {
    crate::built_logged(NODE_BIN_ENV, "tools/node/build.sh", log)
}

/// The state file: who runs the node, where, and the host as it was before.
#[derive(Debug, Serialize, Deserialize)]
struct State {
    owner_pid: u32,
    run_dir: PathBuf,
    socket: PathBuf,
    snapshot: HostSnapshot,
}

fn state_file() -> PathBuf {
    Path::new(STATE_DIR).join("state.json")
}

/// The host-wide lock: held for a node's life (the kernel drops it when the process dies).
fn lock_host() -> Result<File, Error> {
    std::fs::create_dir_all(STATE_DIR).map_err(io(format!("creating {STATE_DIR}")))?;
    let path = Path::new(STATE_DIR).join("lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    file.lock()
        .map_err(io(format!("locking {}", path.display())))?;
    Ok(file)
}

/// What a sweep or teardown did, and what it could not undo.
#[derive(Clone, Debug, Default)]
pub struct Teardown {
    /// One line per action.
    pub log: Vec<String>,
    /// Differences from the snapshot after the restore; empty when the host is as before.
    pub leftovers: Vec<String>,
    pub took: Duration,
}

/// With the host lock held: restores the host from a state file left by a node whose process
/// died, and removes the file once nothing is left. `None` when there was none.
fn sweep_locked() -> Result<Option<Teardown>, Error> {
    let path = state_file();
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let start = Instant::now();
    let state: State =
        serde_json::from_str(&text).map_err(|e| Error::Node(format!("{}: {e}", path.display())))?;
    let mut t = Teardown::default();
    let alive = Path::new("/proc")
        .join(state.owner_pid.to_string())
        .exists();
    t.log.push(format!(
        "sweeping the node of process {} ({}), run directory {}",
        state.owner_pid,
        if alive {
            "alive but without the lock"
        } else {
            "gone"
        },
        state.run_dir.display()
    ));
    host::restore(&state.snapshot, &state.run_dir, &state.socket, &mut t.log);
    t.leftovers = state.snapshot.differences(&HostSnapshot::take()?);
    t.took = start.elapsed();
    if t.leftovers.is_empty() {
        std::fs::remove_file(&path).map_err(io(format!("removing {}", path.display())))?;
        Ok(Some(t))
    } else {
        Err(Error::Node(format!(
            "a node of an earlier run (process {}) left the host changed and the sweep could not \
             undo it:\n{}\nactions:\n{}",
            state.owner_pid,
            t.leftovers.join("\n"),
            t.log.join("\n")
        )))
    }
}

/// Restores the host after a node whose test process died (waits for the host lock while a
/// node runs). `None` when there was nothing to do.
pub fn sweep() -> Result<Option<Teardown>, Error> {
    let _lock = lock_host()?;
    sweep_locked()
}

/// How long the start took, step by step.
#[derive(Clone, Debug, Default)]
pub struct StartTimings {
    pub containerd_serving: Duration,
    pub images_imported: Duration,
    /// From the kubelet's start until the Node is Ready.
    pub ready_after_kubelet_start: Duration,
    /// From the kubelet's start until the Node has a podCIDR (with kube-controller-manager).
    pub pod_cidr_after_kubelet_start: Option<Duration>,
    pub total: Duration,
}

/// A running node. [`RealNode::stop`] tears it down through the API (pods deleted, so the
/// kubelet runs CNI DEL) and restores the host; dropping it without `stop` restores the host
/// without the API.
pub struct RealNode {
    name: String,
    tools: NodeTools,
    run_dir: PathBuf,
    socket: PathBuf,
    snapshot: HostSnapshot,
    lock: Option<File>,
    images: Option<TestImages>,
    admin_kubeconfig: PathBuf,
    containerd: Option<Process>,
    /// With [`NodeOptions::own_namespaces`]: the host pid of the node's PID 1 (containerd),
    /// whose namespaces the kubelet enters.
    node_init: Option<u32>,
    kubelet: Option<Process>,
    /// How the kubelet was started, to start it again ([`RealNode::restart_kubelet`]).
    kubelet_args: Vec<String>,
    controller_manager: Option<Process>,
    proxy: Option<Process>,
    kubelet_healthz: u16,
    proxy_healthz: Option<u16>,
    sweep: Option<Teardown>,
    pub timings: StartTimings,
    torn_down: bool,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNode")
            .field("name", &self.name)
            .field("run_dir", &self.run_dir)
            .finish_non_exhaustive()
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Node(format!("blocking task: {e}")))?
}

impl RealNode {
    /// Starts a node registered with `cp` and waits until it is Ready (and has its podCIDR
    /// when kube-controller-manager runs). Waits for the host lock while another node runs;
    /// restores the host first if a crashed run left it changed.
    pub async fn start(cp: &ControlPlane, options: NodeOptions) -> Result<Self, Error> {
        let started = Instant::now();
        let tools = blocking(prerequisites).await?;
        // Builds (cargo, cached) before taking the host lock.
        let binaries = blocking(crate::image::static_binaries).await?;
        let lock = blocking(lock_host).await?;
        let sweep = blocking(sweep_locked).await?;
        let others: Vec<u32> = ["kubelet", "containerd"]
            .iter()
            .flat_map(|n| host::pids_named(n))
            .collect();
        if !others.is_empty() {
            return Err(Error::Node(format!(
                "another kubelet or containerd runs on this host ({}); one node per host",
                others
                    .iter()
                    .map(|p| format!("{p}: {}", host::cmdline(*p)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let snapshot = blocking(HostSnapshot::take).await?;
        if let Some((tree, _)) = snapshot.cgroups.iter().find(|(_, existed)| **existed) {
            return Err(Error::Node(format!(
                "{tree} exists: another kubelet's pod cgroups (one node per host)"
            )));
        }
        let run_dir = tempfile::Builder::new()
            .prefix(RUN_DIR_PREFIX)
            .tempdir()
            .map_err(io("creating the node's run directory"))?
            .keep();
        let socket = run_dir.join("containerd/containerd.sock");
        let state = State {
            owner_pid: std::process::id(),
            run_dir: run_dir.clone(),
            socket: socket.clone(),
            snapshot: snapshot.clone(),
        };
        let text = serde_json::to_string_pretty(&state)
            .map_err(|e| Error::Node(format!("state file: {e}")))?;
        std::fs::write(state_file(), text).map_err(io("writing the node's state file"))?;

        // From here on, Drop restores the host whatever fails.
        let mut node = RealNode {
            name: options.name.clone(),
            tools,
            run_dir,
            socket,
            snapshot,
            lock: Some(lock),
            images: None,
            admin_kubeconfig: cp.kubeconfig_path.clone(),
            containerd: None,
            node_init: None,
            kubelet: None,
            kubelet_args: Vec::new(),
            controller_manager: None,
            proxy: None,
            kubelet_healthz: 0,
            proxy_healthz: None,
            sweep,
            timings: StartTimings::default(),
            torn_down: false,
        };
        node.boot(cp, &options, binaries).await?;
        node.timings.total = started.elapsed();
        Ok(node)
    }

    async fn boot(
        &mut self,
        cp: &ControlPlane,
        options: &NodeOptions,
        binaries: crate::image::StaticBinaries,
    ) -> Result<(), Error> {
        let d = self.run_dir.clone();
        for sub in [
            "containerd",
            "cni/net.d",
            "cni/bin",
            "cni/ipam",
            "kubelet/root",
            "kubelet/pki",
            "kubelet/volume-plugins",
            "pod-logs",
            "pki",
            "logs",
            "kcm/certs",
            "kcm/flex",
        ] {
            std::fs::create_dir_all(d.join(sub)).map_err(io(format!("creating {sub}")))?;
        }
        let write = |rel: &str, text: &str| -> Result<PathBuf, Error> {
            let p = d.join(rel);
            std::fs::write(&p, text).map_err(io(format!("writing {}", p.display())))?;
            Ok(p)
        };
        let images_dir = d.join("images");
        let images = blocking(move || TestImages::write_with(&images_dir, binaries)).await?;

        // Identities and their RBAC.
        let name = self.name.clone();
        let kubeconfig = |who: &str, user: &str, groups: &[&str]| -> Result<PathBuf, Error> {
            let cert = cp.issue_client(user, groups)?;
            let crt = write(&format!("pki/{who}.crt"), &cert.cert_pem)?;
            let key = write(&format!("pki/{who}.key"), &cert.key_pem)?;
            write(
                &format!("{who}.kubeconfig"),
                &kubeconfig_yaml(&cp.server, &cp.ca_file(), &crt, &key),
            )
        };
        let kubelet_kc = kubeconfig("kubelet", &format!("system:node:{name}"), &["system:nodes"])?;
        let kcm_kc = kubeconfig("kcm", "system:kube-controller-manager", &[])?;
        let proxy_kc = kubeconfig("kube-proxy", "system:kube-proxy", &[])?;
        let client = cp.client().await?;
        bind(
            &client,
            "meshgate-testenv:system:node",
            "system:node",
            "Group",
            "system:nodes",
        )
        .await?;
        if options.proxy {
            bind(
                &client,
                "meshgate-testenv:system:node-proxier",
                "system:node-proxier",
                "User",
                "system:kube-proxy",
            )
            .await?;
        }

        // containerd. Its CNI plugins come from a directory of the node's own, holding links to
        // the host's plugins, so that a mesh-like agent can install its plugin there (as mesh CNI
        // agents do on a real node) without touching the host's directory.
        let plugins = std::fs::read_dir(&self.tools.cni_bin)
            .map_err(io(format!("reading {}", self.tools.cni_bin.display())))?;
        for plugin in plugins.flatten() {
            let link = d.join("cni/bin").join(plugin.file_name());
            std::os::unix::fs::symlink(plugin.path(), &link)
                .map_err(io(format!("linking {}", link.display())))?;
        }
        let config = write(
            "containerd/config.toml",
            &containerd_config(&d, &self.socket, &d.join("cni/bin")),
        )?;
        write("cni/net.d/10-meshgate.conflist", &cni_conflist(&d))?;
        let path = host::child_path();
        let env = [("PATH", path.as_os_str())];
        let t = Instant::now();
        let containerd_args = ["--config".into(), config.display().to_string()];
        let containerd = if options.own_namespaces {
            // unshare forks containerd as PID 1 of a new PID namespace, with that namespace's
            // /proc in a new mount namespace, its mounts first made private (nothing the node
            // mounts reaches the host), then shared among themselves, so that pods may mount
            // node paths HostToContainer (containerd looks up the mount of the path as written:
            // `/var/run/netns`, under the symlink `/var/run`, is on `/`). The child dies with
            // unshare (--kill-child).
            let mut args: Vec<String> = [
                "--pid",
                "--fork",
                "--kill-child",
                "--mount",
                "--mount-proc",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                "mkdir -p /run/netns && mount --make-rshared / && exec \"$0\" \"$@\"",
            ]
            .map(String::from)
            .to_vec();
            args.push(self.tools.containerd.display().to_string());
            args.extend(containerd_args);
            let p = Process::spawn_with_env(
                "containerd",
                &self.tools.unshare,
                &args,
                &env,
                &d.join("logs/containerd.log"),
            )?;
            self.node_init = Some(child_of(p.pid())?);
            p
        } else {
            Process::spawn_with_env(
                "containerd",
                &self.tools.containerd,
                &containerd_args,
                &env,
                &d.join("logs/containerd.log"),
            )?
        };
        self.containerd = Some(containerd);
        loop {
            if let Some(p) = &self.containerd {
                p.check_alive()?;
            }
            if self.ctr(&["version"]).is_ok() {
                break;
            }
            if t.elapsed() > Duration::from_secs(30) {
                return Err(Error::NotReady {
                    name: "containerd",
                    waited: Duration::from_secs(30),
                    log: self
                        .containerd
                        .as_ref()
                        .map(|p| p.log_tail(30))
                        .unwrap_or_default(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.timings.containerd_serving = t.elapsed();
        let t = Instant::now();
        for archive in images.all() {
            self.ctr(&["images", "import", &archive.path.to_string_lossy()])?;
        }
        self.timings.images_imported = t.elapsed();
        self.images = Some(images);

        // kube-controller-manager
        if options.controller_manager {
            let port = free_port()?;
            let kc = kcm_kc.display().to_string();
            let p = Process::spawn_with_env(
                "kube-controller-manager",
                &self.tools.node_bin.join("kube-controller-manager"),
                &[
                    format!("--kubeconfig={kc}"),
                    format!("--authentication-kubeconfig={kc}"),
                    format!("--authorization-kubeconfig={kc}"),
                    "--bind-address=127.0.0.1".into(),
                    format!("--secure-port={port}"),
                    format!("--cert-dir={}", d.join("kcm/certs").display()),
                    "--leader-elect=false".into(),
                    "--use-service-account-credentials=true".into(),
                    format!(
                        "--service-account-private-key-file={}",
                        cp.service_account_key_file().display()
                    ),
                    format!("--root-ca-file={}", cp.ca_file().display()),
                    "--cluster-cidr=10.244.0.0/16".into(),
                    "--allocate-node-cidrs=true".into(),
                    "--node-cidr-mask-size=24".into(),
                    "--service-cluster-ip-range=10.96.0.0/16".into(),
                    format!("--flex-volume-plugin-dir={}", d.join("kcm/flex").display()),
                    "--v=2".into(),
                ],
                &env,
                &d.join("logs/kube-controller-manager.log"),
            )?;
            crate::wait_http(
                &p,
                &format!("https://127.0.0.1:{port}/healthz"),
                Duration::from_secs(60),
            )
            .await?;
            self.controller_manager = Some(p);
        }

        // kubelet
        let (port, healthz) = (free_port()?, free_port()?);
        self.kubelet_healthz = healthz;
        let kubelet_config = write(
            "kubelet/config.yaml",
            &kubelet_config(
                &d,
                &self.socket,
                &cp.ca_file(),
                port,
                healthz,
                &options.register_with_taints,
            ),
        )?;
        let t = Instant::now();
        self.kubelet_args = vec![
            format!("--config={}", kubelet_config.display()),
            format!("--kubeconfig={}", kubelet_kc.display()),
            format!("--root-dir={}", d.join("kubelet/root").display()),
            format!("--cert-dir={}", d.join("kubelet/pki").display()),
            format!("--hostname-override={name}"),
            "--v=2".into(),
        ];
        let kubelet = self.spawn_kubelet()?;
        self.kubelet = Some(kubelet);
        let nodes: Api<Node> = Api::all(client.clone());
        let mut cidr_at = None;
        loop {
            if let Some(p) = &self.kubelet {
                p.check_alive()?;
            }
            if let Ok(Some(n)) = nodes.get_opt(&name).await {
                if cidr_at.is_none() && n.spec.as_ref().and_then(|s| s.pod_cidr.as_ref()).is_some()
                {
                    cidr_at = Some(t.elapsed());
                }
                if self.timings.ready_after_kubelet_start.is_zero() && is_ready(&n) {
                    self.timings.ready_after_kubelet_start = t.elapsed();
                }
                let done = !self.timings.ready_after_kubelet_start.is_zero()
                    && (cidr_at.is_some() || !options.controller_manager);
                if done {
                    break;
                }
            }
            if t.elapsed() > options.ready_timeout {
                return Err(Error::NotReady {
                    name: "kubelet (Node Ready and podCIDR)",
                    waited: options.ready_timeout,
                    log: self
                        .kubelet
                        .as_ref()
                        .map(|p| p.log_tail(40))
                        .unwrap_or_default(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.timings.pod_cidr_after_kubelet_start = cidr_at;

        // kube-proxy
        if options.proxy {
            let (healthz, metrics) = (free_port()?, free_port()?);
            let config = write(
                "kube-proxy.yaml",
                &proxy_config(&proxy_kc, &name, healthz, metrics),
            )?;
            let p = Process::spawn_with_env(
                "kube-proxy",
                &self.tools.node_bin.join("kube-proxy"),
                &[format!("--config={}", config.display()), "--v=2".into()],
                &env,
                &d.join("logs/kube-proxy.log"),
            )?;
            crate::wait_http(
                &p,
                &format!("http://127.0.0.1:{healthz}/healthz"),
                Duration::from_secs(60),
            )
            .await?;
            self.proxy = Some(p);
            self.proxy_healthz = Some(healthz);
        }
        Ok(())
    }

    fn spawn_kubelet(&self) -> Result<Process, Error> {
        let path = host::child_path();
        let kubelet = self.tools.kubelet.clone();
        let (program, args) = match self.node_init {
            // The kubelet in the node's namespaces: nsenter forks it there, and it dies with
            // nsenter (setpriv's parent-death signal).
            Some(init) => {
                let mut args: Vec<String> = vec![
                    "-t".into(),
                    init.to_string(),
                    "-m".into(),
                    "-p".into(),
                    "--".into(),
                    "/usr/bin/setpriv".into(),
                    "--pdeathsig".into(),
                    "KILL".into(),
                    "--".into(),
                    kubelet.display().to_string(),
                ];
                args.extend(self.kubelet_args.iter().cloned());
                (self.tools.nsenter.clone(), args)
            }
            None => (kubelet, self.kubelet_args.clone()),
        };
        Process::spawn_with_env(
            "kubelet",
            &program,
            &args,
            &[("PATH", path.as_os_str())],
            &self.run_dir.join("logs/kubelet.log"),
        )
    }

    /// The kubelet's root directory (`plugins_registry`, `plugins`, pods).
    pub fn kubelet_root(&self) -> PathBuf {
        self.run_dir.join("kubelet/root")
    }

    /// Stops the kubelet (SIGTERM, as a service manager does) and starts it again with the same
    /// flags; waits until its health endpoint answers again. Containers keep running.
    pub async fn restart_kubelet(&mut self) -> Result<(), Error> {
        if let Some(k) = self.kubelet.take() {
            k.terminate();
        }
        let kubelet = self.spawn_kubelet()?;
        crate::wait_http(
            &kubelet,
            &format!("http://127.0.0.1:{}/healthz", self.kubelet_healthz),
            Duration::from_secs(60),
        )
        .await?;
        self.kubelet = Some(kubelet);
        Ok(())
    }

    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The programs the node uses.
    pub fn tools(&self) -> &NodeTools {
        &self.tools
    }

    /// The run directory (logs in `logs/`).
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The CNI configuration directory containerd reads (one conflist: the bridge).
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.run_dir.join("cni/net.d")
    }

    /// The CNI plugin directory containerd runs plugins from (links to the host's, and what
    /// agents install).
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.run_dir.join("cni/bin")
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> &Path {
        &self.socket
    }

    /// The host as it was before the node started.
    pub fn snapshot_before(&self) -> &HostSnapshot {
        &self.snapshot
    }

    /// What the sweep of a crashed earlier run did at start, if there was one.
    pub fn sweep_at_start(&self) -> Option<&Teardown> {
        self.sweep.as_ref()
    }

    /// The imported images and the static binaries in them.
    pub fn images(&self) -> Result<&TestImages, Error> {
        self.images
            .as_ref()
            .ok_or_else(|| Error::Node("no images imported".into()))
    }

    /// The node's processes by name (for memory figures).
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        [
            &self.containerd,
            &self.kubelet,
            &self.controller_manager,
            &self.proxy,
        ]
        .into_iter()
        .flatten()
        .map(|p| (p.name(), p.pid()))
        .collect()
    }

    /// The last lines of a component's log (`containerd`, `kubelet`, `kube-controller-manager`,
    /// `kube-proxy`).
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        let text =
            std::fs::read_to_string(self.run_dir.join("logs").join(format!("{component}.log")))
                .unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The log file of a container of a pod (CRI format: `TIME STREAM TAG TEXT` per line).
    pub fn container_log(
        &self,
        namespace: &str,
        pod: &str,
        uid: &str,
        container: &str,
        restart: u32,
    ) -> PathBuf {
        self.run_dir
            .join("pod-logs")
            .join(format!("{namespace}_{pod}_{uid}"))
            .join(container)
            .join(format!("{restart}.log"))
    }

    /// Runs `ctr -a SOCKET -n k8s.io ARGS…` and returns its stdout.
    pub fn ctr(&self, args: &[&str]) -> Result<String, Error> {
        let out = std::process::Command::new(&self.tools.ctr)
            .arg("-a")
            .arg(&self.socket)
            .args(["-n", K8S_NAMESPACE])
            .args(args)
            .output()
            .map_err(io("running ctr"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(Error::Node(format!(
                "ctr {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }

    /// The host pid of a running container's (or sandbox's) task, by container id (with or
    /// without the `containerd://` prefix of a pod status).
    pub fn task_pid(&self, container_id: &str) -> Result<Option<u32>, Error> {
        let id = container_id.trim_start_matches("containerd://");
        let pid = self.ctr(&["tasks", "ls"])?.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f[..] {
                [task, pid, "RUNNING"] if task == id => pid.parse::<u32>().ok(),
                _ => None,
            }
        });
        Ok(match (pid, self.node_init) {
            // containerd reports pids of the node's PID namespace.
            (Some(pid), Some(init)) => host_pid_in(init, pid),
            (pid, _) => pid,
        })
    }

    /// The host pid of the running pause process of a pod's sandbox, found by the pod's uid in
    /// the sandbox container's labels.
    pub fn sandbox_pid(&self, pod_uid: &str) -> Result<u32, Error> {
        for id in self.ctr(&["containers", "ls", "-q"])?.lines() {
            let info: serde_json::Value =
                serde_json::from_str(&self.ctr(&["containers", "info", id.trim()])?)
                    .map_err(|e| Error::Node(format!("ctr containers info {id}: {e}")))?;
            let labels = &info["Labels"];
            if labels["io.cri-containerd.kind"] == "sandbox"
                && labels["io.kubernetes.pod.uid"] == pod_uid
                && let Some(pid) = self.task_pid(id.trim())?
            {
                return Ok(pid);
            }
        }
        Err(Error::Node(format!(
            "no running sandbox for pod uid {pod_uid}"
        )))
    }

    async fn client(&self) -> Result<Client, Error> {
        let kubeconfig = Kubeconfig::read_from(&self.admin_kubeconfig)
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        Ok(Client::try_from(config)?)
    }

    /// Tears the node down and restores the host: deletes the node's pods through the API and
    /// waits until the kubelet has stopped their sandboxes (CNI DEL), stops the processes,
    /// removes what is left with `ctr`, restores the host from the snapshot, deletes the Node
    /// object and the RBAC bindings. Errors when the host differs from the snapshot afterwards.
    pub async fn stop(mut self) -> Result<Teardown, Error> {
        let start = Instant::now();
        let mut pre = Vec::new();
        if self.kubelet.as_ref().is_some_and(Process::is_running)
            && let Err(e) = self.delete_pods(&mut pre).await
        {
            pre.push(format!("deleting the pods through the API failed: {e}"));
        }
        let (node, mut t) = blocking(move || {
            let t = self.teardown();
            Ok((self, t))
        })
        .await?;
        t.log.splice(0..0, pre);
        if let Ok(client) = node.client().await {
            let _ = Api::<Node>::all(client.clone())
                .delete(&node.name, &DeleteParams::default())
                .await;
            let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(client);
            for b in [
                "meshgate-testenv:system:node",
                "meshgate-testenv:system:node-proxier",
            ] {
                let _ = bindings.delete(b, &DeleteParams::default()).await;
            }
        }
        t.took = start.elapsed();
        if t.leftovers.is_empty() {
            Ok(t)
        } else {
            Err(Error::Node(format!(
                "the teardown left the host changed:\n{}\nactions:\n{}",
                t.leftovers.join("\n"),
                t.log.join("\n")
            )))
        }
    }

    async fn delete_pods(&self, log: &mut Vec<String>) -> Result<(), Error> {
        let client = self.client().await?;
        let pods: Api<Pod> = Api::all(client.clone());
        let on_node = ListParams::default().fields(&format!("spec.nodeName={}", self.name));
        let mut deleted = std::collections::BTreeSet::new();
        for p in pods.list(&on_node).await?.items {
            let (Some(ns), Some(name)) = (p.metadata.namespace, p.metadata.name) else {
                continue;
            };
            log.push(format!("deleting pod {ns}/{name}"));
            let _ = Api::<Pod>::namespaced(client.clone(), &ns)
                .delete(&name, &DeleteParams::default())
                .await;
            deleted.extend(p.metadata.uid);
        }
        // The deleted pods are waited for; pods their controllers create in their place
        // (DaemonSets, ReplicaSets, StatefulSets: the controller manager runs) are not: the
        // teardown stops their containers with the rest.
        let deadline = Instant::now() + Duration::from_secs(60);
        while pods
            .list(&on_node)
            .await?
            .items
            .iter()
            .any(|p| p.metadata.uid.as_ref().is_some_and(|u| deleted.contains(u)))
        {
            if Instant::now() > deadline {
                log.push("pods still on the node after 60 s".into());
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        log.push("pod objects gone".into());
        // The kubelet stops each sandbox (CNI DEL, netns removed) a moment after the object is
        // gone; it would remove the stopped containers only at its next GC (every minute).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let tasks = self.ctr(&["tasks", "ls", "-q"]).unwrap_or_default();
            let netns = std::fs::read_dir("/run/netns")
                .map(|d| {
                    d.flatten()
                        .filter(|e| {
                            e.file_name()
                                .to_str()
                                .is_some_and(|n| !self.snapshot.netns.contains(n))
                        })
                        .count()
                })
                .unwrap_or(0);
            if tasks.trim().is_empty() && netns == 0 {
                log.push("pod sandboxes stopped".into());
                return Ok(());
            }
            if !pods.list(&on_node).await?.items.is_empty() {
                log.push("pods that replaced the deleted ones left to the teardown".into());
                return Ok(());
            }
            if Instant::now() > deadline {
                log.push(format!(
                    "after 30 s: tasks left {:?}, new netns left {netns}",
                    tasks.lines().collect::<Vec<_>>()
                ));
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The host side of the teardown (no API): processes, containers, then the host restore.
    fn teardown(&mut self) -> Teardown {
        let start = Instant::now();
        let mut t = Teardown::default();
        if self.torn_down {
            return t;
        }
        self.torn_down = true;
        let log = &mut t.log;
        if let Some(p) = self.proxy.take() {
            stop_process(&p, log);
            let out = std::process::Command::new(self.tools.node_bin.join("kube-proxy"))
                .args(["--cleanup", "--v=0"])
                .env("PATH", host::child_path())
                .output();
            match out {
                Ok(o) if o.status.success() => log.push("kube-proxy --cleanup".into()),
                Ok(o) => log.push(format!(
                    "kube-proxy --cleanup: {}: {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => log.push(format!("kube-proxy --cleanup: {e}")),
            }
        }
        for p in [self.kubelet.take(), self.controller_manager.take()]
            .into_iter()
            .flatten()
        {
            stop_process(&p, log);
        }
        if let Some(containerd) = self.containerd.take() {
            if containerd.is_running() {
                let tasks = self.ctr(&["tasks", "ls", "-q"]).unwrap_or_default();
                for task in tasks.lines().map(str::trim).filter(|s| !s.is_empty()) {
                    log.push(format!("killing task {task}"));
                    let _ = self.ctr(&["tasks", "kill", "-s", "KILL", task]);
                }
                let deadline = Instant::now() + Duration::from_secs(10);
                for task in tasks.lines().map(str::trim).filter(|s| !s.is_empty()) {
                    while Instant::now() < deadline
                        && self.ctr(&["tasks", "delete", "-f", task]).is_err()
                        && self.task_exists(task)
                    {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
                let containers = self.ctr(&["containers", "ls", "-q"]).unwrap_or_default();
                for c in containers.lines().map(str::trim).filter(|s| !s.is_empty()) {
                    match self.ctr(&["containers", "delete", c]) {
                        Ok(_) => log.push(format!("deleted container {c}")),
                        Err(e) => log.push(format!("container {c} left: {e}")),
                    }
                }
            }
            stop_process(&containerd, log);
        }
        host::restore(&self.snapshot, &self.run_dir, &self.socket, log);
        match HostSnapshot::take() {
            Ok(now) => t.leftovers = self.snapshot.differences(&now),
            Err(e) => t.leftovers.push(format!("cannot read the host state: {e}")),
        }
        if t.leftovers.is_empty() {
            // The host is as before: nothing for a sweeper to do.
            let _ = std::fs::remove_file(state_file());
        }
        self.lock = None;
        t.took = start.elapsed();
        t
    }

    fn task_exists(&self, task: &str) -> bool {
        self.ctr(&["tasks", "ls", "-q"])
            .map(|s| s.lines().any(|l| l.trim() == task))
            .unwrap_or(false)
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        let t = self.teardown();
        if !t.leftovers.is_empty() {
            eprintln!(
                "meshgate-testenv: the node's teardown left the host changed (the next start \
                 sweeps it):\n{}",
                t.leftovers.join("\n")
            );
        }
    }
}

/// SIGTERM, up to 15 s for the exit, then SIGKILL.
fn stop_process(p: &Process, log: &mut Vec<String>) {
    if !p.is_running() {
        log.push(format!("{} had exited", p.name()));
        return;
    }
    let _ = host::run("kill", &["-s", "TERM", &p.pid().to_string()]);
    let deadline = Instant::now() + Duration::from_secs(15);
    while p.is_running() {
        if Instant::now() > deadline {
            p.stop();
            log.push(format!("killed {} ({}) after 15 s", p.name(), p.pid()));
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    log.push(format!("stopped {} ({})", p.name(), p.pid()));
}

fn is_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A ClusterRoleBinding (server-side apply).
async fn bind(
    client: &Client,
    name: &str,
    role: &str,
    kind: &str,
    subject: &str,
) -> Result<(), Error> {
    let binding: k8s_openapi::api::rbac::v1::ClusterRoleBinding =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": subject}],
        }))
        .map_err(|e| Error::Node(format!("binding {name}: {e}")))?;
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(client.clone())
        .patch(
            name,
            &PatchParams::apply("meshgate-testenv").force(),
            &Patch::Apply(&binding),
        )
        .await?;
    Ok(())
}

fn containerd_config(d: &Path, socket: &Path, cni_bin: &Path) -> String {
    let d = d.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni}"
    conf_dir = "{d}/cni/net.d"
    max_conf_num = 1
"#,
        socket = socket.display(),
        pause = crate::image::PAUSE_IMAGE,
        cni = cni_bin.display(),
    )
}

fn cni_conflist(d: &Path) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "meshgate-node",
        "plugins": [
            {
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": d.join("cni/ipam"),
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}

/// The kubelet's configuration: cgroup v1 allowed (these hosts), cgroupfs (no systemd), its
/// directories in the run directory, serving on loopback, no image GC and disk eviction only
/// below 100 MiB free (absolute: 1% of a large build machine's disk is gigabytes, and a node
/// under disk pressure rejects the tests' pods).
fn kubelet_config(
    d: &Path,
    socket: &Path,
    ca: &Path,
    port: u16,
    healthz: u16,
    taints: &[String],
) -> String {
    let taints: Vec<String> = taints
        .iter()
        .map(|k| format!("{{key: {k}, effect: NoSchedule}}"))
        .collect();
    format!(
        "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{socket}
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
clusterDomain: cluster.local
clusterDNS: [10.96.0.10]
podLogsDir: {d}/pod-logs
failSwapOn: false
rotateCertificates: false
serverTLSBootstrap: false
volumePluginDir: {d}/kubelet/volume-plugins
evictionHard: {{memory.available: 50Mi, nodefs.available: 100Mi, nodefs.inodesFree: 1%, imagefs.available: 100Mi}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
registerWithTaints: [{taints}]
",
        socket = socket.display(),
        ca = ca.display(),
        d = d.display(),
        taints = taints.join(", "),
    )
}

/// kube-proxy in iptables mode, on loopback; conntrack and route_localnet left alone (no
/// sysctl changes).
fn proxy_config(kubeconfig: &Path, name: &str, healthz: u16, metrics: u16) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {kc}}}
mode: iptables
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:{healthz}
metricsBindAddress: 127.0.0.1:{metrics}
clusterCIDR: 10.244.0.0/16
hostnameOverride: {name}
conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
iptables: {{localhostNodePorts: false}}
",
        kc = kubeconfig.display()
    )
}

/// The one child of `pid` (unshare's forked command), waiting briefly for the fork.
fn child_of(pid: u32) -> Result<u32, Error> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    for _ in 0..500 {
        let children = std::fs::read_to_string(&path).unwrap_or_default();
        if let Some(child) = children.split_whitespace().find_map(|c| c.parse().ok()) {
            return Ok(child);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(Error::Node(format!(
        "pid {pid} forked no child in 5 s ({path})"
    )))
}

/// The host pid of the process whose pid is `pid` in the PID namespace of `init` (a host pid,
/// that namespace's PID 1), from the `NSpid` lines of the host's `/proc`: the process at that
/// namespace's level with that pid which descends from `init` (every process of the node does;
/// orphans are reparented to it).
fn host_pid_in(init: u32, pid: u32) -> Option<u32> {
    let level = nspid(init)?.len();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let host: u32 = e.file_name().to_str()?.parse().ok()?;
        (nspid(host)?.get(level - 1) == Some(&pid) && descends_from(host, init)).then_some(host)
    })
}

/// A process's pids, from the outermost PID namespace this `/proc` shows to its own (`NSpid:`).
fn nspid(pid: u32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace()
        .skip(1)
        .map(|p| p.parse().ok())
        .collect()
}

fn descends_from(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..64 {
        if pid == ancestor {
            return true;
        }
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let Some(parent) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()
            })
        else {
            return false;
        };
        if parent <= 1 {
            return false;
        }
        pid = parent;
    }
    false
}
