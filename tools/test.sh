#!/usr/bin/env bash
# Runs every check and test of meshgate, from a fresh clone on a fresh machine.
#
#   tools/test.sh
#
# 0. installs the Debian packages the tests need when missing (tools/packages.sh; root);
# 1. builds (once, cached outside the clone) etcd, kube-apiserver and kube-scheduler from the Go
#    module proxy: tools/controlplane/build.sh;
# 1b. for the real node of the real_node test: installs containerd, runc, the CNI plugins and
#    iptables when missing (tools/node/packages.sh; root) and builds, once, kubelet,
#    kube-controller-manager and kube-proxy (tools/node/build.sh);
# 1c. builds yamlcheck (kubectl's YAML reader, sigs.k8s.io/yaml) for the yaml_readback test
#    (tools/yamlcheck/build.sh) and Helm for the helm and real_istio tests (tools/helm/build.sh);
# 1d. builds, once, the real Istio (istiod, pilot-agent, the istio-cni node agent and plugin,
#    and its charts) for the real_istio test (tools/istio/build.sh; about 4 min after the control
#    plane's Go build, measured in a cold run);
# 1d'. builds, once, the real Karpenter (its KWOK provider) and KWOK for the karpenter test
#    (tools/karpenter/build.sh; about 4-5 min cold);
# 1e. builds, once, the Kyverno CLI for the kyverno_oracle test, and beside it Kyverno's admission
#    controller for the kyverno_peers benchmark (tools/kyverno/build.sh; the CLI about 4 min after
#    the Go builds above, measured in a cold run; the admission controller about half a minute
#    after the CLI, most packages shared); MESHGATE_KYVERNO_ORACLE=0 skips it (the test then
#    passes without checking, and says so);
# 2. cargo fmt --check, cargo clippy --all-targets -D warnings, the CRD manifests and the Helm
#    chart are current;
# 3. cargo test --workspace: unit tests, the end-to-end tests against the real control plane, and
#    real_node and real_istio on a real node (it builds meshgate's static binaries once per
#    source state); then the demo's test (`--features demo`: no ERROR or WARN in its run).
#
# 4. the version matrix: the core suites (MATRIX_SUITES below) on each other Kubernetes minor's
#    control plane (1.34, 1.35, 1.37; 1.36 is the default above), built once each
#    (MESHGATE_KUBE_MINOR=<minor> tools/controlplane/build.sh, about 3 min cold each after the
#    default's build, on 2 cores). MESHGATE_MATRIX="1.34" picks the cells, MESHGATE_MATRIX=""
#    runs none;
# 5. other kubelets on the real node: a 1.34 kubelet under the 1.37 API server (the widest gap
#    the skew policy allows), a 1.35 under 1.36 and a 1.37 under 1.37 (the default node runs
#    1.36), each built once (MESHGATE_KUBELET_MINOR=<minor> tools/node/build.sh, 30-45 s each
#    here once the control planes' Go builds are cached): the DRA gate's layer per kubelet, and
#    whether the kubelet needs the node plugin's :authority rewrite. MESHGATE_SKEW="1.37:1.34"
#    picks the cells, "" runs none.
#
# Env: MESHGATE_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/meshgate) holds the control plane,
# the node binaries, yamlcheck, helm, the static test binaries (static-target) and, unless CARGO_TARGET_DIR is set,
# the Cargo build directory, so that a new clone reuses them.
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
# Each step's time is printed when the next begins (and the last's, with the total, at exit):
# the cold and warm times of every cell of the version matrix.
step_name="" step_started=$SECONDS
step_time() { [ -z "$step_name" ] || printf '(%s: %d s)\n' "$step_name" $((SECONDS - step_started)); }
step() { step_time; step_name=$* step_started=$SECONDS; printf '\n== %s ==\n' "$*"; }
trap 'status=$?; step_time; printf "== tools/test.sh: %d s, exit %d ==\n" "$SECONDS" "$status"' EXIT

step "Debian packages (iptables for the network-namespace tests)"
tools/packages.sh

step "control plane (etcd, kube-apiserver, kube-scheduler)"
MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh)
export MESHGATE_CONTROLPLANE_BIN
ls -l "$MESHGATE_CONTROLPLANE_BIN"

