#!/usr/bin/env bash
# Where the node-gate controller's memory goes at scale: runs the controller_scale bench with
# the system allocator and the controller child under heaptrack, then prints what the controller
# held when the bench was done with it (after the burst rounds and the steady arrivals: the
# allocations not freed when it exits at once) and its peak, by allocation site.
#
#   tools/bench/controller-heap.sh                    # 2,000 nodes, one round
#   MESHGATE_BENCH_NODES=5000 tools/bench/controller-heap.sh
#   KEEP=/tmp/heap tools/bench/controller-heap.sh     # keep the heaptrack data (heaptrack_print)
#
# Needs heaptrack (Debian package `heaptrack`) and the control plane (MESHGATE_CONTROLPLANE_BIN,
# built by tools/controlplane/build.sh when unset). heaptrack slows allocation down, so the
# latencies this run prints are not the bench's; the RSS it prints is the system allocator's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/root/.cache/meshgate/target}
command -v heaptrack >/dev/null || { echo "heaptrack is not installed (apt-get install heaptrack)" >&2; exit 1; }
export MESHGATE_CONTROLPLANE_BIN=${MESHGATE_CONTROLPLANE_BIN:-$(tools/controlplane/build.sh)}
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT
MESHGATE_BENCH_NODES=${MESHGATE_BENCH_NODES:-2000} MESHGATE_BENCH_ROUNDS=${MESHGATE_BENCH_ROUNDS:-1} \
MESHGATE_BENCH_STEADY=${MESHGATE_BENCH_STEADY:-50} \
MESHGATE_BENCH_CONTROLLER_WRAPPER="heaptrack -o $out/controller" \
MESHGATE_BENCH_CONTROLLER_EXIT_AT_ONCE=1 \
    cargo bench -q -p meshgate --features bench-system-allocator --bench controller_scale 2>&1 \
    | grep -E '^(VALUE|RATIO|  controller|round)|RSS' || true
data=$(ls "$out"/controller*)
heaptrack_print -f "$data" --print-peaks 0 --print-allocators 0 --print-temporary 0 2>/dev/null \
    | grep -E '^(total runtime|calls to allocation|peak heap memory|peak RSS|total memory leaked)' || true
# Each cost by the first frame, from the allocation up, that names what holds the memory.
for cost in peak leaked; do
    heaptrack_print -f "$data" --print-flamegraph "$out/$cost.folded" \
        --flamegraph-cost-type "$cost" >/dev/null 2>&1
    python3 - "$out/$cost.folded" "$cost" <<'PY'
import collections, re, sys
path, cost = sys.argv[1], sys.argv[2]
# Most specific first: the first that matches a frame (searched from the allocation up) wins.
owners = [
    ("HTTP client read buffers (hyper, one per connection)", r"hyper::proto::h1::(conn|io)"),
    ("HTTP client TLS buffers (rustls, one per connection)", r"\brustls::"),
    ("HTTP client connections: dispatch channels, pool", r"hyper_util::client|hyper::client"),
    ("kube watcher: list pages and watch events", r"kube_runtime::watcher|kube_client::api::core_methods::.*(list|watch)"),
    ("kube reflector stores (cached objects)", r"kube_runtime::reflector"),
    ("kube controller runner: reconciles in flight", r"kube_runtime::controller::runner"),
    ("kube controller scheduler: queued requests", r"kube_runtime::scheduler"),
    ("event recorder", r"kube_runtime::events"),
    ("kube client requests and responses", r"kube_client::"),
    ("agent index (meshgate)", r"meshgate_controller::agents|meshgate_core::nodegate::AgentPod"),
    ("node gate reconcile (meshgate)", r"meshgate_controller::nodegate"),
    ("tokio (tasks, channels, timers)", r"\btokio::"),
    ("JSON decoding", r"serde_json::"),
]
total, by = 0, collections.Counter()
for line in open(path, errors="replace"):
    stack, _, n = line.rstrip().rpartition(" ")
    if not n.isdigit():
        continue
    n = int(n); total += n
    # Legacy-mangled impl frames write paths with `..` and start with `_$LT$`.
    frames = [f.replace("_$LT$", "").replace("..", "::") for f in reversed(stack.split(";"))]
    name = next((o for o, pat in owners if any(re.search(pat, f) for f in frames)), "other")
    by[name] += n
print(f"\n{cost}: {total / 2**20:.1f} MiB")
for name, n in by.most_common():
    print(f"  {n / 2**20:7.1f} MiB  {100 * n / max(total, 1):5.1f}%  {name}")
PY
done
