#!/usr/bin/env bash
# What can be checked of deploy/docker/Dockerfile without a Docker engine:
# every file its build stage COPYs exists in the repository, and every folder
# the top-level CMakeLists.txt builds is COPYed; every file the
# runtime stage ships (deploy/docker/image-files.txt) exists in the build;
# the runtime packages derived from those files with ldd exist in Debian;
# every package the build stage installs exists in Debian and is one of
# scripts/install-deps.sh's (so the image builds with what the tests use);
# no build file asks for -march=native. Where hadolint or docker exist, they
# run too; otherwise the script says they were skipped.
# Usage: dockerfile_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
dockerfile=$src/deploy/docker/Dockerfile
fail() { echo "FAIL: $*"; exit 1; }

echo "--- COPY sources of the build stage exist"
while read -r from; do
  [ -e "$src/$from" ] || fail "Dockerfile copies $from, which does not exist"
  echo "ok: $from"
done < <(awk '/^FROM .* AS runtime/ { exit } /^COPY / && !/--from=/ { for (i = 2; i < NF; ++i) print $i }' "$dockerfile")

echo "--- every folder the top-level CMakeLists.txt builds outside BUILD_TESTING is copied"
copied=$(awk '/^FROM .* AS runtime/ { exit } /^COPY / && !/--from=/ { for (i = 2; i < NF; ++i) print $i }' "$dockerfile")
while read -r dir; do
  grep -qx -- "$dir" <<<"$copied" || fail "CMakeLists.txt adds $dir, which the Dockerfile does not COPY"
  echo "ok: $dir"
done < <(awk '/if\(BUILD_TESTING|if\(COLIBRI_FUZZ/ { skip = 1 } skip && /^endif/ { skip = 0; next }
              !skip && /^add_subdirectory\(/ { sub(/^add_subdirectory\(/, ""); sub(/\).*/, ""); print }' "$src/CMakeLists.txt")

echo "--- files the runtime stage ships exist in the build"
files=()
while read -r kind path; do
  [ -n "$kind" ] || continue
  case "$kind" in bin|lib) ;; *) fail "image-files.txt: unknown kind '$kind'" ;; esac
  [ -f "$build/$path" ] || fail "image-files.txt lists $path, not in the build"
  grep -q -- "$(basename "$path" | sed 's/^lib\(.*\)\.so$/\1/')" "$dockerfile" || fail "the Dockerfile does not build $path"
  files+=("$build/$path")
done < "$src/deploy/docker/image-files.txt"
echo "ok: ${#files[@]} files"

echo "--- runtime packages (ldd + dpkg -S) exist in Debian"
packages=$(bash "$src/deploy/docker/runtime-packages.sh" "${files[@]}")
for p in $packages; do apt-cache show "$p" >/dev/null 2>&1 || fail "runtime package $p is not in Debian's index"; done
echo "ok: $(echo $packages)"

echo "--- build-stage packages exist in Debian and match install-deps.sh"
build_packages=$(awk '/^FROM .* AS runtime/ { exit } /apt-get install/ { on = 1 } on { print } on && !/\\$/ { on = 0 }' "$dockerfile" |
  tr ' \\' '\n\n' | grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -v -x -e apt-get -e install -e '&&' -e rm)
for p in $build_packages; do
  apt-cache show "$p" >/dev/null 2>&1 || fail "build package $p is not in Debian's index"
  grep -qw -- "$p" "$src/scripts/install-deps.sh" || [ "$p" = ca-certificates ] || fail "build package $p is not in install-deps.sh"
done
echo "ok: $(echo $build_packages)"

echo "--- no -march=native in the build"
if grep -n -- "-march=native" "$src/CMakeLists.txt" "$src"/*/CMakeLists.txt "$src"/clients/cpp/CMakeLists.txt |
   grep -v -E '^[^:]+:[0-9]+:[[:space:]]*#'; then
  fail "-march=native found outside a comment"
fi
echo "ok"

if command -v hadolint >/dev/null; then hadolint "$dockerfile"; else echo "skipped: hadolint is not installed (not packaged for Debian 12)"; fi
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  docker build -f "$dockerfile" -t colibri:test "$src"
else
  echo "skipped: no Docker engine here, the image itself was not built"
fi
echo "PASS"
