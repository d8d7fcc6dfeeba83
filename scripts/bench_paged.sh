#!/usr/bin/env bash
# Paged residency against locked weights, same run: the benchmarks'
# Mixtral-8x7B-shaped layer (8 experts, 2.8 GB in bf16, or int4 with --int4),
# one expert node each behind its own router — one with the weights locked in
# RAM, one with --residency paged and --memory_budget at half the shard — and
# `colibri-bench run` decoding (T=1, gate routing, random hidden states, so
# every expert is used) through each. Prints both runs' tokens/s and
# latencies, then the paged node's metrics: evictions, page faults and bytes
# read from storage. The locked pair is stopped before the paged one starts.
# Usage: bash scripts/bench_paged.sh [--seconds 20] [--int4]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=20
type=bf16
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --int4) type=int4; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "bench_paged: unknown argument $1" >&2; exit 2 ;;
  esac
done
build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
bench_layer mixtral_8x7b_layer "$type" --d_model 4096 --d_ff 14336
model=$bench_model
source "$root/scripts/process_lib.sh"
proc_init
shard=$(du -cb "$model"/layer_000/expert_*.bin | tail -1 | cut -f1)
budget=$((shard / 2))
echo "lscpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $model: shard $shard bytes, budget $budget"

run() {  # NAME NODE_ARGS...: a node and a router, then colibri-bench run through them
  local name=$1; shift
  proc_start "$name-node" "$build/expert_node/colibri-expert" --model "$model" --listen 127.0.0.1:0 --threads 2 "$@"
  local node_port=$port
  proc_wait_locked "$name-node"  # a locked node times its calls once its weights are in RAM
  [ "$name" = paged ] && metrics=$(sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$proc_logs/$name-node.out")
  proc_start "$name-router" "$build/router_node/colibri-router" --model "$model" --listen 127.0.0.1:0 \
    --experts_at "127.0.0.1:$node_port"
  echo "== $name: $*"
  "$build/tools/colibri-bench" run --router "127.0.0.1:$port" --model "$model" --routing gate --batch_size 1 \
    --duration "$seconds" --progress=false
}
run locked --residency locked
proc_stop_all >/dev/null  # the locked node's pages would keep the files in the page cache
run paged --residency paged --memory_budget "$budget" --metrics_port 0
echo "== paged node metrics"
curl -s "http://127.0.0.1:$metrics/metrics" |
  grep -E '^colibri_expert_(paged_|page_faults_total|storage_read_bytes|call_major_faults_(sum|count))' || true
