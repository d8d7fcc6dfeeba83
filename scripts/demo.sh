#!/usr/bin/env bash
# The main job, from a fresh clone: install dependencies, build, synthesize a
# Mixtral-shaped checkpoint (no download), convert it, validate it, and run the
# reference MoE layer on sample tokens, printing each step and its time.
#
# Usage: bash scripts/demo.sh [--weight_type bf16|f32|f16|int8|int4] [--tokens N]
# Work files go to ${COLIBRI_DEMO_DIR:-build/demo} (replaced on each run).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
weight_type=bf16
tokens=8
while [ $# -gt 0 ]; do
  case "$1" in
    --weight_type) weight_type=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

step() {  # step "title" command...
  local title=$1; shift
  echo
  echo "=== $title"
  local start=$EPOCHREALTIME
  "$@"
  awk -v t="$title" -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "=== %s: done in %.2f s\n", t, b - a }'
}

step "install dependencies" bash "$root/scripts/install-deps.sh"
step "build" bash "$root/scripts/build.sh"
bin=${COLIBRI_BUILD_DIR:-$root/build}/tools
work=${COLIBRI_DEMO_DIR:-${COLIBRI_BUILD_DIR:-$root/build}/demo}
if [ -e "$work" ] && [ ! -f "$work/.colibri-demo" ] && [ ! -f "$work/checkpoint/config.json" ]; then
  echo "demo: $work exists and is not a demo directory; set COLIBRI_DEMO_DIR to a new path" >&2
  exit 2
fi
rm -rf "$work"
mkdir -p "$work"
touch "$work/.colibri-demo"

step "synthesize a Mixtral-naming checkpoint (2 MoE layers, d_model 1024, d_ff 2816, 8 experts, top-2, bf16)" \
  "$bin/colibri-synth" --out "$work/checkpoint" --naming mixtral --d_model 1024 --d_ff 2816 --layers 2 \
  --experts 8 --top_k 2 --vocab 32000 --dtype bf16 --shards 2 --seed 1
step "convert to a Colibri model directory ($weight_type weights)" \
  "$bin/colibri-convert" --checkpoint "$work/checkpoint" --out "$work/model" --weight_type "$weight_type" \
  --progress=false
step "validate the model directory" "$bin/colibri-validate" --model "$work/model"
step "reference MoE layer and the optimized expert kernels, LUT routing, $tokens sample tokens, every layer" \
  "$bin/colibri-reference" --model "$work/model" --routing lut --tokens "$tokens"
step "reference MoE layer and the optimized expert kernels, exact gate routing, $tokens sample tokens" \
  "$bin/colibri-reference" --model "$work/model" --routing gate --tokens "$tokens"
echo
echo "demo finished; model directory: $work/model"
