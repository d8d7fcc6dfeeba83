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
# local one. Checkpoints: Mixtral naming, Qwen3-MoE with a dense first layer,
# Qwen2-MoE with a gated shared expert, DeepSeek-V2-Lite- and V3-shaped,
# gpt-oss and Llama 4. Exits 77 (skipped) only when torch or grpcio is missing.
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

# check NAME "TYPE:RTOL ..." SYNTH_ARGS...: a checkpoint through every weight type, layer and routing mode.
check() {
  local name=$1 types=$2
  shift 2
  local ck=$tmp/$name
  "$build/tools/colibri-synth" --out "$ck/ckpt" "$@" >/dev/null
  $torch_ref make-inputs --checkpoint "$ck/ckpt" --tokens 11 --seed 777 --out "$ck/in.safetensors" >/dev/null
  for spec in $types; do
    local type=${spec%%:*} rtol=${spec##*:}
    "$build/tools/colibri-convert" --checkpoint "$ck/ckpt" --out "$ck/$type" --weight_type "$type" \
      --progress=false >/dev/null
    # MoE layer L is decoder layer hf_layers[L] of the checkpoint (dense layers are skipped).
    local hf_layers
    hf_layers=($($py -c "import json,sys; print(' '.join(map(str, json.load(open(sys.argv[1]))['hf_layers'])))" \
      "$ck/$type/manifest.json"))
    for layer in "${!hf_layers[@]}"; do
      $torch_ref forward --checkpoint "$ck/ckpt" --inputs "$ck/in.safetensors" --layer "${hf_layers[$layer]}" \
        --routing gate --out "$ck/torch_gate_$layer.safetensors" >/dev/null
      $torch_ref forward --checkpoint "$ck/ckpt" --inputs "$ck/in.safetensors" --layer "${hf_layers[$layer]}" \
        --routing embedding --out "$ck/torch_lut_$layer.safetensors" >/dev/null
    done
    local node=("$build/expert_node/colibri-expert" --model "$ck/$type" --listen 127.0.0.1:0 --residency=paged --threads 1)
    proc_start "a_${name}_$type" "${node[@]}" --experts "$experts_a"; local a=$port
    proc_start "b_${name}_$type" "${node[@]}" --experts "$experts_b"; local b=$port
    proc_start "router_${name}_$type" "$build/router_node/colibri-router" --model "$ck/$type" \
      --experts_at "127.0.0.1:$a,127.0.0.1:$b" --listen 127.0.0.1:0
    local distributed=127.0.0.1:$port
    proc_start "local_${name}_$type" "$build/router_node/colibri-router" --local "$ck/$type" --threads 1 \
      --listen 127.0.0.1:0
    local local_router=127.0.0.1:$port
    for layer in "${!hf_layers[@]}"; do
      for routing in gate lut client; do
        local expected=$ck/torch_${routing}_$layer.safetensors
        [ "$routing" = client ] && expected=$ck/torch_gate_$layer.safetensors
        local args=(forward --inputs "$ck/in.safetensors" --layer "$layer" --routing $routing
                    --routes "$ck/torch_gate_$layer.safetensors")
        $client --router "$distributed" "${args[@]}" --out "$ck/distributed.safetensors" >/dev/null
        $client --router "$local_router" "${args[@]}" --out "$ck/local.safetensors" >/dev/null
        echo "== $name as $type, layer $layer (decoder layer ${hf_layers[$layer]}), routing $routing (rtol $rtol):" \
          "distributed router vs PyTorch"
        $torch_ref compare --expected "$expected" --actual "$ck/distributed.safetensors" --rtol "$rtol"
        if ! cmp -s "$ck/distributed.safetensors" "$ck/local.safetensors"; then
          echo "FAIL: distributed and local outputs differ"; exit 1
        fi
        echo "distributed output == local output, byte for byte"
      done
    done
    proc_stop_all
  done
}

# Node a serves experts 0-4, node b 4-7 (expert 4 on both) and, where there is one, the shared expert (8).
experts_a=0-4 experts_b=4-7
check mixtral "f32:1e-4 bf16:2e-2 int4:0.15" --naming mixtral --d_model 192 --d_ff 320 --layers 2 --experts 8 \
  --top_k 2 --vocab 300 --dtype f32 --seed 9101
# Qwen3-MoE: experts of moe_intermediate_size, decoder layer 0 dense (skipped; MoE layers 0 and 1 are decoder 1 and 2).
check qwen3 "f32:1e-5 bf16:2e-2" --naming qwen3_moe --norm_topk_prob --d_model 128 --d_ff 96 --layers 3 \
  --dense_layers 1 --experts 8 --top_k 2 --vocab 150 --dtype f32 --seed 9102
# Qwen2-MoE: a shared expert (expert 8, wider than the routed ones) with its sigmoid gate, on node b only.
experts_a=0-4 experts_b=4-8
check qwen2_shared "f32:1e-5 int8:2e-2" --naming qwen2_moe --d_model 96 --d_ff 80 --shared_d_ff 176 --layers 2 \
  --experts 8 --top_k 2 --vocab 150 --dtype f32 --seed 9103
# DeepSeek-V2-Lite-shaped: dense decoder layer 0, ungated shared experts (expert 12) on node b only.
experts_a=0-6 experts_b=6-12
check deepseek_v2 "f32:1e-5" --naming deepseek_v2 --d_model 96 --d_ff 80 --shared_d_ff 160 --layers 3 \
  --dense_layers 1 --experts 12 --top_k 3 --vocab 150 --dtype f32 --seed 9104
# DeepSeek-V3-shaped in block FP8: sigmoid, correction bias, 4 groups keep 2, scaling 2.5; shared expert 16 on node b.
experts_a=0-8 experts_b=8-16
check deepseek_v3 "f32:1e-5" --naming deepseek_v3 --fp8 --norm_topk_prob --d_model 96 --d_ff 64 --shared_d_ff 64 \
  --layers 3 --dense_layers 1 --experts 16 --top_k 4 --n_group 4 --topk_group 2 --routed_scaling_factor 2.5 \
  --vocab 150 --dtype f32 --seed 9105
# gpt-oss: router bias, fused interleaved experts with biases, clamped SwiGLU (limit 1: reached), d_ff 72.
experts_a=0-4 experts_b=4-7
check gpt_oss "f32:1e-5 int8:2e-2" --naming gpt_oss --d_model 96 --d_ff 72 --layers 2 --experts 8 --top_k 4 \
  --swiglu_limit 1 --vocab 150 --dtype f32 --seed 9106
# Llama 4: top-1, the sigmoid score scaling the expert's input, every second layer MoE; shared expert 8 on node b.
experts_a=0-4 experts_b=4-8
check llama4 "f32:1e-5 bf16:2e-2" --naming llama4 --d_model 96 --d_ff 80 --layers 4 --interleave_moe_layer_step 2 \
  --experts 8 --top_k 1 --vocab 150 --dtype f32 --seed 9107
echo "PASS"
