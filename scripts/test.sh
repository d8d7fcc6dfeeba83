#!/usr/bin/env bash
# The whole test suite from a fresh clone: install dependencies, build, ctest;
# then the same suite under ASan+UBSan (scripts/sanitize.sh) and a short run
# of every fuzz target (scripts/fuzz.sh --seconds 5). COLIBRI_QUICK=1 stops
# after ctest. Usage: bash scripts/test.sh [extra ctest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/build.sh"
build=${COLIBRI_BUILD_DIR:-$root/build}
(cd "$build" && ctest --output-on-failure -j "${COLIBRI_JOBS:-2}" --timeout 900 "$@")
[ "${COLIBRI_QUICK:-0}" = 1 ] && exit 0
echo "=== the suite under AddressSanitizer + UndefinedBehaviorSanitizer"
bash "$root/scripts/sanitize.sh" "$@"
echo "=== fuzz targets, 5 s each"
bash "$root/scripts/fuzz.sh" --seconds 5
