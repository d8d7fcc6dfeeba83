#!/usr/bin/env bash
# colibri-expert as a real process on 127.0.0.1 with port 0: it starts, prints
# its port, reloads on SIGHUP, refuses a bad model with a clear message, and
# drains and exits 0 on SIGTERM; with --log_format json every stderr line is
# one JSON object with a level (a failed SIGHUP reload at ERROR). Every
# process it starts is stopped on exit.
# Usage: expert_node_process.sh BUILD_DIR
set -euo pipefail
build=$1
tmp=$(mktemp -d)
pid=""
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; cat "$tmp/out" "$tmp/err" 2>/dev/null; exit 1; }
# start_node WAIT_TENTHS WHAT ARGS...: colibri-expert ARGS in the background
# (pid in $pid, stdout and stderr in $tmp/out and err), once it printed its
# port. The files are removed first: the background job truncates them only
# after the fork, so a wait could otherwise read an earlier run's port line.
start_node() {
  local tenths=$1 what=$2
  shift 2
  rm -f "$tmp/out" "$tmp/err"
  "$build/expert_node/colibri-expert" "$@" >"$tmp/out" 2>"$tmp/err" &
  pid=$!
  for _ in $(seq 1 "$tenths"); do
    grep -q "listening on port" "$tmp/out" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || fail "colibri-expert exited early ($what)"
    sleep 0.1
  done
  fail "no port printed ($what)"
}

"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 2 --experts 4 --vocab 50 --dtype bf16 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type int8 --progress=false >/dev/null

echo "--- a bad model directory is refused at start with the reason"
if "$build/expert_node/colibri-expert" --model "$tmp/nowhere" 2>"$tmp/err"; then fail "started without a model"; fi
grep -q "manifest" "$tmp/err" || fail "unclear error: $(cat "$tmp/err")"

echo "--- a bad option is named by its flag"
if "$build/expert_node/colibri-expert" --model "$tmp/model" --experts 7-2 2>"$tmp/err"; then fail "started with --experts 7-2"; fi
grep -q -- "(--experts)" "$tmp/err" || fail "error does not name --experts: $(cat "$tmp/err")"
if "$build/expert_node/colibri-expert" --model "$tmp/model" --tls_cert "$tmp/x.crt" --residency=paged 2>"$tmp/err"; then
  fail "started with a certificate and no key"
fi
grep -q -- "(--tls_key)" "$tmp/err" || fail "error does not name --tls_key: $(cat "$tmp/err")"
if "$build/expert_node/colibri-expert" --model "$tmp/model" --residency locked --memory_budget 1000000 2>"$tmp/err"; then
  fail "started with a memory budget and locked weights"
fi
grep -q -- "(--memory_budget)" "$tmp/err" && grep -q -- "(--residency)" "$tmp/err" ||
  fail "error does not name --memory_budget and --residency: $(cat "$tmp/err")"
if "$build/expert_node/colibri-expert" --model "$tmp/model" --residency swapped 2>"$tmp/err"; then
  fail "started with --residency swapped"
fi
grep -q -- "locked, copy, paged" "$tmp/err" || fail "error does not list the residencies: $(cat "$tmp/err")"
if "$build/expert_node/colibri-expert" --model "$tmp/model" --max_queued_calls 0 --residency=paged 2>"$tmp/err"; then
  fail "started with --max_queued_calls 0 (it would refuse every call)"
fi
grep -q -- "(--max_queued_calls) 0 must be at least 1" "$tmp/err" || fail "unclear error: $(cat "$tmp/err")"

echo "--- start, SIGHUP, SIGTERM"
start_node 100 "SIGHUP" --model "$tmp/model" --experts "layer:1/expert:0-1" --listen 127.0.0.1:0 --residency=paged
port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$tmp/out")
[ -n "$port" ] && [ "$port" -gt 0 ] || fail "no port printed"
echo "listening on port $port"
kill -HUP "$pid"
for _ in $(seq 1 100); do grep -q "SIGHUP reload" "$tmp/err" && break; sleep 0.1; done
grep -q "SIGHUP reload: ok" "$tmp/err" || fail "SIGHUP reload did not succeed"
kill -TERM "$pid"
for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then fail "still running 10 s after SIGTERM"; fi
wait "$pid" && status=0 || status=$?
pid=""
[ "$status" -eq 0 ] || fail "exit status $status after SIGTERM"
grep -q "^I.*draining and stopping" "$tmp/err" || fail "no INFO line for the drain: $(cat "$tmp/err")"

echo "--- oneDNN capped at AVX2: the profile is measured, not aborted, and says what became of oneDNN"
# (On AMD oneDNN then has no bf16 matmul; on an Intel Xeon it has one, whose
# bits may depend on the width of a run.)
XDG_CACHE_HOME="$tmp/cache" ONEDNN_MAX_CPU_ISA=AVX2 COLIBRI_MAX_ISA=avx2 COLIBRI_KERNEL_PROFILE= \
  start_node 1200 "oneDNN capped" --model "$tmp/model" --listen 127.0.0.1:0 --residency=paged
if grep -q "defaults (a sanitizer or unoptimized build does not measure" "$tmp/out"; then
  echo "(this build does not measure kernel profiles: it started on the defaults)"
else
  grep -q "kernels avx2: .*measured, cached" "$tmp/out" || fail "no measured profile with oneDNN capped"
  grep -Eq "^evidence (oneDNN not used: |bf16 matmul )" "$tmp/cache"/colibri/kernels-*.txt ||
    fail "the profile does not say what became of oneDNN: $(cat "$tmp/cache"/colibri/kernels-*.txt)"
fi
kill -TERM "$pid"
wait "$pid" || fail "exit status $? after SIGTERM"
pid=""

echo "--- --log_format json: one object per line, levels; a bad format is refused"
if "$build/expert_node/colibri-expert" --model "$tmp/model" --log_format xml 2>"$tmp/err"; then fail "took --log_format xml"; fi
grep -q -- "--log_format 'xml'" "$tmp/err" || fail "unclear error: $(cat "$tmp/err")"
# A directory name that is not UTF-8: the reload error names it, and the line must stay JSON.
model2="$tmp/model"$'\xff'"2"
cp -r "$tmp/model" "$model2"
start_node 100 "json" --model "$model2" --listen 127.0.0.1:0 --residency=paged --log_format json
rm "$model2/manifest.json"  # the SIGHUP reload now fails: an ERROR line
kill -HUP "$pid"
for _ in $(seq 1 100); do grep -q "SIGHUP reload" "$tmp/err" && break; sleep 0.1; done
kill -TERM "$pid"
wait "$pid" || fail "exit status $? after SIGTERM (json)"
pid=""
/usr/bin/python3 - "$tmp/err" <<'PY' || fail "stderr is not one JSON object per line with the expected levels"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8") if l.strip()]
assert all({"time", "level", "thread", "file", "line", "message"} <= set(l) for l in lines), lines
levels = {l["level"] for l in lines if "SIGHUP reload" in l["message"]}
assert levels == {"ERROR"}, lines
assert any(l["level"] == "INFO" and "loaded" in l["message"] for l in lines), lines
print(f"ok: {len(lines)} JSON lines, the failed reload at ERROR")
PY
echo "PASS"
