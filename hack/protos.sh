#!/usr/bin/env bash
# Generate the Python modules of the two gRPC APIs sandkeep's CSI node plugin speaks, from pinned .proto files,
# into controller/csi/proto/ (git-ignored; the image build copies controller/, so run this before it):
#
#   csi.proto                 the CSI spec: Identity and Node services (module github.com/container-storage-interface/spec)
#   pluginregistration.proto  the kubelet's plugin registration API (module k8s.io/kubelet at the version of the
#                             kubelet the tests build, the k8s.io/kubernetes pin of hack/tools/kube/go.mod)
#
#   hack/protos.sh [PYTHON]   # `make venv` runs it; PYTHON (default .venv/bin/python) must have grpcio-tools
#
# The pins, in one place each: the CSI spec's version and module sum here; the kubelet's version and sum are those
# of hack/tools/kube/go.mod and go.sum; grpcio-tools (the protoc that generates) is constraints.txt's. Each module
# comes from `go mod download -json` (the Go module proxy, verified by the checksum database, cached in GOMODCACHE)
# and its sum must also equal the pinned one. Idempotent: a stamp holds the key (versions, sums, grpcio-tools,
# this script); with an unchanged key the script exits at once.
set -euo pipefail

CSI_SPEC_MODULE=github.com/container-storage-interface/spec
CSI_SPEC_VERSION=v1.12.0
CSI_SPEC_SUM=h1:zrFOEqpR5AghNaaDG4qyedwPBqU2fU0dWjLQMP/azK0=

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${1:-$repo/.venv/bin/python}
out=$repo/controller/csi/proto
stamp=$out/.generated
kube_mod=$repo/hack/tools/kube

log() { printf '[protos %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "FAILED: $*"
	exit 1
}

[[ $py == */* ]] || py=$(command -v "$py") || die "no $1 on PATH"
py=$(realpath -s "$py") # absolute (the steps below change directory), the venv's link kept
[[ -x $py ]] || die "no Python at $py: run \`make venv\` (or name a Python with grpcio-tools)"
# k8s.io/kubelet v0.X.Y is the module of Kubernetes v1.X.Y.
kube_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3; exit}' "$kube_mod/go.mod")
[[ $kube_version == v1.* ]] || die "no k8s.io/kubernetes pin in $kube_mod/go.mod"
KUBELET_MODULE=k8s.io/kubelet
KUBELET_VERSION=v0.${kube_version#v1.}
KUBELET_SUM=$(awk -v m="$KUBELET_MODULE" -v v="$KUBELET_VERSION" '$1 == m && $2 == v {print $3; exit}' "$kube_mod/go.sum")
[[ -n $KUBELET_SUM ]] || die "$kube_mod/go.sum has no sum for $KUBELET_MODULE $KUBELET_VERSION"
tools_version=$("$py" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null) ||
	die "$py has no grpcio-tools: run \`make venv\`"

key=$(printf '%s\n' "$CSI_SPEC_MODULE@$CSI_SPEC_VERSION $CSI_SPEC_SUM" "$KUBELET_MODULE@$KUBELET_VERSION $KUBELET_SUM" \
	"grpcio-tools $tools_version" "$(sha256sum <"${BASH_SOURCE[0]}")" | sha256sum | cut -c1-16)
generated=(__init__.py csi_pb2.py csi_pb2.pyi csi_pb2_grpc.py pluginregistration_pb2.py pluginregistration_pb2.pyi
	pluginregistration_pb2_grpc.py)

up_to_date() {
	[[ -f $stamp && $(<"$stamp") == "$key" ]] || return 1
	local f
	for f in "${generated[@]}"; do [[ -s $out/$f ]] || return 1; done
}
up_to_date && exit 0

mkdir -p "$repo/.cache"
exec 9>"$repo/.cache/protos.lock"
flock 9
up_to_date && exit 0 # generated meanwhile by another run

work=$(mktemp -d "$repo/.cache/protos.XXXXXX") # beside the repo: the final mv is a rename
trap 'rm -rf "$work"' EXIT

# download MODULE VERSION SUM: the module's directory in GOMODCACHE, once its sum is the pinned one.
download() {
	local module=$1 version=$2 sum=$3 json dir got
	# Outside any module (no go.mod of ours applies), never skipping the checksum database for these paths.
	if ! json=$(cd "$work" && env -u GONOSUMDB -u GONOSUMCHECK -u GOPRIVATE -u GOINSECURE GOTOOLCHAIN=local \
		GOFLAGS=-mod=mod go mod download -json "$module@$version"); then
		die "go mod download $module@$version: $json"
	fi
	dir=$("$py" -c 'import json, sys; d = json.load(sys.stdin); print(d.get("Dir", ""))' <<<"$json")
	got=$("$py" -c 'import json, sys; d = json.load(sys.stdin); print(d.get("Sum", ""))' <<<"$json")
	[[ $got == "$sum" ]] || die "$module@$version has sum '$got', the pin says $sum"
	[[ -d $dir ]] || die "$module@$version: no directory in the module cache"
	printf '%s\n' "$dir"
}

command -v go >/dev/null || die "Go is needed to fetch the .proto files' modules (go mod download)"
[[ $(go env GOSUMDB) != off ]] || die "GOSUMDB=off: the modules must be verified by the checksum database"
log "fetching $CSI_SPEC_MODULE@$CSI_SPEC_VERSION and $KUBELET_MODULE@$KUBELET_VERSION"
spec_dir=$(download "$CSI_SPEC_MODULE" "$CSI_SPEC_VERSION" "$CSI_SPEC_SUM")
kubelet_dir=$(download "$KUBELET_MODULE" "$KUBELET_VERSION" "$KUBELET_SUM")

# protoc names the generated imports after the .proto's path under its include root, so the protos sit at
# controller/csi/proto/ under $work and the generated code imports `controller.csi.proto.csi_pb2`.
pkg=$work/controller/csi/proto
mkdir -p "$pkg"
install -m 0644 "$spec_dir/csi.proto" "$pkg/csi.proto"
install -m 0644 "$kubelet_dir/pkg/apis/pluginregistration/v1/api.proto" "$pkg/pluginregistration.proto"
log "generating with grpcio-tools $tools_version"
(cd "$work" && "$py" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
	controller/csi/proto/csi.proto controller/csi/proto/pluginregistration.proto)
cat >"$pkg/__init__.py" <<EOF
"""Generated by hack/protos.sh (not in git): the CSI spec's and the kubelet's plugin registration gRPC APIs.

csi.proto: $CSI_SPEC_MODULE@$CSI_SPEC_VERSION ($CSI_SPEC_SUM)
pluginregistration.proto: $KUBELET_MODULE@$KUBELET_VERSION pkg/apis/pluginregistration/v1/api.proto ($KUBELET_SUM)
grpcio-tools $tools_version
"""

CSI_SPEC_VERSION = "${CSI_SPEC_VERSION#v}"
KUBELET_VERSION = "${KUBELET_VERSION#v}"
EOF
printf '%s\n' "$key" >"$pkg/.generated"
rm -rf "$out.old"
[[ ! -e $out ]] || mv "$out" "$out.old"
mv "$pkg" "$out"
rm -rf "$out.old"
log "generated $out"
