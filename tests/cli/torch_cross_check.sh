#!/usr/bin/env bash
# Cross-checks the C++ reference MoE layer against the independent PyTorch
# computation (scripts/torch_moe_reference.py) on checkpoints made here with
# seeds the golden vectors do not use, in both namings and both routings.
# Exits 77 (ctest: skipped) only when Debian's torch is not installed.
# Usage: torch_cross_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
bin=$1/tools
torch_ref="/usr/bin/python3 $2/scripts/torch_moe_reference.py"
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 cannot import torch (scripts/install-deps.sh installs python3-torch)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

check() {  # name synth-args... ; then weight types to test come from $types
  local name=$1; shift
  "$bin/colibri-synth" --out "$tmp/$name/ckpt" "$@" > /dev/null
  $torch_ref make-inputs --checkpoint "$tmp/$name/ckpt" --tokens 9 --seed 4242 --out "$tmp/$name/in.safetensors"
  for spec in $types; do
    local type=${spec%%:*} rtol=${spec##*:}
    "$bin/colibri-convert" --checkpoint "$tmp/$name/ckpt" --out "$tmp/$name/$type" --weight_type "$type" --progress=false > /dev/null
    # MoE layer L of the model directory is decoder layer hf_layers[L] of the checkpoint (dense ones skipped).
    local hf_layers
    hf_layers=$(/usr/bin/python3 -c "import json,sys; print(' '.join(map(str, json.load(open(sys.argv[1]))['hf_layers'])))" \
      "$tmp/$name/$type/manifest.json")
    local layer=0
    for hf_layer in $hf_layers; do
      for routing in gate lut; do
        local torch_routing=$routing
        [ "$routing" = lut ] && torch_routing=embedding
        $torch_ref forward --checkpoint "$tmp/$name/ckpt" --inputs "$tmp/$name/in.safetensors" --layer "$hf_layer" \
          --routing "$torch_routing" --out "$tmp/$name/torch.safetensors" > /dev/null
        "$bin/colibri-reference" --model "$tmp/$name/$type" --layer "$layer" --routing "$routing" \
          --inputs "$tmp/$name/in.safetensors" --output "$tmp/$name/colibri.safetensors" > /dev/null
        echo "== $name stored as $type, layer $layer (decoder layer $hf_layer), routing $routing (rtol $rtol)"
        $torch_ref compare --expected "$tmp/$name/torch.safetensors" --actual "$tmp/$name/colibri.safetensors" --rtol "$rtol"
      done
      layer=$((layer + 1))
    done
  done
}

types="f32:1e-5 int8:2e-2 int4:0.15"
check mixtral_f32 --naming mixtral --d_model 192 --d_ff 320 --layers 2 --experts 8 --top_k 2 --vocab 300 \
  --dtype f32 --seed 9001 --shards 2
types="bf16:1e-5 f32:1e-5 f16:5e-3"
check olmoe_bf16 --naming olmoe --d_model 128 --d_ff 192 --layers 1 --experts 64 --top_k 8 --vocab 200 \
  --dtype bf16 --seed 9002
types="bf16:1e-5"
check qwen_bf16 --naming qwen2_moe --norm_topk_prob --d_model 96 --d_ff 160 --layers 1 --experts 16 --top_k 4 \
  --vocab 120 --dtype bf16 --seed 9003
# Qwen2-MoE with its shared expert (wider than the routed ones) and the shared expert's sigmoid gate.
types="f32:1e-5 int8:2e-2"
check qwen2_shared --naming qwen2_moe --d_model 96 --d_ff 80 --shared_d_ff 176 --layers 2 --experts 8 --top_k 2 \
  --vocab 120 --dtype bf16 --seed 9005
# DeepSeek-V2-Lite-shaped: greedy softmax routing, not renormalized, two shared experts (one MLP, ungated),
# decoder layer 0 dense (first_k_dense_replace).
types="f32:1e-5 int4:0.15"
check deepseek_v2 --naming deepseek_v2 --d_model 96 --d_ff 80 --shared_d_ff 160 --layers 3 --dense_layers 1 \
  --experts 12 --top_k 3 --vocab 120 --dtype bf16 --seed 9006
# DeepSeek-V2 with group-limited greedy routing (group score = max) and a routed scaling factor.
types="f32:1e-5"
check deepseek_v2_groups --naming deepseek_v2 --d_model 96 --d_ff 64 --shared_d_ff 128 --layers 2 --dense_layers 1 \
  --experts 16 --top_k 4 --n_group 4 --topk_group 2 --routed_scaling_factor 16 --vocab 120 --dtype bf16 --seed 9007
# DeepSeek-V3-shaped: sigmoid scores, correction bias, groups by their top-two sum, renormalized and scaled.
types="f32:1e-5 bf16:2e-2"
check deepseek_v3 --naming deepseek_v3 --norm_topk_prob --d_model 96 --d_ff 64 --shared_d_ff 64 --layers 3 \
  --dense_layers 1 --experts 16 --top_k 4 --n_group 4 --topk_group 2 --routed_scaling_factor 2.5 --vocab 120 \
  --dtype bf16 --seed 9008
# The same in DeepSeek-V3's block FP8 (d_model 160: a ragged second 128-column block), dequantized exactly.
types="f32:1e-5 int8:2e-2"
check deepseek_v3_fp8 --naming deepseek_v3 --fp8 --norm_topk_prob --d_model 160 --d_ff 96 --shared_d_ff 96 \
  --layers 2 --dense_layers 1 --experts 16 --top_k 4 --n_group 4 --topk_group 2 --routed_scaling_factor 2.5 \
  --vocab 120 --dtype bf16 --seed 9009
# Qwen3-MoE: moe_intermediate_size differs from intermediate_size, and decoder layer 0 is dense (mlp_only_layers).
types="bf16:1e-5 int8:2e-2"
check qwen3_bf16 --naming qwen3_moe --norm_topk_prob --d_model 128 --d_ff 96 --layers 3 --dense_layers 1 \
  --experts 16 --top_k 4 --vocab 150 --dtype bf16 --seed 9004
# gpt-oss: router bias, softmax over the top-k logits, fused interleaved gate_up_proj with biases, clamped
# SwiGLU (swiglu_limit 1 so the clamp is reached), d_ff 72 (not a multiple of 64).
types="f32:1e-5 bf16:1e-5 int8:2e-2"
check gpt_oss --naming gpt_oss --d_model 96 --d_ff 72 --layers 2 --experts 8 --top_k 4 --swiglu_limit 1 \
  --vocab 120 --dtype bf16 --seed 9010
# Llama 4 (multimodal layout, language_model.): top-1 by logit, sigmoid of it scaling the expert's input, fused
# gate_up_proj in halves, the shared expert; every second decoder layer MoE (interleave_moe_layer_step 2).
types="f32:1e-5 bf16:1e-5 int4:0.15"
check llama4 --naming llama4 --d_model 96 --d_ff 80 --layers 4 --interleave_moe_layer_step 2 --experts 8 --top_k 1 \
  --vocab 120 --dtype bf16 --seed 9011
echo "PASS"
