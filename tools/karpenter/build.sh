#!/usr/bin/env bash
# Builds the real Karpenter with its KWOK cloud provider (the `karpenter` controller of
# sigs.k8s.io/karpenter/kwok) and KWOK (sigs.k8s.io/kwok/cmd/kwok) from the Go modules beside this
# script, once, into a cache outside the repository, and prints the directory that holds:
#   karpenter   the controller binary (Karpenter core + the KWOK provider, which creates the Nodes itself)
#   kwok        the KWOK controller that fakes the kubelet of those Nodes and of their pods
#   crds/       NodePool, NodeClaim, NodeOverlay, CapacityBuffer (the KWOK chart's copies, which
#               reserve the karpenter.kwok.sh label domain) and KWOKNodeClass
#   stages/     KWOK's node-fast, node-heartbeat-with-lease and pod-fast Stage objects (kwok refuses
#               to start without stages; pass them with `kwok --config`)
#   version     `name=value` lines: the two versions and the Go toolchains that built them
#
#   tools/karpenter/build.sh            # build if missing, print the directory on stdout
#   tools/karpenter/build.sh --cached   # print it only if built already; exit 3 otherwise (no build)
#
# The versions are pinned in one place each: the `sigs.k8s.io/karpenter` requirement of
# karpenter/go.mod and the `sigs.k8s.io/kwok` requirement of kwok/go.mod (each the `tool` of its
# module). They are two modules so that each is built from exactly its release's dependency set
# and Go version: Karpenter v1.15.0 needs Go >= 1.26.9, so karpenter/go.mod also carries a
# `toolchain` line, and this script builds it with GOTOOLCHAIN set to that toolchain (the Go
# command fetches it from the module proxy like a module, once); KWOK builds with the local Go.
# To move a version:
#   cd tools/karpenter/karpenter && GOTOOLCHAIN=<toolchain> go get -tool sigs.k8s.io/karpenter/kwok@<version> && go mod tidy
#   cd tools/karpenter/kwok && go get -tool sigs.k8s.io/kwok/cmd/kwok@<version> && go mod tidy
# The CRDs and stages are copied at build time from the two modules in the module cache (nothing
# fetched is kept in the repository).
# To run both out of cluster against a kube-apiserver (DIR is what this script prints, KC a
# kubeconfig; kube-scheduler and kube-controller-manager must run too: the latter's node lifecycle
# controller removes the node.kubernetes.io/not-ready taint, and Karpenter waits for that):
#   kubectl apply --server-side -f DIR/crds/        # then a KWOKNodeClass and a NodePool
#   HOME=<empty dir> DIR/kwok --kubeconfig=KC \
#     --config=$(ls DIR/stages/*.yaml | paste -sd,) \
#     --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
#     --node-lease-duration-seconds=40 --node-ip=127.0.0.1 --server-address=127.0.0.1:<port>
#   KUBECONFIG=KC DISABLE_LEADER_ELECTION=true METRICS_PORT=<port> HEALTH_PROBE_PORT=<port> \
#     BATCH_IDLE_DURATION=100ms BATCH_MAX_DURATION=2s INSTANCE_TYPES_FILE_PATH=<json> DIR/karpenter
# (karpenter binds its two ports on all addresses: it has no bind-address setting.)
# The cache key is the two versions plus a hash of the go.mod/go.sum files. Static (CGO_ENABLED=0).
# A cold build took 4 min 20 s on 2 cores shared with other work (karpenter 2 min 43 s, kwok
# 1 min 37 s; the toolchain and modules were already downloaded, about a minute more): karpenter
# 41 MiB, kwok 61 MiB (stripped); progress goes to stderr.
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}

# shellcheck source=../lib/kube.sh
source "$here/../lib/kube.sh"
karpenter_version=$(pinned sigs.k8s.io/karpenter "$here/karpenter/go.mod")
kwok_version=$(pinned sigs.k8s.io/kwok "$here/kwok/go.mod")
toolchain=$(awk '$1 == "toolchain" {print $2}' "$here/karpenter/go.mod")
[ -n "$karpenter_version" ] && [ -n "$kwok_version" ] && [ -n "$toolchain" ] || {
  echo "build.sh: cannot read the pinned versions (and karpenter's toolchain) from $here/{karpenter,kwok}/go.mod" >&2
  exit 1
}
sum=$(cat "$here"/karpenter/go.mod "$here"/karpenter/go.sum "$here"/kwok/go.mod "$here"/kwok/go.sum |
  sha256sum | cut -c1-12)
