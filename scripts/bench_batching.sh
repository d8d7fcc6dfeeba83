#!/usr/bin/env bash
# Dynamic batching: concurrent single-token streams against two router+node
# pairs on the same CPUs, one merging concurrent calls of a layer
# (--batch_window_us W, nodes --merge_calls) and one merging nowhere
# (--batch_window_us 0, --merge_calls=false), same run. The
# Mixtral-8x7B-shaped layer (d_model 4096, d_ff 14336, 8 experts, top-2;
# cached, shared with the other benchmarks; --small: d_model 1024, d_ff 2816)
# in --type (bf16), colibri-expert with 2 threads on both CPUs (the pair
# not measured is idle).
# For each stream count, off then on, --rounds times: tokens/s and per-call
# latency from `colibri-bench run`, and the weight bytes the node read per
# token (its colibri_expert_weight_bytes_total over colibri_expert_rows_total)
# beside the expected bytes of a merged call of that many tokens (the
# expected union of top-k of E experts over n uniformly routed tokens,
# E * (1 - (1 - k/E)^n), plus the shared experts, times one expert's weight
# bytes, over n), and the mean callers
# per merged call (the router's colibri_router_batch_callers). Every process
# started is stopped on exit.
#
# --model DIR runs another converted model instead (e.g. a DeepSeek-V3-shaped
# layer), --paged its nodes with --residency paged (the two nodes then share
# the page cache instead of locking two copies).
#
# Usage: bash scripts/bench_batching.sh [--streams "1 4 16"] [--duration 10] [--rounds 1]
#                                       [--window_us 5000] [--type bf16] [--small] [--model DIR] [--paged]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
streams_list="1 4 16"
duration=10
rounds=1
window_us=5000
type=bf16
model=
residency=locked
shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
while [ $# -gt 0 ]; do
  case "$1" in
    --streams) streams_list=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --window_us) window_us=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    --model) model=$2; shift 2 ;;
    --paged) residency=paged; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "bench_batching: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$window_us" -gt 0 ] || { echo "bench_batching: --window_us must be > 0 (0 is the 'off' router)" >&2; exit 2; }

build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
if [ -z "$model" ]; then
  bench_layer "$name" "$type" "${shape[@]}"
  model=$bench_model
fi
name=$(basename "$(dirname "$model")")/$(basename "$model")
# manifest_int KEY: an integer of the model's manifest (0 when absent).
manifest_int() { grep -o "\"$1\": [0-9]*" "$model/manifest.json" | head -1 | grep -o '[0-9]*$' || echo 0; }
n_experts=$(manifest_int n_experts)
top_k=$(manifest_int top_k)
n_shared=$(grep -A1 '"shared_experts": {' "$model/manifest.json" | grep -o '"count": [0-9]*' | grep -o '[0-9]*$' || echo 0)

source "$root/scripts/process_lib.sh"
proc_init
all_cpus=0-$(($(nproc) - 1))

# metrics_port NAME: the port the process NAME serves /metrics on.
metrics_port() {
  for _ in $(seq 1 100); do grep -q 'metrics on port' "$proc_logs/$1.out" && break; sleep 0.1; done
  sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$proc_logs/$1.out"
}
# Per mode a node and a router: "off" merges nowhere, "on" in the router and the node.
declare -A routers node_metrics router_metrics
for mode in off on; do
  w=0 merge=false
  [ "$mode" = on ] && w=$window_us merge=true
  proc_start "node-$mode" taskset -c "$all_cpus" "$build/expert_node/colibri-expert" --model "$model" \
    --threads 2 --listen 127.0.0.1:0 --metrics_port 0 --merge_calls="$merge" --residency "$residency"
  node="127.0.0.1:$port"
  proc_wait_locked "node-$mode"
  node_metrics[$mode]=$(metrics_port "node-$mode")
  proc_start "router-$mode" taskset -c "$all_cpus" "$build/router_node/colibri-router" --model "$model" \
    --experts_at "$node" --listen 127.0.0.1:0 --batch_window_us "$w" --metrics_port 0
  routers[$mode]="127.0.0.1:$port"
  router_metrics[$mode]=$(metrics_port "router-$mode")
  for _ in $(seq 1 100); do
    "$build/tools/colibri-health" --target "${routers[$mode]}" --timeout_ms 500 >/dev/null 2>&1 && break
    sleep 0.1
  done
done

# "bytes rows callers calls" of MODE: the node's weight bytes read and token rows received so far,
# and the router's merged-call callers and calls.
counters() {
  { curl -s "http://127.0.0.1:${node_metrics[$1]}/metrics"; curl -s "http://127.0.0.1:${router_metrics[$1]}/metrics"; } |
    awk '
    /^colibri_expert_weight_bytes_total/ { b += $NF }
    /^colibri_expert_rows_total/ { r += $NF }
    /^colibri_router_batch_callers_sum/ { s += $NF }
    /^colibri_router_batch_callers_count/ { n += $NF }
    END { printf "%.0f %.0f %.0f %.0f\n", b, r, s, n }'
}

# One expert's weight bytes, about as the node counts them (its three matrices' data, scales and
# zero points): its file's size (which adds a small header).
weight_type=$(grep -o '"weight_type": "[a-z0-9]*"' "$model/manifest.json" | grep -o '[a-z0-9]*"$' | tr -d '"')
expert_bytes=$(stat -c %s "$model/layer_000/expert_000.bin")
echo "# machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "# $name ($weight_type, top-$top_k of $n_experts + $n_shared shared, one expert $((expert_bytes / 1048576)) MiB); 1 node, 2 threads ($residency); router and"
echo "# clients on the same 2 CPUs. colibri-bench run: N single-token streams, ${duration} s a run, lut routes;"
echo "# merging on: --batch_window_us $window_us. Runs close in time are compared (the machine's speed drifts)."
echo "# streams | merging | tokens/s | p50 (us) | p99 (us) | node MB read / token | merged-call MB / token (expected) | callers / merged call"
declare -A tps
for round in $(seq 1 "$rounds"); do
  for n in $streams_list; do
    for mode in off on; do
      read -r b0 r0 s0 n0 < <(counters "$mode")
      out=$(taskset -c "$all_cpus" "$build/tools/colibri-bench" run --router "${routers[$mode]}" \
        --concurrency "$n" --duration "$duration" --batch_size 1 --progress=false)
      read -r b1 r1 s1 n1 < <(counters "$mode")
      figures=$(bench_run_figures "$out")
      tps[$mode]=${figures%%|*}
      echo "$n | $mode | ${figures//|/ | } | $(awk -v b=$((b1 - b0)) -v r=$((r1 - r0)) 'BEGIN {
        if (r > 0) printf "%.1f", b / r / 1e6; else printf "-" }') | $(awk -v n="$n" -v e="$expert_bytes" 'BEGIN {
        printf "%.1f", ('"$n_experts"' * (1 - (1 - '"$top_k"' / '"$n_experts"') ^ n) + '"$n_shared"') * e / n / 1e6 }') | $(awk -v s=$((s1 - s0)) -v c=$((n1 - n0)) 'BEGIN {
        if (c > 0) printf "%.1f", s / c; else printf "-" }')"
    done
    echo "# $n streams, round $round: on / off tokens/s = $(awk -v a="${tps[off]}" -v b="${tps[on]}" 'BEGIN {
      if (a > 0) printf "%.2f", b / a }')"
  done
done
exit 0
