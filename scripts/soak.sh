#!/usr/bin/env bash
# A bounded soak on loopback: two expert nodes (experts 0-5 and 2-7: four
# experts on both) and a router under high concurrency for --minutes: clients
# on streams (batch 1), unary clients (batch 8 and batch 32), and clients that
# give up (unary calls with a 2 ms deadline: DEADLINE_EXCEEDED, the router
# cancels its node calls); beside them, abusive clients (scripts/abuse_client.py:
# malformed, oversized and cancelled calls, Reload on the data port, slow
# connections to the gRPC and metrics ports). Every 5 s it samples RSS, open
# fds and threads of the router and both nodes. Pass: no failed call of the
# normal clients (abandoned ones aside), every abusive call refused as
# documented, and
# after the warm-up (the first fifth) to the end (3 s after the clients) no fd growth, at most 4 more threads
# (gRPC sizes its pools to the load) and RSS within 10% (+16 MiB) of where it
# was. Prints the figures either way.
#
# Usage: bash scripts/soak.sh [--minutes 3] [--concurrency 8]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
minutes=3
concurrency=8
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "soak: unknown argument $1" >&2; exit 2 ;;
  esac
done
bash "$root/scripts/build.sh" >/dev/null
build=${COLIBRI_BUILD_DIR:-$root/build}
source "$root/scripts/process_lib.sh"
proc_init
work=$proc_logs
seconds=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
"$build/tools/colibri-synth" --out "$work/ckpt" --d_model 256 --d_ff 512 --layers 4 --experts 8 --vocab 1000 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$work/ckpt" --out "$work/model" --weight_type int8 --progress=false >/dev/null
node=("$build/expert_node/colibri-expert" --model "$work/model" --listen 127.0.0.1:0 --residency=paged --threads 1
  --metrics_port 0)
metrics_port() {  # printed right after the listening line
  for _ in $(seq 1 50); do
    grep -q 'metrics on port' "$proc_logs/$1.out" && break
    sleep 0.1
  done
  grep -o 'metrics on port [0-9]*' "$proc_logs/$1.out" | grep -o '[0-9]*$'
}
proc_start node_a "${node[@]}" --experts 0-5; a=$port; pid_a=$last_pid
proc_start node_b "${node[@]}" --experts 2-7; b=$port; pid_b=$last_pid
proc_start router "$build/router_node/colibri-router" --model "$work/model" --experts_at "127.0.0.1:$a,127.0.0.1:$b" \
  --listen 127.0.0.1:0 --workers 16 --max_tokens 4096 --metrics_port 0
router=127.0.0.1:$port; pid_r=$last_pid
echo "# soak: $minutes min, router $router, nodes 127.0.0.1:$a (experts 0-5), 127.0.0.1:$b (experts 2-7)"

sample() {  # name pid -> "rss_kib fds threads"
  local rss threads fds
  rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$2/status")
  threads=$(awk '/^Threads:/ { print $2 }' "/proc/$2/status")
  fds=$(ls "/proc/$2/fd" | wc -l)
  echo "$1 $rss $fds $threads"
}
(
  end=$((SECONDS + seconds))
  while [ $SECONDS -lt $end ]; do
    t=$SECONDS
    for p in "router $pid_r" "node_a $pid_a" "node_b $pid_b"; do echo "$t $(sample $p)"; done
    sleep 5
  done
) > "$work/samples" &
monitor=$!

bench=("$build/tools/colibri-bench" run --router "$router" --duration "$seconds" --json --progress=false --warmup 0)
third=$(( (concurrency + 2) / 3 ))
"${bench[@]}" --concurrency "$third" --batch_size 1 --seq_len 32 > "$work/stream.json" 2> "$work/stream.err" &
p1=$!
"${bench[@]}" --concurrency "$third" --batch_size 8 --unary --seed 2 > "$work/unary8.json" 2> "$work/unary8.err" &
p2=$!
"${bench[@]}" --concurrency 1 --batch_size 32 --unary --routing gate --seed 3 > "$work/unary32.json" 2> "$work/unary32.err" &
p3=$!
"${bench[@]}" --concurrency "$third" --batch_size 4 --deadline_ms 2 --seed 4 > "$work/abandon.json" 2> "$work/abandon.err" &
p4=$!
/usr/bin/python3 "$root/scripts/abuse_client.py" --router "$router" --nodes "127.0.0.1:$a,127.0.0.1:$b" \
  --metrics "$(metrics_port router),$(metrics_port node_a),$(metrics_port node_b)" --seconds "$seconds" \
  --d_model 256 --max_tokens 4096 > "$work/abuse.txt" 2>&1 &
p5=$!
proc_track "$monitor" "$p1" "$p2" "$p3" "$p4" "$p5"  # a failure or Ctrl-C ends them too
status=0
for p in $p1 $p2 $p3 $p4; do wait "$p" || status=1; done
abuse_status=0
wait "$p5" || abuse_status=1
wait "$monitor" || true
# The end sample: after every client (and its connections) is gone.
sleep 3
for p in "router $pid_r" "node_a $pid_a" "node_b $pid_b"; do echo "$((seconds + 3)) $(sample $p)"; done >> "$work/samples"
cat "$work/abuse.txt"
[ "$abuse_status" = 0 ] || { echo "an abusive call was not refused as documented"; status=1; }

/usr/bin/python3 - "$work" "$seconds" "$status" <<'PY'
import json, sys
work, seconds, bench_status = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ok = bench_status == 0
print("| clients | calls | abandoned | p50 ms | p99 ms | max ms |")
print("|---|---|---|---|---|---|")
for name in ("stream", "unary8", "unary32", "abandon"):
    try:
        r = json.load(open(f"{work}/{name}.json"))
    except Exception:
        print(f"| {name} | FAILED: {open(f'{work}/{name}.err').read().strip()[:200]} |")
        ok = False
        continue
    l = r["latency_us"]
    print(f"| {name} (x{r['concurrency']}, batch {r['batch_size']}) | {r['calls']} | {r['abandoned']} | "
          f"{l['p50']/1e3:.2f} | {l['p99']/1e3:.2f} | {l['max']/1e3:.2f} |")
samples = {}
for line in open(f"{work}/samples"):
    t, name, rss, fds, threads = line.split()
    samples.setdefault(name, []).append((int(t), int(rss), int(fds), int(threads)))
warm = seconds // 5
print("\n| process | RSS after warm-up MiB | RSS max after MiB | RSS end MiB | growth | fds after warm-up / end | threads after warm-up / end |")
print("|---|---|---|---|---|---|---|")
for name, rows in samples.items():
    after = [r for r in rows if r[0] >= warm] or rows
    base, end = after[0], after[-1]
    peak = max(r[1] for r in after)
    growth = (end[1] - base[1]) / base[1]
    # gRPC sizes its thread pools to the load: a few threads may come and go.
    flat = end[1] <= base[1] * 1.10 + 16 * 1024 and end[2] <= base[2] and end[3] <= base[3] + 4
    ok = ok and flat
    print(f"| {name} | {base[1]/1024:.1f} | {peak/1024:.1f} | {end[1]/1024:.1f} | {growth*100:+.1f}% | "
          f"{base[2]} / {end[2]} | {base[3]} / {end[3]} |{'' if flat else ' GREW'}")
for name, rows in samples.items():
    print(f"{name} RSS MiB every 5 s: " + " ".join(f"{r[1] / 1024:.0f}" for r in rows))
print("\nPASS" if ok else "\nFAIL")
sys.exit(0 if ok else 1)
PY
