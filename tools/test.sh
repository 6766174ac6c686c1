#!/usr/bin/env bash
# Runs every check and test of meshgate, from a fresh clone on a fresh machine.
#
#   tools/test.sh
#
# 0. installs the Debian packages the tests need when missing (tools/packages.sh; root);
# 1. builds (once, cached outside the clone) etcd, kube-apiserver and kube-scheduler from the Go
#    module proxy: tools/controlplane/build.sh;
# 2. cargo fmt --check, cargo clippy --all-targets -D warnings, the CRD manifests are current;
# 3. cargo test --workspace: unit tests and the end-to-end tests against the real control plane.
#
# Env: MESHGATE_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate) holds the control plane
# and, unless CARGO_TARGET_DIR is set, the Cargo build directory, so that a new clone reuses them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
step() { printf '\n== %s ==\n' "$*"; }

step "Debian packages (iptables for the network-namespace tests)"
tools/packages.sh

step "control plane (etcd, kube-apiserver, kube-scheduler)"
MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh)
export MESHGATE_CONTROLPLANE_BIN
ls -l "$MESHGATE_CONTROLPLANE_BIN"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "generated CRD manifests are current"
cargo run --quiet --locked -p meshgate -- crds --check deploy/crds

step "cargo test --workspace"
# The end-to-end test binaries each start their own control plane; two at a time fit 2 cores.
cargo test --workspace --locked -- --test-threads 4
