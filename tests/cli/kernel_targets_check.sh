#!/usr/bin/env bash
# scripts/kernel_targets.py, the verdicts bench_kernels.sh ends with:
# 1. on `colibri-bench kernels` output of this build (a tiny model, every
#    type), it finds the default layer rows the targets without PyTorch read
#    (T=1 and T=128); the PyTorch comparisons are "not measured" there;
# 2. on two logs of known figures, the second with each judged figure moved
#    across its threshold, each verdict is the one the figures give (the AMX
#    and the non-AMX T=128 target alike);
# 3. a log without Colibri rows exits 2.
# No timing is judged.
# Usage: kernel_targets_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
targets() { /usr/bin/python3 "$src/scripts/kernel_targets.py" "$@"; }
# verdict LOG TARGET STATUS: the line of TARGET ends with STATUS.
verdict() {
  local line
  line=$(grep -F -- "$2" "$1") || fail "no line for '$2' in $(cat "$1")"
  [[ "$line" =~ \ \ $3$ ]] || fail "'$2': expected '$3', got: $line"
}

# 1. This build's output format.
"$build/tools/colibri-synth" --out "$tmp/ckpt" --naming mixtral --d_model 128 --d_ff 256 --layers 1 --experts 8 \
  --top_k 2 --vocab 100 --dtype bf16 --seed 5 >/dev/null
for type in bf16 int8 int4; do
  "$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/$type" --weight_type "$type" \
    --progress=false >/dev/null
  "$build/tools/colibri-bench" kernels --model "$tmp/$type" --tokens 1,8,32,128 --repeat 3 >>"$tmp/real.log" 2>&1
done
targets "$tmp/real.log" >"$tmp/real.txt"
cat "$tmp/real.txt"
grep -q "from this run (d_model 128, d_ff 256)" "$tmp/real.txt" || fail "no shape in the header"
[ "$(grep -c '^#   ' "$tmp/real.txt")" = 13 ] || fail "expected 13 targets"
verdict "$tmp/real.txt" "T=8 int4 >= 2x PyTorch bf16" "not measured"
for target in "T=1 bf16" "T=1 int4" "T=1 int8" "T=128 int8 at least" "T=128 int4 at least" "p99 <="; do
  if grep -F -- "$target" "$tmp/real.txt" | grep -q "not measured"; then fail "'$target' not found in the real log"; fi
done

