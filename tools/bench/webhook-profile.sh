#!/usr/bin/env bash
# Profiles one round of the webhook throughput bench with perf (software clock sampling with
# DWARF call graphs: hardware counters are often unavailable in VMs) and says where each
# server's CPU goes, by the first meshgate/serde/tracing/TLS frame on each sampled stack.
#
#   tools/bench/webhook-profile.sh            # SECONDS_PER_ROUND=4 by default
#   DEBUG=1 tools/bench/webhook-profile.sh    # with line tables: inlined functions named
#
# Needs perf (linux-perf). The servers are told apart by what their stacks contain: the webhook
# runs meshgate_webhook::server, baseline+work the bench's Work::answer, the baseline the
# bench's start_baseline only.
#
# Limits: a function inlined into its caller has no frame of its own in a release build, so its
# samples count as "the rest"; DEBUG=1 builds the bench with line tables (a separate, full build)
# so that perf can name inlined frames. Frames in the allocator (mimalloc, glibc) are not always unwound: allocator samples are
# counted by their leaf frame, callers unknown.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/root/.cache/meshgate/target}
command -v perf >/dev/null || { echo "perf is not installed" >&2; exit 1; }
if [ "${DEBUG:-0}" = 1 ]; then
    # Its own directory: the shared release artifacts stay as they are.
    export CARGO_PROFILE_BENCH_DEBUG=line-tables-only CARGO_TARGET_DIR=$CARGO_TARGET_DIR/profile-debug
fi
cargo bench --quiet -p meshgate-webhook --bench throughput --no-run
bin=$(ls -t "$CARGO_TARGET_DIR"/release/deps/throughput-* | grep -v '\.d$' | head -1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
MESHGATE_BENCH_ROUNDS=1 MESHGATE_BENCH_SECONDS=${SECONDS_PER_ROUND:-4} \
    timeout 300 perf record -q -F 299 -e cpu-clock --call-graph dwarf,32768 -o "$out/perf.data" \
    -- "$bin" --bench | tail -9
perf script -i "$out/perf.data" -F +pid 2>/dev/null | python3 -c '
import collections, sys
cats = [
    ("allocator (leaf frame)", None),
    ("decode the review and the pod view (admission::decode_as)",
     ["meshgate_webhook::admission::decode", "meshgate_core::view::", "serde_json::read::", "serde_json::de::"]),
    ("plan the gate (gate::Planner)", ["meshgate_core::gate::", "meshgate_core::resources::", "meshgate_core::mesh::"]),
    ("answer: admission::allow, the patch serialised", ["meshgate_webhook::admission::allow", "JsonPatch::to_bytes", "serde_json::ser::"]),
    ("tracing span", ["tracing::span::", "tracing_subscriber", "tracing_core::"]),
    ("metrics", ["prometheus_client"]),
    ("TLS (rustls, ring)", ["rustls::", "ring_core", "ring::"]),
    ("kernel (socket syscalls, scheduling, faults)", ["kallsyms", "__GI___writev", "__libc_recv", "__libc_read", "epoll"]),
    ("hyper/axum/tower/tokio, the rest", [""]),
]
alloc = ("malloc", "free", "unlink_chunk", "tcache", "_int_", "realloc", "mi_", "_mi_")
per_pid = collections.defaultdict(collections.Counter)
role = {}
def flush(pid, frames):
    if pid is None or not frames:
        return
    text = "\n".join(frames)
    if "meshgate_webhook::server" in text:
        role[pid] = "webhook"
    elif "Work::answer" in text:
        role[pid] = "baseline+work"
    elif "start_baseline" in text:
        role.setdefault(pid, "baseline")
    if any(k in frames[0] for k in alloc):
        per_pid[pid][cats[0][0]] += 1
        return
    for name, keys in cats[1:]:
        if any(k in text for k in keys):
            per_pid[pid][name] += 1
            return
pid, frames = None, []
for line in sys.stdin:
    if not line.strip():
        flush(pid, frames); pid, frames = None, []
    elif line[0] not in " \t":
        pid = line.split()[1].split("/")[0]
    else:
        frames.append(line.strip())
flush(pid, frames)
for pid, name in sorted(role.items(), key=lambda x: x[1], reverse=True):
    c = per_pid[pid]; total = sum(c.values())
    print(f"\n{name} (pid {pid}): {total} samples")
    for cat, _ in cats:
        if c[cat]:
            print(f"  {100 * c[cat] / total:5.1f}%  {cat}")
'
