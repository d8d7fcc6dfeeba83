#!/usr/bin/env bash
# Regenerates tests/data/golden: small colibri-synth checkpoints (fixed seeds,
# one per model family),
# inputs, and the outputs of the independent PyTorch MoE block
# (scripts/torch_moe_reference.py) for exact gate routing and for routing by
# each token's embedding. Run after a deliberate change of the synth format;
# the golden files are committed. Usage: scripts/make_golden.sh [BUILD_DIR [CASE...]]
# (with CASEs, only those are regenerated).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${1:-$root/build}/tools
out=$root/tests/data/golden
torch_ref="/usr/bin/python3 $root/scripts/torch_moe_reference.py"

only=("${@:2}")
make_case() {  # name synth-args...; one expected file per MoE layer L (decoder layer hf_layers[L]) and routing
  local name=$1; shift
  if [ ${#only[@]} -gt 0 ] && [[ ! " ${only[*]} " =~ " $name " ]]; then return; fi
  rm -rf "${out:?}/$name"
  "$bin/colibri-synth" --out "$out/$name/checkpoint" "$@" >/dev/null
  $torch_ref make-inputs --checkpoint "$out/$name/checkpoint" --tokens 7 --seed 11 --out "$out/$name/inputs.safetensors"
  # The MoE layers are the decoder layers with a gate / router tensor, ascending.
  local hf_layers
  hf_layers=$(/usr/bin/python3 - "$out/$name/checkpoint" <<'PY'
import json, os, re, sys
d = sys.argv[1]
names = set()
for f in os.listdir(d):
    if f.endswith(".safetensors"):
        with open(os.path.join(d, f), "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            names |= set(json.loads(fh.read(n)))
layers = sorted({int(m.group(1)) for n in names
                 for m in [re.search(r"model\.layers\.(\d+)\.(block_sparse_moe\.gate|mlp\.gate|mlp\.router|feed_forward\.router)\.weight$", n)] if m})
print(" ".join(map(str, layers)))
PY
)
  local layer=0
  for hf_layer in $hf_layers; do
    for routing in gate embedding; do
      $torch_ref forward --checkpoint "$out/$name/checkpoint" --inputs "$out/$name/inputs.safetensors" \
        --layer "$hf_layer" --routing "$routing" --out "$out/$name/expected_${routing}_layer${layer}.safetensors"
    done
    layer=$((layer + 1))
  done
}

make_case mixtral_f32 --naming mixtral --d_model 48 --d_ff 80 --layers 2 --experts 4 --top_k 2 --vocab 64 \
  --dtype f32 --seed 101
make_case olmoe_bf16 --naming olmoe --d_model 64 --d_ff 96 --layers 1 --experts 8 --top_k 3 --vocab 50 \
  --dtype bf16 --seed 202 --shards 2
# One case per further family, each with what sets it apart.
make_case qwen2_shared_bf16 --naming qwen2_moe --d_model 48 --d_ff 40 --shared_d_ff 88 --layers 1 --experts 6 \
  --top_k 2 --vocab 40 --dtype bf16 --seed 303
make_case qwen3_dense_bf16 --naming qwen3_moe --norm_topk_prob --d_model 64 --d_ff 48 --layers 2 --dense_layers 1 \
  --experts 8 --top_k 2 --vocab 40 --dtype bf16 --seed 404
make_case deepseek_v2_bf16 --naming deepseek_v2 --d_model 48 --d_ff 32 --shared_d_ff 64 --layers 2 \
  --dense_layers 1 --experts 8 --top_k 2 --n_group 4 --topk_group 2 --routed_scaling_factor 16 --vocab 40 \
  --dtype bf16 --seed 505
make_case deepseek_v3_fp8 --naming deepseek_v3 --fp8 --norm_topk_prob --d_model 136 --d_ff 48 --shared_d_ff 48 \
  --layers 2 --dense_layers 1 --experts 8 --top_k 2 --n_group 4 --topk_group 2 --routed_scaling_factor 2.5 \
  --vocab 40 --dtype bf16 --seed 606
make_case gpt_oss_bf16 --naming gpt_oss --d_model 48 --d_ff 40 --layers 1 --experts 6 --top_k 3 --swiglu_limit 1 \
  --vocab 40 --dtype bf16 --seed 707
make_case llama4_bf16 --naming llama4 --d_model 48 --d_ff 40 --layers 2 --interleave_moe_layer_step 2 --experts 6 \
  --top_k 1 --vocab 40 --dtype bf16 --seed 808
du -sh "$out"/*
