#!/usr/bin/env bash
# Builds the real Kyverno CLI (kubectl-kyverno, `kyverno apply`) and, when asked, Kyverno's
# admission controller (`cmd/kyverno`, the binary of its chart's admission-controller Deployment)
# from the Go module beside this script, once each, into a cache outside the repository, and prints
# the path of what was asked for; the admission controller is beside the CLI, named
# `kyverno-admission-controller`. The CLI is used by
# the `kyverno_oracle` test, which runs the same policies and objects through `kyverno apply` and
# `meshgate render` and fails on any difference docs/design.md does not list; the admission
# controller by the `kyverno_peers` benchmark (meshgate's policies against Kyverno's, same work).
#
#   tools/kyverno/build.sh            # build the CLI if missing, print its path on stdout
#   tools/kyverno/build.sh --cached   # print it only if built already; exit 3 otherwise (no build)
#   tools/kyverno/build.sh --admission-controller   # the admission controller (and the CLI, if
#                                     # missing): only the kyverno_peers benchmark asks for it, so
#                                     # tools/test.sh never builds it
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
want=cli
case "${1:-}" in
  "") ;;
  --cached) [ -x "$bin" ] && { echo "$bin"; exit 0; }; exit 3 ;;
  --admission-controller) want=admission ;;
  *) echo "build.sh: unknown argument $1 (--cached, --admission-controller)" >&2; exit 2 ;;
esac
dir=$(dirname "$bin")
admission="$dir/kyverno-admission-controller"
done_already() {
  [ -x "$bin" ] || return 1
  [ $want = cli ] || [ -x "$admission" ]
}
result() { if [ $want = cli ]; then echo "$bin"; else echo "$admission"; fi; }
if done_already; then
  result
  exit 0
fi
mkdir -p "$cache/kyverno"
exec 9>"$cache/kyverno/.lock"
log "waiting for the build lock ($cache/kyverno/.lock)"
flock 9
if done_already; then
  result
  exit 0
fi
tmp="$dir.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
log "[1/2] downloading modules"
(cd "$here" && go mod download)
# The version the binaries report (`kyverno version`, the controller's start-up log), stamped as
# Kyverno's Makefile does.
ldflags="-s -w -X github.com/kyverno/kyverno/pkg/version.BuildVersion=$version"
if [ ! -x "$bin" ]; then
  log "[2/2] compiling kubectl-kyverno $version into $bin (a cold build takes about 4-10 minutes on 2 cores)"
  (cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$tmp/kyverno" \
    github.com/kyverno/kyverno/cmd/cli/kubectl-kyverno)
  "$tmp/kyverno" version >&2 || true
else
  cp -a "$dir/." "$tmp/"
fi
if [ $want = admission ]; then
  log "[2/2] compiling the admission controller (cmd/kyverno) $version"
  (cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$tmp/kyverno-admission-controller" \
    github.com/kyverno/kyverno/cmd/kyverno)
fi
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
log "done in $(( $(date +%s) - start ))s ($(du -sh "$dir" | cut -f1))"
result
