#!/usr/bin/env bash
# Regenerates tests/data/golden: small colibri-synth checkpoints (fixed seeds),
# inputs, and the outputs of the independent PyTorch MoE block
# (scripts/torch_moe_reference.py) for exact gate routing and for routing by
# each token's embedding. Run after a deliberate change of the synth format;
# the golden files are committed. Usage: scripts/make_golden.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${1:-$root/build}/tools
out=$root/tests/data/golden
torch_ref="/usr/bin/python3 $root/scripts/torch_moe_reference.py"

make_case() {  # name layers synth-args...
  local name=$1 layers=$2; shift 2
  rm -rf "${out:?}/$name"
  "$bin/colibri-synth" --out "$out/$name/checkpoint" "$@"
  $torch_ref make-inputs --checkpoint "$out/$name/checkpoint" --tokens 7 --seed 11 --out "$out/$name/inputs.safetensors"
  for ((layer = 0; layer < layers; layer++)); do
    for routing in gate embedding; do
      $torch_ref forward --checkpoint "$out/$name/checkpoint" --inputs "$out/$name/inputs.safetensors" \
        --layer "$layer" --routing "$routing" --out "$out/$name/expected_${routing}_layer${layer}.safetensors"
    done
  done
}

make_case mixtral_f32 2 --naming mixtral --d_model 48 --d_ff 80 --layers 2 --experts 4 --top_k 2 --vocab 64 \
  --dtype f32 --seed 101
make_case olmoe_bf16 1 --naming olmoe --d_model 64 --d_ff 96 --layers 1 --experts 8 --top_k 3 --vocab 50 \
  --dtype bf16 --seed 202 --shards 2
du -sh "$out"/*
