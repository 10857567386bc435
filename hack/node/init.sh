#!/usr/bin/env bash
# pid 1 of the local node (hack/localnode.py starts it with `unshare --pid --mount --net --fork`).
#
# Inside its own PID, mount and network namespaces it lays the node's filesystem over the host's
# (/var/lib, /var/log and /run come from the node's directory, so nothing the kubelet, containerd or
# the CNI writes lands in the host's), configures the network the parent gave it, then runs containerd
# and the kubelet until SIGTERM. When this process exits the kernel kills everything left in the PID
# namespace, and the mounts and network go with their namespaces: nothing outlives the node.
#
#   init.sh NODE_DIR SOCKET_DIR NODE_ADDRESS/PREFIX GATEWAY
set -euo pipefail

dir=$1 sockets=$2 address=$3 gateway=$4

log() { printf '[node-init %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Mounts made here stay here (unshare made them private); the node's own mounts (Pod volumes,
# container root filesystems) are shared among themselves, as on a real node, so HostToContainer
# propagation behaves as the kubelet expects.
mount --make-rshared /
mount --bind "$dir/var-lib" /var/lib
mount --bind "$dir/var-log" /var/log
mount -t tmpfs -o mode=0755,size=256m tmpfs /run

# The parent moves one end of a veth pair in here, named eth0 (the other is on the host's bridge); wait for it.
for _ in $(seq 100); do
	ip link show eth0 >/dev/null 2>&1 && break
	sleep 0.1
done
ip link set lo up
ip addr add "$address" dev eth0
ip link set eth0 up
ip route add default via "$gateway"
# Pods reach the API server (and the host reaches Pods) through this namespace.
sysctl -qw net.ipv4.ip_forward=1

containerd_pid='' kubelet_pid=''
stop() {
	log "stopping"
	local pid
	for pid in $kubelet_pid $containerd_pid; do
		kill -TERM "$pid" 2>/dev/null || true
		for _ in $(seq 150); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
	done
	exit 0
}
trap stop TERM INT

log "starting containerd"
containerd --config "$dir/containerd.toml" >"$dir/containerd.log" 2>&1 &
containerd_pid=$!
for _ in $(seq 300); do
	[[ -S $sockets/containerd.sock ]] && break
	sleep 0.1
done
[[ -S $sockets/containerd.sock ]] || {
	log "containerd did not open its socket"
	exit 1
}
touch "$dir/containerd.ready"
# The parent imports the Pod sandbox image first, then says go.
for _ in $(seq 600); do
	[[ -e $dir/kubelet.go ]] && break
	sleep 0.1
done

# The kubelet's pid in this namespace is in kubelet.pid. A test stops it as an operator would (the node
# stays up, its containers keep running): it creates kubelet.paused, then signals the kubelet; the
# kubelet starts again, with the same flags, once kubelet.paused is removed.
mapfile -t kubelet <"$dir/kubelet.cmd"
start_kubelet() {
	log "starting the kubelet"
	"${kubelet[@]}" >>"$dir/kubelet.log" 2>&1 &
	kubelet_pid=$!
	echo "$kubelet_pid" >"$dir/kubelet.pid"
}
start_kubelet

# pid 1 must reap orphans: `wait` returns whenever any child exits, and the node stops when one of
# its own components does (the kubelet only when it was not stopped on request).
while true; do
	wait -n || true
	if ! kill -0 "$kubelet_pid" 2>/dev/null && [[ -e $dir/kubelet.paused ]]; then
		log "the kubelet stopped on request; it starts again once kubelet.paused is removed"
		while [[ -e $dir/kubelet.paused ]]; do sleep 0.2; done
		start_kubelet
	fi
	for pid in $containerd_pid $kubelet_pid; do
		if ! kill -0 "$pid" 2>/dev/null; then
			log "component $pid exited; stopping the node"
			stop
		fi
	done
done
