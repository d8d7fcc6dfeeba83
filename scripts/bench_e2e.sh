#!/usr/bin/env bash
# The end-to-end table of docs/PERFORMANCE.md: one Mixtral-8x7B-shaped MoE
# layer (bf16; cached, shared with bench_kernels.sh), called by a client
# through (a) the in-process engine, (b) a router with two expert nodes on
# loopback (experts 0-3 and 4-7, 2 threads each), and (c) PyTorch
# (scripts/bench_torch.py, exact gate routing), at each T, in one run.
# Reports p50 and p99 per call in ms. Every process started is stopped on exit.
#
# Usage: bash scripts/bench_e2e.sh [--tokens 1,8,128] [--repeat 20] [--small]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tokens=1,8,128
repeat=20
shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
while [ $# -gt 0 ]; do
  case "$1" in
    --tokens) tokens=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "bench_e2e: unknown argument $1" >&2; exit 2 ;;
  esac
done
build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
bench_layer "$name" bf16 "${shape[@]}"
model=$bench_model
source "$root/scripts/process_lib.sh"
proc_init
node=("$build/expert_node/colibri-expert" --model "$model" --listen 127.0.0.1:0 --threads 2)
proc_start node_a "${node[@]}" --experts 0-3; a=$port
proc_start node_b "${node[@]}" --experts 4-7; b=$port
proc_wait_locked node_a
proc_wait_locked node_b
proc_start router "$build/router_node/colibri-router" --model "$model" --experts_at "127.0.0.1:$a,127.0.0.1:$b" \
  --listen 127.0.0.1:0
router=127.0.0.1:$port
results=$proc_logs/results.jsonl
echo "# machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%Y-%m-%dT%H:%MZ)"
run=(run --batch_size 0 --seq_len 1 --layers 1 --repeat "$((repeat + 2))" --warmup 2 --routing gate --json --progress=false)
for t in ${tokens//,/ }; do
  run[2]=$t
  "$build/tools/colibri-bench" "${run[@]}" --local "$model" | sed 's/^{/{"path":"engine",/' >>"$results"
  "$build/tools/colibri-bench" "${run[@]}" --router "$router" | sed 's/^{/{"path":"router",/' >>"$results"
done
proc_stop_all >/dev/null
/usr/bin/python3 "$root/scripts/bench_torch.py" "${shape[@]}" --tokens "$tokens" --dtypes bf16 --routing gate \
  --repeat "$repeat" --json >"$proc_logs/torch.json" || echo "# PyTorch baseline failed or unavailable" >&2
/usr/bin/python3 - "$results" "$proc_logs/torch.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
try:
    torch = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
except Exception:
    torch = []
def ms(v): return f"{v / 1000:.2f}"
print("| T | engine p50 | engine p99 | router + 2 nodes p50 | p99 | PyTorch bf16 p50 | p99 |")
print("|---|---|---|---|---|---|---|")
for t in sorted({r["batch_size"] for r in rows}):
    e = next(r for r in rows if r["path"] == "engine" and r["batch_size"] == t)
    d = next(r for r in rows if r["path"] == "router" and r["batch_size"] == t)
    p = next((x for x in torch if x.get("T") == t), None)
    tp = f"{p['median_ms']:.2f} | {p['p99_ms']:.2f}" if p else "- | -"
    print(f"| {t} | {ms(e['latency_us']['p50'])} | {ms(e['latency_us']['p99'])} | {ms(d['latency_us']['p50'])} | "
          f"{ms(d['latency_us']['p99'])} | {tp} |")
PY
