#!/usr/bin/env bash
# Builds, vets and tests the Go client offline, in GOPATH mode, against
# Debian's Go packages (golang-google-grpc-dev, golang-google-protobuf-dev
# under /usr/share/gocode): no module proxy, no network.
#
# How: $COLIBRI_GO_DIR (default: the repository's build/go) becomes a GOPATH
# whose src/github.com/colibri-moe/colibri/clients/go is a symlink to this
# directory, and go runs from that symlinked path with
#   GO111MODULE=off GOPATH=$dir:/usr/share/gocode GOFLAGS= GOPROXY=off GOCACHE=$dir/cache
# Go 1.19 resolves our import path from the logical working directory ($PWD),
# so relative patterns (./..., ./colibri) work; import-path patterns ending in
# /... do not (go does not follow the symlink when walking GOPATH). go.mod is
# ignored here; it is for module-mode builds elsewhere.
#
# The proxyless package (colibri/direct) is cgo over libcolibri.so: its
# header comes from this repository and the library from $COLIBRI_LIB_DIR
# (default: build/router_node), which CGO_CFLAGS / CGO_LDFLAGS (with an
# rpath) point at. Without a libcolibri.so there, `test` leaves it out.
#
# Usage: clients/go/build.sh vet                    go vet ./...
#        clients/go/build.sh test [HOST:PORT] [args] go test ./colibri and
#                                                   ./colibri/direct against
#                                                   the router at HOST:PORT
#                                                   (COLIBRI_ROUTER; direct's
#                                                   tests also need
#                                                   COLIBRI_MODEL and
#                                                   COLIBRI_NODES); without
#                                                   them those tests skip
#        clients/go/build.sh example -o PATH        builds colibri-decode-example
#        clients/go/build.sh GO_ARGS...             any other go command
# Builds run under nice -n 19.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
command -v go >/dev/null || { echo "build.sh: go is not installed (Debian: golang-go)" >&2; exit 1; }
[ $# -gt 0 ] || { sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

dir=${COLIBRI_GO_DIR:-$here/../../build/go}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
link=$dir/src/github.com/colibri-moe/colibri/clients/go
mkdir -p "$(dirname "$link")"
if [ "$(readlink "$link" 2>/dev/null)" != "$here" ]; then
  rm -rf "$link"
  ln -s "$here" "$link"
fi
export GO111MODULE=off GOPATH=$dir:/usr/share/gocode GOFLAGS= GOPROXY=off GOCACHE=$dir/cache
lib=${COLIBRI_LIB_DIR:-$here/../../build/router_node}
export CGO_ENABLED=1 CGO_CFLAGS="-I$(cd "$here/../.." && pwd)" CGO_LDFLAGS="-L$lib -Wl,-rpath,$lib"
packages=(./colibri)
if [ -f "$lib/libcolibri.so" ]; then
  packages+=(./colibri/direct)
else
  echo "build.sh: no $lib/libcolibri.so: the proxyless package (colibri/direct) is not tested" >&2
fi
# -o PATH is relative to the caller's directory, not to the one go runs in.
args=() prev=
for a in "$@"; do
  case $prev,$a in
    -o,/*|-o,-) ;;
    -o,*) a=$PWD/$a ;;
    *,-o=/*) ;;
    *,-o=*) a=-o=$PWD/${a#-o=} ;;
  esac
  args+=("$a") prev=$a
done
set -- "${args[@]}"
cd "$link"  # logical path: go sees the package under $GOPATH/src

cmd=$1; shift
case $cmd in
  vet) exec nice -n 19 go vet "$@" ./... ;;
  test)
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then export COLIBRI_ROUTER=$1; shift; fi
    exec nice -n 19 go test -count=1 "$@" "${packages[@]}" ;;
  example) exec nice -n 19 go build "$@" ./cmd/colibri-decode-example ;;
  *) exec nice -n 19 go "$cmd" "$@" ;;
esac
