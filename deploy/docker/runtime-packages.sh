#!/usr/bin/env bash
# Prints, one per line, the Debian packages that provide the shared libraries
# the given ELF files load (ldd + dpkg -S). The image's build stage runs it on the files it ships; the runtime
# stage installs exactly these packages. Fails if a library is not found or
# belongs to no package.
set -euo pipefail
libs=$(ldd "$@" | awk '/=> not found/ { print "MISSING " $1; next } /=> \// { print $3 }' | sort -u)
if grep -q '^MISSING' <<<"$libs"; then
  echo "runtime-packages: libraries not found: $(grep '^MISSING' <<<"$libs" | cut -d' ' -f2 | xargs)" >&2
  exit 1
fi
for lib in $libs; do
  real=$(readlink -f "$lib")
  dpkg -S "$lib" 2>/dev/null || dpkg -S "$real" 2>/dev/null || dpkg -S "${lib#/usr}" 2>/dev/null ||
    { echo "runtime-packages: no Debian package owns $lib" >&2; exit 1; }
done | cut -d: -f1 | sort -u
