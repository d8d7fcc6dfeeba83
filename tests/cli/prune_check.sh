#!/usr/bin/env bash
# colibri-prune end to end: a Mixtral-named checkpoint (8 experts, top-2,
# 2 layers) with calibration records, converted (f32 and bf16), pruned to
# the 5 most loaded experts per layer by routing the records through the
# gate; the result passes colibri-validate, serves through a local router and
# through a distributed one (two nodes) byte for byte alike, and matches an
# independent PyTorch computation of the pruned layer (the original
# checkpoint's gate restricted to the kept experts) with gate routing. Also:
# the load taken from a router's /metrics page, --min_share, and the refusals.
# Exits 77 (skipped) only when torch or grpcio is missing.
# Usage: prune_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
py=/usr/bin/python3
torch_ref="$py $src/scripts/torch_moe_reference.py"
client="$py $src/scripts/router_client.py"
if ! $py -c 'import torch, grpc, google.protobuf' 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 cannot import torch, grpc and protobuf (scripts/install-deps.sh installs them)"
  exit 77
fi
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs
fail() { echo "FAIL: $*"; exit 1; }

"$build/tools/colibri-synth" --out "$tmp/ckpt" --naming mixtral --d_model 96 --d_ff 80 --layers 2 --experts 8 \
  --top_k 2 --vocab 150 --dtype f32 --seed 9201 --calibration "$tmp/calib.safetensors" \
  --calibration_records 400 >/dev/null
