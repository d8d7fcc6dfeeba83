#!/usr/bin/env bash
# colibri-bench router end to end on a small model: a router over two expert
# nodes (experts 0-3 and 4-7) against the in-process engine and a proxyless
# client calling the same nodes, with unary calls and over one ForwardStream:
# every row prints, and the router's and the proxyless client's answers are
# the engine's bytes ("yes" in both "identical" columns); the targets judged
# from the run are printed, each met or not. No timing is judged here.
# Usage: bench_router_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs
fail() { echo "FAIL: $*"; exit 1; }

"$build/tools/colibri-synth" --out "$tmp/ckpt" --naming mixtral --d_model 128 --d_ff 256 --layers 1 --experts 8 \
  --top_k 2 --vocab 100 --dtype bf16 --seed 5 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false \
  >/dev/null
proc_start node_a "$build/expert_node/colibri-expert" --model "$tmp/model" --threads 1 --experts 0-3 \
  --listen 127.0.0.1:0
a=127.0.0.1:$port
proc_start node_b "$build/expert_node/colibri-expert" --model "$tmp/model" --threads 1 --experts 4-7 \
  --listen 127.0.0.1:0
b=127.0.0.1:$port
proc_start router "$build/router_node/colibri-router" --model "$tmp/model" --experts_at "$a,$b" \
  --listen 127.0.0.1:0 --health_interval_ms 100
router=127.0.0.1:$port
router_pid=$last_pid
for _ in $(seq 1 100); do
  "$build/tools/colibri-health" --target "$router" --timeout_ms 500 >/dev/null 2>&1 && break
  sleep 0.1
done

for mode in "" --stream; do
  "$build/tools/colibri-bench" router --model "$tmp/model" --router "$router" --router_pid "$router_pid" \
    --direct_nodes "$a,$b" --tokens 1,3 --repeat 5 --gap_us 0 --bf16 --threads 1 $mode >"$tmp/out.txt" ||
    { cat "$tmp/out.txt"; fail "colibri-bench router $mode failed"; }
  rows=$(grep -c '^[0-9]' "$tmp/out.txt" || true)
  [ "$rows" = 2 ] || { cat "$tmp/out.txt"; fail "$mode: $rows rows, want 2 (T = 1, 3)"; }
  # Columns 15 and 19: the router's and the proxyless client's answers against the engine's.
  if awk -F' [|] ' '/^[0-9]/ && ($15 != "yes" || $19 != "yes") { bad = 1 } END { exit !bad }' "$tmp/out.txt"; then
    cat "$tmp/out.txt"
    fail "$mode: an answer differs from the engine's"
  fi
  # The targets judged from the run: each line says met or not met.
  for target in "T=1 added p50 <= 2 x round trip + 50 us" "T=1 proxyless added p50 <= round trip + 50 us" \
    "T=1 router p99 <= 2 x p50" "T=1 node bytes <= 1.1 x the minimum" "T=3 node bytes <= 1.1 x the minimum"; do
    grep -F "#   $target " "$tmp/out.txt" | grep -E " (met|not met)$" >/dev/null ||
      { cat "$tmp/out.txt"; fail "$mode: no verdict for '$target'"; }
  done
  how=unary
  [ -n "$mode" ] && how="over one ForwardStream"
  grep -q "router calls $how" "$tmp/out.txt" ||
    { cat "$tmp/out.txt"; fail "$mode: the header does not say how the router was called"; }
  echo "ok: colibri-bench router ${mode:-(unary)}: both answers identical to the engine's"
done
