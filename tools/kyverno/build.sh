#!/usr/bin/env bash
# Builds the real Kyverno CLI (kubectl-kyverno, `kyverno apply`) and Kyverno's admission
# controller (`cmd/kyverno`, the binary of its chart's admission-controller Deployment) from the Go
# module beside this script, once, into a cache outside the repository, and prints the CLI's path;
# the admission controller is beside it, named `kyverno-admission-controller`. The CLI is used by
# the `kyverno_oracle` test, which runs the same policies and objects through `kyverno apply` and
# `meshgate render` and fails on any difference docs/design.md does not list; the admission
# controller by the `kyverno_peers` benchmark (meshgate's policies against Kyverno's, same work).
#
#   tools/kyverno/build.sh            # build if missing, print the CLI's path on stdout
#   tools/kyverno/build.sh --cached   # print it only if built already; exit 3 otherwise (no build)
#
# The version is pinned in one place: the `github.com/kyverno/kyverno` requirement of go.mod
# here (both binaries are `tool`s of this module). go.mod also carries Kyverno's own `replace` of
# k8s.io/pod-security-admission (Kyverno's fork), which a dependency's go.mod cannot pass on, so
# the CLI is built from the same sources as Kyverno's release. To move the version:
#   cd tools/kyverno && go get -tool github.com/kyverno/kyverno/cmd/cli/kubectl-kyverno@<version>
# then copy the `replace` lines of Kyverno's go.mod of that version, `go mod tidy`, and run the
# kyverno_oracle test.
# The cache key is the version plus a hash of go.mod/go.sum. Static (CGO_ENABLED=0). A cold build
# of the CLI took 9 min 54 s on 2 cores shared with other work (modules downloaded: about a minute
# more), a 253 MB binary and 2.7 GB of Go build cache; the admission controller after it, sharing
# most of its packages, 33 s (measured 2026-12-06, the CLI's Go build cache warm); progress goes
# to stderr.
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}

# shellcheck source=../lib/kube.sh
source "$here/../lib/kube.sh"
version=$(pinned github.com/kyverno/kyverno "$here/go.mod")
[ -n "$version" ] || {
  echo "build.sh: cannot read the pinned github.com/kyverno/kyverno version from $here/go.mod" >&2
  exit 1
}
sum=$(cat "$here"/go.mod "$here"/go.sum | sha256sum | cut -c1-12)
bin="$cache/kyverno/kyverno-$version-$sum/kyverno"

log() { printf '[kyverno %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
[ "${1:-}" = --cached ] && exit 3

mkdir -p "$cache/kyverno"
exec 9>"$cache/kyverno/.lock"
log "waiting for the build lock ($cache/kyverno/.lock)"
flock 9
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi

dir=$(dirname "$bin")
tmp="$dir.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
log "building the Kyverno CLI $version into $bin (a cold build takes about 10 minutes on 2 cores)"
log "[1/3] downloading modules"
(cd "$here" && go mod download)
log "[2/3] compiling kubectl-kyverno (the long step)"
# The version the binaries report (`kyverno version`, the controller's start-up log), stamped as
# Kyverno's Makefile does.
ldflags="-s -w -X github.com/kyverno/kyverno/pkg/version.BuildVersion=$version"
(cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$tmp/kyverno" \
  github.com/kyverno/kyverno/cmd/cli/kubectl-kyverno)
"$tmp/kyverno" version >&2 || true
log "[3/3] compiling the admission controller (cmd/kyverno)"
(cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$tmp/kyverno-admission-controller" \
  github.com/kyverno/kyverno/cmd/kyverno)
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
log "done in $(( $(date +%s) - start ))s ($(du -sh "$bin" | cut -f1))"
echo "$bin"
