# A small job scheduler for tools/test.sh (sourced): the builds one at a time, the tests side by
# side, and the tests that need the host kept apart.
#
#   build NAME VAR AFTER -- CMD...      a build: one at a time, at the lowest CPU priority
#                                       (nice 19), below the tests; the last line CMD prints is
#                                       exported as VAR to every job that names NAME in its AFTER
#                                       (VAR "-": nothing exported)
#   test_job NAME HOST AFTER -- CMD...  a test: at most $JOBS_TESTS at once. HOST says what of the
#                                       host it needs:
#     node  the host to itself (a real node: one kubelet, containerd, the host's iptables, cgroups
#           and CNI; its teardown compares the host with before): no other node or host job runs
#           beside it
#     host  changes what a node's teardown compares (network namespaces, processes a node also
#           runs): may run beside other host jobs, never beside a node job
#     -     a control plane of its own on free ports: anything
#   AFTER: the jobs (comma-separated) that must pass first, or "-".
#   run_jobs: runs every job, in the order declared as far as AFTER and HOST allow (a node job
#   waiting for the host holds back the host jobs declared after it); prints a line as each
#   ends, and the log of each that failed; returns 1 when any failed or could not run.
#
# Each job's output goes to $JOBS_LOG/<name>.log (a build's stdout to <name>.log.out). A test
# job's libtest summaries ("test result: ok. N passed; M failed; K ignored") are added up into
# JOBS_PASSED, JOBS_FAILED, JOBS_IGNORED.

J_NAME=() J_KIND=() J_HOST=() J_AFTER=() J_VAR=() J_CMD=()
JOBS_TESTS=${JOBS_TESTS:-3}
JOBS_PASSED=0 JOBS_FAILED=0 JOBS_IGNORED=0

_job() {
  local kind=$1 name=$2 host=$3 var=$4 after=$5
  shift 5
  [ "${1:-}" = -- ] || { echo "jobs.sh: $kind $name: '--' before the command expected" >&2; return 2; }
  shift
  J_NAME+=("$name") J_KIND+=("$kind") J_HOST+=("$host") J_VAR+=("$var") J_AFTER+=("$after")
  J_CMD+=("$(printf '%q ' "$@")")
}
build() { local name=$1 var=$2 after=$3; shift 3; _job build "$name" - "$var" "$after" "$@"; }
test_job() { local name=$1 host=$2 after=$3; shift 3; _job test "$name" "$host" - "$after" "$@"; }

# The file a job's log goes to (job names hold '/' and ':').
_log_of() { printf '%s/%s.log' "$JOBS_LOG" "${1//[\/: ]/_}"; }

_report() {
  local i=$1 verdict=$2 took=$3 log summary
  log=$(_log_of "${J_NAME[i]}")
  summary=""
  if [ "${J_KIND[i]}" = test ] && [ -f "$log" ]; then
    local p=0 f=0 g=0 line
    while read -r line; do
      [[ $line =~ ([0-9]+)\ passed\;\ ([0-9]+)\ failed\;\ ([0-9]+)\ ignored ]] || continue
      p=$((p + BASH_REMATCH[1])) f=$((f + BASH_REMATCH[2])) g=$((g + BASH_REMATCH[3]))
    done < <(grep -a '^test result: ' "$log")
    JOBS_PASSED=$((JOBS_PASSED + p)) JOBS_FAILED=$((JOBS_FAILED + f)) JOBS_IGNORED=$((JOBS_IGNORED + g))
    summary=" ($p passed, $f failed, $g ignored)"
  elif [ "${J_KIND[i]}" = build ] && [ -f "$log.out" ] && [ "$verdict" = ok ]; then
    summary=" -> $(tail -n 1 "$log.out")"
  fi
  printf '[%s] %-6s %5s s  %s %s%s\n' "$(date +%H:%M:%S)" "$verdict" "$took" "${J_KIND[i]}" "${J_NAME[i]}" "$summary"
  if [ "$verdict" = FAILED ]; then
    printf -- '---- %s (the last 400 lines of %s) ----\n' "${J_NAME[i]}" "$log"
    tail -n 400 "$log"
    printf -- '---- end of %s ----\n' "${J_NAME[i]}"
  fi
}

