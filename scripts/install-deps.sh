#!/usr/bin/env bash
# Installs every Debian 12 package Colibri's build, tests and tools need.
# Idempotent: when everything is already installed it changes nothing (and
# skips the package index update); otherwise it runs apt-get update first.
# Needs root (or sudo) for the install.
set -euo pipefail

packages=(
  # build
  build-essential cmake ninja-build pkg-config git openssl
  # libraries (the customer's stack and helpers)
  libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libdnnl-dev ocl-icd-opencl-dev opencl-headers libnuma-dev nlohmann-json3-dev libxxhash-dev catch2
  # (Debian's oneDNN is built with an OpenCL GPU runtime: its CMake config needs the OpenCL headers)
  # the independent PyTorch reference (golden vectors, cross-checks, baselines)
  python3 python3-numpy python3-torch
  # an independent gRPC client for the router's end-to-end checks (scripts/router_client.py)
  python3-grpcio python3-protobuf
  # the Go client (clients/go), built offline against Debian's Go sources
  golang-go golang-google-grpc-dev golang-google-protobuf-dev protoc-gen-go protoc-gen-go-grpc
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
