#!/usr/bin/env bash
# Where the API server's CPU goes per configuration of the end-to-end bench: one round of
# admission_e2e with the API server's profiling on, a Go CPU profile of kube-apiserver over the
# first seconds of each configuration's creates, then `go tool pprof` on each: the top
# functions (cumulative) of the native gate, and what the native gate and the minimal policy
# add over no admission (-diff_base).
#
#   tools/bench/apiserver-profile.sh                 # 4000 pods, 3 s profiles
#   KEEP=/tmp/profiles tools/bench/apiserver-profile.sh    # keep the .pprof files
#
# Needs Go (for `go tool pprof`) and the control plane (MESHGATE_CONTROLPLANE_BIN, built by
# tools/controlplane/build.sh when unset).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/root/.cache/meshgate/target}
export MESHGATE_CONTROLPLANE_BIN=${MESHGATE_CONTROLPLANE_BIN:-$(tools/controlplane/build.sh)}
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT
MESHGATE_BENCH_ROUNDS=1 MESHGATE_BENCH_PODS=${MESHGATE_BENCH_PODS:-4000} \
MESHGATE_BENCH_PROFILE_SECONDS=${MESHGATE_BENCH_PROFILE_SECONDS:-3} \
MESHGATE_BENCH_APISERVER_PROFILE="$out" \
    cargo bench -q -p meshgate --bench admission_e2e 2>&1 | grep -E '^(round|1 )'
apiserver="$MESHGATE_CONTROLPLANE_BIN/kube-apiserver"
top() { go tool pprof -top -cum -nodecount="${NODES:-30}" "$@" 2>/dev/null | sed -n '1,40p'; }
for mode in native min-policy none; do
    echo; echo "== $mode: top functions, cumulative"
    top "$apiserver" "$out/$mode.pprof"
done
for mode in native min-policy; do
    echo; echo "== $mode minus none (the same number of seconds of creates)"
    top -diff_base "$out/none.pprof" "$apiserver" "$out/$mode.pprof"
done
