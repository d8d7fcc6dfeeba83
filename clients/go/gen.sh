#!/usr/bin/env bash
# Regenerates the Go protobuf and gRPC code in clients/go/colibriv1/ from
# proto/colibri/v1/*.proto. The files are committed, so building the client
# needs neither protoc nor the plugins; run this after changing a .proto.
#
# Needs protoc and the plugins protoc-gen-go and protoc-gen-go-grpc on PATH
# (Debian: protobuf-compiler, protoc-gen-go, protoc-gen-go-grpc). The protos'
# go_package is github.com/colibri-moe/colibri/clients/go/colibriv1, and
# `module=` strips the module path so the files land in clients/go/colibriv1/.
# tests/cli/proto_generated.sh regenerates into a scratch directory and fails
# if the committed files differ.
# Usage: clients/go/gen.sh [OUT_DIR]   (default: clients/go, i.e. in place)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
proto_dir=$(cd "$here/../../proto" && pwd)
module=github.com/colibri-moe/colibri/clients/go

mkdir -p "$out/colibriv1"
rm -f "$out"/colibriv1/*.pb.go
protoc -I "$proto_dir" \
  --go_out="$out" --go_opt=module="$module" \
  --go-grpc_out="$out" --go-grpc_opt=module="$module" \
  "$proto_dir"/colibri/v1/*.proto
ls "$out"/colibriv1/*.pb.go
