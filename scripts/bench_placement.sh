#!/usr/bin/env bash
# Placement from load: a naive contiguous split against colibri-plan's plan,
# same run, on a skewed decoding workload. The Mixtral-8x7B-shaped bf16 layer
# (d_model 4096, d_ff 14336, 8 experts, top-2; cached, shared with the other
# benchmarks; --small: d_model 1024, d_ff 2816), two colibri-expert nodes
# pinned one per CPU (1 thread each), a router in front, and `colibri-bench
# run` with many concurrent single-token streams whose routes are skewed
# (--zipf 1.2: expert 0 gets ~35% of the slots, expert 7 ~4%):
#   1. naive: experts 0-3 on node 0, 4-7 on node 1 (the Helm chart's even split);
#   2. a 5 s run on it, its load read off the live router (colibri-plan --router),
#      planned for two nodes of --node_experts experts' memory each (default 5:
#      room for two copies);
#   3. plan: two more nodes (same CPUs) with the plan's shard specs, and a router;
#   4. --rounds rounds of the same load on the naive split, then on the plan.
# With two nodes and top-2 no expert can take more than half the slots, so a
# plan balances by moving experts; --top_k 1 (a top-1 layer of the same
# shape: a hot expert can then outweigh a node) makes it replicate.
# Prints tokens/s and per-call latency of every run, the plan's table (with the
# expected busiest-node/mean of both placements), and the median tokens/s of
# each and their ratio. Every process started is stopped on exit.
#
# Usage: bash scripts/bench_placement.sh [--streams 16] [--duration 10] [--rounds 3] [--zipf 1.2]
#                                        [--node_experts 5] [--small] [--top_k 1]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
streams=16
duration=10
rounds=3
zipf=1.2
node_experts=5
top_k=2
shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
while [ $# -gt 0 ]; do
  case "$1" in
    --streams) streams=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --zipf) zipf=$2; shift 2 ;;
    --node_experts) node_experts=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    --top_k) top_k=$2; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bench_placement: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$(nproc)" -ge 2 ] || { echo "bench_placement: needs 2 CPUs (one per node)" >&2; exit 2; }

build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
if [ "$top_k" != 2 ]; then
  shape+=(--top_k "$top_k")
  name=${name}_top$top_k
fi
bench_layer "$name" bf16 "${shape[@]}"
model=$bench_model

source "$root/scripts/process_lib.sh"
proc_init
plan_dir=$(mktemp -d)
trap 'proc_stop_all >/dev/null; rm -rf "$proc_logs" "$plan_dir"' EXIT
all_cpus=0-$(($(nproc) - 1))

# run_load TITLE ROUTER: colibri-bench run against ROUTER; prints and records "TITLE | tokens/s | p50 | p99".
results=()
run_load() {
  local title=$1 out
  out=$(taskset -c "$all_cpus" "$build/tools/colibri-bench" run --router "$2" --zipf "$zipf" \
    --concurrency "$streams" --duration "$duration" --batch_size 1 --progress=false)
  results+=("$title|$(bench_run_figures "$out")")
  echo "${results[-1]//|/ | }"
}

# start_cluster NAME SPEC0 SPEC1: a node per CPU with these --experts, and a router; sets $router.
start_cluster() {
  proc_start "$1-node0" taskset -c 0 "$build/expert_node/colibri-expert" --model "$model" --threads 1 \
    --experts "$2" --listen 127.0.0.1:0
  local a=$port
  proc_start "$1-node1" taskset -c 1 "$build/expert_node/colibri-expert" --model "$model" --threads 1 \
    --experts "$3" --listen 127.0.0.1:0
  local b=$port
  proc_wait_locked "$1-node0"
  proc_wait_locked "$1-node1"
  proc_start "$1-router" taskset -c "$all_cpus" "$build/router_node/colibri-router" --model "$model" \
    --experts_at "127.0.0.1:$a,127.0.0.1:$b" --listen 127.0.0.1:0
  router="127.0.0.1:$port"
  for _ in $(seq 1 100); do
    "$build/tools/colibri-health" --target "$router" --timeout_ms 500 >/dev/null 2>&1 && break
    sleep 0.1
  done
}

# The median of the numbers on stdin.
median() {
  sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

expert_bytes=$(stat -c %s "$model/layer_000/expert_000.bin")
echo "# machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "# colibri-bench run: $streams concurrent single-token streams, ${duration} s a run, $name (bf16, top-$top_k),"
echo "# routes skewed by --zipf $zipf; 2 nodes, 1 CPU and 1 thread each, $node_experts experts' memory each."
echo "# Both placements run side by side (the one not measured is idle) and are measured in turn, $rounds rounds:"
echo "# this machine's speed drifts by up to 2x between minutes, so only runs close in time are compared."

start_cluster naive 0-3 4-7
naive_router=$router
# The load, as production would collect it: a run on the naive split, read off the live router.
taskset -c "$all_cpus" "$build/tools/colibri-bench" run --router "$naive_router" --zipf "$zipf" \
  --concurrency "$streams" --duration 5 --batch_size 1 --progress=false >/dev/null
"$build/tools/colibri-plan" --model "$model" --nodes 2 --node_memory $((expert_bytes * node_experts + 4096)) \
  --router "$naive_router" --out "$plan_dir" >"$plan_dir/plan.txt"
spec0=$(cat "$plan_dir/node-0.experts")
spec1=$(cat "$plan_dir/node-1.experts")
start_cluster plan "$spec0" "$spec1"
plan_router=$router

echo "# naive split: node 0 0-3, node 1 4-7; plan: node 0 $spec0, node 1 $spec1"
echo "# config | tokens/s | latency p50 (us) | p99 (us)"
ratios=()
for round in $(seq 1 "$rounds"); do
  run_load "naive split, round $round" "$naive_router"
  run_load "plan, round $round" "$plan_router"
  ratios+=("$(awk -F'|' -v a="${results[-2]}" -v b="${results[-1]}" 'BEGIN {
    split(a, x, "|"); split(b, y, "|"); if (x[2] > 0) printf "%.2f", y[2] / x[2] }')")
done
echo "# colibri-plan's table (expected shares from the load of the naive split):"
sed 's/^/#   /' "$plan_dir/plan.txt"
echo "# plan / naive split, tokens/s, by round: ${ratios[*]}; median $(printf '%s\n' "${ratios[@]}" | median)x"
exit 0
