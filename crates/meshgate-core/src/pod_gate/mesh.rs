//! What each mesh does to a pod, read from the pod as the mesh's injector left it: whether the
//! mesh will capture the pod's traffic at all, how, and so whether a gate has anything to wait
//! for. Every rule follows the mesh's own code (cited in docs/design.md, "What the meshes do");
//! where meshgate cannot tell, it leaves the pod alone: a gate that can never pass is worse
//! than none.

use std::net::SocketAddr;

use meshgate_api::config::{GateCheck, IpFamily};
use meshgate_api::mesh::{Capture, Mesh, MeshProfile};

use crate::object::Meta;
use crate::object::view::{ContainerView, PodSpecView};
use crate::pod_gate::capture::{Outbound, Ports, Ranges, parse_cidrs};

/// Why a selected pod gets no gate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoGate {
    /// `spec.os.name: windows`: no mesh agent runs there, and the API server refuses the
    /// gate's Linux security settings on such a pod.
    Windows,
    /// No proxy container: injection was skipped (or has not run yet); nothing will capture
    /// this pod.
    NoProxy,
    /// The pod's own init container installs redirection (`istio-init`, `linkerd-init`): it
    /// runs before every later container, so there is no race with a node agent.
    RedirectByInit(String),
    /// The proxy is a gateway (Istio proxy type `router`): the CNI plugin leaves it alone.
    Gateway,
    /// The proxy is disabled (`DISABLE_ENVOY=true`).
    ProxyDisabled,
    /// `sidecar.istio.io/inject` is false: the CNI plugin leaves the pod alone.
    InjectDisabled,
    /// No `sidecar.istio.io/status` annotation: the CNI plugin leaves the pod alone.
    NoInjectionStatus,
    /// `sidecar.istio.io/interceptionMode` is `NONE`: nothing is redirected.
    InterceptionNone,
    /// A sidecar pod in an ambient selection: ambient leaves pods with a sidecar alone.
    SidecarPod,
    /// The pod's traffic annotations leave no address of the primary family redirected.
    NothingRedirected,
    /// A traffic annotation meshgate cannot read (the mesh refuses the pod's network set-up
    /// in that case, which no gate can fix).
    Unreadable(String),
    /// No gate resources fit the namespace's LimitRanges and the pod's QoS class.
    Resources(String),
    /// The pod is created bound to a node (`spec.nodeName`), so the resource gate cannot hold
    /// it, and the init gate is off.
    NodeBound,
    /// The mesh's own validator (`istio-validation`, `linkerd-network-validator`) is the pod's
    /// first init container: it holds every container after it until the mesh redirects the
    /// pod, and the mesh's repair acts on its failure (an init gate in front of it would keep
    /// that repair from ever seeing the pod); the resource gate cannot hold the pod.
    MeshValidates,
}

impl NoGate {
    /// A short word for logs, metrics and the verdict annotation.
    pub fn word(&self) -> &'static str {
        match self {
            NoGate::Windows => "windows",
            NoGate::NoProxy => "no-proxy",
            NoGate::RedirectByInit(_) => "redirect-by-init-container",
            NoGate::Gateway => "gateway",
            NoGate::ProxyDisabled => "proxy-disabled",
            NoGate::InjectDisabled => "inject-disabled",
            NoGate::NoInjectionStatus => "no-injection-status",
            NoGate::InterceptionNone => "interception-none",
            NoGate::SidecarPod => "sidecar-pod",
            NoGate::NothingRedirected => "nothing-redirected",
            NoGate::Unreadable(_) => "unreadable-annotation",
            NoGate::Resources(_) => "limit-range",
            NoGate::NodeBound => "node-bound",
            NoGate::MeshValidates => "mesh-validates",
        }
    }

    /// The annotation value: `none: <word> (<detail>)`.
    pub fn annotation(&self) -> String {
        match self {
            NoGate::RedirectByInit(d) | NoGate::Unreadable(d) | NoGate::Resources(d) => {
                format!("none: {} ({d})", self.word())
            }
            _ => format!("none: {}", self.word()),
        }
    }
}

