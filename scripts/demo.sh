#!/usr/bin/env bash
# The main job, from a fresh clone: install dependencies, build, synthesize a
# Mixtral-shaped checkpoint (no download), convert and validate it, start two
# expert nodes and a router on loopback, drive the router for a few seconds
# with colibri-bench (throughput, latency percentiles, stages, expert load, a
# Chrome trace), check sample outputs against the reference MoE layer, decode
# a few tokens with the C++ client example, and stop everything — also on
# Ctrl-C or failure: no process is left behind.
#
# Usage: bash scripts/demo.sh [--weight_type bf16|f32|f16|int8|int4] [--duration SECONDS]
#                             [--concurrency N] [--full] [--tiny] [--skip-deps] [--skip-build]
# --full: a full-size Mixtral-8x7B-shaped layer (d_model 4096, d_ff 14336; ~3 GB per weight type,
#         cached under build/bench) for realistic numbers; --tiny: a d_model 64 model (the test).
# Work files go to ${COLIBRI_DEMO_DIR:-build/demo} (replaced on each run).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
weight_type=bf16
duration=5
concurrency=2
size=default
deps=1
build_it=1
while [ $# -gt 0 ]; do
  case "$1" in
    --weight_type) weight_type=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --full) size=full; shift ;;
    --tiny) size=tiny; shift ;;
    --skip-deps) deps=0; shift ;;
    --skip-build) build_it=0; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

step() {  # step "title" command...
  local title=$1; shift
  echo
  echo "=== $title"
  local start=$EPOCHREALTIME
  "$@"
  awk -v t="$title" -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "=== %s: done in %.2f s\n", t, b - a }'
}

[ "$deps" = 1 ] && step "install dependencies" bash "$root/scripts/install-deps.sh"
[ "$build_it" = 1 ] && step "build (what the demo runs)" bash "$root/scripts/build.sh" --target colibri_demo
build=${COLIBRI_BUILD_DIR:-$root/build}
bin=$build/tools
work=${COLIBRI_DEMO_DIR:-$build/demo}
if [ -e "$work" ] && [ ! -f "$work/.colibri-demo" ] && [ ! -f "$work/checkpoint/config.json" ]; then
  echo "demo: $work exists and is not a demo directory; set COLIBRI_DEMO_DIR to a new path" >&2
  exit 2
fi
rm -rf "$work"
mkdir -p "$work"
touch "$work/.colibri-demo"

case $size in
  tiny) shape=(--d_model 64 --d_ff 96 --layers 2 --experts 4 --vocab 50); experts_a=0-1; experts_b=2-3
        ckpt=$work/checkpoint; what="2 MoE layers, d_model 64, d_ff 96, 4 experts, top-2" ;;
  full) shape=(--d_model 4096 --d_ff 14336 --layers 1 --experts 8 --vocab 32000 --shards 2); experts_a=0-3
        experts_b=4-7; ckpt=${COLIBRI_BENCH_DIR:-$build/bench}/mixtral_8x7b_layer/checkpoint
        what="1 Mixtral-8x7B-shaped MoE layer, d_model 4096, d_ff 14336, 8 experts, top-2" ;;
  *)    shape=(--d_model 1024 --d_ff 2816 --layers 4 --experts 8 --vocab 32000 --shards 2); experts_a=0-3
        experts_b=4-7; ckpt=$work/checkpoint; what="4 MoE layers, d_model 1024, d_ff 2816, 8 experts, top-2" ;;
esac
if [ ! -f "$ckpt/config.json" ]; then
  step "synthesize a Mixtral-naming checkpoint ($what, bf16)" \
    "$bin/colibri-synth" --out "$ckpt" --naming mixtral "${shape[@]}" --top_k 2 --dtype bf16 --seed 1
fi
step "convert to a Colibri model directory ($weight_type weights)" \
  "$bin/colibri-convert" --checkpoint "$ckpt" --out "$work/model" --weight_type "$weight_type" --progress=false
step "validate the model directory" "$bin/colibri-validate" --model "$work/model"

source "$root/scripts/process_lib.sh"
proc_init
start_cluster() {
  local node=("$build/expert_node/colibri-expert" --model "$work/model" --listen 127.0.0.1:0 --residency=paged)
  proc_start node_a "${node[@]}" --experts "$experts_a"; node_a=$port
  echo "expert node A: experts $experts_a on 127.0.0.1:$node_a (pid $last_pid)"
  proc_start node_b "${node[@]}" --experts "$experts_b"; node_b=$port
  echo "expert node B: experts $experts_b on 127.0.0.1:$node_b (pid $last_pid)"
  proc_start router "$build/router_node/colibri-router" --model "$work/model" \
    --experts_at "127.0.0.1:$node_a,127.0.0.1:$node_b" --listen 127.0.0.1:0
  router=127.0.0.1:$port
  echo "router: $router (pid $last_pid), asks each node what it serves"
  proc_wait_serving "$bin/colibri-health" "$router"
}
step "start two expert nodes and a router on loopback" start_cluster
step "drive the router for $duration s: $concurrency clients, one stream each, every layer per token; then check samples against the reference MoE layer" \
  "$bin/colibri-bench" run --router "$router" --model "$work/model" --concurrency "$concurrency" \
  --duration "$duration" --trace "$work/trace.json" --check 4
step "decode 3 tokens through every layer with the C++ client example (hidden state + MoE output, residual)" \
  "$build/clients/cpp/colibri-decode-example" --router "$router" --steps 3
step "stop the router and the nodes (SIGTERM: drain, exit 0)" proc_stop_all
echo
echo "demo finished. Trace of the run: $work/trace.json (open in chrome://tracing or https://ui.perfetto.dev);"
echo "model directory: $work/model"
