#!/usr/bin/env bash
# Installs every Debian 12 package Colibri's build, tests and tools need.
# Idempotent: when everything is already installed it changes nothing (and
# skips the package index update); otherwise it runs apt-get update first.
# Needs root (or sudo) for the install.
set -euo pipefail

packages=(
  # build
  build-essential cmake ninja-build pkg-config git openssl
  # libraries: gRPC, protobuf, Abseil, oneDNN, libnuma, and helpers
  libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libdnnl-dev ocl-icd-opencl-dev opencl-headers libnuma-dev nlohmann-json3-dev libxxhash-dev catch2
  prometheus-cpp-dev libgoogle-glog-dev
  # (Debian's oneDNN is built with an OpenCL GPU runtime: its CMake config needs the OpenCL headers)
  # the independent PyTorch reference (golden vectors, cross-checks, baselines)
  python3 python3-numpy python3-torch
  # an independent gRPC client for the router's end-to-end checks (scripts/router_client.py)
  python3-grpcio python3-protobuf
  # the Go client (clients/go), built offline against Debian's Go sources
  golang-go golang-google-grpc-dev golang-google-protobuf-dev protoc-gen-go protoc-gen-go-grpc
  # the Helm chart's tests: render with text/template + Sprig, read YAML
  golang-github-masterminds-sprig-dev golang-gopkg-yaml.v2-dev golang-gopkg-yaml.v3-dev python3-yaml
  # the benchmark scripts: metrics pages, start-up times, the conversion's peak memory, emulated hosts
  curl bc time iproute2
  # libFuzzer targets (scripts/fuzz.sh)
  clang libclang-rt-14-dev libfuzzer-14-dev
)
# Node.js (for the Kubernetes schema validators) unless some node is already installed.
command -v npm >/dev/null || packages+=(nodejs npm)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
else
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The Kubernetes schema validators the chart test uses (npm registry, pinned),
# installed once into ${COLIBRI_NODE_TOOLS:-/opt/colibri-tools}.
tools=${COLIBRI_NODE_TOOLS:-/opt/colibri-tools}
if [ ! -f "$tools/node_modules/kubernetes-models/package.json" ] || [ ! -f "$tools/node_modules/yaml/package.json" ]; then
  echo "install-deps: npm install kubernetes-models@5.1.0 yaml@2.9.1 into $tools"
  $SUDO mkdir -p "$tools"
  (cd "$tools" && $SUDO npm install --no-audit --no-fund --silent kubernetes-models@5.1.0 yaml@2.9.1)
fi
