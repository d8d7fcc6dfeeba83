#!/usr/bin/env bash
# The router/expert integration tests under ThreadSanitizer, in their own
# build directory (build-tsan): the expert service in-process, the router core,
# the C++ client, and the process tests — whose colibri-router and
# colibri-expert are TSan builds too, so races in the servers show up.
# Debian's gRPC is not built with TSan: synchronization inside it is invisible,
# and reports whose stacks are only in gRPC or protobuf internals are
# suppressed (scripts/tsan.supp); reports in Colibri's code are not.
# A report fails the run (halt_on_error in the tests; the servers' stderr is
# checked). Usage: bash scripts/tsan.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${COLIBRI_TSAN_BUILD_DIR:-$root/build-tsan}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="-fsanitize=thread -O1 -g" \
  -DCMAKE_C_FLAGS="-fsanitize=thread -O1 -g" >/dev/null
tests=(expert_service_test router_test client_test router_process_test fault_test tls_test)
cmake --build "$build" -j "${COLIBRI_JOBS:-2}" --target "${tests[@]}" colibri-expert colibri-router
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/scripts/tsan.supp"
status=0
: > "$build/tsan.log"
for t in "${tests[@]}"; do
  echo "=== $t"
  if ! "$build/tests/$t" >> "$build/tsan.log" 2>&1; then
    echo "FAIL: $t (see $build/tsan.log)"
    status=1
  fi
done
if grep -q "WARNING: ThreadSanitizer" "$build/tsan.log"; then
  grep -A30 "WARNING: ThreadSanitizer" "$build/tsan.log" | head -60
  echo "FAIL: ThreadSanitizer reports (in $build/tsan.log)"
  exit 1
fi
[ "$status" = 0 ] && echo "PASS: no ThreadSanitizer report"
exit "$status"
