#!/usr/bin/env bash
# The end-to-end suite (tests/node/test_e2e.py) on kind, for a machine WITH Docker and kind.
#
#   hack/kind-e2e.sh                 # create the cluster, run the suite, delete the cluster
#   KEEP_CLUSTER=1 hack/kind-e2e.sh  # leave the cluster up afterwards (kubectl --context kind-sandkeep-e2e)
#   KIND_NODE_IMAGE=kindest/node:v1.32.0 hack/kind-e2e.sh   # the chart needs Kubernetes >= 1.31
#
# The same test code as this repository's CI, which runs it on a local real node instead (make e2e;
# tests/bed/e2e_bed.py's LocalBed). Here the bed is KindBed: a one-node kind cluster, the image built by
# `docker build` from the Dockerfile and loaded with `kind load`, node-side steps (a job's directory,
# chattr) through `docker exec` on the node container, and Prometheus on this machine scraping the Pods
# (a route to the node's Pod range is added, so this needs root). The suite installs the chart itself.
# Never run on this repository's machines (no Docker engine there); tests only shellcheck it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=${CLUSTER_NAME:-sandkeep-e2e}
image=${IMAGE:-localhost/sandkeep:e2e}
ctx=kind-$cluster
routes=()

log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "FAILED: $*"
	exit 1
}
k() { kubectl --context "$ctx" "$@"; }

require_tools() {
	local tool missing=()
	for tool in docker kind kubectl make go ip; do
		command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
	done
	((${#missing[@]} == 0)) || die "missing tools: ${missing[*]} (this script needs Docker, kind, kubectl, make and Go)"
	docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"
	((EUID == 0)) || die "run as root: Prometheus reaches the Pods through a route this script adds"
}

cleanup() {
	local code=$? cidr
	for cidr in ${routes[@]+"${routes[@]}"}; do
		ip route del "$cidr" 2>/dev/null || true
	done
	if [[ ${KEEP_CLUSTER:-0} == 1 ]]; then
		log "cluster kept: kubectl --context $ctx ..."
	else
		kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
	fi
	exit "$code"
}

create_cluster() {
	# One node, as in the local bed: kind's only node is schedulable and runs every Pod of the suite.
	log "creating kind cluster $cluster (one node)"
	local image_args=()
	[[ -z ${KIND_NODE_IMAGE:-} ]] || image_args=(--image "$KIND_NODE_IMAGE")
	kind create cluster --name "$cluster" ${image_args[@]+"${image_args[@]}"} --wait 120s
}

build_and_load() {
	log "building $image from the Dockerfile"
	docker build -t "$image" "$repo"
	kind load docker-image "$image" --name "$cluster"
}

# Prometheus runs on this machine and scrapes the Pods at their IPs: route each node's Pod range to it.
route_pods() {
	local node cidr ip
	for node in $(k get nodes -o jsonpath='{.items[*].metadata.name}'); do
		cidr=$(k get node "$node" -o jsonpath='{.spec.podCIDR}')
		ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$node")
		ip route replace "$cidr" via "$ip"
		routes+=("$cidr")
	done
}

main() {
	require_tools
	trap cleanup EXIT
	create_cluster
	build_and_load
	route_pods
	log "building the suite's virtualenv and tools (kubectl, helm, prometheus)"
	make -C "$repo" -s venv >/dev/null
	bash "$repo/hack/tools/build.sh" kubectl helm prometheus >/dev/null
	log "running the end-to-end suite (tests/node/test_e2e.py) on kind-$cluster"
	SANDKEEP_E2E_KIND=$cluster SANDKEEP_E2E_IMAGE=$image "$repo/.venv/bin/pytest" -m e2e "$repo/tests/node/test_e2e.py"
	log "PASSED"
}

main "$@"
