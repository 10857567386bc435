#!/usr/bin/env bash
# Build the local control plane's tools (kube-apiserver, kube-controller-manager, kubectl, etcd), the real
# node's (kubelet, kube-scheduler), helm, promtool, the Prometheus server, the OCI registry (CNCF Distribution)
# crane (pushes the image to it) and krew (installs the kubectl plugin as a user does) from the pinned wrapper modules beside this script, into a versioned cache. Names given as arguments build only those.
#
# Idempotent: each tool lands in $SANDKEEP_TOOLS_DIR/<name>-<key>/, where <key> hashes its
# wrapper's go.mod and go.sum, its package and its link flags, and is skipped when already built. A second run
# only prints the bin directory. Prints that directory (symlinks to every tool) on stdout.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${SANDKEEP_TOOLS_DIR:-$repo/.cache/tools}
bin=$cache/bin
mkdir -p "$cache" "$bin"

export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
export GOCACHE=${GOCACHE:-$cache/go-build}

log() { printf '[tools %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# key_of MODULE_DIR PACKAGE LDFLAGS: what decides the binary, and nothing else.
key_of() { { cat "$here/$1/go.mod" "$here/$1/go.sum"; printf '%s\n' "$2" "$3"; } | sha256sum | cut -c1-12; }

kube_version() { awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$here/kube/go.mod" | head -1; }

# build MODULE_DIR OUT PACKAGE [LDFLAGS]
build() {
	local mod=$1 out=$2 pkg=$3 ldflags=${4:-}
	local dest key
	# Prebuilt binaries of one's own (setup-envtest's KUBEBUILDER_ASSETS holds kube-apiserver, etcd and
	# kubectl) are used as they are, unbuilt: the version is then theirs, not the pinned one.
	if [[ -n ${KUBEBUILDER_ASSETS:-} && -x $KUBEBUILDER_ASSETS/$out ]]; then
		log "using $out from KUBEBUILDER_ASSETS ($KUBEBUILDER_ASSETS), not building it"
		ln -sfn "$KUBEBUILDER_ASSETS/$out" "$bin/$out"
		return
	fi
	key=$(key_of "$mod" "$pkg" "$ldflags")
	dest=$cache/$out-$key
	if [[ ! -x $dest/$out ]]; then
		log "building $out from $pkg (module $mod) ..."
		local start=$SECONDS
		rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
		(cd "$here/$mod" && go build -trimpath -ldflags "-s -w $ldflags" -o "$dest.tmp/$out" "$pkg")
		rm -rf "$dest" && mv "$dest.tmp" "$dest"
		log "built $out in $((SECONDS - start))s"
	fi
	ln -sfn "$dest/$out" "$bin/$out"
}

kv=$(grep -E '^require k8s.io/kubernetes ' "$here/kube/go.mod" | awk '{print $3}')
[[ -n $kv ]] || kv=$(kube_version)
minor=$(echo "$kv" | cut -d. -f2)
stamp=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	stamp+=" -X $p.gitVersion=$kv -X $p.gitMajor=1 -X $p.gitMinor=$minor"
	stamp+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

# helm: unstamped, offline `helm template`/`lint` assume Kubernetes v1.20 and refuse the chart's kubeVersion.
hv=$(awk '$1 == "helm.sh/helm/v3" {print $2; exit}' "$here/helm/go.mod")
[[ -n $hv ]] || hv=$(grep -E '^require helm.sh/helm/v3 ' "$here/helm/go.mod" | awk '{print $3}')
helm_stamp="-X helm.sh/helm/v3/internal/version.version=$hv"
for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
	helm_stamp+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
done

want=${*:-kube-apiserver kube-controller-manager kubectl etcd kubelet kube-scheduler helm promtool prometheus registry crane krew}

build_tool() {
	case $1 in
	kube-apiserver) build kube kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$stamp" ;;
	kube-controller-manager) build kube kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$stamp" ;;
	kubectl) build kube kubectl k8s.io/kubernetes/cmd/kubectl "$stamp" ;;
	kubelet) build kube kubelet k8s.io/kubernetes/cmd/kubelet "$stamp" ;;
	kube-scheduler) build kube kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "$stamp" ;;
	etcd) build etcd etcd go.etcd.io/etcd/server/v3 ;;
	helm) build helm helm helm.sh/helm/v3/cmd/helm "$helm_stamp" ;;
	promtool) build promtool promtool github.com/prometheus/prometheus/cmd/promtool ;;
	prometheus) build promtool prometheus github.com/prometheus/prometheus/cmd/prometheus ;;
	registry) build registry registry github.com/distribution/distribution/v3/cmd/registry ;;
	crane) build crane crane github.com/google/go-containerregistry/cmd/crane ;;
	krew) build krew kubectl-krew sigs.k8s.io/krew/cmd/krew ;;
	esac
}

# Tools of one wrapper module share most of their packages, so they build one after another in one lane
# (the second reuses the first's compiled packages); the lanes are independent and build side by side
# where the cores allow: SANDKEEP_TOOLS_JOBS lanes at once (default: half the cores, at least 1; on two
# cores that is one lane, since each `go build` already compiles packages on every core).
declare -A lane_tools=()
lanes=()
for tool in $want; do
	case $tool in
	kube-apiserver | kube-controller-manager | kubectl | kubelet | kube-scheduler) lane=kube ;;
	etcd) lane=etcd ;;
	helm) lane=helm ;;
	promtool | prometheus) lane=prometheus ;;
	registry) lane=registry ;;
	crane) lane=crane ;;
	krew) lane=krew ;;
	*) log "unknown tool: $tool"; exit 2 ;;
	esac
	[[ -v lane_tools[$lane] ]] || lanes+=("$lane")
	lane_tools[$lane]+=" $tool"
done

cores=$(nproc 2>/dev/null || echo 1)
jobs=${SANDKEEP_TOOLS_JOBS:-$((cores / 2 > 1 ? cores / 2 : 1))}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { log "SANDKEEP_TOOLS_JOBS must be a positive integer, got '$jobs'"; exit 2; }

run_lane() {
	local t
	for t in $1; do build_tool "$t"; done
}

if ((jobs == 1 || ${#lanes[@]} == 1)); then
	for lane in "${lanes[@]}"; do run_lane "${lane_tools[$lane]}"; done
else
	log "building ${#lanes[@]} lanes (${lanes[*]}), $jobs at a time"
	declare -A running=()
	failed=0
	for lane in "${lanes[@]}"; do
		while ((${#running[@]} >= jobs)); do
			wait -n -p done_pid || failed=1
			unset "running[$done_pid]"
		done
		run_lane "${lane_tools[$lane]}" &
		running[$!]=$lane
	done
	for pid in "${!running[@]}"; do
		wait "$pid" || { log "lane ${running[$pid]} failed"; failed=1; }
	done
	((failed == 0)) || exit 1
fi
echo "$bin"
