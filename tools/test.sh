#!/usr/bin/env bash
# Runs every check and test of meshgate, from a fresh clone on a fresh machine.
#
#   tools/test.sh
#
# The builds one at a time, the tests side by side (tools/lib/jobs.sh):
# 1. in turn: the Debian packages the tests need when missing (tools/packages.sh,
#    tools/node/packages.sh; root); the default control plane (etcd, kube-apiserver,
#    kube-scheduler of Kubernetes 1.36, tools/controlplane/build.sh, built once from the Go module
#    proxy and cached outside the clone); cargo fmt --check; cargo clippy --all-targets -D warnings;
#    the tests, built once (`cargo test --no-run`, with the demo's harness, so that meshgate is
#    compiled once for the tests and the demo; static, so that the same binaries go into the real
#    node's images); the CRD manifests and the Helm chart's generated data are current (the binary
#    just built);
# 2. then every test binary as a job, while the remaining builds run one at a time beside them at
#    the lowest CPU priority (each test waits only for what it uses):
#    - the real node's kubelet, kube-controller-manager and kube-proxy (tools/node/build.sh);
#    - Helm (tools/helm/build.sh), the real Istio (tools/istio/build.sh), the real Karpenter on
#      KWOK (tools/karpenter/build.sh), yamlcheck (kubectl's YAML reader, tools/yamlcheck/build.sh),
#      the Kyverno CLI for the kyverno_oracle test (tools/kyverno/build.sh;
#      MESHGATE_KYVERNO_ORACLE=0 skips it, and the test then passes without checking, and says so;
#      Kyverno's admission controller is built only by the kyverno_peers benchmark that uses it);
#    - the version matrix: the core suites (MATRIX_SUITES below) on each other Kubernetes minor's
#      control plane (1.34, 1.35, 1.37; MESHGATE_KUBE_MINOR=<minor> tools/controlplane/build.sh).
#      MESHGATE_MATRIX="1.34" picks the cells, MESHGATE_MATRIX="" runs none;
#    - other kubelets on the real node: a 1.34 kubelet under the 1.37 API server (the widest gap
#      the skew policy allows), a 1.35 under 1.36 and a 1.37 under 1.37 (the default node runs
#      1.36), each built once (MESHGATE_KUBELET_MINOR=<minor> tools/node/build.sh): the DRA gate's
#      layer per kubelet, and whether the kubelet needs the node plugin's :authority rewrite.
#      MESHGATE_SKEW="1.37:1.34" picks the cells, "" runs none.
#    Which tests need the host to themselves is said in one place: NODE_TESTS and HOST_TESTS
#    below. MESHGATE_TEST_JOBS (default 3) test binaries run at once.
#
# Each step prints its time and the share of the machine's CPU time that was idle during it; the
# end, the total against the budget of a cold run (BUDGET_S). A cold run: tools/clean-caches.sh
# empties every cache this script fills (Go's module and build caches, Cargo's registry, meshgate's).
#
# Env: MESHGATE_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate) holds the control planes,
# the node binaries, the tools, the jobs' logs (test-logs) and, unless CARGO_TARGET_DIR is set, the
# Cargo build directory, so that a new clone reuses them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
matrix=${MESHGATE_MATRIX-1.34 1.35 1.37}
skew=${MESHGATE_SKEW-1.37:1.34 1.36:1.35 1.37:1.37}
[ $# -eq 0 ] || { echo "test.sh: takes no arguments (got $*); see its header for the environment" >&2; exit 2; }
cache=${MESHGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# No incremental compilation data in the shared cache: a test run gains nothing from it, and it
# grows by gigabytes per run (a full disk puts the real node under disk pressure).
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# A cold run's budget (issue: a cold CI run within 60 of CI's 90 minutes).
BUDGET_S=3600

# Each step's time and the idle share of the machine's CPU time during it are printed when the
# next begins (and the last's, with the total, at exit).
cpu() { local _ u n s i w q sq st; read -r _ u n s i w q sq st _ </proc/stat; echo "$((i + w)) $((u + n + s + i + w + q + sq + st))"; }
step_name="" step_started=$SECONDS step_cpu=$(cpu)
step_time() {
  [ -n "$step_name" ] || return 0
  local i0 t0 i1 t1
  read -r i0 t0 <<<"$step_cpu"
  read -r i1 t1 <<<"$(cpu)"
  printf '(%s: %d s, CPU idle %d%%)\n' "$step_name" $((SECONDS - step_started)) $(((i1 - i0) * 100 / (t1 - t0 + 1)))
}
step() { step_time; step_name=$* step_started=$SECONDS step_cpu=$(cpu); printf '\n== %s ==\n' "$*"; }
trap 'status=$?; step_time; printf "== tools/test.sh: %d s (a cold run'"'"'s budget: %d s), exit %d ==\n" "$SECONDS" "$BUDGET_S" "$status"' EXIT

step "Debian packages (iptables for the network-namespace tests; the real node's)"
tools/packages.sh
tools/node/packages.sh

step "control plane (etcd, kube-apiserver, kube-scheduler)"
MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh)
export MESHGATE_CONTROLPLANE_BIN
ls -l "$MESHGATE_CONTROLPLANE_BIN"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "build the tests (cargo test --no-run), static: their binaries are the real node's images' too"
# One build serves the tests, the demo's test (meshgate with the demo's harness, compiled once) and
# the real node's images: static executables (glibc, static PIE), the target and flags of
# meshgate-testenv's image.rs (TARGET, STATIC_RUSTFLAGS), which takes them from MESHGATE_STATIC_BIN
# instead of building its own (release) set; the images hold debug builds then.
static_target=x86_64-unknown-linux-gnu
static_flags="-C target-feature=+crt-static"
tests_list=$cache/test-binaries.tsv
# Every test executable, one line each: package, target kind, target name, path, package dir.
RUSTFLAGS=$static_flags cargo test --workspace --locked --features meshgate/demo --target $static_target \
  --no-run --message-format=json-render-diagnostics |
  jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test)
    | (.manifest_path | rtrimstr("/Cargo.toml")) as $dir
    | [($dir | split("/") | last), .target.kind[0], .target.name, .executable, $dir] | @tsv' >"$tests_list"