/// What the gate waits for in one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatePlan {
    pub checks: Vec<GateCheck>,
    /// Destinations for the redirect check, one per IP family at most (primary first).
    pub targets: Vec<SocketAddr>,
    /// uids and gids the gate must not run as: the mesh does not redirect their traffic.
    pub avoid_uids: Vec<i64>,
    pub avoid_gids: Vec<i64>,
    /// The mesh's validator is the pod's first init container (meshgate's own gate aside): it
    /// already holds the pod until redirection works, and the mesh's repair acts on its
    /// failure, so no init gate goes in front of it (docs/design.md, "The init gate: the
    /// verdict per pod").
    pub mesh_validates: bool,
}

impl GatePlan {
    /// `meshgate-wait`'s arguments for the checks (without `--timeout`).
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = self.checks.iter().flat_map(GateCheck::args).collect();
        if self
            .checks
            .iter()
            .any(|c| matches!(c, GateCheck::RedirectCheck { .. }))
        {
            for t in &self.targets {
                args.push("--redirect-target".into());
                args.push(t.to_string());
            }
        }
        args
    }

    /// The annotation value: `gated: <args>`.
    pub fn annotation(&self) -> String {
        format!("gated: {}", self.args().join(" "))
    }
}

/// The verdict for one pod.
pub type Verdict = Result<GatePlan, NoGate>;

/// What the gate is configured to check instead of the mesh's default, if anything.
#[derive(Clone, Copy, Debug)]
pub struct Options<'a> {
    /// Configured checks (`initGate.checks`); empty: the mesh's check.
    pub checks: &'a [GateCheck],
    pub primary_family: IpFamily,
}

fn container<'c, 'a>(spec: &'c PodSpecView<'a>, name: &str) -> Option<&'c ContainerView<'a>> {
    spec.apps()
        .chain(spec.inits().map(|(_, c)| c))
        .find(|c| c.name() == Some(name))
}

fn has_init(spec: &PodSpecView<'_>, name: &str) -> bool {
    spec.inits().any(|(_, c)| c.name() == Some(name))
}

/// `Err` when one of the pod's init containers installs the mesh's redirection itself.
fn own_redirect_init(record: &MeshProfile, spec: &PodSpecView<'_>) -> Result<(), NoGate> {
    match record
        .redirect_init_containers
        .iter()
        .find(|init| has_init(spec, init))
    {
        Some(init) => Err(NoGate::RedirectByInit(format!(
            "{init} installs redirection before later containers"
        ))),
        None => Ok(()),
    }
}

