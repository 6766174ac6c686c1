//! The real Istio on the real node: istiod, pilot-agent, the istio-cni node agent and plugin
//! built from Istio's Go module by `tools/istio/build.sh` (the version is pinned there), with
//! Istio's own Helm charts of the same commit, put into images written here (no registry, no
//! container engine) and installed with Helm (`tools/helm/build.sh`).
//!
//! Real: istiod (its injector, CA, webhook patcher, untaint controller), the `istio-validation`
//! check (`pilot-agent istio-iptables --run-validation`), the node agent (`install-cni`: it
//! chains the plugin into the node's CNI configuration, writes the plugin's kubeconfig, serves
//! its readiness, repairs pods), and the CNI plugin (`istio-cni`, which programs the pod's
//! iptables with the host's `iptables-restore`). A stand-in: only the proxy process that Envoy
//! would be (`mesh-proxy` of `meshgate-standins`, the proxy image's entry point; it runs the
//! real `pilot-agent` for every command but `proxy`), and in ambient mode the node proxy that
//! ztunnel (Rust, not a crate) would be: `mesh-node-proxy`, fed by the real node agent over ZDS
//! (`meshgate_standins::zds`), in the image Istio's `ztunnel` chart runs. The node agent's image carries the
//! host's iptables (the Debian package's multi-call binaries, their extensions and libraries),
//! as Istio's own image carries its base image's: the agent's repair and ambient mode run
//! them inside its container.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::image::{ImageArchive, ImageConfig, StaticBinaries, write_image};
use crate::node::RealNode;
use crate::{Error, io};

/// The namespace Istio's charts are installed into.
pub const ISTIO_NAMESPACE: &str = "istio-system";

/// The directory `tools/istio/build.sh` prints (set it to skip the script).
pub const ISTIO_ENV: &str = "MESHGATE_ISTIO";
/// istiod: `/usr/local/bin/pilot-discovery`, user 1337 as Istio's image (the chart says
/// `runAsNonRoot` without a uid).
pub const PILOT_IMAGE: &str = "meshgate.local/istio-pilot:1";
/// The sidecar's image (Istio's `proxyv2`): the real `pilot-agent` and the `mesh-proxy`
/// stand-in as its entry point.
pub const PROXY_IMAGE: &str = "meshgate.local/istio-proxyv2:1";
/// The node agent's image: `/usr/local/bin/install-cni` and the plugin at
/// `/opt/cni/bin/istio-cni` (the node agent copies every file of that directory to the node).
pub const CNI_IMAGE: &str = "meshgate.local/istio-install-cni:1";
/// The ambient node proxy's image (Istio's `ztunnel`): the `mesh-node-proxy` stand-in as its
/// entry point, which takes the chart's `proxy ztunnel` arguments as ztunnel does.
pub const NODE_PROXY_IMAGE: &str = "meshgate.local/istio-ztunnel:1";

/// A build of Istio: binaries, charts and version.
#[derive(Clone, Debug)]
pub struct Istio {
    pub dir: PathBuf,
    /// What the binaries report (`1.31-dev`), and the module version they were built from.
    pub version: String,
}

