//! Mesh-like agents for meshgate's tests and demo: small programs that behave, where meshgate
//! can observe it, like a service mesh's node agents, without being one.
//!
//! * [`cni`]: a **chained CNI plugin** (`mesh-cni`). On `ADD` it installs, inside the new pod's
//!   network namespace, a mesh-style outbound redirect (every TCP connection leaving the pod goes
//!   to the proxy's outbound port, except the proxy's own uid/gid and loopback), like a mesh's CNI
//!   plugin in sidecar mode; it passes the previous plugin's result on. Namespaces on its
//!   exclusion list are left alone, as the meshes' plugins leave theirs.
//! * [`conflist`]: how the **CNI agent** (`mesh-cni-agent`) inserts that plugin into the node's
//!   CNI configuration once it is "ready", and takes it out again, as a mesh's CNI DaemonSet
//!   does: pods whose sandbox is created before that get no redirect.
//!
//! * [`nodeproxy`]: a **node proxy** (`mesh-node-proxy`) that, once "ready", opens listeners
//!   (15008, 15001, 15006) inside the network namespace of each pod sandbox on the node, as an
//!   ambient node proxy does for the pods it captures. It finds sandboxes by their process name
//!   (the pause binary), not through the API: every pod on the node is enrolled. Started as
//!   Istio's node proxy is (`proxy ztunnel`), it is instead fed by the real Istio node agent
//!   over [`zds`] and opens listeners in exactly the pods the agent hands it.
//!
//! Everything here is plain functions of their inputs; the binaries in `src/bin` do the I/O.

pub mod cni;
pub mod conflist;
pub mod http;
pub mod nodeproxy;
pub mod zds;
