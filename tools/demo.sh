#!/usr/bin/env bash
# Runs `meshgate demo` (a new node, its agents, a mesh pod and a policy on a real local control
# plane; then, where this host can run one, a real node with a kubelet on which a gated pod
# really runs). Builds the control plane once into the cache, like tools/test.sh, and shares its
# Cargo build directory; as root it also installs the node's Debian packages and builds the node
# binaries once (tools/node/*.sh). Extra arguments go to `meshgate demo` (e.g. --keep).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh)
export MESHGATE_CONTROLPLANE_BIN
if [ "$(id -u)" = 0 ] && tools/node/packages.sh && MESHGATE_NODE_BIN=$(tools/node/build.sh); then
  export MESHGATE_NODE_BIN
else
  echo "demo.sh: no real node (needs root and the node's packages); the demo uses simulated nodes" >&2
fi
cargo build --quiet --locked -p meshgate --features demo
exec "$CARGO_TARGET_DIR/debug/meshgate" demo "$@"
