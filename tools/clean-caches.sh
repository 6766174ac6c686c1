#!/usr/bin/env bash
# Empties every cache that tools/test.sh and tools/demo.sh fill, so that the next run is cold, as
# on a fresh machine (the figure the CI budget is measured by):
#   meshgate's cache   $MESHGATE_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate): the
#                      control planes, the node binaries, Helm, Istio, Karpenter, Kyverno, yamlcheck,
#                      the Cargo build directory and the static binaries' build directory
#   Go's caches        the module cache (`go env GOMODCACHE`) and the build cache (`go env GOCACHE`)
#   Cargo's            the registry's downloaded and unpacked crates and git checkouts
#                      ($CARGO_HOME/registry, $CARGO_HOME/git), and $CARGO_TARGET_DIR when set
# The Debian packages the scripts install, Rust's toolchain and its targets stay: they are the
# machine's, not a cache (a fresh machine of this kind has the toolchains; the scripts install the
# packages).
#
#   tools/clean-caches.sh          # says what it would remove, removes nothing
#   tools/clean-caches.sh --yes    # removes it
set -euo pipefail
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
paths=("$cache" "$cargo_home/registry" "$cargo_home/git")
[ -z "${CARGO_TARGET_DIR:-}" ] || paths+=("$CARGO_TARGET_DIR")
if command -v go >/dev/null 2>&1; then
  paths+=("$(go env GOMODCACHE)" "$(go env GOCACHE)")
fi
for p in "${paths[@]}"; do
  [ -e "$p" ] && printf '%8s  %s\n' "$(du -sh "$p" 2>/dev/null | cut -f1)" "$p"
done
if [ "${1:-}" != --yes ]; then
  echo "clean-caches.sh: nothing removed; --yes removes the paths above"
  exit 0
fi
# The Go module cache is read-only by design: `go clean -modcache` is how Go removes it (with
# the toolchains GOTOOLCHAIN downloaded, Karpenter's, which live there too).
if command -v go >/dev/null 2>&1; then go clean -modcache && go clean -cache; fi
rm -rf "${paths[@]}"
echo "clean-caches.sh: removed; the next tools/test.sh is cold"
