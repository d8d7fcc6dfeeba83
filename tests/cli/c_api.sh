#!/usr/bin/env bash
# The C API end to end: the tools make a tiny model, then the C program
# tests/router_node/c_api_test.c (linked against libcolibri.so) runs on it.
# Usage: c_api.sh BUILD_DIR
set -euo pipefail
build=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 2 --experts 4 --top_k 2 \
  --vocab 100 --dtype bf16 --seed 5 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 \
  --progress=false >/dev/null
"$build/tests/c_api_test" "$tmp/model"
