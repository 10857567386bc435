#!/usr/bin/env bash
# Build the compiled walker (rmtree/: `sandkeep-rmtree`, which fsdelete.py deletes directories with when it is
# beside the interpreter) into OUT: `make venv` puts it in .venv/bin, hack/image.sh into the image.
#
#   hack/rmtree.sh OUT
#
# A static binary (no cgo), built from the pinned module (rmtree/go.mod, go.sum verified by the checksum
# database); Go's build cache makes a second build of an unchanged tree instant.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:?usage: hack/rmtree.sh OUT}")
export GOFLAGS=-mod=readonly GOTOOLCHAIN=local CGO_ENABLED=0
export GOCACHE=${GOCACHE:-${SANDKEEP_TOOLS_DIR:-$repo/.cache/tools}/go-build}

command -v go >/dev/null || { echo "[rmtree] Go is needed to build rmtree/ (the compiled walker)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
(cd "$repo/rmtree" && go build -trimpath -ldflags "-s -w" -o "$out.tmp" .)
mv "$out.tmp" "$out"
