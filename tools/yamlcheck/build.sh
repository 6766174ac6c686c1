#!/usr/bin/env bash
# Builds yamlcheck (kubectl's YAML reading: sigs.k8s.io/yaml, the version Kubernetes v1.36 pins)
# from the Go module beside this script, once, into a cache outside the repository, and prints
# the binary's path. The cache key is a hash of the module's files. Progress goes to stderr.
# Env: MESHGATE_CACHE (default: ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
sum=$(cat "$here"/go.mod "$here"/go.sum "$here"/main.go | sha256sum | cut -c1-12)
bin="$cache/yamlcheck/$sum/yamlcheck"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$cache/yamlcheck"
exec 9>"$cache/yamlcheck/.lock"
flock 9
if [ ! -x "$bin" ]; then
  printf '[yamlcheck %s] building into %s\n' "$(date +%H:%M:%S)" "$bin" >&2
  mkdir -p "$(dirname "$bin")"
  (cd "$here" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -o "$bin.tmp" .)
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
