#!/usr/bin/env bash
# The router end to end against the independent PyTorch computation, through
# an independent gRPC client (scripts/router_client.py: Python grpcio):
# two expert nodes (experts 0-4 and 4-7: expert 4 on both) behind a
# distributed router, and a local router, on models stored as f32, bf16 and
# int4. For every layer and each routing mode — gate (exact), lut (compared
# with PyTorch routing each token by its embedding, which is how the
# converter builds the table) and client (PyTorch's routes sent by the
# client) — the output matches PyTorch within the weight type's tolerance,
# the routes match, and the distributed output is byte-identical to the
# local one. Exits 77 (skipped) only when torch or grpcio is missing.
# Usage: router_torch_check.sh BUILD_DIR SOURCE_DIR
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

"$build/tools/colibri-synth" --out "$tmp/ckpt" --naming mixtral --d_model 192 --d_ff 320 --layers 2 --experts 8 \
  --top_k 2 --vocab 300 --dtype f32 --seed 9101 >/dev/null
$torch_ref make-inputs --checkpoint "$tmp/ckpt" --tokens 11 --seed 777 --out "$tmp/in.safetensors" >/dev/null
for layer in 0 1; do
  $torch_ref forward --checkpoint "$tmp/ckpt" --inputs "$tmp/in.safetensors" --layer $layer --routing gate \
    --out "$tmp/torch_gate_$layer.safetensors" >/dev/null
  $torch_ref forward --checkpoint "$tmp/ckpt" --inputs "$tmp/in.safetensors" --layer $layer --routing embedding \
    --out "$tmp/torch_lut_$layer.safetensors" >/dev/null
done

for spec in f32:1e-4 bf16:2e-2 int4:0.15; do
  type=${spec%%:*} rtol=${spec##*:}
  "$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/$type" --weight_type "$type" \
    --progress=false >/dev/null
  node=("$build/expert_node/colibri-expert" --model "$tmp/$type" --listen 127.0.0.1:0 --nomlock --threads 1)
  proc_start "a_$type" "${node[@]}" --experts 0-4; a=$port
  proc_start "b_$type" "${node[@]}" --experts 4-7; b=$port
  proc_start "router_$type" "$build/router_node/colibri-router" --model "$tmp/$type" \
    --experts_at "127.0.0.1:$a,127.0.0.1:$b" --listen 127.0.0.1:0
  distributed=127.0.0.1:$port
  proc_start "local_$type" "$build/router_node/colibri-router" --local "$tmp/$type" --threads 1 --listen 127.0.0.1:0
  local=127.0.0.1:$port
  for layer in 0 1; do
    for routing in gate lut client; do
      expected=$tmp/torch_${routing}_$layer.safetensors
      [ "$routing" = client ] && expected=$tmp/torch_gate_$layer.safetensors
      args=(forward --inputs "$tmp/in.safetensors" --layer $layer --routing $routing --routes "$tmp/torch_gate_$layer.safetensors")
      $client --router "$distributed" "${args[@]}" --out "$tmp/distributed.safetensors" >/dev/null
      $client --router "$local" "${args[@]}" --out "$tmp/local.safetensors" >/dev/null
      echo "== $type, layer $layer, routing $routing (rtol $rtol): distributed router vs PyTorch"
      $torch_ref compare --expected "$expected" --actual "$tmp/distributed.safetensors" --rtol "$rtol"
      if ! cmp -s "$tmp/distributed.safetensors" "$tmp/local.safetensors"; then
        echo "FAIL: distributed and local outputs differ"; exit 1
      fi
      echo "distributed output == local output, byte for byte"
    done
  done
  proc_stop_all
done
echo "PASS"
