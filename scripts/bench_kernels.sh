#!/usr/bin/env bash
# The kernels benchmark of docs/PERFORMANCE.md, side by side with PyTorch in
# the same run: builds, synthesizes a full Mixtral-8x7B-shaped MoE layer
# (d_model 4096, d_ff 14336, 8 experts, top-2; cached in the work dir),
# converts it to each weight type, runs `colibri-bench kernels` on each, then
# times the same layer with PyTorch (scripts/bench_torch.py), and prints the
# bandwidth it measured before and after; last, one line per kernel target
# (docs/PERFORMANCE.md) with what this run measured and whether it was met
# (scripts/kernel_targets.py).
#
# Usage: bash scripts/bench_kernels.sh [--types bf16,int8,int4,f32] [--tokens 1,8,32,128]
#                                      [--repeat 30] [--torch_dtypes bf16] [--small]
# --small runs a d_model 1024 / d_ff 2816 layer instead (quick smoke run).
# Work files: ${COLIBRI_BENCH_DIR:-build/bench} (needs ~10 GB of disk for all types).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
types=bf16,int8,int4
tokens=1,8,32,128
repeat=30
torch_dtypes=bf16
shape=(--d_model 4096 --d_ff 14336)
torch_shape=(--d_model 4096 --d_ff 14336)
name=mixtral_8x7b_layer
while [ $# -gt 0 ]; do
  case "$1" in
    --types) types=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --torch_dtypes) torch_dtypes=$2; shift 2 ;;
    --small) shape=(--d_model 1024 --d_ff 2816); torch_shape=(--d_model 1024 --d_ff 2816); name=small_layer; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "bench_kernels: unknown argument $1" >&2; exit 2 ;;
  esac
done

build=${COLIBRI_BUILD_DIR:-$root/build}
bin=$build/tools
source "$root/scripts/bench_lib.sh"
bench_build

run_all() {
  echo "# machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%Y-%m-%dT%H:%MZ)"
  for type in ${types//,/ }; do
    bench_layer "$name" "$type" "${shape[@]}"
    "$bin/colibri-bench" kernels --model "$bench_model" --tokens "$tokens" --repeat "$repeat" | tee "$run_out"
    if [ "$type" = int8 ] || [ "$type" = int4 ]; then
      echo "# the same, without tiles (the block kernels for every T):"
      "$bin/colibri-bench" kernels --model "$bench_model" --tokens "$tokens" --repeat "$repeat" --dequant_min_tokens 0 \
        --single_expert=false | grep -v '^#'
    fi
    if [ "$type" = bf16 ] || [ "$type" = f32 ]; then
      echo "# the same, oneDNN for every T (default: hand-written kernels only):"
      "$bin/colibri-bench" kernels --model "$bench_model" --tokens "$tokens" --repeat "$repeat" --onednn_min_tokens 1 \
        --single_expert=false | grep -v '^#'
      # AMX rows where this process uses the tiles (its kernels line says so),
      # not merely where the CPU lists them: a refused tile state, a failed
      # self-check or COLIBRI_MAX_ISA leave the tile kernels out.
      if [ "$type" = bf16 ] && grep -q "bf16 on AMX tiles" "$run_out"; then
        echo "# the same, AMX tiles for every T (oneDNN never):"
        "$bin/colibri-bench" kernels --model "$bench_model" --tokens "$tokens" --repeat "$repeat" --amx_min_tokens 1 \
          --onednn_min_tokens 0 --single_expert=false | grep -v '^#'
        echo "# the same, never AMX tiles:"
        "$bin/colibri-bench" kernels --model "$bench_model" --tokens "$tokens" --repeat "$repeat" --amx_min_tokens 0 \
          --onednn_min_tokens 0 --single_expert=false | grep -v '^#'
      elif [ "$type" = bf16 ]; then
        echo "# AMX tiles: not available ($(sed -n 's/.*AMX tiles not available: \([^;]*\).*/\1/p' "$run_out" | head -1)): no AMX rows"
      fi
    fi
  done
  echo "# PyTorch baseline, same layer shape, same thread count:"
  /usr/bin/python3 "$root/scripts/bench_torch.py" "${torch_shape[@]}" --experts 8 --top_k 2 --tokens "$tokens" \
    --dtypes "$torch_dtypes" --threads "$(nproc)" --repeat "$repeat" --routing gate
}

# Everything above, then the targets judged from it (scripts/kernel_targets.py),
# also when a part failed (e.g. no PyTorch: its comparisons are "not measured").
log=$(mktemp)
run_out=$(mktemp)  # the current default run's output, for its kernels line
trap 'rm -f "$log" "$run_out"' EXIT
set +e  # (run_all stops at its first failure: errexit holds in its subshell)
(set -e; run_all) 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
/usr/bin/python3 "$root/scripts/kernel_targets.py" "$log"
targets=$?
[ "$status" = 0 ] && status=$targets
exit "$status"