out="$cache/karpenter/karpenter-$karpenter_version-kwok-$kwok_version-$sum"

log() { printf '[karpenter %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
built() { [ -x "$out/karpenter" ] && [ -x "$out/kwok" ] && [ -f "$out/version" ]; }

if built; then
  echo "$out"
  exit 0
fi
[ "${1:-}" = --cached ] && exit 3

mkdir -p "$cache/karpenter"
exec 9>"$cache/karpenter/.lock"
log "waiting for the build lock ($cache/karpenter/.lock)"
flock 9
if built; then
  echo "$out"
  exit 0
fi

tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/crds" "$tmp/stages"
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
log "building Karpenter $karpenter_version (KWOK provider, $toolchain) and KWOK $kwok_version into $out (a cold build takes about 5 minutes on 2 cores)"

log "[1/4] downloading modules (and the $toolchain toolchain)"
(cd "$here/karpenter" && GOTOOLCHAIN=$toolchain go mod download)
(cd "$here/kwok" && GOTOOLCHAIN=local go mod download)
karpenter_dir=$(cd "$here/karpenter" && GOTOOLCHAIN=$toolchain go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)
kwok_dir=$(cd "$here/kwok" && GOTOOLCHAIN=local go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)

log "[2/4] copying the CRDs and KWOK stages"
# The KWOK chart's CRDs (its NodePool/NodeClaim copies also reserve the karpenter.kwok.sh label
# domain). Its KWOKNodeClass CRD is a symlink into kwok/apis/crds, which the module zip leaves out,
# so that one comes from kwok/apis/crds.
for f in "$karpenter_dir"/kwok/charts/crds/*.yaml "$karpenter_dir"/kwok/apis/crds/*.yaml; do
  install -m 0644 "$f" "$tmp/crds/"
done
for f in karpenter.sh_nodepools karpenter.sh_nodeclaims karpenter.sh_nodeoverlays karpenter.kwok.sh_kwoknodeclasses; do
  [ -f "$tmp/crds/$f.yaml" ] || { log "missing CRD $f.yaml in $karpenter_dir"; exit 1; }
done
# The stages of KWOK's `stage/fast` kustomization (what its release's stage-fast.yaml holds): the
# files each of its three parts lists as resources.
for part in node/fast node/heartbeat-with-lease pod/fast; do
  d="$kwok_dir/kustomize/stage/$part"
  files=$(awk '/^resources:/ {r = 1; next} /^[^ -]/ {r = 0} r && $1 == "-" {print $2}' "$d/kustomization.yaml")
  [ -n "$files" ] || { log "no stages listed in $d/kustomization.yaml"; exit 1; }
  for f in $files; do
    install -m 0644 "$d/$f" "$tmp/stages/$f"
  done
done

log "[3/4] compiling karpenter (sigs.k8s.io/karpenter/kwok with $toolchain; the long step)"
# The version Karpenter reports (karpenter_build_info metric, user agent).
(cd "$here/karpenter" && GOTOOLCHAIN=$toolchain go build -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/karpenter/pkg/operator.Version=$karpenter_version" \
  -o "$tmp/karpenter" sigs.k8s.io/karpenter/kwok)

log "[4/4] compiling kwok (sigs.k8s.io/kwok/cmd/kwok)"
(cd "$here/kwok" && GOTOOLCHAIN=local go build -trimpath -ldflags "-s -w" \
  -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)
"$tmp/kwok" --version >&2 || true

{
  echo "karpenter=$karpenter_version"
  echo "karpenter_go=$toolchain"
  echo "kwok=$kwok_version"
  echo "kwok_go=$(GOTOOLCHAIN=local go env GOVERSION)"
} >"$tmp/version"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
log "done in $(( $(date +%s) - start ))s (karpenter $(du -sh "$out/karpenter" | cut -f1), kwok $(du -sh "$out/kwok" | cut -f1))"
echo "$out"
