#!/usr/bin/env bash
# The offline tools as a user runs them: synth -> convert -> validate ->
# reference, then the faults validate and convert must refuse.
# Usage: synth_convert_validate.sh BUILD_DIR
set -euo pipefail
bin=$1/tools
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/colibri-synth" --out "$tmp/ckpt" --naming mixtral --d_model 64 --d_ff 96 --layers 2 --experts 4 \
  --top_k 2 --vocab 100 --dtype bf16 --shards 2 --seed 3
"$bin/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type int4 --balance_loss_weight 100
"$bin/colibri-validate" --model "$tmp/model"
"$bin/colibri-reference" --model "$tmp/model" --tokens 4 --routing gate | tee "$tmp/reference.log"
grep -q "relative L2 error vs reference" "$tmp/reference.log" || fail "no kernel comparison printed"
"$bin/colibri-reference" --model "$tmp/model" --tokens 4 --routing lut --layer 1

echo "--- converting over an existing model without --overwrite must fail"
if "$bin/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" 2>"$tmp/err"; then fail "second convert succeeded"; fi
grep -q -- "--overwrite" "$tmp/err" || fail "no hint to --overwrite: $(cat "$tmp/err")"

echo "--- a flipped byte in a weight file must make validate fail, naming the file"
target="$tmp/model/layer_001/expert_003.bin"
/usr/bin/python3 - "$target" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(5000); b = f.read(1); f.seek(5000); f.write(bytes([b[0] ^ 0xFF]))
PY
if "$bin/colibri-validate" --model "$tmp/model" >"$tmp/validate.log" 2>&1; then fail "validate accepted a flipped byte"; fi
grep "FAIL" "$tmp/validate.log"
grep -q "layer_001/expert_003.bin" "$tmp/validate.log" || fail "validate did not name the file"

echo "--- a reference run on the damaged model must refuse the file"
if "$bin/colibri-reference" --model "$tmp/model" --layer 1 --tokens 64 --routing gate 2>"$tmp/err"; then
  fail "reference ran on a damaged file"
fi
grep -q "checksum" "$tmp/err" || fail "unexpected error: $(cat "$tmp/err")"

echo "--- bad flags are refused"
if "$bin/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/m2" --weight_type int3 2>"$tmp/err"; then fail "int3 accepted"; fi
grep -q "int3" "$tmp/err" || fail "int3 not named"
echo "PASS"
