#!/usr/bin/env bash
# How long an expert node takes to start: the first start (every owned file
# hashed) against a restart on the unchanged model (files remembered as
# verified: common/file_verifier.h), for each residency, and a restart after
# one file was touched (that file alone is hashed again). The model is the
# benchmarks' Mixtral-8x7B-shaped bf16 layer (8 experts, 2.8 GB); the page
# cache is warm in every case (the first run reads the files once).
# Usage: scripts/bench_start.sh [RUNS]   (RUNS restarts per case, default 3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${COLIBRI_BUILD_DIR:-$root/build}
runs=${1:-3}
source "$root/scripts/bench_lib.sh"
bench_build
source "$root/scripts/process_lib.sh"
proc_init
proc_poll_s=0.005  # proc_start looks for "listening" every 5 ms: the restart takes ~0.2 s
bench_layer mixtral_8x7b_layer bf16 --d_model 4096 --d_ff 14336
cache=$proc_logs/verified.txt
cat "$bench_model"/layer_000/*.bin >/dev/null  # warm the page cache for every case alike

# start RESIDENCY: starts a node, prints the seconds until it listens and its verification line, stops it.
start() {
  local t0 t1
  t0=$(date +%s.%N)
  proc_start node "$build/expert_node/colibri-expert" --model "$bench_model" --listen 127.0.0.1:0 \
    --residency "$1" --verify_cache "$cache"
  t1=$(date +%s.%N)
  printf '%-7s %7.2f s   %s\n' "$1" "$(echo "$t1 - $t0" | bc)" \
    "$(grep -o 'verified [0-9]* files.*unchanged since verified' "$proc_logs/node.err")"
  proc_stop_all >/dev/null
}

echo "lscpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; model $bench_model ($(du -sh "$bench_model" | cut -f1))"
for residency in locked copy paged; do
  echo "== --residency $residency: first start, then $runs restarts"
  rm -f "$cache"
  start "$residency"
  for _ in $(seq 1 "$runs"); do start "$residency"; done
done
echo "== touched one file (new ctime): it alone is hashed again"
touch "$bench_model/layer_000/expert_003.bin"
start locked
