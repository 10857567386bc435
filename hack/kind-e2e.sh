#!/usr/bin/env bash
# End-to-end check of sandkeep on a real cluster (kind), for a machine WITH Docker, kind, kubectl and helm.
#
#   hack/kind-e2e.sh                 # create the cluster, test, delete the cluster
#   KEEP_CLUSTER=1 hack/kind-e2e.sh  # leave the cluster up afterwards (kubectl --context kind-sandkeep-e2e)
#   KIND_NODE_IMAGE=kindest/node:v1.32.0 hack/kind-e2e.sh   # the chart needs Kubernetes >= 1.31
#
# What it proves, on real kubelets and a real node disk: the image builds and both components start; the
# agent adopts a sandbox retained on a node's disk (written there with `docker exec` into the kind node);
# `kubectl annotate ... pin-for` pins one; shortening the window with a SandboxPolicy expires the other,
# which the controller deletes and the agent removes from the node's disk (no tombstone left behind),
# while the pinned one stays. It cannot run where there is no Docker engine (the unit tests only check
# it with shellcheck and bash -n there).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=${CLUSTER_NAME:-sandkeep-e2e}
image=${IMAGE:-sandkeep:e2e}
release=sandkeep
system_ns=sandkeep-system
ns=e2e
root=/var/lib/sandkeep
timeout_s=${TIMEOUT_SECONDS:-180}
ctx=kind-$cluster

log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "FAILED: $*"
	exit 1
}
k() { kubectl --context "$ctx" "$@"; }

# wait_for DESCRIPTION COMMAND...: run COMMAND every 2 s until it succeeds or timeout_s passes.
wait_for() {
	local what=$1 deadline=$((SECONDS + timeout_s))
	shift
	until "$@" >/dev/null 2>&1; do
		((SECONDS < deadline)) || die "timed out after ${timeout_s}s waiting for: $what"
		sleep 2
	done
	log "ok: $what"
}

require_tools() {
	local tool missing=()
	for tool in docker kind kubectl helm; do
		command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
	done
	((${#missing[@]} == 0)) || die "missing tools: ${missing[*]} (this script needs Docker, kind, kubectl and helm)"
	docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"
}

cleanup() {
	local code=$?
	if ((code != 0)); then
		log "dumping state for the failure"
		k get rsb -A -o wide || true
		k -n "$system_ns" get pods -o wide || true
		k -n "$system_ns" logs -l app.kubernetes.io/component=controller --tail=50 || true
		k -n "$system_ns" logs -l app.kubernetes.io/component=agent --tail=50 || true
	fi
	if [[ ${KEEP_CLUSTER:-0} == 1 ]]; then
		log "cluster kept: kubectl --context $ctx ..."
	else
		kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
	fi
	exit "$code"
}

create_cluster() {
	log "creating kind cluster $cluster (one control plane, one worker)"
	local image_args=()
	[[ -z ${KIND_NODE_IMAGE:-} ]] || image_args=(--image "$KIND_NODE_IMAGE")
	kind create cluster --name "$cluster" ${image_args[@]+"${image_args[@]}"} --wait 120s --config - <<-EOF
		kind: Cluster
		apiVersion: kind.x-k8s.io/v1alpha4
		nodes:
		  - role: control-plane
		  - role: worker
	EOF
}

build_and_load() {
	log "building $image"
	docker build -t "$image" "$repo"
	kind load docker-image "$image" --name "$cluster"
}

install_chart() {
	log "installing the chart"
	helm --kube-context "$ctx" install "$release" "$repo/charts/sandkeep" \
		--namespace "$system_ns" --create-namespace \
		--set image.repository="${image%:*}" --set image.tag="${image##*:}" --set image.pullPolicy=Never \
		--set agent.scanInterval=5s --set agent.root="$root" \
		--wait --timeout 180s
	k -n "$system_ns" rollout status deploy/"$release"-controller --timeout=120s
	k -n "$system_ns" rollout status ds/"$release"-agent --timeout=120s
}

# retain_on_node NODE NAME: write a finished job's workspace and its manifest into the node's root, as a
# retaining job would (created now, kept for the default window).
retain_on_node() {
	local node=$1 name=$2 now until
	now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
	until=$(date -u -d '+72 hours' +%Y-%m-%dT%H:%M:%SZ)
	docker exec -i "$node" sh -eu -c '
		root=$1 ns=$2 name=$3
		install -d -m 0700 "$root"
		install -d -m 0755 "$root/$ns" "$root/$ns/$name" "$root/$ns/$name/workspace"
		echo "results of $name" >"$root/$ns/$name/workspace/out.txt"
		cat >"$root/$ns/$name/manifest.json"
		chmod 0600 "$root/$ns/$name/manifest.json"
	' sh "$root" "$ns" "$name" <<-EOF
		{"schemaVersion": 1, "namespace": "$ns", "name": "$name", "jobId": "job-$name",
		 "createdAt": "$now", "retainUntil": "$until", "node": "$node", "workspace": "workspace"}
	EOF
	log "retained $ns/$name on $node"
}

on_disk() { docker exec "$1" test -e "$root/$ns/$2"; }
gone_from_disk() { ! on_disk "$@"; }
no_tombstones() { [[ -z $(docker exec "$1" find "$root" -maxdepth 1 -name '.reap-*' -print) ]]; }
rsb_exists() { k -n "$ns" get rsb "$1"; }
rsb_gone() { ! rsb_exists "$1"; }
rsb_phase_is() { [[ $(k -n "$ns" get rsb "$1" -o jsonpath='{.status.phase}') == "$2" ]]; }

main() {
	require_tools
	trap cleanup EXIT
	create_cluster
	build_and_load
	install_chart

	local node=$cluster-worker
	k create namespace "$ns"
	retain_on_node "$node" keep-me
	retain_on_node "$node" let-go
	wait_for "the agent adopts $ns/keep-me" rsb_exists keep-me
	wait_for "the agent adopts $ns/let-go" rsb_exists let-go
	wait_for "$ns/keep-me is Retained" rsb_phase_is keep-me Retained

	log "pinning $ns/keep-me for 2h with kubectl annotate"
	k -n "$ns" annotate rsb keep-me sandkeep.io/pin-for=2h
	wait_for "$ns/keep-me is Pinned" rsb_phase_is keep-me Pinned

	log "shortening the window of namespace $ns to 1s: let-go expires, keep-me is pinned"
	k apply -f - <<-EOF
		apiVersion: sandkeep.io/v1alpha1
		kind: SandboxPolicy
		metadata: {name: short, namespace: $ns}
		spec: {retention: 1s}
	EOF
	wait_for "$ns/let-go is deleted" rsb_gone let-go
	wait_for "$ns/let-go is gone from $node's disk" gone_from_disk "$node" let-go
	wait_for "no tombstone is left on $node" no_tombstones "$node"
	on_disk "$node" keep-me || die "$ns/keep-me was deleted from $node's disk although it is pinned"
	rsb_phase_is keep-me Pinned || die "$ns/keep-me is no longer Pinned"
	log "PASSED"
}

main "$@"
