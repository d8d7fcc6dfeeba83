#!/usr/bin/env bash
# Regenerates the Go protobuf and gRPC code in clients/go/colibriv1/ from
# proto/colibri/v1/*.proto. The files are committed, so building the client
# needs neither protoc nor the plugins; run this after changing a .proto.
#
# Needs protoc and the plugins protoc-gen-go and protoc-gen-go-grpc on PATH
# (Debian: protobuf-compiler, protoc-gen-go, protoc-gen-go-grpc). The protos'
# go_package is github.com/colibri-moe/colibri/clients/go/colibriv1, and
# `module=` strips the module path so the files land in clients/go/colibriv1/.
# Usage: clients/go/gen.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
proto_dir=$(cd "$here/../../proto" && pwd)
module=github.com/colibri-moe/colibri/clients/go

rm -f "$here"/colibriv1/*.pb.go
protoc -I "$proto_dir" \
  --go_out="$here" --go_opt=module="$module" \
  --go-grpc_out="$here" --go-grpc_opt=module="$module" \
  "$proto_dir"/colibri/v1/*.proto
ls "$here"/colibriv1/
