#!/usr/bin/env bash
# The generated protocol code matches proto/:
# - the Go code committed in clients/go/colibriv1/ equals what clients/go/gen.sh
#   makes from proto/colibri/v1/*.proto now (a .proto changed without
#   regenerating fails here);
# - the C++ messages and gRPC stubs in the build equal what protoc and
#   grpc_cpp_plugin make from proto/ now (the build's generation rule covers
#   every file, with the include paths the code uses).
# Usage: proto_generated.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
for tool in protoc protoc-gen-go protoc-gen-go-grpc grpc_cpp_plugin; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed (scripts/install-deps.sh installs it)"; exit 77; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0

bash "$src/clients/go/gen.sh" "$tmp/go" > /dev/null
for f in "$tmp"/go/colibriv1/*.pb.go; do
  committed=$src/clients/go/colibriv1/$(basename "$f")
  if ! diff -q "$f" "$committed" > /dev/null 2>&1; then
    echo "FAIL: $committed differs from the generated code (run clients/go/gen.sh):"
    diff -u "$committed" "$f" | head -20 || true
    status=1
  fi
done
committed_count=$(ls "$src"/clients/go/colibriv1/*.pb.go | wc -l)
generated_count=$(ls "$tmp"/go/colibriv1/*.pb.go | wc -l)
if [ "$committed_count" != "$generated_count" ]; then
  echo "FAIL: clients/go/colibriv1 holds $committed_count .pb.go files; gen.sh makes $generated_count"
  status=1
fi

mkdir -p "$tmp/cpp"
protos=(colibri/v1/tensor.proto colibri/v1/expert_node.proto colibri/v1/router.proto grpc/health/v1/health.proto)
(cd "$src/proto" && protoc -I . --cpp_out="$tmp/cpp" --grpc_out="$tmp/cpp" \
  --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" "${protos[@]}")
for f in $(cd "$tmp/cpp" && find . -name '*.pb.*' | sort); do
  if ! diff -q "$tmp/cpp/$f" "$build/proto/$f" > /dev/null 2>&1; then
    echo "FAIL: $build/proto/$f differs from protoc's output for proto/ (or is missing)"
    status=1
  fi
done
listed=$(ls "$src"/proto/colibri/v1/*.proto | wc -l)
if [ "$listed" != 3 ]; then
  echo "FAIL: proto/colibri/v1 has $listed .proto files; this check and proto/CMakeLists.txt list 3"
  status=1
fi
[ "$status" = 0 ] && echo "PASS: generated Go and C++ code match proto/"
exit "$status"
