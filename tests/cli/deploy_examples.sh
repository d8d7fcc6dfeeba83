#!/usr/bin/env bash
# deploy/examples: run-local.sh brings up a router and expert nodes on this
# host (one per socket, or --nodes N) until the router serves every expert
# (a shared one included),
# then stops them; the systemd units name binaries and flags that exist
# (systemd-analyze verify where systemd is installed).
# Usage: deploy_examples.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d)
trap 'pkill -KILL -f "$tmp/" 2>/dev/null || true; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# With a shared expert: it must be served too (the router serves only when every expert has a node).
"$build/tools/colibri-synth" --out "$tmp/ckpt" --naming qwen2_moe --d_model 64 --d_ff 96 --shared_d_ff 64 --layers 2 \
  --experts 4 --vocab 50 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false >/dev/null
echo "--- run-local.sh with 2 nodes"
COLIBRI_BUILD_DIR=$build bash "$src/deploy/examples/run-local.sh" --model "$tmp/model" --nodes 2 --router_port 0 \
  --base_port 0 --ready_only > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "run-local.sh failed"; }
cat "$tmp/out"
grep -q "serving every expert" "$tmp/out" || fail "not serving"
pgrep -f "$tmp/model" && fail "processes remain"

echo "--- systemd units"
for unit in "$src"/deploy/examples/systemd/*.service; do
  for section in '\[Unit\]' '\[Service\]' '\[Install\]'; do grep -q "^$section" "$unit" || fail "$unit lacks $section"; done
  exec_line=$(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | tr -d '\\\n')
  binary=$(grep -o '/usr/local/bin/colibri-[a-z]*' <<<"$exec_line" | head -1)
  [ -x "$build/$(basename "$binary" | sed 's/colibri-expert/expert_node\/colibri-expert/; s/colibri-router/router_node\/colibri-router/')" ] ||
    fail "$unit runs $binary, which the build does not make"
  help=$("$build/$(basename "$binary" | sed 's/colibri-expert/expert_node\/colibri-expert/; s/colibri-router/router_node\/colibri-router/')" --help 2>&1 || true)
  for flag in $(grep -o -- ' --[a-z_]*' <<<"${exec_line#*$binary}"); do
    grep -q -- "$flag " <<<"$help" || fail "$unit: $binary has no flag $flag"
  done
  if command -v systemd-analyze >/dev/null && [ -d /run/systemd/system ]; then
    systemd-analyze verify "$unit" || fail "systemd-analyze verify $unit"
  fi
  echo "ok: $(basename "$unit")"
done
command -v systemd-analyze >/dev/null && [ -d /run/systemd/system ] || echo "skipped: systemd-analyze verify (no systemd running here)"
echo "PASS"
