# Shell helpers to run Colibri servers in the background (sourced by the
# benchmark, demo and test scripts).
#   proc_init              makes $proc_logs and sets a trap that stops every
#                          started process (and removes the logs) on exit.
#   proc_start NAME CMD... runs CMD, waits until it prints "listening on port
#                          N"; sets $port and $last_pid. Fails (exit 1) with
#                          the process's stderr if it exits or takes > 60 s.
#                          It looks every $proc_poll_s seconds (default 0.1;
#                          a benchmark timing starts sets it smaller).
#   proc_wait_serving HEALTH TARGET
#                          waits until the server at TARGET reports SERVING
#                          (HEALTH: the colibri-health binary), up to 30 s; a
#                          router serves once its health checks reached its
#                          nodes. Fails (exit 1) saying so.
#   proc_wait_locked NAME  for an expert node started as NAME whose weights
#                          are being locked in RAM (its default residency):
#                          waits until they are (or the lock was refused), up
#                          to 300 s, so that no timed call waits on their
#                          first reads. Returns at once for other residencies.
#   proc_track PID...      background jobs (clients, samplers) that proc_stop_all
#                          also ends (SIGTERM, not waited for, not printed).
#   proc_stop_all          SIGTERM to every started process, waits (SIGKILL after
#                          10 s) and prints each one's exit status.
proc_pids=()
proc_names=()
proc_tracked=()
proc_track() { proc_tracked+=("$@"); }
proc_init() {
  proc_logs=$(mktemp -d)
  trap 'proc_stop_all; rm -rf "$proc_logs"' EXIT
  trap 'exit 130' INT TERM
}
proc_start() {
  local name=$1; shift
  : >"$proc_logs/$name.out"  # exists before the background job opens it: the poll below may run first
  "$@" >>"$proc_logs/$name.out" 2>"$proc_logs/$name.err" &
  last_pid=$!
  proc_pids+=("$last_pid")
  proc_names+=("$name")
  local poll=${proc_poll_s:-0.1} deadline=$((SECONDS + 60))
  while [ "$SECONDS" -lt "$deadline" ]; do
    port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$proc_logs/$name.out" || true)
    [ -n "$port" ] && return 0
    if ! kill -0 "$last_pid" 2>/dev/null; then
      echo "$name exited before listening:" >&2; cat "$proc_logs/$name.err" >&2; exit 1
    fi
    sleep "$poll"
  done
  echo "$name did not start within 60 s" >&2; exit 1
}
proc_wait_serving() {
  local health=$1 target=$2 deadline=$((SECONDS + 30))
  while [ "$SECONDS" -lt "$deadline" ]; do
    "$health" --target "$target" --timeout_ms 1000 >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "$target did not report SERVING within 30 s" >&2; exit 1
}
proc_wait_locked() {
  local logs=("$proc_logs/$1.err" "$proc_logs/$1.out") deadline=$((SECONDS + 300))
  grep -q 'being locked in RAM' "${logs[@]}" 2>/dev/null || return 0
  while [ "$SECONDS" -lt "$deadline" ]; do
    grep -q -e 'locked in RAM:' -e 'unlocked weights' "${logs[@]}" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "$1: weights not locked within 300 s" >&2; exit 1
}
proc_stop_all() {
  local i p status
  for p in "${proc_tracked[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  proc_tracked=()
  for p in "${proc_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for i in "${!proc_pids[@]}"; do
    p=${proc_pids[$i]}
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null && status=0 || status=$?
    echo "stopped ${proc_names[$i]} (pid $p): exit status $status"
  done
  proc_pids=()
  proc_names=()
}
