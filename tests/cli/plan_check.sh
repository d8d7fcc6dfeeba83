#!/usr/bin/env bash
# colibri-plan end to end: a qwen2_moe-named model (2 layers, 8 experts,
# top-2, a shared expert) planned for three nodes from calibration records;
# the nodes start with the planned specs and a router over them serves (every
# expert covered) and answers within the reference's tolerance; the load of
# that traffic, read off the live router, plans again; a node file with
# addresses gives a cluster file the router takes; the same inputs give the
# same plan; and every refusal names its reason.
# Usage: plan_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs
fail() { echo "FAIL: $*"; exit 1; }
plan() { "$build/tools/colibri-plan" --model "$tmp/model" "$@"; }

"$build/tools/colibri-synth" --out "$tmp/ckpt" --naming qwen2_moe --d_model 64 --d_ff 64 --shared_d_ff 128 \
  --layers 2 --experts 8 --top_k 2 --vocab 100 --dtype bf16 --seed 77 --calibration "$tmp/calib.safetensors" \
  --calibration_records 300 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false \
  >/dev/null
expert=$(stat -c %s "$tmp/model/layer_000/expert_000.bin")
shared=$(stat -c %s "$tmp/model/layer_000/expert_008.bin")
need=$(((16 * expert + 2 * shared)))
memory=$((need / 2))  # three nodes: room for about half the model again in replicas