fn is_true(v: &str) -> Option<bool> {
    // Go's strconv.ParseBool, which both meshes use.
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// The verdict of one mesh profile for a pod it selects.
pub fn verdict(
    record: &MeshProfile,
    spec: &PodSpecView<'_>,
    pod: &Meta,
    namespace: &Meta,
    options: Options<'_>,
) -> Verdict {
    if spec.os() == Some("windows") {
        return Err(NoGate::Windows);
    }
    match (record.mesh, record.capture) {
        (Mesh::Istio, Capture::NodeProxy { .. }) => {
            // Ambient enrolment excludes pods with a sidecar (the injection status annotation).
            if pod.annotations.contains_key(ISTIO_STATUS)
                || container(spec, record.proxy_container).is_some()
            {
                return Err(NoGate::SidecarPod);
            }
            // No validator runs in an ambient pod (it is the sidecar injector's).
            Ok(GatePlan {
                mesh_validates: false,
                ..plan(record, spec, options, Vec::new(), Vec::new(), Vec::new())
            })
        }
        (Mesh::Istio, Capture::Sidecar { .. }) => istio_sidecar(record, spec, pod, options),
        (Mesh::Linkerd, _) => linkerd(record, spec, pod, namespace, options),
    }
}

const ISTIO_STATUS: &str = "sidecar.istio.io/status";

fn plan(
    record: &MeshProfile,
    spec: &PodSpecView<'_>,
    options: Options<'_>,
    targets: Vec<SocketAddr>,
    avoid_uids: Vec<i64>,
    avoid_gids: Vec<i64>,
) -> GatePlan {
    let checks = if options.checks.is_empty() {
        vec![record.check()]
    } else {
        options.checks.to_vec()
    };
    GatePlan {
        checks,
        targets,
        avoid_uids,
        avoid_gids,
        mesh_validates: validator_first(record, spec),
    }
}

/// Whether the mesh's validator is the pod's first init container, meshgate's own gate aside
/// (it is first when meshgate decides again on a reinvocation).
fn validator_first(record: &MeshProfile, spec: &PodSpecView<'_>) -> bool {
    let first = spec
        .inits()
        .map(|(_, c)| c.name())
        .find(|n| *n != Some(meshgate_api::names::GATE_CONTAINER));
    record.validator_container.is_some() && first == Some(record.validator_container)
}

/// Targets of both families, primary first; `NothingRedirected` when the primary has none.
fn targets(
    outbound: impl Fn(IpFamily) -> Option<Outbound>,
    primary: IpFamily,
) -> Result<Vec<SocketAddr>, NoGate> {
    let other = match primary {
        IpFamily::IPv4 => IpFamily::IPv6,
        IpFamily::IPv6 => IpFamily::IPv4,
    };
    let first = outbound(primary)
        .and_then(|o| o.target())
        .ok_or(NoGate::NothingRedirected)?;
    Ok(std::iter::once(first)
        .chain(outbound(other).and_then(|o| o.target()))
        .collect())
}

/// Istio's CNI plugin in sidecar mode (`cni/pkg/plugin/plugin.go`, `doAddRun`), in its order.
fn istio_sidecar(
    record: &MeshProfile,
    spec: &PodSpecView<'_>,
    pod: &Meta,
    options: Options<'_>,
) -> Verdict {
    own_redirect_init(record, spec)?;
    let Some(proxy) = container(spec, record.proxy_container) else {
        return Err(NoGate::NoProxy);
    };
    if proxy.env("DISABLE_ENVOY").and_then(is_true) == Some(true) {
        return Err(NoGate::ProxyDisabled);
    }
    let args: Vec<&str> = proxy.args().collect();
    if args.first() == Some(&"proxy") && args.get(1).is_some_and(|t| *t != "sidecar") {
        return Err(NoGate::Gateway);
    }
    let inject = pod
        .labels
        .get("sidecar.istio.io/inject")
        .or_else(|| pod.annotations.get("sidecar.istio.io/inject"));
    if inject.and_then(|v| is_true(v)) == Some(false) {
        return Err(NoGate::InjectDisabled);
    }
    if !pod.annotations.contains_key(ISTIO_STATUS) {
        return Err(NoGate::NoInjectionStatus);
    }
    match pod
        .annotations
        .get("sidecar.istio.io/interceptionMode")
        .map(String::as_str)
    {
        None | Some("REDIRECT") | Some("TPROXY") => {}
        Some("NONE") => return Err(NoGate::InterceptionNone),
        Some(other) => {
            return Err(NoGate::Unreadable(format!(
                "sidecar.istio.io/interceptionMode {other:?}"
            )));
        }
    }
    let ann = |k: &str| {
        pod.annotations
            .get(&format!("traffic.sidecar.istio.io/{k}"))
            .map(String::as_str)
    };
    let unreadable =
        |k: &str, e: String| NoGate::Unreadable(format!("traffic.sidecar.istio.io/{k}: {e}"));
    let include = ann("includeOutboundIPRanges").unwrap_or("*");
    let include_cidrs = if include.trim() == "*" {
        None
    } else {
        Some(parse_cidrs(include).map_err(|e| unreadable("includeOutboundIPRanges", e))?)
    };
    let exclude = parse_cidrs(ann("excludeOutboundIPRanges").unwrap_or(""))
        .map_err(|e| unreadable("excludeOutboundIPRanges", e))?;
    let include_ports = Ports::parse(ann("includeOutboundPorts").unwrap_or(""))
        .map_err(|e| unreadable("includeOutboundPorts", e))?;
    // The CNI plugin's default when the annotation is absent.
    let exclude_ports = Ports::parse(ann("excludeOutboundPorts").unwrap_or("15020"))
        .map_err(|e| unreadable("excludeOutboundPorts", e))?;
    let outbound = |family| {
        Some(Outbound {
            family,
            include: include_cidrs
                .as_ref()
                .map_or_else(|| Ranges::all(family), |c| Ranges::of_cidrs(c, family)),
            exclude: Ranges::of_cidrs(&exclude, family),
            include_ports: include_ports.clone(),
            exclude_ports: exclude_ports.clone(),
        })
    };
    let targets = targets(outbound, options.primary_family)?;
    // The plugin excludes the proxy's uid and gid: its container's, where non-zero, else 1337.
    let sc = proxy.security_context.get().copied().unwrap_or_default();
    let uid = sc
        .run_as_user
        .0
        .filter(|u| *u != 0)
        .unwrap_or(record.proxy_uid);
    let gid = sc
        .run_as_group
        .0
        .filter(|g| *g != 0)
        .or(record.proxy_gid)
        .unwrap_or(uid);
    Ok(plan(record, spec, options, targets, vec![uid], vec![gid]))
}

/// linkerd-cni (`cni-plugin/main.go`, `cmdAdd`): a pod with a `linkerd-proxy` container and no
/// `linkerd-init` gets outbound TCP redirected to 4140, except the proxy's uid (gid), loopback
/// and the skipped outbound ports; IPv6 only where the CNI plugin enables it, which the
/// injected validator's `--connect-addr` shows.
fn linkerd(
    record: &MeshProfile,
    spec: &PodSpecView<'_>,
    pod: &Meta,
    namespace: &Meta,
    options: Options<'_>,
) -> Verdict {
    own_redirect_init(record, spec)?;
    if container(spec, record.proxy_container).is_none() {
        return Err(NoGate::NoProxy);
    }
    // Pod annotation first, then the namespace's (as the CNI plugin reads them).
    let ann = |k: &str| {
        pod.annotations
            .get(k)
            .filter(|v| !v.is_empty())
            .or_else(|| namespace.annotations.get(k))
            .map(String::as_str)
    };
    let skip = ann("config.linkerd.io/skip-outbound-ports").unwrap_or("");
    let exclude_ports = Ports::parse(skip)
        .map_err(|e| NoGate::Unreadable(format!("config.linkerd.io/skip-outbound-ports: {e}")))?;
    let id = |k: &str| -> Result<Option<i64>, NoGate> {
        ann(k)
            .map(|v| {
                v.trim()
                    .parse::<i64>()
                    .map_err(|_| NoGate::Unreadable(format!("{k}: {v:?} is not a number")))
            })
            .transpose()
    };
    let uid = id("config.linkerd.io/proxy-uid")?.unwrap_or(record.proxy_uid);
    let gid = id("config.linkerd.io/proxy-gid")?.or(record.proxy_gid);
    let ipv6 = record
        .validator_container
        .and_then(|v| container(spec, v))
        .is_some_and(|v| {
            let args: Vec<&str> = v.args().collect();
            args.windows(2)
                .any(|w| w[0] == "--connect-addr" && w[1].starts_with('['))
                || args.iter().any(|a| a.starts_with("--connect-addr=["))
        });
    let outbound = |family| {
        (family == IpFamily::IPv4 || ipv6).then(|| Outbound {
            family,
            include: Ranges::all(family),
            exclude: Ranges::default(),
            include_ports: Ports::default(),
            exclude_ports: exclude_ports.clone(),
        })
    };
    let targets = targets(outbound, options.primary_family)?;
    Ok(plan(
        record,
        spec,
        options,
        targets,
        vec![uid],
        gid.into_iter().collect(),
    ))
}
