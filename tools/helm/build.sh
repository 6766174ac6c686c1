#!/usr/bin/env bash
# Builds helm (helm.sh/helm/v3, the version go.mod pins) from the Go module beside this script,
# once, into a cache outside the repository, and prints the binary's path. The cache key is a
# hash of the module's files. Progress goes to stderr. Used by the `helm` test.
#   tools/helm/build.sh            # build if missing, print the binary's path
#   tools/helm/build.sh --cached   # print it only if built already; exit 3 otherwise (no build)
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
sum=$(cat "$here"/go.mod "$here"/go.sum | sha256sum | cut -c1-12)
bin="$cache/helm/$sum/helm"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
[ "${1:-}" = --cached ] && exit 3
mkdir -p "$cache/helm"
exec 9>"$cache/helm/.lock"
flock 9
if [ ! -x "$bin" ]; then
  printf '[helm %s] building into %s\n' "$(date +%H:%M:%S)" "$bin" >&2
  mkdir -p "$(dirname "$bin")"
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bin.tmp" helm.sh/helm/v3/cmd/helm)
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
