#!/usr/bin/env bash
# Standard tools against the servers: a reflection-only client (no .proto
# files; tests/cli/reflection_client, built offline against Debian's Go
# packages) describes grpc.health.v1.Health through the server's reflection
# service and calls Health/Check on an expert node and on a router.
# Exits 77 (skipped) when go is not installed.
# Usage: reflection.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
command -v go >/dev/null || { echo "SKIP: go is not installed (Debian: golang-go)"; exit 77; }
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs

mkdir -p "$build/go/cache"
GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS= GOPROXY=off GOCACHE=$build/go/cache \
  nice -n 19 go build -o "$tmp/reflection_client" "$src/tests/cli/reflection_client/main.go"

"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 1 --experts 4 --vocab 50 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/model" --weight_type bf16 --progress=false >/dev/null
proc_start node "$build/expert_node/colibri-expert" --model "$tmp/model" --listen 127.0.0.1:0 --residency=paged --threads 1
node=127.0.0.1:$port
proc_start router "$build/router_node/colibri-router" --model "$tmp/model" --experts_at "$node" --listen 127.0.0.1:0
router=127.0.0.1:$port
proc_wait_serving "$build/tools/colibri-health" "$router"  # its first health round reached the node
for target in "$node" "$router"; do
  out=$("$tmp/reflection_client" "$target" grpc.health.v1.Health/Check)
  echo "$target grpc.health.v1.Health/Check: $out"
  [ "$out" = '{"status":"SERVING"}' ] || { echo "FAIL: expected SERVING"; exit 1; }
done
echo PASS
