#!/bin/sh
# CTest's go_bindings: `go test` of the wavekv package, offline, against the
# libwavekv.so of a build tree, with GOPATH and GOCACHE inside that tree.
# Exits 77 (skipped) without go.
#
#   ctest.sh <directory of libwavekv.so> <work directory> [go]
set -eu
lib_dir=$1
work_dir=$2
go=${3:-go}
here=$(cd "$(dirname "$0")" && pwd)

if ! command -v "$go" > /dev/null 2>&1; then
  echo "go_bindings: skipped: no go (Debian package golang-go;" \
       "tools/install-deps.sh installs it)"
  exit 77
fi
if [ ! -e "$lib_dir/libwavekv.so" ]; then
  echo "go_bindings: no $lib_dir/libwavekv.so: build the wavekv target first" >&2
  exit 1
fi
lib_dir=$(cd "$lib_dir" && pwd)
mkdir -p "$work_dir"
work_dir=$(cd "$work_dir" && pwd)

export GOPATH="$work_dir/gopath"
export GOCACHE="$work_dir/gocache"
export GOENV=off GOPROXY=off GOFLAGS=-mod=mod GO111MODULE=on GOTOOLCHAIN=local CGO_ENABLED=1
export CGO_LDFLAGS="-L$lib_dir -Wl,-rpath,$lib_dir${CGO_LDFLAGS:+ $CGO_LDFLAGS}"
"$go" version
cd "$here"
exec "$go" test -count=1 -v ./...
