#!/usr/bin/env bash
# The whole test suite from a fresh clone: install dependencies, build, ctest.
# Usage: bash scripts/test.sh [extra ctest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/build.sh"
build=${COLIBRI_BUILD_DIR:-$root/build}
cd "$build"
ctest --output-on-failure -j "${COLIBRI_JOBS:-2}" --timeout 900 "$@"