run_jobs() {
  mkdir -p "$JOBS_LOG"
  local n=${#J_NAME[@]} i d dep ready blocked_node failed_any=0
  local -A state=() out=() pid_of=() started=()
  local builds=0 tests=0 nodes=0 hosts=0 running=0
  for ((i = 0; i < n; i++)); do state[${J_NAME[i]}]=pending; done
  while :; do
    blocked_node=0
    for ((i = 0; i < n; i++)); do
      [ "${state[${J_NAME[i]}]}" = pending ] || continue
      ready=1
      if [ "${J_AFTER[i]}" != - ]; then
        IFS=, read -ra deps <<<"${J_AFTER[i]}"
        for dep in "${deps[@]}"; do
          case "${state[$dep]:-missing}" in
            ok) ;;
            pending | running) ready=0 ;;
            missing) echo "jobs.sh: ${J_NAME[i]}: no job named $dep" >&2; ready=skip ;;
            *) ready=skip ;;
          esac
        done
      fi
      if [ "$ready" = skip ]; then
        state[${J_NAME[i]}]=skipped
        failed_any=1
        printf '[%s] %-6s %5s s  %s %s (not run: %s did not pass)\n' "$(date +%H:%M:%S)" SKIPPED - \
          "${J_KIND[i]}" "${J_NAME[i]}" "${J_AFTER[i]}"
        continue
      fi
      [ "$ready" = 1 ] || continue
      case "${J_HOST[i]}" in
        node) if ((nodes + hosts > 0)); then blocked_node=1; continue; fi ;;
        host) if ((nodes > 0 || blocked_node)); then continue; fi ;;
      esac
      if [ "${J_KIND[i]}" = build ]; then ((builds < 1)) || continue; else ((tests < JOBS_TESTS)) || continue; fi
      # Start it: the AFTER jobs' exported paths in its environment, its output in its log.
      local envs=()
      if [ "${J_AFTER[i]}" != - ]; then
        IFS=, read -ra deps <<<"${J_AFTER[i]}"
        for dep in "${deps[@]}"; do
          for ((d = 0; d < n; d++)); do
            [ "${J_NAME[d]}" = "$dep" ] && [ "${J_VAR[d]}" != - ] && envs+=("${J_VAR[d]}=${out[$dep]}")
          done
        done
      fi
      local nice=()
      [ "${J_KIND[i]}" = build ] && nice=(nice -n 19)
      local log
      log=$(_log_of "${J_NAME[i]}")
      (
        for e in "${envs[@]}"; do export "${e?}"; done
        if [ "${J_KIND[i]}" = build ]; then
          eval "${nice[*]} ${J_CMD[i]}" >"$log.out" 2>"$log"
        else
          eval "${J_CMD[i]}" >"$log" 2>&1
        fi
      ) </dev/null &
      pid_of[$!]=$i started[$i]=$SECONDS state[${J_NAME[i]}]=running
      running=$((running + 1))
      if [ "${J_KIND[i]}" = build ]; then builds=$((builds + 1)); else tests=$((tests + 1)); fi
      case "${J_HOST[i]}" in node) nodes=$((nodes + 1)) ;; host) hosts=$((hosts + 1)) ;; esac
    done
    if ((running == 0)); then
      for ((i = 0; i < n; i++)); do
        if [ "${state[${J_NAME[i]}]}" = pending ]; then
          echo "jobs.sh: ${J_NAME[i]} can never start (AFTER: ${J_AFTER[i]})" >&2
          failed_any=1
        fi
      done
      break
    fi
    local done_pid rc=0
    wait -n -p done_pid || rc=$?
    [ -n "${pid_of[$done_pid]:-}" ] || continue
    i=${pid_of[$done_pid]}
    unset "pid_of[$done_pid]"
    running=$((running - 1))
    if [ "${J_KIND[i]}" = build ]; then builds=$((builds - 1)); else tests=$((tests - 1)); fi
    case "${J_HOST[i]}" in node) nodes=$((nodes - 1)) ;; host) hosts=$((hosts - 1)) ;; esac
    if [ $rc -eq 0 ]; then
      state[${J_NAME[i]}]=ok
      [ "${J_KIND[i]}" != build ] || out[${J_NAME[i]}]=$(tail -n 1 "$(_log_of "${J_NAME[i]}").out")
      _report "$i" ok $((SECONDS - started[$i]))
    else
      state[${J_NAME[i]}]=failed
      failed_any=1
      _report "$i" FAILED $((SECONDS - started[$i]))
    fi
  done
  return $failed_any
}
