#!/usr/bin/env bash
# Configures Colibri with a CMake preset (CMakePresets.json) and builds it
# with -j ${COLIBRI_JOBS:-2}. The preset "default" (Ninja, RelWithDebInfo)
# builds into build/ or $COLIBRI_BUILD_DIR; preset P into build-P/.
# Usage: bash scripts/build.sh [--preset P] [cmake --build arguments, e.g. --target colibri_demo]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
preset=default
if [ "${1:-}" = --preset ]; then
  [ $# -ge 2 ] || { echo "build.sh: --preset needs a name (CMakePresets.json)" >&2; exit 2; }
  preset=$2
  shift 2
fi
if [ "$preset" = default ]; then
  build=${COLIBRI_BUILD_DIR:-$root/build}
else
  build=$root/build-$preset
fi
configure=(--preset "$preset" -B "$build")
# $COLIBRI_BUILD_TYPE (e.g. Debug) changes the default preset's build type only.
if [ "$preset" = default ] && [ -n "${COLIBRI_BUILD_TYPE:-}" ]; then
  configure+=(-DCMAKE_BUILD_TYPE="$COLIBRI_BUILD_TYPE")
fi
(cd "$root" && cmake "${configure[@]}" >/dev/null)
cmake --build "$build" -j "${COLIBRI_JOBS:-2}" "$@"
