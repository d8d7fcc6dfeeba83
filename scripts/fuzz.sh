#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang, ASan and UBSan into
# build-fuzz/, replays every regression input (tests/fuzz/regressions/<target>/:
# inputs that once crashed must not crash again), then fuzzes each target for
# --seconds (default 10; CI runs 5) starting from its seed corpus
# (tests/fuzz/corpus/<target>/, copied: new units stay in build-fuzz/).
# A crash fails the run and leaves the input in build-fuzz/crashes/<target>/:
# fix the bug, then add the input to tests/fuzz/regressions/<target>/.
# Longer run: bash scripts/fuzz.sh --seconds 3600 [--only router_request_fuzz]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=10
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "fuzz: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v clang++ >/dev/null || { echo "fuzz: clang++ is not installed (scripts/install-deps.sh installs it)" >&2; exit 1; }
build=$root/build-fuzz
# The fuzz preset (CMakePresets.json): every library and server compiled by
# clang with -Werror=thread-safety, so this build is also the check of the
# locking annotations (common/mutex.h). Targets: tests/fuzz/*_fuzz.cc.
targets=()
for f in "$root"/tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$f" .cc)"); done
[ -n "$only" ] && targets=("$only")
bash "$root/scripts/build.sh" --preset fuzz --target fuzz_all
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
failed=0
for t in "${targets[@]}"; do
  regressions=$root/tests/fuzz/regressions/$t
  if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions" 2>/dev/null)" ]; then
    echo "=== $t: replaying $(ls "$regressions" | wc -l) regression input(s)"
    "$build/tests/fuzz/$t" "$regressions"/* > "$build/$t.replay.log" 2>&1 || { tail -30 "$build/$t.replay.log"; failed=1; }
  fi
  corpus=$build/corpus/$t
  mkdir -p "$corpus" "$build/crashes/$t"
  [ -d "$root/tests/fuzz/corpus/$t" ] && cp -n "$root/tests/fuzz/corpus/$t"/* "$corpus"/ 2>/dev/null || true
  echo "=== $t: fuzzing for $seconds s"
  if "$build/tests/fuzz/$t" "$corpus" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=3072 -print_final_stats=1 \
      -artifact_prefix="$build/crashes/$t/" > "$build/$t.log" 2>&1; then
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$build/$t.log" | tr '\n' ' '; echo
  else
    tail -40 "$build/$t.log"
    echo "FAIL: $t crashed; the input is in $build/crashes/$t/"
    failed=1
  fi
done
exit $failed
