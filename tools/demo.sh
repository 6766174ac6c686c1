#!/usr/bin/env bash
# Runs `meshgate demo` (a new node, its agents, a mesh pod and a policy on a real local control
# plane; then, where this host can run one, a real node with a kubelet on which a gated pod
# really runs). Builds the control plane once into the cache, like tools/test.sh, and shares its
# Cargo build directory; as root it also installs the node's Debian packages and builds the node
# binaries once (tools/node/*.sh). Extra arguments go to `meshgate demo` (e.g. --keep).
#
# Every build happens before the story: one progress line each (what, and how long it takes on a
# cold machine with 2 cores), the tools' own output (go, apt, cargo) in one log file
# (<cache>/demo-build.log), named at the end. The last build, meshgate's static binaries for the
# real node's images, is run by `meshgate demo` itself before its story (once per source state).
# Istio is never built here: when tools/test.sh has built it (and Helm), the real node runs the
# real Istio (MESHGATE_ISTIO, MESHGATE_HELM), else meshgate's mesh stand-ins. Nor is Karpenter:
# when tools/test.sh has built it (and KWOK), it launches the demo's new node (MESHGATE_KARPENTER).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
export CARGO_TERM_COLOR=never
# As tools/test.sh: no incremental compilation data in the shared cache.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
mkdir -p "$cache"
log=$cache/demo-build.log
: >"$log"
export MESHGATE_BUILD_LOG=$log

real_node=no
[ "$(id -u)" = 0 ] && real_node=yes
total=2
[ $real_node = yes ] && total=5
n=0
# build WHAT COLD COMMAND...: one progress line; the command's stderr goes to the log, its
# stdout (the directory a build script prints) to $result. A failure ends the demo, unless
# soft=1 (the real node's steps: the demo then uses simulated nodes).
soft=0
build() {
  local what=$1 cold=$2 start out rc=0
  shift 2
  n=$((n + 1))
  printf 'build [%d/%d] %s (cold: %s) ... ' "$n" "$total" "$what" "$cold"
  start=$(date +%s)
  printf '\n== %s: %s\n' "$(date +%H:%M:%S)" "$what" >>"$log"
  out=$("$@" 2>>"$log") || rc=$?
  if [ $rc -ne 0 ] && [ $soft = 1 ]; then
    echo "failed (exit $rc; see $log): the demo uses simulated nodes"
    real_node=no
    return 1
  fi
  if [ $rc -ne 0 ]; then
    echo "failed (exit $rc)"
    echo "demo.sh: $what failed; its output is in $log:" >&2
    tail -n 20 "$log" >&2
    exit $rc
  fi
  echo "done in $(($(date +%s) - start)) s"
  result=$out
}

echo "Builds first (each once; later runs reuse them). Their output: $log"
build "the control plane: etcd, kube-apiserver, kube-scheduler (Go)" "about 6 min on 2 cores" \
  tools/controlplane/build.sh
export MESHGATE_CONTROLPLANE_BIN=$result
if [ $real_node = yes ]; then
  soft=1
  if build "the real node's Debian packages: containerd, runc, CNI plugins, nftables (apt)" \
    "about 1 min" tools/node/packages.sh &&
    build "the real node's kubelet, kube-controller-manager, kube-proxy (Go)" \
      "about 2-5 min on 2 cores" tools/node/build.sh; then
    export MESHGATE_NODE_BIN=$result
  fi
  soft=0
fi
if [ $real_node = yes ]; then
  # The real Istio on the real node when tools/test.sh has built it (and Helm); never built here.
  if istio=$(tools/istio/build.sh --cached 2>>"$log") && helm=$(tools/helm/build.sh --cached 2>>"$log"); then
    export MESHGATE_ISTIO=$istio MESHGATE_HELM=$helm
    echo "Istio: built and cached ($istio): the real node runs the real Istio"
  else
    echo "Istio: not built (tools/test.sh builds it and Helm, about 15 min cold): the real node runs meshgate's mesh stand-ins"
  fi
  # The real Karpenter launches the demo's new node when tools/test.sh has built it (its
  # kube-controller-manager comes with the node's binaries); never built here.
  if [ -n "${MESHGATE_NODE_BIN:-}" ] && karpenter=$(tools/karpenter/build.sh --cached 2>>"$log"); then
    export MESHGATE_KARPENTER=$karpenter
    echo "Karpenter: built and cached ($karpenter): it launches the demo's new node"
  else
    echo "Karpenter: not built (tools/test.sh builds it and KWOK, about 5 min cold): the demo registers its new node itself"
  fi
fi
build "meshgate with the demo (cargo, debug)" "about 4 min on 2 cores" \
  cargo build --locked -p meshgate --features demo
if [ $real_node = yes ]; then
  export MESHGATE_BUILD_STEP="$total/$total"
else
  # The demo says why in its story; the real node's builds are skipped.
  export MESHGATE_SKIP_REAL_NODE=1
  echo "demo.sh: no real node (needs root and the node's packages); the demo uses simulated nodes"
fi
exec "$CARGO_TARGET_DIR/debug/meshgate" demo "$@"