# The images' pause and app (meshgate-testbins has no tests/, so the test build has not built them).
RUSTFLAGS=$static_flags cargo build --locked --target $static_target -p meshgate-testbins --bins
export MESHGATE_STATIC_BIN=$CARGO_TARGET_DIR/$static_target/debug
echo "$(wc -l <"$tests_list") test executables; the images' binaries in $MESHGATE_STATIC_BIN"

step "generated CRD manifests and the Helm chart's generated data are current"
"$MESHGATE_STATIC_BIN/meshgate" crds --check deploy/crds
"$MESHGATE_STATIC_BIN/meshgate" chart --check deploy/helm/meshgate

# run_test PACKAGE KIND TARGET [ARGS...]: one test executable of the list, as `cargo test` runs it
# (in its package's directory, with Cargo's run-time variables).
run_test() {
  local pkg=$1 kind=$2 target=$3 exe dir
  shift 3
  IFS=$'\t' read -r _ _ _ exe dir < <(awk -F'\t' -v p="$pkg" -v k="$kind" -v t="$target" \
    '$1 == p && $2 == k && $3 == t' "$tests_list")
  [ -n "${exe:-}" ] || { echo "run_test: no test executable $pkg $kind $target in $tests_list" >&2; return 1; }
  echo "$exe $*"
  cd "$dir" && CARGO=$(command -v cargo) CARGO_MANIFEST_DIR=$dir CARGO_MANIFEST_PATH=$dir/Cargo.toml \
    CARGO_PKG_NAME=$pkg exec "$exe" "$@"
}

step "the tests side by side, the remaining builds beside them"
# shellcheck source=lib/jobs.sh
source tools/lib/jobs.sh
JOBS_LOG=$cache/test-logs
rm -rf "$JOBS_LOG"
JOBS_TESTS=${MESHGATE_TEST_JOBS:-3}

# Who needs the host. The one place that says it:
# the real node (a kubelet, containerd, the host's iptables, cgroups and CNI; its teardown compares
# the host with before and looks for its daemons by name): one at a time, nothing of HOST_TESTS
# beside it;
NODE_TESTS=(meshgate/real_node meshgate/real_istio meshgate/demo)
# tests that change what a node's teardown compares: network namespaces of their own
# (the netns tests), or a process a node also runs, found by name (meshgate-wait's CLI test), and
# the Karpenter test, whose timing-dependent assertions (Karpenter packs the same pods into the
# same NodeClaims with meshgate as without) failed beside a real node's load (two 4-CPU nodes
# against one 8-CPU node, 2026-12-07): side by side with each other, never beside a node.
HOST_TESTS=(meshgate/karpenter meshgate-standins/cni_netns meshgate-standins/node_proxy_netns
  meshgate-wait/redirect_netns meshgate-wait/cli)
# What each test uses of the builds (every test uses the default control plane, built above).
declare -A USES=(
  [meshgate/real_node]=node,helm
  [meshgate/real_istio]=node,helm,istio
  [meshgate/demo]=node,helm,istio,karpenter
  [meshgate/karpenter]=node,karpenter
  [meshgate/helm]=helm
  [meshgate/yaml_readback]=yamlcheck
  [meshgate/kyverno_oracle]=kyverno
)
host_of() {
  local t
  for t in "${NODE_TESTS[@]}"; do [ "$t" = "$1" ] && { echo node; return; }; done
  for t in "${HOST_TESTS[@]}"; do [ "$t" = "$1" ] && { echo host; return; }; done
  echo -
}