# 2. Known figures. Columns: impl dtype case T median p99 p99/p50 GB/s frac_bw
# GFLOP/s MB_read floor_ms x_floor; PyTorch: impl dtype T samples median p90
# p99 max GB/s GFLOP/s. Rows after "# the same" lines are not the defaults.
row() { echo "colibri  $1  layer  $2  $3  $4  1.00  30.0  $5  10.0  100.0  1.000  $6"; }
# known_log A|B: B moves each judged figure across its threshold from A.
known_log() {
  local b=$([ "$1" = B ] && echo 1 || echo 0)
  pick() { if [ "$b" = 1 ]; then echo "$2"; else echo "$1"; fi; }
  echo "# model m/bf16 layer 0: mixtral, 8 experts, top-2, d_model 4096, d_ff 14336, bf16 weights"
  row bf16 1 10.0 12.0 "$(pick 0.90 0.89)" 1.05
  row bf16 8 "$(pick 50.0 50.1)" 55.0 0.1 -
  row bf16 32 "$(pick 60.0 61.0)" 62.0 0.1 -
  row bf16 128 200.0 210.0 0.1 1.25
  echo "# the same, oneDNN for every T (default: hand-written kernels only):"
  row bf16 128 1.0 1.0 0.1 -
  echo "# model m/int8 layer 0: mixtral, 8 experts, top-2, d_model 4096, d_ff 14336, int8 weights"
  row int8 1 10.0 12.0 "$(pick 0.84 0.85)" 1.20
  row int8 8 "$(pick 51.0 50.0)" 52.0 0.1 -
  row int8 32 40.0 41.0 0.1 -
  row int8 128 "$(pick 201.0 200.0)" 202.0 0.1 -
  echo "# model m/int4 layer 0: mixtral, 8 experts, top-2, d_model 4096, d_ff 14336, int4 weights"
  row int4 1 10.0 "$(pick 14.0 13.0)" "$(pick 0.80 0.79)" 1.20
  row int4 8 20.0 21.0 0.1 -
  row int4 32 40.0 41.0 0.1 -
  row int4 128 "$(pick 200.0 200.1)" 201.0 0.1 -
  echo "impl  dtype  T  samples  median_ms  p90_ms  p99_ms  max_ms  GB/s  GFLOP/s"
  for t in "1 30.0" "8 100.0" "32 120.0" "128 $(pick 300.0 299.0)"; do
    set -- $t
    echo "torch  bf16  $1  20  $2  1.0  1.0  1.0  1.00  1.00"
  done
}
known_log A >"$tmp/known.log"
targets "$tmp/known.log" >"$tmp/known.txt"
cat "$tmp/known.txt"
verdict "$tmp/known.txt" "T=1 bf16 >= 0.90" "met"
verdict "$tmp/known.txt" "T=1 int8 >= 0.85" "not met"
verdict "$tmp/known.txt" "T=1 int4 >= 0.80" "met"
grep -F "T=1 bf16" "$tmp/known.txt" | grep -q "0.900, 0.952 per call" || fail "per-call fraction not 1 / x_floor"
verdict "$tmp/known.txt" "T=128 bf16 >= 1.5x PyTorch (no AMX)" "met"  # 300 / 200
verdict "$tmp/known.txt" "T=8 bf16 >= 2x" "met"                        # 100 / 50
verdict "$tmp/known.txt" "T=8 int8 >= 2x" "not met"                    # 100 / 51
verdict "$tmp/known.txt" "T=32 bf16 >= 2x" "met"                       # 120 / 60
verdict "$tmp/known.txt" "T=128 int8 at least as fast as bf16" "not met"
verdict "$tmp/known.txt" "T=128 int4 at least as fast as bf16" "met"  # equal
verdict "$tmp/known.txt" "p99 <= 1.3x p50" "not met"                  # int4 T=1: 1.4
grep -F "p99 <=" "$tmp/known.txt" | grep -q "1.00-1.40" || fail "p99/p50 range"
known_log B >"$tmp/moved.log"
targets "$tmp/moved.log" >"$tmp/moved.txt"
cat "$tmp/moved.txt"
verdict "$tmp/moved.txt" "T=1 bf16 >= 0.90" "not met"
verdict "$tmp/moved.txt" "T=1 int8 >= 0.85" "met"
verdict "$tmp/moved.txt" "T=1 int4 >= 0.80" "not met"
verdict "$tmp/moved.txt" "T=128 bf16 >= 1.5x PyTorch (no AMX)" "not met"  # 299 / 200
verdict "$tmp/moved.txt" "T=8 bf16 >= 2x" "not met"                        # 100 / 50.1
verdict "$tmp/moved.txt" "T=8 int8 >= 2x" "met"                            # 100 / 50
verdict "$tmp/moved.txt" "T=32 bf16 >= 2x" "not met"                       # 120 / 61
verdict "$tmp/moved.txt" "T=128 int8 at least as fast as bf16" "met"       # equal
verdict "$tmp/moved.txt" "T=128 int4 at least as fast as bf16" "not met"
verdict "$tmp/moved.txt" "p99 <= 1.3x p50" "met"                           # at most 1.3
# With the AMX rows, T=128 bf16 is judged against the read time: 1.25 <= 1.3.
sed 's/^# the same, oneDNN for every T.*/# the same, AMX tiles for every T (oneDNN never):/' "$tmp/known.log" >"$tmp/amx.log"
targets "$tmp/amx.log" >"$tmp/amx.txt"
verdict "$tmp/amx.txt" "T=128 bf16 <= 1.3x the time to read its bytes (AMX)" "met"
sed -i 's/^\(colibri  bf16  layer  128 .*\)1.25$/\11.35/' "$tmp/amx.log"
targets "$tmp/amx.log" >"$tmp/amx.txt"
verdict "$tmp/amx.txt" "T=128 bf16 <= 1.3x the time to read its bytes (AMX)" "not met"

# 3. Nothing to judge.
if echo "# nothing" | targets >/dev/null 2>"$tmp/err.txt"; then fail "an empty log was judged"; fi
status=0
echo "# nothing" | targets >/dev/null 2>&1 || status=$?
[ "$status" = 2 ] || fail "exit $status for an empty log, not 2"
grep -q "no default Colibri layer rows" "$tmp/err.txt" || fail "no reason given"
echo "kernel_targets_check: ok"
