#!/usr/bin/env bash
# colibri-router's command line: --help documents every flag defined in
# colibri_router.cc; wrong flag combinations and a bad model exit non-zero
# with a message naming the problem; a distributed router whose node is down
# still starts (its health says NOT_SERVING: router_process_test checks that)
# and drains to exit 0 on SIGTERM.
# Usage: router_cli.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
router=$build/router_node/colibri-router
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs
fail() { echo "FAIL: $*"; exit 1; }

echo "--- --help documents every flag"
"$router" --help >"$tmp/help" 2>&1 || true
for flag in $(sed -n 's/^ABSL_FLAG([^,]*, *\([a-z_0-9]*\),.*/\1/p' "$src/router_node/colibri_router.cc"); do
  grep -q -- "-$flag " "$tmp/help" || grep -q -- "-$flag)" "$tmp/help" || fail "--help does not list --$flag"
done
echo "ok: $(grep -c -- '^    --' "$tmp/help") flags listed"

echo "--- bad command lines"
expect_exit() {  # code needle args...
  local code=$1 needle=$2; shift 2
  set +e; "$router" "$@" >"$tmp/out" 2>"$tmp/err"; local got=$?; set -e
  [ "$got" = "$code" ] || fail "colibri-router $* exited $got, expected $code: $(cat "$tmp/err")"
  grep -q -- "$needle" "$tmp/err" || fail "colibri-router $*: message lacks '$needle': $(cat "$tmp/err")"
  echo "ok: $* -> exit $code: $(head -1 "$tmp/err")"
}
expect_exit 2 "--model or --local is required"
expect_exit 2 "exactly one of" --model "$tmp"
"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 1 --experts 4 --vocab 50 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false >/dev/null
expect_exit 2 "exactly one of" --local "$tmp/model" --experts-at 127.0.0.1:1
expect_exit 1 "manifest.json" --model "$tmp/nowhere" --experts_at 127.0.0.1:1
expect_exit 1 "not host:port" --model "$tmp/model" --experts_at nohostport
expect_exit 1 "(--max_tokens)" --local "$tmp/model" --max_tokens 0
expect_exit 1 "(--max_tokens) 16777216: replies of that many tokens of d_model 64 in f32 with their routes would pass gRPC's 2 GiB message limit (at most 7833704)" \
  --local "$tmp/model" --max_tokens 16777216
# Below what the rows alone allow (8384511), above what they take with their top-2 routes.
expect_exit 1 "(at most 7833704)" --local "$tmp/model" --max_tokens 8000000
expect_exit 1 "(--max_queued_requests) 0 must be at least 1" --local "$tmp/model" --max_queued_requests 0
expect_exit 1 "(--node_timeout_ms) 0 must be positive" --model "$tmp/model" --experts_at 127.0.0.1:1 --node_timeout_ms 0
expect_exit 1 "(--health_interval_ms) -5ms must be positive" --model "$tmp/model" --experts_at 127.0.0.1:1 \
  --health_interval_ms -5
expect_exit 1 "(--node_tls_ca)" --model "$tmp/model" --experts_at 127.0.0.1:1 --node_tls_cert "$tmp/x.crt" \
  --node_tls_key "$tmp/x.key"

echo "--- a node that is down: the router starts anyway (dashed flag names work too) and exits 0 on SIGTERM"
proc_start router "$router" --model "$tmp/model" --experts-at 127.0.0.1:1 --health-interval-ms 100
pid=$last_pid
kill -TERM "$pid"
for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$pid" 2>/dev/null && fail "still running 10 s after SIGTERM"
wait "$pid" && status=0 || status=$?
[ "$status" = 0 ] || fail "exit status $status after SIGTERM"
echo "PASS"