plan --nodes 3 --node_memory "$memory" --calibration "$tmp/calib.safetensors" --out "$tmp/plan" | tee "$tmp/plan.txt"
grep -q "busiest node .* x the mean with the plan" "$tmp/plan.txt" || fail "no summary line"
[ "$(wc -l <"$tmp/plan/shards.txt")" = 3 ] || fail "shards.txt does not list 3 nodes"
[ "$(grep -c '^    - "layer:' "$tmp/plan/values-plan.yaml")" = 3 ] || fail "values-plan.yaml lacks 3 shard specs"
grep -q "assignment: explicit" "$tmp/plan/values-plan.yaml" || fail "values-plan.yaml: no explicit assignment"
[ ! -e "$tmp/plan/cluster.txt" ] || fail "a cluster file without addresses"
grep -q "expert:.*8" "$tmp/plan/shards.txt" || fail "the shared expert (id 8) is placed nowhere"
echo "ok: planned from calibration records: shards.txt, <node>.experts, values-plan.yaml"

plan --nodes 3 --node_memory "$memory" --calibration "$tmp/calib.safetensors" --out "$tmp/again" >/dev/null
cmp -s "$tmp/plan/shards.txt" "$tmp/again/shards.txt" || fail "the same inputs gave another plan"
echo "ok: deterministic"

addresses=""
for n in 0 1 2; do
  proc_start "node$n" "$build/expert_node/colibri-expert" --model "$tmp/model" --residency=paged --threads 1 \
    --experts "$(cat "$tmp/plan/node-$n.experts")" --listen 127.0.0.1:0
  addresses+="${addresses:+,}127.0.0.1:$port"
done
proc_start router "$build/router_node/colibri-router" --model "$tmp/model" --experts_at "$addresses" \
  --listen 127.0.0.1:0 --health_interval_ms 100 --metrics_port 0
router=127.0.0.1:$port
for _ in $(seq 1 50); do grep -q "metrics on port" "$proc_logs/router.out" && break; sleep 0.1; done
metrics_port=$(sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$proc_logs/router.out")
[ -n "$metrics_port" ] || fail "the router printed no metrics port"
for _ in $(seq 1 100); do
  "$build/tools/colibri-health" --target "$router" --timeout_ms 500 >/dev/null 2>&1 && break
  sleep 0.1
done
"$build/tools/colibri-health" --target "$router" --timeout_ms 500 >/dev/null || fail "the planned cluster does not serve"
"$build/tools/colibri-bench" run --router "$router" --model "$tmp/model" --concurrency 2 --batch_size 5 --seq_len 4 \
  --routing gate --check 4 --progress=false >"$tmp/run.txt" || { cat "$tmp/run.txt"; fail "answers off the reference"; }
echo "ok: three nodes on the planned specs serve; $(grep '^check:' "$tmp/run.txt")"
# colibri-bench run's usage errors come before the run.
if "$build/tools/colibri-bench" run --router "$router" --trace "$tmp/t.json" --trace_calls -1 2>"$tmp/err"; then
  fail "--trace_calls -1 accepted"
fi
grep -q -- "--trace_calls must be >= 1" "$tmp/err" || fail "--trace_calls -1: $(cat "$tmp/err")"
if "$build/tools/colibri-bench" run --router "$router" --check 3 --duration 60 2>"$tmp/err" >/dev/null; then
  fail "--check without --model accepted"
fi
grep -q -- "--check needs --model" "$tmp/err" || fail "--check without --model: $(cat "$tmp/err")"

plan --nodes 3 --node_memory "$memory" --router "$router" >"$tmp/live.txt" || fail "no plan from the live router"
grep -q "busiest node" "$tmp/live.txt" || fail "no plan from the live router"
echo "ok: planned from the live router's load"

# The router's /metrics page, saved: the shared expert's samples (id 8) and
# the other metrics (the exporter's own included) are skipped.
/usr/bin/python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://127.0.0.1:$metrics_port/metrics" >"$tmp/metrics.txt"
grep -q '^colibri_router_expert_tokens_total{expert="8",layer="1"}' "$tmp/metrics.txt" || fail "no shared-expert sample"
grep -q '^exposer_' "$tmp/metrics.txt" || fail "no exporter metric on the page"
plan --nodes 3 --node_memory "$memory" --load "$tmp/metrics.txt" >"$tmp/by_metrics.txt" ||
  { cat "$tmp/by_metrics.txt"; fail "no plan from the router's saved /metrics page"; }
echo "ok: planned from the router's saved /metrics page"
# Samples with timestamps (a federated page) read the same.
sed 's/^\(colibri_router_expert_tokens_total{.*} [0-9.e+]*\)$/\1 1733400000000/' "$tmp/metrics.txt" >"$tmp/stamped.txt"
grep -q '^colibri_router_expert_tokens_total{.* 1733400000000$' "$tmp/stamped.txt" || fail "no timestamped sample"
plan --nodes 3 --node_memory "$memory" --load "$tmp/stamped.txt" >"$tmp/by_stamped.txt" ||
  { cat "$tmp/by_stamped.txt"; fail "no plan from a page with timestamps"; }
cmp -s <(grep busiest "$tmp/by_metrics.txt") <(grep busiest "$tmp/by_stamped.txt") || fail "timestamps changed the plan"
# Cut short: inside a sample, or after one.
head -c "$(($(grep -b -m1 'expert="5",layer="1"' "$tmp/metrics.txt" | cut -d: -f1) + 45))" "$tmp/metrics.txt" \
  >"$tmp/cut.txt"
if plan --nodes 3 --node_memory "$memory" --load "$tmp/cut.txt" >"$tmp/out.txt" 2>&1; then fail "a cut page accepted"; fi
grep -q "does not parse (a page cut short?)" "$tmp/out.txt" || fail "cut page: $(cat "$tmp/out.txt")"
grep -v 'expert="5",layer="1"' "$tmp/metrics.txt" >"$tmp/cut.txt"
if plan --nodes 3 --node_memory "$memory" --load "$tmp/cut.txt" >"$tmp/out.txt" 2>&1; then fail "a partial page accepted"; fi
grep -q "no colibri_router_expert_tokens_total sample for layer 1 expert 5" "$tmp/out.txt" ||
  fail "partial page: $(cat "$tmp/out.txt")"
echo "ok: a page cut short is refused, naming the line or the missing expert"

printf '# address memory host\n%s %s a\n%s %s a\n%s %s b\n' \
  "${addresses%%,*}" "$memory" "$(cut -d, -f2 <<<"$addresses")" "$memory" "${addresses##*,}" "$memory" \
  >"$tmp/nodes.txt"
plan --node_file "$tmp/nodes.txt" --calibration "$tmp/calib.safetensors" --out "$tmp/withaddr" >/dev/null
[ "$(tr '\n' , <"$tmp/withaddr/cluster.txt")" = "$addresses," ] || fail "cluster.txt does not list the addresses"
proc_start router2 "$build/router_node/colibri-router" --model "$tmp/model" \
  --cluster_file "$tmp/withaddr/cluster.txt" --listen 127.0.0.1:0
echo "ok: a node file with addresses gives a cluster file the router takes"
plan --nodes 3 --node_memory "$memory" --calibration "$tmp/calib.safetensors" --out "$tmp/withaddr" >/dev/null
[ ! -e "$tmp/withaddr/cluster.txt" ] || fail "a plan without addresses left an earlier plan's cluster.txt"
echo "ok: a plan without addresses written over it leaves no cluster file"

refuse() {  # refuse TEXT ARGS...: colibri-plan ARGS fails naming TEXT
  local want=$1
  shift
  if plan "$@" >"$tmp/out.txt" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$want" "$tmp/out.txt" || { cat "$tmp/out.txt"; fail "refusal of '$*' does not say '$want'"; }
  echo "ok: refused ($want)"
}
refuse "missing" --nodes 2 --node_memory $((need / 4)) --calibration "$tmp/calib.safetensors"
refuse "is not a size" --nodes 2 --node_memory lots --calibration "$tmp/calib.safetensors"
refuse "load once" --nodes 2 --node_memory "$need"
refuse "load once" --nodes 2 --node_memory "$need" --calibration "$tmp/calib.safetensors" --load "$tmp/nodes.txt"
echo "0 1 oops" >"$tmp/bad_load.txt"
refuse "line 1" --nodes 2 --node_memory "$need" --load "$tmp/bad_load.txt"
printf 'colibri_router_expert_tokens_total{expert="1",layer="99999999999999999999"} 5\n' >"$tmp/huge_load.txt"
refuse "not a number" --nodes 2 --node_memory "$need" --load "$tmp/huge_load.txt"
echo "127.0.0.1:1" >"$tmp/bad_nodes.txt"
refuse "address memory" --node_file "$tmp/bad_nodes.txt" --calibration "$tmp/calib.safetensors"
refuse "gets no expert" --nodes 20 --node_memory "$need" --max_replicas 1 --calibration "$tmp/calib.safetensors"
refuse "once" --nodes 2 --node_memory "$need" --node_file "$tmp/nodes.txt" --calibration "$tmp/calib.safetensors"
refuse "(--max_replicas) must be >= 0" --nodes 2 --node_memory "$need" --max_replicas -1 --calibration "$tmp/calib.safetensors"
refuse "(--target_ratio) must be a number >= 1" --nodes 2 --node_memory "$need" --target_ratio nan --calibration "$tmp/calib.safetensors"
refuse "more than 1 PiB" --nodes 2 --node_memory 8000000T --calibration "$tmp/calib.safetensors"
echo "PASS"
