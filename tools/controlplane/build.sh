#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-scheduler) from the Go modules beside this
# script, once, into a cache outside the repository, and prints the directory that holds the binaries.
#
#   tools/controlplane/build.sh            # build if missing, print the bin directory on stdout
#   MESHGATE_KUBE_MINOR=1.34 tools/controlplane/build.sh   # another cell of the version matrix
#
# One Go module per Kubernetes minor (kube-<minor>/go.mod pins its latest patch); the default
# minor is 1.36. MESHGATE_KUBE_MINOR picks another: 1.34, 1.35, 1.37.
# The cache key is the pinned versions plus a hash of the go.mod/go.sum files, so a version bump
# builds a new set and an unchanged checkout reuses the old one. Progress goes to stderr.
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}

# shellcheck source=../lib/kube.sh
source "$here/../lib/kube.sh"
minor=${MESHGATE_KUBE_MINOR:-1.36}
kube="$here/kube-$minor"
[ -f "$kube/go.mod" ] || {
  echo "build.sh: no Kubernetes $minor here (MESHGATE_KUBE_MINOR: one of $(cd "$here" && ls -d kube-* | sed 's/kube-//' | tr '\n' ' '))" >&2
  exit 1
}
kube_version=$(pinned k8s.io/kubernetes "$kube/go.mod")
etcd_version=$(pinned go.etcd.io/etcd/server/v3 "$here/etcd/go.mod")
[ -n "$kube_version" ] && [ -n "$etcd_version" ] || {
  echo "build.sh: cannot read the pinned versions from $here/{kube-$minor,etcd}/go.mod" >&2
  exit 1
}
sum=$(cat "$kube"/go.mod "$kube"/go.sum "$here"/etcd/go.mod "$here"/etcd/go.sum | sha256sum | cut -c1-12)
bin="$cache/controlplane/kube-$kube_version-etcd-$etcd_version-$sum"

log() { printf '[controlplane %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kube-scheduler" ] && [ -x "$bin/etcd" ]; then
  echo "$bin"
  exit 0
fi

mkdir -p "$cache/controlplane"
exec 9>"$cache/controlplane/.lock"
log "waiting for the build lock ($cache/controlplane/.lock)"
flock 9
if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kube-scheduler" ] && [ -x "$bin/etcd" ]; then
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
log "[1/3] etcd $etcd_version: downloading modules"
(cd "$here/etcd" && go mod download)
log "[1/3] etcd $etcd_version: compiling"
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)
log "[2/3] kube-apiserver $kube_version: downloading modules"
(cd "$kube" && go mod download)
log "[2/3] kube-apiserver $kube_version: compiling (the long step)"
(cd "$kube" && go build -trimpath -ldflags "$kube_ldflags" -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver)
log "[3/3] kube-scheduler $kube_version: compiling"
(cd "$kube" && go build -trimpath -ldflags "$kube_ldflags" -o "$tmp/kube-scheduler" k8s.io/kubernetes/cmd/kube-scheduler)
"$tmp/kube-apiserver" --version >&2
rm -rf "$bin"
mv "$tmp" "$bin"
trap - EXIT
log "done in $(( $(date +%s) - start ))s"
echo "$bin"
