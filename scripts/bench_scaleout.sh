#!/usr/bin/env bash
# Scale-out: does a second expert node add decoding throughput? Same run, same
# Mixtral-8x7B-shaped bf16 layer (d_model 4096, d_ff 14336, 8 experts, top-2;
# cached, shared with the other benchmarks), `colibri-bench run` with many
# concurrent single-token streams (ForwardStream each) against:
#   1. the in-process engine on 1 CPU (taskset -c 0, 1 thread): the baseline;
#   2. one colibri-expert on CPU 0 (1 thread) holding all 8 experts, behind a router;
#   3. two colibri-expert processes, experts 0-3 on CPU 0 and 4-7 on CPU 1, behind a router.
# Decode is bound by reading expert weights, and one core reads about half of
# what two do, so (3) should approach twice (2). The router and the client are
# not pinned (they mostly wait). Prints tokens/s and per-call latency of each,
# and (3) against (2). Every process started is stopped on exit.
#
# With --netns RATE, each node runs on an emulated host of its own and the
# router and client on a third (scripts/cluster_netns.sh: network namespaces,
# links limited to RATE, e.g. 25gbit, with --delay_us one way, default 20;
# root only; refused clearly where namespaces or netem are missing, and
# --delay_us 0 uses the rate limit alone).
#
# Usage: bash scripts/bench_scaleout.sh [--streams 8] [--duration 15] [--small]
#                                       [--netns RATE] [--delay_us 20]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
streams=8
duration=15
shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
rate=""
delay_us=20
while [ $# -gt 0 ]; do
  case "$1" in
    --streams) streams=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    --netns) rate=$2; shift 2 ;;
    --delay_us) delay_us=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "bench_scaleout: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$(nproc)" -ge 2 ] || { echo "bench_scaleout: needs 2 CPUs (one per node)" >&2; exit 2; }
if [ -n "$rate" ]; then
  source "$root/scripts/cluster_netns.sh"
  netns_check "$rate" "$delay_us"
fi

build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
bench_layer "$name" bf16 "${shape[@]}"
model=$bench_model

source "$root/scripts/process_lib.sh"
proc_init
if [ -n "$rate" ]; then
  trap 'proc_stop_all >/dev/null; netns_down; rm -rf "$proc_logs"' EXIT
  netns_up 3 "$rate" "$delay_us"
fi

# on HOST CPUS COMMAND...: becomes (exec) the command on an emulated host (with
# --netns) or here, pinned to CPUS. Only in a subshell: proc_start's
# background job or a $(...).
on() {
  local host=$1 cpus=$2
  shift 2
  if [ -n "$rate" ]; then
    exec ip netns exec "colibri-h$host" taskset -c "$cpus" "$@"
  fi
  exec taskset -c "$cpus" "$@"
}
address() { if [ -n "$rate" ]; then echo "10.77.0.$(($1 + 1))"; else echo 127.0.0.1; fi; }

# run_load TITLE ARGS...: colibri-bench run with ARGS; prints "TITLE | tokens/s | p50 | p99".
results=()
run_load() {
  local title=$1
  shift
  local out
  out=$(on 0 0-$(($(nproc) - 1)) "$build/tools/colibri-bench" run "$@" --concurrency "$streams" \
    --duration "$duration" --batch_size 1 --progress=false)
  results+=("$title|$(bench_run_figures "$out")")
  echo "${results[-1]//|/ | }"
}

# start_router NODE_ADDRESSES...: a router on host 0 in front of them; sets $router.
start_router() {
  local at
  at=$(IFS=,; echo "$*")
  proc_start router on 0 0-$(($(nproc) - 1)) "$build/router_node/colibri-router" --model "$model" \
    --experts_at "$at" --listen "$(address 0):0"
  router="$(address 0):$port"
  # Serving once its first health round reached every node.
  for _ in $(seq 1 100); do
    (on 0 0-$(($(nproc) - 1)) "$build/tools/colibri-health" --target "$router" --timeout_ms 500) >/dev/null 2>&1 && break
    sleep 0.1
  done
}

node=("$build/expert_node/colibri-expert" --model "$model" --threads 1)
echo "# machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
hosts=""
[ -n "$rate" ] && hosts="; nodes on emulated hosts: $rate links, ${delay_us} us one way"
echo "# colibri-bench run: $streams concurrent single-token streams, ${duration} s each, $name (bf16)$hosts"
echo "# config | tokens/s | latency p50 (us) | p99 (us)"

run_load "engine, 1 CPU" --local "$model" --threads 1

proc_start node_all on 1 0 "${node[@]}" --experts all --listen "$(address 1):0"
all_port=$port
proc_wait_locked node_all
start_router "$(address 1):$all_port"
run_load "1 node (all experts), 1 CPU" --router "$router"
proc_stop_all >/dev/null

proc_start node_a on 1 0 "${node[@]}" --experts 0-3 --listen "$(address 1):0"
a=$port
proc_start node_b on 2 1 "${node[@]}" --experts 4-7 --listen "$(address 2):0"
b=$port
proc_wait_locked node_a
proc_wait_locked node_b
start_router "$(address 1):$a" "$(address 2):$b"
run_load "2 nodes (4 experts each), 1 CPU each" --router "$router"

one=$(cut -d'|' -f2 <<<"${results[1]}")
two=$(cut -d'|' -f2 <<<"${results[2]}")
awk -v one="$one" -v two="$two" 'BEGIN { if (one > 0) printf "# scale-out: 2 nodes / 1 node = %.2fx tokens/s (target >= 1.8x: %s)\n", two / one, ((two >= 1.8 * one) ? "met" : "not met") }'
exit 0
