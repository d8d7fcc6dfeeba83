#!/usr/bin/env bash
# Placement from load: a naive contiguous split against colibri-plan's plan,
# same run, on a skewed decoding workload. The Mixtral-8x7B-shaped bf16 layer
# (d_model 4096, d_ff 14336, 8 experts, top-2; cached, shared with the other
# benchmarks; --small: d_model 1024, d_ff 2816), two colibri-expert nodes
# pinned one per CPU (1 thread each), a router in front, and `colibri-bench
# run` with many concurrent single-token streams whose routes are skewed
# (--zipf 1.2: expert 0 gets ~35% of the slots, expert 7 ~4%):
#   1. naive: experts 0-3 on node 0, 4-7 on node 1 (the Helm chart's even split);
#   2. the load of run 1, read from the live router (colibri-plan --router), is
#      planned for two nodes of --node_experts experts' memory each (default 5:
#      room for two replicas);
#   3. plan: the nodes restarted with the plan's shard specs, the same load again.
# Prints the plan's table, the expected busiest-node/mean of both placements,
# tokens/s and per-call latency of both, and plan/naive. Every process started
# is stopped on exit.
#
# Usage: bash scripts/bench_placement.sh [--streams 8] [--duration 15] [--zipf 1.2]
#                                        [--node_experts 5] [--small]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
streams=8
duration=15
zipf=1.2
node_experts=5
shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
while [ $# -gt 0 ]; do
  case "$1" in
    --streams) streams=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --zipf) zipf=$2; shift 2 ;;
    --node_experts) node_experts=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench_placement: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$(nproc)" -ge 2 ] || { echo "bench_placement: needs 2 CPUs (one per node)" >&2; exit 2; }

bash "$root/scripts/build.sh" >/dev/null
build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_layer "$name" bf16 "${shape[@]}"
model=$bench_model

source "$root/scripts/process_lib.sh"
proc_init
plan_dir=$(mktemp -d)
trap 'proc_stop_all >/dev/null; rm -rf "$proc_logs" "$plan_dir"' EXIT
all_cpus=0-$(($(nproc) - 1))

# run_load TITLE: colibri-bench run against $router; prints "TITLE | tokens/s | p50 | p99".
results=()
run_load() {
  local title=$1 out tps p50 p99
  out=$(taskset -c "$all_cpus" "$build/tools/colibri-bench" run --router "$router" --zipf "$zipf" \
    --concurrency "$streams" --duration "$duration" --batch_size 1 --progress=false)
  tps=$(sed -n 's/^throughput: \([0-9.]*\) tokens\/s.*/\1/p' <<<"$out")
  p50=$(sed -n 's/^latency per layer call (us): p50 \([0-9]*\).*/\1/p' <<<"$out")
  p99=$(sed -n 's/.* p99 \([0-9]*\) .*/\1/p' <<<"$out" | head -1)
  results+=("$title|$tps|$p50|$p99")
  echo "$title | $tps | $p50 | $p99"
}

# start_cluster SPEC0 SPEC1: a node per CPU with these --experts, and a router; sets $router.
start_cluster() {
  proc_start node0 taskset -c 0 "$build/expert_node/colibri-expert" --model "$model" --threads 1 \
    --experts "$1" --listen 127.0.0.1:0
  local a=$port
  proc_start node1 taskset -c 1 "$build/expert_node/colibri-expert" --model "$model" --threads 1 \
    --experts "$2" --listen 127.0.0.1:0
  local b=$port
  proc_start router taskset -c "$all_cpus" "$build/router_node/colibri-router" --model "$model" \
    --experts_at "127.0.0.1:$a,127.0.0.1:$b" --listen 127.0.0.1:0
  router="127.0.0.1:$port"
  for _ in $(seq 1 100); do
    "$build/tools/colibri-health" --target "$router" --timeout_ms 500 >/dev/null 2>&1 && break
    sleep 0.1
  done
}

expert_bytes=$(stat -c %s "$model/layer_000/expert_000.bin")
echo "# machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "# colibri-bench run: $streams concurrent single-token streams, ${duration} s each, $name (bf16),"
echo "# routes skewed by --zipf $zipf; 2 nodes, 1 CPU and 1 thread each, $node_experts experts' memory each"

start_cluster 0-3 4-7
echo "# config | tokens/s | latency p50 (us) | p99 (us)"
run_load "naive split (0-3 | 4-7)"
"$build/tools/colibri-plan" --model "$model" --nodes 2 --node_memory $((expert_bytes * node_experts + 4096)) \
  --router "$router" --out "$plan_dir" >"$plan_dir/plan.txt"
proc_stop_all >/dev/null

start_cluster "$(cat "$plan_dir/node-0.experts")" "$(cat "$plan_dir/node-1.experts")"
run_load "plan ($(cat "$plan_dir/node-0.experts") | $(cat "$plan_dir/node-1.experts"))"
echo "# colibri-plan's table (expected shares from run 1's load):"
sed 's/^/#   /' "$plan_dir/plan.txt"

naive=$(cut -d'|' -f2 <<<"${results[0]}")
plan=$(cut -d'|' -f2 <<<"${results[1]}")
awk -v a="$naive" -v b="$plan" 'BEGIN { if (a > 0) printf "# plan / naive split = %.2fx tokens/s\n", b / a }'
exit 0