step "real node (containerd, runc, CNI plugins; kubelet, kube-controller-manager, kube-proxy)"
tools/node/packages.sh
MESHGATE_NODE_BIN=$(tools/node/build.sh)
export MESHGATE_NODE_BIN
ls -l "$MESHGATE_NODE_BIN"

step "yamlcheck (kubectl's YAML reader, for the yaml_readback test)"
MESHGATE_YAMLCHECK=$(tools/yamlcheck/build.sh)
export MESHGATE_YAMLCHECK

step "helm (for the helm and real_istio tests)"
MESHGATE_HELM=$(tools/helm/build.sh)
export MESHGATE_HELM

step "Istio (istiod, pilot-agent, istio-cni; for the real_istio test)"
MESHGATE_ISTIO=$(tools/istio/build.sh)
export MESHGATE_ISTIO
cat "$MESHGATE_ISTIO/version"

step "Karpenter and KWOK (for the karpenter test)"
MESHGATE_KARPENTER=$(tools/karpenter/build.sh)
export MESHGATE_KARPENTER
cat "$MESHGATE_KARPENTER/version"

step "Kyverno CLI and admission controller (the kyverno_oracle test, the kyverno_peers bench; MESHGATE_KYVERNO_ORACLE=0 skips it)"
# Measured in a cold CI run at commit bf55032 (2026-12-02, 2 cores): 248 s after the control
# plane's and Istio's Go builds, so that the whole run took about 43 of its 90 minutes.
if [ "${MESHGATE_KYVERNO_ORACLE:-1}" != 0 ]; then
  MESHGATE_KYVERNO=$(tools/kyverno/build.sh)
elif MESHGATE_KYVERNO=$(tools/kyverno/build.sh --cached); then
  :
else
  MESHGATE_KYVERNO=
  export MESHGATE_KYVERNO_OPTIONAL=1
  echo "not built (MESHGATE_KYVERNO_ORACLE=0): kyverno_oracle passes without checking"
fi
export MESHGATE_KYVERNO
[ -z "$MESHGATE_KYVERNO" ] || "$MESHGATE_KYVERNO" version

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "generated CRD manifests are current"
cargo run --quiet --locked -p meshgate -- crds --check deploy/crds

step "the Helm chart's generated data (CRDs, mesh profiles, native gate) is current"
cargo run --quiet --locked -p meshgate -- chart --check deploy/helm/meshgate

step "cargo test --workspace"
# The end-to-end test binaries each start their own control plane; two at a time fit 2 cores.
cargo test --workspace --locked -- --test-threads 4

step "meshgate demo: its story, and no ERROR or WARN line (cargo test --features demo --test demo)"
cargo test --locked -p meshgate --features demo --test demo

# The core suites, which read the cluster's version instead of assuming the default's: on 1.34
# and 1.35 the test environment turns the MutatingAdmissionPolicy beta on (the policy path meshgate
# takes there; their defaults, no policy API, are covered by policy_enforcement and install).
MATRIX_SUITES=(--test install --test node_gate --test node_gate_safety --test init_gate
  --test policies_native --test check --test uninstall --test policy_enforcement --test helm)
for minor in $matrix; do
  step "Kubernetes $minor: the core suites (${MATRIX_SUITES[*]})"
  MESHGATE_CONTROLPLANE_BIN=$(MESHGATE_KUBE_MINOR=$minor tools/controlplane/build.sh) \
    cargo test --locked -p meshgate "${MATRIX_SUITES[@]}"
done

# Other kubelets on the real node: each cell is <API server minor>:<kubelet minor> (the kubelet
# built once by MESHGATE_KUBELET_MINOR=<minor> tools/node/build.sh, the rest of the node the
# default's): the DRA gate guards pods by the layer that kubelet supports, and the kubelet's
# registration client needs the node plugin's :authority rewrite.
for cell in $skew; do
  api=${cell%%:*} kubelet=${cell##*:}
  step "Kubernetes $api with a $kubelet kubelet: the DRA gate on the real node"
  MESHGATE_CONTROLPLANE_BIN=$(MESHGATE_KUBE_MINOR=$api tools/controlplane/build.sh) \
  MESHGATE_KUBELET_BIN=$(MESHGATE_KUBELET_MINOR=$kubelet tools/node/build.sh) \
    cargo test --locked -p meshgate --test real_node dra_gate_guards_pods_by_the_layer
done
