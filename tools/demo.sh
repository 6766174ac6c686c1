#!/usr/bin/env bash
# Runs `meshgate demo` (a new node, its agents, a mesh pod and a policy on a real local control
# plane). Builds the control plane once into the cache, like tools/test.sh, and shares its Cargo
# build directory. Extra arguments go to `meshgate demo` (e.g. --keep).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh)
export MESHGATE_CONTROLPLANE_BIN
cargo build --quiet --locked -p meshgate
exec "$CARGO_TARGET_DIR/debug/meshgate" demo "$@"
