#!/usr/bin/env bash
# Configures and builds Colibri into ${COLIBRI_BUILD_DIR:-build} (Ninja, -j2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${COLIBRI_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${COLIBRI_BUILD_TYPE:-RelWithDebInfo} >/dev/null
cmake --build "$build" -j "${COLIBRI_JOBS:-2}"
