#!/usr/bin/env bash
# The DeepSeek-V3-shaped benchmark of docs/PERFORMANCE.md: two MoE layers at
# DeepSeek-V3's real shape — d_model 7168, moe_intermediate_size 2048, 256
# routed experts top-8 in 8 groups keeping 4 (sigmoid scores, correction
# bias), routed scaling 2.5, one shared expert — synthesized in DeepSeek-V3's
# block FP8 (~11 GB per layer), converted to int4, then timed:
#   1. in process (`colibri-bench kernels`): one decode step of one layer at
#      each T (the top-8 routes of T tokens plus the shared expert), beside
#      floor_ms, the time to read the touched experts' bytes at the read
#      bandwidth measured in the same run;
#   2. distributed: a router (gate routing) and two expert nodes on loopback,
#      node A experts 0-127 and the shared expert (256), node B 128-255, each
#      pinned to its own CPU, driven by `colibri-bench run` at each T: the
#      per-layer call latency the caller sees;
#   3. the in-process engine (`colibri-bench run --local`) with the same
#      workload, for the same per-call figure without the network.
# Every process started is stopped on exit.
#
# Usage: bash scripts/bench_deepseek.sh [--tokens 1,8,32] [--repeat 30] [--duration 20] [--type int4]
#          [--layers 2] [--prepare]
# Work files: ${COLIBRI_BENCH_DIR:-build/bench}/deepseek_v3 (the FP8 checkpoint ~22 GB, kept;
# the int4 model ~11 GB), deepseek_v3_Nlayer with --layers N other than 2. Needs ~14 GB of
# free RAM. --prepare makes the model and stops (e.g. --layers 1 --prepare for bench_batching.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tokens=1,8,32
repeat=30
duration=20
type=int4
layers=2
prepare=false
while [ $# -gt 0 ]; do
  case "$1" in
    --tokens) tokens=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --prepare) prepare=true; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bench_deepseek: unknown argument $1" >&2; exit 2 ;;
  esac
done

source "$root/scripts/bench_lib.sh"
bench_build
build=${COLIBRI_BUILD_DIR:-$root/build}
bin=$build/tools
work=${COLIBRI_BENCH_DIR:-$build/bench}/deepseek_v3
[ "$layers" = 2 ] || work=${work}_${layers}layer
mkdir -p "$work"
echo "# machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
if [ ! -f "$work/checkpoint/config.json" ]; then
  echo "# synthesizing the FP8 checkpoint (once; kept in $work/checkpoint)"
  start=$(date +%s)
  "$bin/colibri-synth" --out "$work/checkpoint" --naming deepseek_v3 --fp8 --norm_topk_prob \
    --d_model 7168 --d_ff 2048 --shared_d_ff 2048 --layers "$layers" --experts 256 --top_k 8 --n_group 8 --topk_group 4 \
    --routed_scaling_factor 2.5 --vocab 4096 --dtype bf16 --shards 3 --seed 3 --overwrite >/dev/null
  echo "# synthesized in $(( $(date +%s) - start )) s: $(du -sh "$work/checkpoint" | cut -f1)"
fi
if [ ! -f "$work/$type/manifest.json" ]; then
  start=$(date +%s)
  "$bin/colibri-convert" --checkpoint "$work/checkpoint" --out "$work/$type" --weight_type "$type" \
    --progress=false --overwrite | grep -E "^converting|weights: max|^wrote"
  echo "# converted in $(( $(date +%s) - start )) s: $(du -sh "$work/$type" | cut -f1)"
fi
model=$work/$type
if [ "$prepare" = true ]; then
  echo "# the model: $model"
  exit 0
fi

echo "## 1. in process: one layer's decode step (routed top-8 + shared expert) vs the read-bandwidth floor"
"$build/tools/colibri-bench" kernels --model "$model" --layer 0 --tokens "$tokens" --repeat "$repeat" \
  --single_expert=false

source "$root/scripts/process_lib.sh"
proc_init
echo "## 2. distributed: router + node A (experts 0-127 + shared 256, CPU 0) + node B (128-255, CPU 1)"
node=("$build/expert_node/colibri-expert" --model "$model" --listen 127.0.0.1:0 --threads 1)
pin_a=() pin_b=()
if [ "$(nproc)" -ge 2 ]; then pin_a=(taskset -c 0); pin_b=(taskset -c 1); fi
proc_start node_a "${pin_a[@]}" "${node[@]}" --experts "0-127,256"; a=$port
proc_start node_b "${pin_b[@]}" "${node[@]}" --experts 128-255; b=$port
proc_wait_locked node_a  # time the calls once the weights are in RAM
proc_wait_locked node_b
proc_start router "$build/router_node/colibri-router" --model "$model" --experts_at "127.0.0.1:$a,127.0.0.1:$b" \
  --listen 127.0.0.1:0
router=127.0.0.1:$port
for t in ${tokens//,/ }; do
  echo "# T=$t"
  "$build/tools/colibri-bench" run --router "$router" --routing gate --batch_size "$t" --duration "$duration" \
    --progress=false
done
proc_stop_all

echo "## 3. in process, the same workload through the engine (gate routing, both CPUs)"
for t in ${tokens//,/ }; do
  echo "# T=$t"
  "$build/tools/colibri-bench" run --local "$model" --routing gate --batch_size "$t" --duration "$duration" \
    --progress=false
done
