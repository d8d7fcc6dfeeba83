#!/usr/bin/env bash
# The C API end to end: the tools make a tiny model, then the C program
# tests/router_node/c_api_test.c (linked against libcolibri.so) runs on it,
# and on a model with a shared expert; then tests/router_node/c_api_direct_test.c
# runs proxyless engines against two expert nodes (experts 0-2 and 2-3).
# Usage: c_api.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source "$2/scripts/process_lib.sh"
proc_init
tmp=$proc_logs

"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 2 --experts 4 --top_k 2 \
  --vocab 100 --dtype bf16 --seed 5 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 \
  --progress=false >/dev/null
"$build/tests/c_api_test" "$tmp/model"
# A model with a shared expert (Qwen2-MoE naming, gated) reports it.
"$build/tools/colibri-synth" --out "$tmp/shared_ckpt" --naming qwen2_moe --d_model 64 --d_ff 96 --shared_d_ff 128 \
  --layers 1 --experts 4 --top_k 2 --vocab 100 --dtype bf16 --seed 6 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/shared_ckpt" --out "$tmp/shared_model" --weight_type bf16 \
  --progress=false >/dev/null
"$build/tests/c_api_test" "$tmp/shared_model" 1
# Proxyless: two nodes (expert 2 on both), an address where nothing listens,
# and a node that holds every call for 5 s (fault injection).
node=$build/expert_node/colibri-expert
proc_start node_a "$node" --model "$tmp/model" --experts 0-2 --listen 127.0.0.1:0 --threads 1
port_a=$port
proc_start node_b "$node" --model "$tmp/model" --experts 2-3 --listen 127.0.0.1:0 --threads 1
port_b=$port
proc_start node_slow "$node" --model "$tmp/model" --listen 127.0.0.1:0 --threads 1 --inject_delay_ms 5000
port_slow=$port
"$build/tests/c_api_direct_test" "$tmp/model" "127.0.0.1:$port_a,127.0.0.1:$port_b" 127.0.0.1:1 \
  "127.0.0.1:$port_slow"
# libcolibri.so exports the C API and nothing else.
others=$(nm -D --defined-only "$build/router_node/libcolibri.so" | awk '$3 !~ /^colibri_/ {print $3}')
if [ -n "$others" ]; then
  echo "FAIL: libcolibri.so exports more than colibri_*: $others"
  exit 1
fi
echo "PASS: libcolibri.so exports only colibri_* symbols"