impl Istio {
    /// `MESHGATE_ISTIO`, else `tools/istio/build.sh` (builds once, cached).
    pub fn find() -> Result<Self, Error> {
        let dir = crate::built(ISTIO_ENV, "tools/istio/build.sh")?;
        let version = std::fs::read_to_string(dir.join("version"))
            .map_err(io(format!("reading {}/version", dir.display())))?
            .trim()
            .to_owned();
        let istio = Self { dir, version };
        for b in ["pilot-discovery", "pilot-agent", "install-cni", "istio-cni"] {
            if !istio.bin(b).is_file() {
                return Err(Error::Build {
                    script: "tools/istio/build.sh".into(),
                    message: format!("{} is missing", istio.bin(b).display()),
                });
            }
        }
        Ok(istio)
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// One of Istio's charts: `base`, `istio-control/istio-discovery`, `istio-cni`, `ztunnel`.
    pub fn chart(&self, name: &str) -> PathBuf {
        self.dir.join("charts").join(name)
    }

    /// Writes the four images into `dir` (for `ctr images import`).
    pub fn write_images(
        &self,
        dir: &Path,
        binaries: &StaticBinaries,
    ) -> Result<Vec<ImageArchive>, Error> {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        const PATH: &str = "PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
        let pilot = self.bin("pilot-discovery");
        let agent = self.bin("pilot-agent");
        let proxy = binaries.standin(crate::image::PROXY_STANDIN);
        let node_proxy = binaries.standin("mesh-node-proxy");
        let install = self.bin("install-cni");
        let plugin = self.bin("istio-cni");
        let iptables = host_iptables()?;
        let mut cni_files: Vec<(&str, &Path)> = vec![
            ("usr/local/bin/install-cni", &install),
            ("opt/cni/bin/istio-cni", &plugin),
        ];
        cni_files.extend(iptables.iter().map(|(p, h)| (p.as_str(), h.as_path())));
        Ok(vec![
            write_image(
                PILOT_IMAGE,
                &[("usr/local/bin/pilot-discovery", &pilot)],
                &ImageConfig {
                    entrypoint: &["/usr/local/bin/pilot-discovery"],
                    user: Some("1337:1337"),
                    env: &[PATH],
                },
                &dir.join("istio-pilot.tar"),
            )?,
            write_image(
                PROXY_IMAGE,
                &[
                    ("usr/local/bin/pilot-agent", &agent),
                    ("usr/local/bin/mesh-proxy", &proxy),
                ],
                &ImageConfig {
                    entrypoint: &["/usr/local/bin/mesh-proxy"],
                    user: Some("1337:1337"),
                    env: &[PATH],
                },
                &dir.join("istio-proxyv2.tar"),
            )?,
            write_image(
                CNI_IMAGE,
                &cni_files,
                &ImageConfig {
                    entrypoint: &["/usr/local/bin/install-cni"],
                    user: None,
                    env: &[PATH],
                },
                &dir.join("istio-install-cni.tar"),
            )?,
            write_image(
                NODE_PROXY_IMAGE,
                &[("usr/local/bin/mesh-node-proxy", &node_proxy)],
                &ImageConfig {
                    entrypoint: &["/usr/local/bin/mesh-node-proxy"],
                    user: None,
                    env: &[PATH],
                },
                &dir.join("istio-ztunnel.tar"),
            )?,
        ])
    }
}

/// How [`Istio::install`] installs Istio on the test node.
#[derive(Clone, Debug, Default)]
pub struct InstallOptions {
    /// Ambient mode, as Istio's `ambient` profile turns it on: istiod's `PILOT_ENABLE_AMBIENT`,
    /// the node agent's `ambient.enabled`, and the node proxy (Istio's `ztunnel` chart with
    /// [`NODE_PROXY_IMAGE`]).
    pub ambient: bool,
    /// Taint keys istiod tolerates beside Istio's own readiness taint (`pilot.tolerations`,
    /// effect `NoSchedule`): a node gate's taint, where the node proxy needs istiod to become
    /// Ready (docs/design.md, "Autoscalers and other controllers").
    pub istiod_tolerates: Vec<String>,
}

/// The values files [`Istio::install`] wrote, one per release (to upgrade or reinstall it).
#[derive(Clone, Debug)]
pub struct Values {
    pub istiod: PathBuf,
    pub cni: PathBuf,
}

impl Istio {
    /// Installs Istio with Helm from its own charts: `istio-base`, `istiod`, `istio-cni` and,
    /// in ambient mode, `ztunnel`, each a release in [`ISTIO_NAMESPACE`] (created). The values
    /// are what a one-node cluster without a registry needs: the images imported (never
    /// pulled), small requests, one istiod without an autoscaler, injection for the CNI plugin
    /// (`istio-validation`, not `istio-init`), the node agent on the node's CNI directories,
    /// Istio's untaint controller on (its `cni.istio.io/not-ready` taint). Everything else is
    /// Istio's default (native sidecars: auto, which the kubelet v1.36 turns on), but the node
    /// agent's repair mode (below). The values files are written into `dir`.
    pub fn install(
        &self,
        helm: &Path,
        kubeconfig: &Path,
        node: &RealNode,
        dir: &Path,
        options: &InstallOptions,
    ) -> Result<Values, Error> {
        let small = json!({"requests": {"cpu": "10m", "memory": "32Mi"}});
        let mut istiod = json!({
            "global": {
                "imagePullPolicy": "Never",
                // The untaint controller says what it did only at debug.
                "logging": {"level": "default:info,untaint:debug"},
                "proxy": {"image": PROXY_IMAGE, "resources": small},
                "proxy_init": {"image": PROXY_IMAGE},
            },
            "pilot": {
                "image": PILOT_IMAGE,
                "autoscaleEnabled": false,
                "replicaCount": 1,
                "resources": {"requests": {"cpu": "10m", "memory": "128Mi"}},
                "cni": {"enabled": true},
                // Istio's node untaint controller, beside meshgate's node gate.
                "taint": {"enabled": true},
            },
        });
        if !options.istiod_tolerates.is_empty() {
            istiod["pilot"]["tolerations"] = tolerations(&options.istiod_tolerates);
        }
        // The node agent's repair: Istio's default repairs a broken pod in place, from the
        // network namespace of the host's PID 1 (`cni/pkg/repair` `runInHost`:
        // `/host/proc/1/ns/net`), which the init of some hosts (this VM's) lets no one open, not
        // even root; its other mode, which every host allows, deletes the broken pod.
        let mut cni = json!({
            "global": {"imagePullPolicy": "Never"},
            "cni": {
                "image": CNI_IMAGE,
                "cniBinDir": node.cni_bin_dir(),
                "cniConfDir": node.cni_conf_dir(),
                "resources": small,
                "repair": {"repairPods": false, "deletePods": true},
            },
        });
        if options.ambient {
            istiod["pilot"]["env"] = json!({"PILOT_ENABLE_AMBIENT": "true"});
            cni["cni"]["ambient"] = json!({"enabled": true});
        }
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        let write = |name: &str, v: &Value| -> Result<PathBuf, Error> {
            let path = dir.join(name);
            std::fs::write(&path, v.to_string())
                .map_err(io(format!("writing {}", path.display())))?;
            Ok(path)
        };
        let values = Values {
            istiod: write("istiod.json", &istiod)?,
            cni: write("istio-cni.json", &cni)?,
        };
        let mut releases = vec![
            ("istio-base", "base", None),
            (
                "istiod",
                "istio-control/istio-discovery",
                Some(values.istiod.clone()),
            ),
            ("istio-cni", "istio-cni", Some(values.cni.clone())),
        ];
        if options.ambient {
            let ztunnel =
                json!({"image": NODE_PROXY_IMAGE, "imagePullPolicy": "Never", "resources": small});
            releases.push(("ztunnel", "ztunnel", Some(write("ztunnel.json", &ztunnel)?)));
        }
        for (release, chart, values) in releases {
            let chart = self.chart(chart);
            let mut args = vec![
                "install".to_owned(),
                release.to_owned(),
                chart.to_string_lossy().into_owned(),
                "--namespace".to_owned(),
                ISTIO_NAMESPACE.to_owned(),
                "--create-namespace".to_owned(),
            ];
            if let Some(v) = values {
                args.extend(["--values".to_owned(), v.to_string_lossy().into_owned()]);
            }
            run_helm(helm, kubeconfig, &args)?;
        }
        Ok(values)
    }
}

/// Tolerations of `keys` (any value, effect `NoSchedule`), as Istio's charts take them.
pub fn tolerations(keys: &[String]) -> Value {
    keys.iter()
        .map(|k| json!({"key": k, "operator": "Exists", "effect": "NoSchedule"}))
        .collect()
}

/// Runs Helm against a cluster; its stdout, or an error with its output.
pub fn run_helm(helm: &Path, kubeconfig: &Path, args: &[String]) -> Result<String, Error> {
    let out = std::process::Command::new(helm)
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .output()
        .map_err(io(format!("running {}", helm.display())))?;
    if !out.status.success() {
        return Err(Error::Helm {
            args: args.join(" "),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The host's iptables for an image: every name of the nft and legacy multi-call binaries
/// (they dispatch on the name they are run by) in `/usr/sbin`, their extensions, and the
/// shared libraries all of them load (from `ldd`), each at its host path.
fn host_iptables() -> Result<Vec<(String, PathBuf)>, Error> {
    const SBIN: &str = "/usr/sbin";
    const EXTENSIONS: &str = "/usr/lib/x86_64-linux-gnu/xtables";
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let mut objects: Vec<PathBuf> = Vec::new();
    for (multi, names) in [
        (
            "xtables-nft-multi",
            &["iptables", "ip6tables", "iptables-nft", "ip6tables-nft"][..],
        ),
        (
            "xtables-legacy-multi",
            &["iptables-legacy", "ip6tables-legacy"][..],
        ),
    ] {
        let host = Path::new(SBIN).join(multi);
        if !host.is_file() {
            return Err(Error::Node(format!(
                "{} is missing: the node agent's image carries the host's iptables (tools/node/packages.sh installs it)",
                host.display()
            )));
        }
        for name in names {
            for suffix in ["", "-save", "-restore"] {
                files.push((format!("usr/sbin/{name}{suffix}"), host.clone()));
            }
        }
        objects.push(host);
    }
    for entry in std::fs::read_dir(EXTENSIONS)
        .map_err(io(format!("reading {EXTENSIONS}")))?
        .flatten()
    {
        let path = entry.path();
        if path.is_file() {
            files.push((
                path.to_string_lossy().trim_start_matches('/').to_owned(),
                path.clone(),
            ));
            objects.push(path);
        }
    }
    let mut libraries = std::collections::BTreeSet::new();
    for object in &objects {
        let out = std::process::Command::new("ldd")
            .arg(object)
            .output()
            .map_err(io(format!("running ldd {}", object.display())))?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)`, `/lib64/ld-linux-x86-64.so.2 (0x...)`
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line
                    .split_whitespace()
                    .next()
                    .filter(|p| p.starts_with('/')),
            };
            if let Some(p) = path.filter(|p| p.starts_with('/')) {
                libraries.insert(PathBuf::from(p));
            }
        }
    }
    for lib in libraries {
        let real =
            std::fs::canonicalize(&lib).map_err(io(format!("resolving {}", lib.display())))?;
        files.push((
            lib.to_string_lossy().trim_start_matches('/').to_owned(),
            real,
        ));
    }
    Ok(files)
}
