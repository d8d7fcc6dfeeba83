#!/usr/bin/env bash
# The README's main job on a tiny model, as a user runs it: scripts/demo.sh
# starts two expert nodes and a router, drives them, checks samples against
# the reference layer, writes a Chrome trace, and stops everything. Then the
# same demo is interrupted (SIGINT to its process group, as Ctrl-C does)
# while the benchmark runs: no process may remain either way.
# Usage: demo.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'pkill -KILL -f "$tmp/" 2>/dev/null || true; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export COLIBRI_BUILD_DIR=$build

echo "--- the demo, start to end"
COLIBRI_DEMO_DIR=$tmp/run bash "$src/scripts/demo.sh" --tiny --skip-deps --skip-build --duration 2 >"$tmp/out" 2>&1 ||
  { cat "$tmp/out"; fail "demo failed"; }
for needle in "latency per layer call (us): p50" "throughput:" "vs the reference MoE layer: max relative L2 error" \
              "): OK" "trace: $tmp/run/trace.json" "step 2 token" "stopped router" "demo finished"; do
  grep -qF -- "$needle" "$tmp/out" || { cat "$tmp/out"; fail "output lacks '$needle'"; }
done
grep -q "stopped .*exit status [^0]" "$tmp/out" && { cat "$tmp/out"; fail "a server did not exit 0"; }
/usr/bin/python3 - "$tmp/run/trace.json" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["args"]["name"] for e in events if e["ph"] == "M"}
spans = [e for e in events if e["ph"] == "X"]
assert all(isinstance(e["ts"], (int, float)) and e["dur"] > 0 for e in spans), "bad span"
stages = {e["name"] for e in spans if e["pid"] == 2}
assert {"route", "dispatch", "aggregate"} <= stages, stages
nodes = [n for n in names if n.startswith("node ")]
assert len(nodes) == 2, names
print(f"trace: {len(spans)} spans; processes {sorted(names)}; router stages {sorted(stages)}")
PY
pgrep -f "$tmp/run/" && fail "processes remain after the demo"
echo "ok: demo output, trace, and no process left"

echo "--- Ctrl-C in the middle"
setsid bash -c "COLIBRI_DEMO_DIR=$tmp/int exec bash $src/scripts/demo.sh --tiny --skip-deps --skip-build --duration 60" \
  >"$tmp/int.out" 2>&1 &
demo=$!
for _ in $(seq 1 300); do grep -q "=== drive the router" "$tmp/int.out" && break; sleep 0.1; done
grep -q "=== drive the router" "$tmp/int.out" || { cat "$tmp/int.out"; fail "demo did not reach the benchmark"; }
sleep 1
kill -INT -- -"$demo"
for _ in $(seq 1 150); do kill -0 "$demo" 2>/dev/null || break; sleep 0.1; done
kill -0 "$demo" 2>/dev/null && fail "demo still running 15 s after SIGINT"
sleep 0.5
if pgrep -f "$tmp/int/"; then fail "processes remain after Ctrl-C"; fi
echo "ok: interrupted demo left no process"
echo "PASS"
