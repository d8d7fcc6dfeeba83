#!/usr/bin/env bash
# The router benchmark of docs/PERFORMANCE.md: a router and two expert nodes
# on loopback against the in-process engine, same calls, same run.
# Builds, synthesizes and converts a Mixtral-8x7B-shaped MoE layer (d_model
# 4096, d_ff 14336, 8 experts, top-2, bf16 unless --type; cached, shared with
# bench_kernels.sh), starts node A (experts 0-3) and node B (experts 4-7),
# each pinned with taskset to its own CPU with one compute thread, and a
# router in front, then runs `colibri-bench router` (the engine in the bench
# process uses both CPUs, and a proxyless client in it calls the same two
# nodes directly). Every process started is stopped on exit.
#
# Usage: bash scripts/bench_router.sh [--tokens 1,8,128] [--repeat 30] [--routing lut|gate]
#                                     [--node_threads 1] [--layout split|replicated] [--small|--tiny]
#                                     [--bf16] [--gap_us 2000] [--node_replies exact|partial|per_expert]
#                                     [--batch_window_us N] [--stream] [--type bf16|int8|int4] [--q8_records]
#                                     [--node_stream_max_bytes N]
# --node_threads 2 runs each node with two threads instead (both nodes share both CPUs).
# --layout replicated: both nodes own all 8 experts (one answers each layer call, with
# --node_threads 2 the same compute as the engine: what is left is the cost of distribution).
# --small: a d_model 1024 / d_ff 2816 layer (quick smoke run); --tiny: d_model 128 / d_ff 256,
# whose compute (~70 us) leaves the transport's own cost.
# --bf16: hidden states and output in bf16; --gap_us: the pause before each call;
# --node_replies, --batch_window_us: the router's flags of those names; --stream: the client
# sends its router calls over one ForwardStream (a decoding loop's session) instead of unary calls.
# --type: the weight type of the layer; --q8_records (int8/int4): nodes and engine build int8 tile records.
# --node_stream_max_bytes: the router's and the proxyless client's (0: every node call unary).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tokens=1,8,128
repeat=30
routing=lut
node_threads=1
layout=split
shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
type=bf16
bench_args=()
router_args=()
node_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tokens) tokens=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --routing) routing=$2; shift 2 ;;
    --node_threads) node_threads=$2; shift 2 ;;
    --layout) layout=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    --tiny) shape=(--d_model 128 --d_ff 256); name=tiny_layer; shift ;;
    --bf16) bench_args+=(--bf16); shift ;;
    --stream) bench_args+=(--stream); shift ;;
    --type) type=$2; shift 2 ;;
    --q8_records) bench_args+=(--q8_records); node_args+=(--q8_records); shift ;;
    --gap_us) bench_args+=(--gap_us "$2"); shift 2 ;;
    --node_replies) router_args+=(--node_replies "$2"); shift 2 ;;
    --batch_window_us) router_args+=(--batch_window_us "$2"); shift 2 ;;
    --node_stream_max_bytes) router_args+=(--node_stream_max_bytes "$2"); bench_args+=(--node_stream_max_bytes "$2"); shift 2 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "bench_router: unknown argument $1" >&2; exit 2 ;;
  esac
done

build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
bench_layer "$name" "$type" "${shape[@]}"
model=$bench_model

source "$root/scripts/process_lib.sh"
proc_init
node=("$build/expert_node/colibri-expert" --model "$model" --listen 127.0.0.1:0 --threads "$node_threads" "${node_args[@]}")
experts_a=0-3; experts_b=4-7
[ "$layout" = replicated ] && experts_a=all && experts_b=all
if [ "$node_threads" = 1 ] && [ "$(nproc)" -ge 2 ]; then
  proc_start node_a taskset -c 0 "${node[@]}" --experts $experts_a; a=$port
  proc_start node_b taskset -c 1 "${node[@]}" --experts $experts_b; b=$port
else
  proc_start node_a "${node[@]}" --experts $experts_a; a=$port
  proc_start node_b "${node[@]}" --experts $experts_b; b=$port
fi
proc_wait_locked node_a
proc_wait_locked node_b
proc_start router env COLIBRI_DEBUG=${COLIBRI_DEBUG:-0} "$build/router_node/colibri-router" --model "$model" --experts_at "127.0.0.1:$a,127.0.0.1:$b" \
  --listen 127.0.0.1:0 "${router_args[@]}"
router_port=$port
router_pid=$last_pid
echo "# machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "# nodes: A experts $experts_a on 127.0.0.1:$a, B experts $experts_b on 127.0.0.1:$b, $node_threads thread(s) each"
"$build/tools/colibri-bench" router --model "$model" --router "127.0.0.1:$router_port" --router_pid "$router_pid" \
  --tokens "$tokens" --repeat "$repeat" --routing "$routing" --threads "${COLIBRI_BENCH_ENGINE_THREADS:-0}" \
  --direct_nodes "127.0.0.1:$a,127.0.0.1:$b" "${bench_args[@]}"
[ "${COLIBRI_DEBUG:-0}" != 0 ] && cat "$proc_logs/router.err" >&2
exit 0
