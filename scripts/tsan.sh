#!/usr/bin/env bash
# The concurrency tests (ctest label tsan: the expert service in-process, the
# router core, the C++ client, and the process tests — whose colibri-router
# and colibri-expert are TSan builds too, so races in the servers show up)
# under ThreadSanitizer: the tsan preset (CMakePresets.json) in build-tsan/.
# Debian's gRPC is not built with TSan: synchronization inside it is invisible,
# and reports whose stacks are only in gRPC or protobuf internals are
# suppressed (scripts/tsan.supp); reports in Colibri's code are not.
# A report fails the run (halt_on_error in the tests; the servers' stderr,
# which the tests print on failure and ctest logs, is checked).
# Usage: bash scripts/tsan.sh [ctest args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build-tsan
bash "$root/scripts/build.sh" --preset tsan --target tests_tsan
# Every process's reports (the servers' too) go to $build/tsan/report.<pid>.
rm -rf "$build/tsan" && mkdir -p "$build/tsan"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/scripts/tsan.supp log_path=$build/tsan/report"
status=0
(cd "$build" && ctest --output-on-failure -j 1 --timeout 900 --no-tests=error -L tsan "$@") || status=1
if grep -q "WARNING: ThreadSanitizer" "$build"/tsan/report.* 2>/dev/null; then
  grep -h -A30 "WARNING: ThreadSanitizer" "$build"/tsan/report.* | head -60
  echo "FAIL: ThreadSanitizer reports (in $build/tsan/)"
  exit 1
fi
[ "$status" = 0 ] && echo "PASS: no ThreadSanitizer report"
exit "$status"