$torch_ref make-inputs --checkpoint "$tmp/ckpt" --tokens 13 --seed 31 --out "$tmp/in.safetensors" >/dev/null
for spec in f32:1e-4 bf16:2e-2; do
  type=${spec%%:*} rtol=${spec##*:}
  "$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/$type" --weight_type "$type" \
    --progress=false >/dev/null
  "$build/tools/colibri-prune" --model "$tmp/$type" --out "$tmp/${type}_pruned" --calibration "$tmp/calib.safetensors" \
    --keep_top 5 | tee "$tmp/prune_$type.txt"
  grep -q "wrote .*2 layers x 5 routed experts (was 8)" "$tmp/prune_$type.txt" || fail "no summary line"
  "$build/tools/colibri-validate" "$tmp/${type}_pruned" >/dev/null || fail "the pruned $type model is not valid"
  echo "ok: the pruned $type model passes colibri-validate"
  model=$tmp/${type}_pruned
  proc_start "local_$type" "$build/router_node/colibri-router" --local "$model" --threads 1 --listen 127.0.0.1:0
  local_router=127.0.0.1:$port
  node=("$build/expert_node/colibri-expert" --model "$model" --listen 127.0.0.1:0 --residency=paged --threads 1)
  proc_start "a_$type" "${node[@]}" --experts 0-2; a=$port
  proc_start "b_$type" "${node[@]}" --experts 2-4; b=$port
  proc_start "router_$type" "$build/router_node/colibri-router" --model "$model" \
    --experts_at "127.0.0.1:$a,127.0.0.1:$b" --listen 127.0.0.1:0
  distributed=127.0.0.1:$port
  for layer in 0 1; do
    kept=$(sed -n "s/^layer $layer: kept 5 of 8 experts \[\([0-9,]*\)\].*/\1/p" "$tmp/prune_$type.txt")
    [ -n "$kept" ] || fail "no kept experts printed for layer $layer"
    $torch_ref forward --checkpoint "$tmp/ckpt" --inputs "$tmp/in.safetensors" --layer "$layer" --routing gate \
      --keep_experts "$kept" --out "$tmp/torch_$layer.safetensors" >/dev/null
    for routing in gate lut; do
      args=(forward --inputs "$tmp/in.safetensors" --layer "$layer" --routing $routing)
      $client --router "$distributed" "${args[@]}" --out "$tmp/distributed.safetensors" >/dev/null
      $client --router "$local_router" "${args[@]}" --out "$tmp/local.safetensors" >/dev/null
      cmp -s "$tmp/distributed.safetensors" "$tmp/local.safetensors" || fail "distributed and local outputs differ"
      if [ $routing = gate ]; then
        echo "== pruned $type, layer $layer (kept $kept), gate routing: router vs PyTorch with the gate restricted"
        $torch_ref compare --expected "$tmp/torch_$layer.safetensors" --actual "$tmp/distributed.safetensors" \
          --rtol "$rtol"
      fi
      echo "ok: layer $layer, $routing routing: distributed output == local output, byte for byte"
    done
  done
  proc_stop_all >/dev/null
done

echo "--- the load from a router's /metrics page, and --min_share"
# A page as a router writes it: a sample for every (layer, expert), 0 for
# those not given here, and other metrics, the exporter's own included.
declare -A counts=([0.0]=500 [0.1]=20 [0.6]=300 [0.7]=180 [1.2]=600 [1.3]=400)
{
  echo '# HELP colibri_router_expert_tokens_total Token rows routed to each (layer, expert).'
  echo '# TYPE colibri_router_expert_tokens_total counter'
  for layer in 0 1; do
    for expert in 0 1 2 3 4 5 6 7; do
      echo "colibri_router_expert_tokens_total{expert=\"$expert\",layer=\"$layer\"} ${counts[$layer.$expert]:-0}"
    done
  done
  echo 'colibri_router_calls_total{code="OK"} 1000'
  echo 'exposer_transferred_bytes_total 10548'
  echo 'exposer_request_latencies{quantile="0.5"} Nan'
} >"$tmp/metrics.txt"
"$build/tools/colibri-prune" --model "$tmp/f32" --out "$tmp/by_metrics" --load "$tmp/metrics.txt" --min_share 0.1 |
  tee "$tmp/by_metrics.txt"
grep -q "^layer 0: kept 3 of 8 experts \[0,6,7\]" "$tmp/by_metrics.txt" || fail "layer 0 should keep 0,6,7"
grep -q "^layer 1: kept 3 of 8 experts \[0,2,3\]" "$tmp/by_metrics.txt" || fail "layer 1 should keep 2,3 and then 0"
"$build/tools/colibri-validate" "$tmp/by_metrics" >/dev/null || fail "the model pruned by metrics is not valid"

echo "--- refusals"
refuse() {  # EXPECTED_TEXT ARGS...
  local want=$1; shift
  if "$build/tools/colibri-prune" --model "$tmp/f32" --out "$tmp/refused" "$@" 2>"$tmp/err" >/dev/null; then
    fail "colibri-prune $* succeeded"
  fi
  grep -q -- "$want" "$tmp/err" || fail "colibri-prune $*: unclear error: $(cat "$tmp/err")"
  echo "ok: refused ($(cat "$tmp/err"))"
}
refuse "outside \[top_k 2" --calibration "$tmp/calib.safetensors" --keep_top 1
refuse "exactly one of" --calibration "$tmp/calib.safetensors" --keep_top 3 --min_share 0.1
refuse "no load" --keep_top 3
# Calibration records with a NaN (the last value of record 2).
/usr/bin/python3 - "$tmp/nan.safetensors" <<'PY'
import json, struct, sys
rows, d = 3, 96
data = struct.pack("<%df" % (rows * d), *([0.5] * (rows * d - 1) + [float("nan")]))
header = json.dumps({"hidden_states.0": {"dtype": "F32", "shape": [rows, d], "data_offsets": [0, len(data)]}})
header += " " * (-len(header) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header.encode() + data)
PY
refuse "record 2 has a value that is not finite" --calibration "$tmp/nan.safetensors" --keep_top 3
refuse "line 1" --load "$tmp/in.safetensors" --keep_top 3
printf '0 9 5\n' >"$tmp/bad_load.txt"
refuse "outside the model" --load "$tmp/bad_load.txt" --keep_top 3
if "$build/tools/colibri-prune" --model "$tmp/f32" --out "$tmp/./f32/" --overwrite --load "$tmp/metrics.txt" \
  --keep_top 3 2>"$tmp/err" >/dev/null; then fail "pruned a model into its own directory"; fi
grep -q "is the model directory" "$tmp/err" || fail "unclear error: $(cat "$tmp/err")"
"$build/tools/colibri-validate" "$tmp/f32" >/dev/null || fail "a refused prune into the model's own directory harmed it"
echo "ok: refused ($(cat "$tmp/err"))"
"$build/tools/colibri-synth" --out "$tmp/v3" --naming deepseek_v3 --norm_topk_prob --d_model 64 --d_ff 32 \
  --shared_d_ff 32 --layers 2 --dense_layers 1 --experts 8 --top_k 2 --n_group 4 --topk_group 2 --vocab 50 \
  --dtype f32 --seed 3 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/v3" --out "$tmp/v3_model" --progress=false >/dev/null
if "$build/tools/colibri-prune" --model "$tmp/v3_model" --out "$tmp/refused" --load "$tmp/metrics.txt" \
  --keep_top 4 2>"$tmp/err" >/dev/null; then fail "pruned a model with expert groups"; fi
grep -q "expert groups" "$tmp/err" || fail "unclear error: $(cat "$tmp/err")"
echo "ok: refused ($(cat "$tmp/err"))"
echo "PASS"
