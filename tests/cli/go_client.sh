#!/usr/bin/env bash
# The Go client (clients/go) against a real distributed router: go vet is
# clean, the package's tests pass against the router (COLIBRI_ROUTER), the
# proxyless package's answers are the router's bytes (COLIBRI_NODES), and
# the decode example runs; when the C++ example is built, both examples print
# the same bytes. Builds offline in GOPATH mode (clients/go/build.sh) under
# BUILD_DIR/go. Exits 77 (skipped) when go is not installed.
# Usage: go_client.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
command -v go >/dev/null || { echo "SKIP: go is not installed (Debian: golang-go)"; exit 77; }
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs
fail() { echo "FAIL: $*"; exit 1; }
# The proxyless package links libcolibri.so; a sanitizer build's cannot be
# loaded by a Go program (the sanitizer runtime must come first), so there it
# is left out.
lib=$build/router_node
if grep -q -- '-fsanitize' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "--- a sanitizer build: the proxyless Go package (colibri/direct) is not tested here"
  lib=$build/no-libcolibri-for-go
else
  [ -f "$lib/libcolibri.so" ] || fail "no $lib/libcolibri.so: the proxyless Go package cannot be tested"
fi
go_build() { COLIBRI_GO_DIR=$build/go COLIBRI_LIB_DIR=$lib "$src/clients/go/build.sh" "$@"; }

echo "--- a tiny bf16 model, two expert nodes (expert 2 on both), a router"
"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 2 --experts 4 --vocab 50 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false >/dev/null
node=$build/expert_node/colibri-expert
proc_start node_a "$node" --model "$tmp/model" --experts 0-2 --listen 127.0.0.1:0 --residency=paged --threads 1
port_a=$port
proc_start node_b "$node" --model "$tmp/model" --experts 2-3 --listen 127.0.0.1:0 --residency=paged --threads 1
port_b=$port
proc_start router "$build/router_node/colibri-router" --model "$tmp/model" \
  --experts_at "127.0.0.1:$port_a,127.0.0.1:$port_b" --listen 127.0.0.1:0
router=127.0.0.1:$port
proc_wait_serving "$build/tools/colibri-health" "$router"

echo "--- go vet"
go_build vet || fail "go vet"

echo "--- go test against $router (and proxyless, against the nodes)"
COLIBRI_MODEL=$tmp/model COLIBRI_NODES=127.0.0.1:$port_a,127.0.0.1:$port_b go_build test "$router" -v \
  >"$tmp/test.out" 2>&1 || { cat "$tmp/test.out"; fail "go test"; }
grep -E '^(--- |ok|PASS|FAIL)' "$tmp/test.out"
! grep -q -- '--- SKIP' "$tmp/test.out" || fail "tests skipped although COLIBRI_ROUTER is set"

echo "--- the decode example"
go_build example -o "$tmp/go-decode-example" || fail "building the example"
for routing in lut gate; do
  "$tmp/go-decode-example" --router "$router" --steps 3 --routing "$routing" >"$tmp/go.$routing" ||
    fail "the Go example (--routing $routing) failed"
  cat "$tmp/go.$routing"
  [ "$(grep -c '^step ' "$tmp/go.$routing")" = 3 ] || fail "the Go example printed no 3 steps"
done
"$tmp/go-decode-example" --router "$router" --steps 3 >"$tmp/go.again"
cmp -s "$tmp/go.lut" "$tmp/go.again" || fail "two runs of the Go example differ"

cpp=$build/clients/cpp/colibri-decode-example
if [ -x "$cpp" ]; then
  echo "--- the C++ example prints the same bytes"
  for routing in lut gate; do
    "$cpp" --router "$router" --steps 3 --routing "$routing" >"$tmp/cpp.$routing" ||
      fail "the C++ example (--routing $routing) failed"
    diff "$tmp/cpp.$routing" "$tmp/go.$routing" || fail "the Go and C++ examples differ (--routing $routing)"
  done
  echo "ok: identical"
else
  echo "--- no $cpp: the C++ comparison is skipped"
fi
echo "PASS"
