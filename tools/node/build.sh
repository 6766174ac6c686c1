#!/usr/bin/env bash
# Builds the node-side Kubernetes binaries (kubelet, kube-controller-manager, kube-proxy) from the Go
# module beside this script, once, into a cache outside the repository, and prints the directory
# that holds the binaries. They match the control plane that tools/controlplane/build.sh builds:
# kube/go.mod pins the same k8s.io/kubernetes release and the same staging-module replaces.
#
#   tools/node/build.sh            # build if missing, print the bin directory on stdout
#   MESHGATE_KUBELET_MINOR=1.34 tools/node/build.sh   # only a 1.34 kubelet (version skew cells)
#
# The cache key is the pinned version plus a hash of the go.mod/go.sum files, so a version bump
# builds a new set and an unchanged checkout reuses the old one. Progress goes to stderr.
# All three are static (CGO_ENABLED=0): the kubelet needs no cgo (only net and os/user would use
# it, and both have pure-Go fallbacks), as in the Kubernetes release build.
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}

# shellcheck source=../lib/kube.sh
source "$here/../lib/kube.sh"
# MESHGATE_KUBELET_MINOR=<minor>: only a kubelet of that older minor (kubelet-<minor>/go.mod),
# for a node whose kubelet is older than its API server; the testenv takes it from
# MESHGATE_KUBELET_BIN (the directory printed) beside the default node binaries.
if [ -n "${MESHGATE_KUBELET_MINOR:-}" ]; then
  mod="$here/kubelet-$MESHGATE_KUBELET_MINOR"
  [ -f "$mod/go.mod" ] || {
    echo "build.sh: no kubelet $MESHGATE_KUBELET_MINOR here (MESHGATE_KUBELET_MINOR: one of $(cd "$here" && ls -d kubelet-* | sed 's/kubelet-//' | tr '\n' ' '))" >&2
    exit 1
  }
  name=kubelet
  tools=(kubelet)
else
  mod="$here/kube"
  name=kube
  tools=(kubelet kube-controller-manager kube-proxy)
fi
kube_version=$(pinned k8s.io/kubernetes "$mod/go.mod")
[ -n "$kube_version" ] || {
  echo "build.sh: cannot read the pinned version from $mod/go.mod" >&2
  exit 1
}
sum=$(cat "$mod"/go.mod "$mod"/go.sum | sha256sum | cut -c1-12)
bin="$cache/node/$name-$kube_version-$sum"

log() { printf '[node %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
built() { local t; for t in "${tools[@]}"; do [ -x "$bin/$t" ] || return 1; done; }

if built; then
  echo "$bin"
  exit 0
fi

mkdir -p "$cache/node"
exec 9>"$cache/node/.lock"
log "waiting for the build lock ($cache/node/.lock)"
flock 9
if built; then
  echo "$bin"
  exit 0
fi

kube_ldflags=$(kube_ldflags "$kube_version")

tmp="$bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
log "building into $bin (a cold build takes several minutes on 2 cores)"
log "kube $kube_version: downloading modules"
(cd "$mod" && go mod download)
n=0
for t in "${tools[@]}"; do
  n=$((n + 1))
  log "[$n/${#tools[@]}] $t $kube_version: compiling"
  (cd "$mod" && go build -trimpath -ldflags "$kube_ldflags" -o "$tmp/$t" "k8s.io/kubernetes/cmd/$t")
done
"$tmp/kubelet" --version >&2
rm -rf "$bin"
mv "$tmp" "$bin"
trap - EXIT
log "done in $(( $(date +%s) - start ))s"
echo "$bin"
