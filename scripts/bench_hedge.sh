#!/usr/bin/env bash
# Hedged calls against a replica with a slow tail: two expert nodes with every
# expert of a d_model 1024 / d_ff 2816 bf16 layer (cached, shared with the
# other benchmarks' --small); node A — the one an idle router picks first —
# sleeps --delay_ms on every --every-th call. One router without hedging and
# one with --hedge_after_ms, the same client load on each in turn (one client,
# T=1, one layer per call): p50/p90/p99/max per call.
#
# Usage: bash scripts/bench_hedge.sh [--calls 400] [--delay_ms 50] [--every 10] [--hedge_after_ms 10]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
calls=400 delay=50 every=10 hedge=10
while [ $# -gt 0 ]; do
  case "$1" in
    --calls) calls=$2; shift 2 ;;
    --delay_ms) delay=$2; shift 2 ;;
    --every) every=$2; shift 2 ;;
    --hedge_after_ms) hedge=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "bench_hedge: unknown argument $1" >&2; exit 2 ;;
  esac
done
build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/bench_lib.sh"
bench_build
bench_layer small_layer bf16 --d_model 1024 --d_ff 2816
model=$bench_model
source "$root/scripts/process_lib.sh"
proc_init
node=("$build/expert_node/colibri-expert" --model "$model" --listen 127.0.0.1:0 --experts all --threads 1)
proc_start slow "${node[@]}" --inject_delay_ms "$delay" --inject_delay_every "$every"; a=$port
proc_start fast "${node[@]}"; b=$port
proc_wait_locked slow
proc_wait_locked fast
router=("$build/router_node/colibri-router" --model "$model" --experts_at "127.0.0.1:$a,127.0.0.1:$b" --listen 127.0.0.1:0)
proc_start plain "${router[@]}"; plain=$port
proc_start hedged "${router[@]}" --hedge_after_ms "$hedge"; hedged=$port
echo "# machine: $(nproc) CPUs, $(date -u +%Y-%m-%dT%H:%MZ); node A sleeps $delay ms every $every calls; $calls calls each"
echo "| router | p50 ms | p90 ms | p99 ms | max ms |"
echo "|---|---|---|---|---|"
for r in "plain:$plain" "hedged after $hedge ms:$hedged"; do
  "$build/tools/colibri-bench" run --router "127.0.0.1:${r##*:}" --batch_size 1 --seq_len 1 --layers 1 --repeat "$calls" \
    --warmup 5 --json --progress=false |
    /usr/bin/python3 -c "import json,sys; r=json.load(sys.stdin)['latency_us']; print('| ${r%%:*} | ' + ' | '.join(f'{r[k]/1e3:.2f}' for k in ('p50','p90','p99','max')) + ' |')"
done
proc_stop_all >/dev/null
