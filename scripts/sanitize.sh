#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer: the
# asan-ubsan preset (CMakePresets.json) in build-asan-ubsan/, every test but
# the PyTorch cross-checks (label torch: Python under ASan is not ours to
# check). Usage: bash scripts/sanitize.sh [ctest args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install-deps.sh" >/dev/null
bash "$root/scripts/build.sh" --preset asan-ubsan
cd "$root/build-asan-ubsan"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j "${COLIBRI_JOBS:-2}" --timeout 900 -LE torch "$@"