# The builds, in the order the tests want them: the real node's first (its tests are the longest
# chain).
build node MESHGATE_NODE_BIN - -- tools/node/build.sh
build helm MESHGATE_HELM - -- tools/helm/build.sh
build karpenter MESHGATE_KARPENTER - -- tools/karpenter/build.sh
build istio MESHGATE_ISTIO - -- tools/istio/build.sh
build yamlcheck MESHGATE_YAMLCHECK - -- tools/yamlcheck/build.sh
# The other minors' control planes and kubelets, each as soon as a cell can use it (a skew cell's
# pair together), in the order of the cells.
declare -A planned=()
plan() {
  [ -z "${planned[$1-$2]:-}" ] || return 0
  planned[$1-$2]=1
  case $1 in
    controlplane) [ "$2" = 1.36 ] || build "controlplane-$2" MESHGATE_CONTROLPLANE_BIN - -- \
      env MESHGATE_KUBE_MINOR="$2" tools/controlplane/build.sh ;;
    kubelet) build "kubelet-$2" MESHGATE_KUBELET_BIN - -- env MESHGATE_KUBELET_MINOR="$2" tools/node/build.sh ;;
  esac
}
for cell in $skew; do plan controlplane "${cell%%:*}"; plan kubelet "${cell##*:}"; done
for minor in $matrix; do plan controlplane "$minor"; done
# The Kyverno CLI last: one short test waits for it.
if [ "${MESHGATE_KYVERNO_ORACLE:-1}" != 0 ]; then
  build kyverno MESHGATE_KYVERNO - -- tools/kyverno/build.sh
elif tools/kyverno/build.sh --cached >/dev/null; then
  build kyverno MESHGATE_KYVERNO - -- tools/kyverno/build.sh --cached
else
  echo "Kyverno CLI not built (MESHGATE_KYVERNO_ORACLE=0): kyverno_oracle passes without checking"
  export MESHGATE_KYVERNO_OPTIONAL=1
  unset "USES[meshgate/kyverno_oracle]"
fi
plane() { [ "$1" = 1.36 ] && echo - || echo "controlplane-$1"; }
# after A B ...: the job names of its arguments (each a comma-separated list, or "-"), joined.
after() {
  local a p out=()
  for a in "$@"; do
    IFS=, read -ra parts <<<"$a"
    for p in "${parts[@]}"; do [ -z "$p" ] || [ "$p" = - ] || out+=("$p"); done
  done
  local IFS=,
  echo "${out[*]:--}"
}

# The job of each test executable: PACKAGE/TARGET for a tests/ file, PACKAGE/KIND:TARGET for the
# unit tests of a library or binary.
declare -A run_of=()
test_names=()
while IFS=$'\t' read -r pkg kind name _ _; do
  case $kind in
    test) n="$pkg/$name" ;;
    *) n="$pkg/$kind:$name" ;;
  esac
  test_names+=("$n")
  run_of[$n]="$pkg $kind $name"
done <"$tests_list"
for t in "${NODE_TESTS[@]}" "${HOST_TESTS[@]}"; do
  [ -n "${run_of[$t]:-}" ] || { echo "test.sh: $t (NODE_TESTS, HOST_TESTS) is not a test executable" >&2; exit 1; }
  # Four tests at a time within a binary, as `cargo test --workspace -- --test-threads 4` ran them;
  # the demo's with libtest's default, as its own `cargo test` step ran it.
  threads=(--test-threads 4)
  [ "$t" != meshgate/demo ] || threads=()
  # shellcheck disable=SC2086
  test_job "$t" "$(host_of "$t")" "${USES[$t]:--}" -- run_test ${run_of[$t]} "${threads[@]}"
done
for cell in $skew; do
  api=${cell%%:*} kubelet=${cell##*:}
  test_job "Kubernetes $api, kubelet $kubelet: meshgate/real_node dra_gate_guards_pods_by_the_layer" node \
    "$(after node,helm "$(plane "$api")" "kubelet-$kubelet")" -- \
    run_test meshgate test real_node dra_gate_guards_pods_by_the_layer
done
for n in "${test_names[@]}"; do
  [ "$(host_of "$n")" = - ] || continue
  # shellcheck disable=SC2086
  test_job "$n" - "${USES[$n]:--}" -- run_test ${run_of[$n]} --test-threads 4
done
# The core suites, which read the cluster's version instead of assuming the default's: on 1.34
# and 1.35 the test environment turns the MutatingAdmissionPolicy beta on (the policy path meshgate
# takes there; their defaults, no policy API, are covered by policy_enforcement and install).
MATRIX_SUITES=(install node_gate node_gate_safety init_gate policies_native check uninstall
  policy_enforcement helm)
for minor in $matrix; do
  for suite in "${MATRIX_SUITES[@]}"; do
    test_job "Kubernetes $minor: meshgate/$suite" - "$(after "$(plane "$minor")" "${USES[meshgate/$suite]:--}")" -- \
      run_test meshgate test "$suite"
  done
done
jobs_status=0
run_jobs || jobs_status=$?
# The closing count, also when a job failed (skipped: libtest's ignored tests).
echo "tests: $JOBS_PASSED passed, $JOBS_FAILED failed, $JOBS_IGNORED skipped"
exit $jobs_status
