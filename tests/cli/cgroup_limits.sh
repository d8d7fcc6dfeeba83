#!/usr/bin/env bash
# colibri-expert and colibri-router inside a memory cgroup (cgroup v2's
# memory.max, or v1's memory.limit_in_bytes), as a container or a systemd
# unit would put them: the node refuses weights and a call that would not fit
# the limit, naming it, instead of being killed by the kernel, and so does a
# router locking its in-process experts; started with
# room, each logs the limit and keeps its default in-flight budget within it.
# Needs root and a writable cgroup file system: else skipped (77). Every
# process and cgroup it makes is removed on exit.
# Usage: cgroup_limits.sh BUILD_DIR
set -euo pipefail
build=$1
tmp=$(mktemp -d)
group=""
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [ -n "$group" ]; then
    for p in $(cat "$group/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  fi
  wait 2>/dev/null || true
  if [ -n "$group" ]; then
    for _ in $(seq 1 50); do rmdir "$group" 2>/dev/null && break; sleep 0.1; done
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; cat "$tmp/err" 2>/dev/null; exit 1; }

if grep -q -- '-fsanitize' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "SKIP: a sanitizer build takes several times the memory these limits are set for"
  exit 77
fi
name=colibri-test-$$
if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null &&
  mkdir "/sys/fs/cgroup/$name" 2>/dev/null; then
  group=/sys/fs/cgroup/$name
  limit_file=memory.max
elif [ -d /sys/fs/cgroup/memory ] && mkdir "/sys/fs/cgroup/memory/$name" 2>/dev/null; then
  group=/sys/fs/cgroup/memory/$name
  limit_file=memory.limit_in_bytes
else
  echo "SKIP: cannot make a memory cgroup here (not root, or no writable cgroup file system)"
  exit 77
fi
# Runs "$@" in the group (the shell moves itself in, then execs: one pid),
# under `timeout` so that nothing outlives a test killed from outside.
enter='echo $$ > "$0/cgroup.procs"; exec "$@"'

"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 256 --d_ff 512 --layers 2 --experts 8 --vocab 100 \
  --dtype bf16 > /dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false > /dev/null
mib=$((1 << 20))

echo "--- weights and one call that do not fit the limit: refused by name, not killed"
# 16 copies of 2 MiB pages + 256 MiB for the process + a call of 100 000 rows (400 MiB) > 600 MiB
echo $((600 * mib)) > "$group/$limit_file"
if sh -c "$enter" "$group" timeout 120 "$build/expert_node/colibri-expert" --model "$tmp/model" --residency copy --max_rows 100000 \
  2> "$tmp/err"; then
  fail "the node started"
else
  status=$?
fi
[ "$status" -eq 1 ] || fail "exit status $status (137: killed by the kernel)"
grep -q "pass the memory limit of 0.63 GB ($group/$limit_file)" "$tmp/err" || fail "no refusal naming the limit"
echo "ok: refused, exit 1"
# The router's in-process experts, locked: 16 files of 0.8 MB + 256 MiB for the process > 266 MiB.
echo $((266 * mib)) > "$group/$limit_file"
if sh -c "$enter" "$group" timeout 120 "$build/router_node/colibri-router" --local "$tmp/model" --mlock \
  --listen 127.0.0.1:0 > /dev/null 2> "$tmp/err"; then
  fail "the router started"
else
  status=$?
fi
[ "$status" -eq 1 ] || fail "router exit status $status (137: killed by the kernel)"
grep -q "pass the memory limit of 0.28 GB ($group/$limit_file).*--mlock, --hugepages and --numa_node" "$tmp/err" ||
  fail "no refusal naming the limit and the flags"
echo "ok: the router's locked weights refused, exit 1"

echo "--- with room: the limit is logged and the default budget stays within it"
# Starts "$@" in the group, checks its log for `limit` bytes, stops it with SIGTERM.
serve_within() {
  local limit=$1 what=$2
  shift 2
  echo "$limit" > "$group/$limit_file"
  sh -c "$enter" "$group" timeout 120 "$@" --listen 127.0.0.1:0 > "$tmp/out" 2> "$tmp/err" &
  pids+=($!)
  for _ in $(seq 1 100); do grep -q "listening on port" "$tmp/out" 2>/dev/null && break; sleep 0.1; done
  grep -q "listening on port" "$tmp/out" || fail "the $what did not start"
  grep -q "memory limit $limit bytes ($group/$limit_file)" "$tmp/err" || fail "no memory limit line from the $what"
  grep -q "in-flight budget .* within the memory limit of $limit bytes" "$tmp/err" || fail "no budget line from the $what"
  kill -TERM "${pids[0]}"
  wait "${pids[0]}" || fail "the $what did not exit 0 on SIGTERM"
  pids=()
  echo "ok: $what"
}
# 33 MiB of copies: what is left takes a second version and a budget below
# the default (two calls of 50 000 rows, 400 MB).
serve_within $((600 * mib)) node "$build/expert_node/colibri-expert" --model "$tmp/model" --residency copy --max_rows 50000
serve_within $((300 * mib)) router "$build/router_node/colibri-router" --local "$tmp/model"
echo "PASS"
