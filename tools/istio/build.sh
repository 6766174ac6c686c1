#!/usr/bin/env bash
# Builds the real Istio from the Go module beside this script, once, into a cache outside the
# repository, and prints the directory that holds it:
#
#   <dir>/bin/pilot-discovery   istiod (the control plane and the sidecar injector)
#   <dir>/bin/pilot-agent       the sidecar's agent (also the injected istio-validation check)
#   <dir>/bin/install-cni       the istio-cni node agent (DaemonSet)
#   <dir>/bin/istio-cni         the istio-cni CNI plugin (install-cni copies it onto the node)
#   <dir>/charts/               Istio's own Helm charts of the same commit (base,
#                               istio-control/istio-discovery, istio-cni, ztunnel)
#   <dir>/version               the version the binaries report, and the module version
#
#   tools/istio/build.sh            # build if missing, print the directory on stdout
#   tools/istio/build.sh --cached   # print it only if built already; exit 3 otherwise (no
#                                   # build: `meshgate demo` uses Istio only when tools/test.sh
#                                   # has built it)
#
# The version is pinned in one place: the `istio.io/istio` requirement of go.mod here. The module
# proxy serves Istio as pseudo-versions of its master branch; to move it:
#   cd tools/istio && go get -tool istio.io/istio/pilot/cmd/pilot-discovery@<version> \
#     istio.io/istio/pilot/cmd/pilot-agent@<version> istio.io/istio/cni/cmd/install-cni@<version> \
#     istio.io/istio/cni/cmd/istio-cni@<version>
# then run the real_istio test (it proves the verdict table of docs/design.md against it).
# The cache key is the version plus a hash of go.mod/go.sum. All four are static (CGO_ENABLED=0),
# as in Istio's release build. Progress goes to stderr.
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}

# shellcheck source=../lib/kube.sh
source "$here/../lib/kube.sh"
version=$(pinned istio.io/istio "$here/go.mod")
[ -n "$version" ] || {
  echo "build.sh: cannot read the pinned istio.io/istio version from $here/go.mod" >&2
  exit 1
}
sum=$(cat "$here"/go.mod "$here"/go.sum | sha256sum | cut -c1-12)
out="$cache/istio/istio-$version-$sum"
tools=(pilot-discovery pilot-agent install-cni istio-cni)

log() { printf '[istio %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

complete() {
  local t
  for t in "${tools[@]}"; do [ -x "$out/bin/$t" ] || return 1; done
  [ -f "$out/charts/istio-cni/Chart.yaml" ] && [ -f "$out/version" ]
}

if complete; then
  echo "$out"
  exit 0
fi
[ "${1:-}" = --cached ] && exit 3

mkdir -p "$cache/istio"
exec 9>"$cache/istio/.lock"
log "waiting for the build lock ($cache/istio/.lock)"
flock 9
if complete; then
  echo "$out"
  exit 0
fi

tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin"
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
log "building Istio $version into $out (a cold build takes about 15 minutes on 2 cores)"
log "[1/2] downloading modules"
(cd "$here" && go mod download)
src=$(cd "$here" && go list -m -f '{{.Dir}}' istio.io/istio)
# The version the binaries report, stamped as Istio's Makefile does (its VERSION file plus
# "-dev" for a build of master), and the module version as the tag.
istio_version="$(cat "$src/VERSION")-dev"
ldflags="-s -w -X istio.io/istio/pkg/version.buildVersion=$istio_version -X istio.io/istio/pkg/version.buildTag=$version -X istio.io/istio/pkg/version.buildStatus=Clean"
log "[2/2] compiling pilot-discovery, pilot-agent, install-cni, istio-cni (the long step)"
(cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$tmp/bin/" \
  istio.io/istio/pilot/cmd/pilot-discovery istio.io/istio/pilot/cmd/pilot-agent \
  istio.io/istio/cni/cmd/install-cni istio.io/istio/cni/cmd/istio-cni)
cp -r "$src/manifests/charts" "$tmp/charts"
chmod -R u+w "$tmp/charts"
echo "$istio_version $version" > "$tmp/version"
"$tmp/bin/pilot-discovery" version -s >&2 || true
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
log "done in $(( $(date +%s) - start ))s"
echo "$out"
